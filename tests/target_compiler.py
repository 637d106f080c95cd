"""The planner's target-compile tests need XLA:GPU / XLA:TPU's compilers (the [plan] extra,
which `pip install -e '.[test]'` brings on Linux x86-64, CI's platform). Where the wheels can be
installed and are not, that is a broken test environment: fail, naming what to install. Only
where no wheel exists (another OS or CPU) is the test skipped."""

from __future__ import annotations

import platform
import sys

import pytest


def require_target_compiler(target_platform: str):
    """Fail (or, off Linux x86-64, skip) unless this process can compile for `target_platform`
    ("gpu" | "tpu")."""
    from train.plan.target import compiler_unavailable

    why = compiler_unavailable(target_platform)
    if why is None:
        return
    if sys.platform == "linux" and platform.machine() == "x86_64":
        pytest.fail(f"the [plan] extra is missing or broken: {why}; pip install -e '.[test]' installs it")
    pytest.skip(f"no [plan] wheels for {sys.platform}/{platform.machine()}: {why}")
