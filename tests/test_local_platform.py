"""A quiet CPU venv (k3jax/local_platform.py): with no GPU or TPU device node and no
JAX_PLATFORMS, JAX starts on the CPU without trying the [plan] extra's plugins (no CUDA-plugin
traceback, no libtpu errors), and the deviceless GPU compile still has its compiler."""

import os
import subprocess
import sys

from k3jax.local_platform import ACCELERATOR_NODES, accelerator_nodes, local_platform


def test_the_decision():
    assert local_platform(environ={}, nodes=[]) == "cpu"
    for node in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd", "/dev/accel0", "/dev/vfio/0"):
        assert local_platform(environ={}, nodes=[node]) is None  # a machine with an accelerator: JAX's choice
    assert local_platform(environ={"JAX_PLATFORMS": ""}, nodes=[]) is None  # the user's choice, even empty
    assert local_platform(environ={"JAX_PLATFORMS": "cuda"}, nodes=[]) is None


def test_device_nodes_found(tmp_path):
    patterns = [str(tmp_path) + p for p in ACCELERATOR_NODES]
    (tmp_path / "dev" / "vfio").mkdir(parents=True)
    (tmp_path / "dev" / "vfio" / "vfio").touch()  # the VFIO control node of any host: no accelerator
    (tmp_path / "dev" / "nvidia-uvm").touch()  # not a GPU's node either
    assert accelerator_nodes(patterns) == []
    (tmp_path / "dev" / "vfio" / "0").touch()  # a TPU v5p / v6e chip's group
    (tmp_path / "dev" / "accel1").touch()  # a TPU v4 / v5e chip
    assert sorted(accelerator_nodes(patterns)) == sorted([str(tmp_path / "dev" / "accel1"),
                                                          str(tmp_path / "dev" / "vfio" / "0")])


def test_a_fresh_process_is_quiet_and_still_compiles_for_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = ("import jax\nfrom k3jax.local_platform import cpu_unless_accelerator\nprint(cpu_unless_accelerator())\n"
            "print(jax.devices()[0].platform)\nfrom k3jax.chips import CHIPS\nfrom train.plan.target import topology\n"
            "print(topology(CHIPS['h200'], 1).devices[0].device_kind)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    expected = local_platform(environ=env)  # this machine: "cpu" where it has no accelerator
    chosen, platform, gpu = r.stdout.split("\n")[:3]
    assert chosen == str(expected) and (platform == "cpu" if expected == "cpu" else True)
    assert gpu == "NVIDIA H200"  # the CUDA plugin still registered: k3jax-plan's target compile works
    for noise in ("Traceback", "cuDNN", "TPU_WORKER_HOSTNAMES", "plugin configuration error"):
        assert noise not in r.stderr, r.stderr
