"""train/stderr_capture.py: a failed restore's stray output is held and dropped, a good one's
passed on; only the named coroutines' unraisable reports and asyncio "never retrieved" lines are
dropped."""

import subprocess
import sys

CODE = r'''
import os, sys, threading
from train.stderr_capture import StderrCapture, drop_unraisable_from
with StderrCapture() as held:
    os.write(2, b"from C\n")                      # what TensorStore's threads write
    print("from python", file=sys.stderr)
    t = threading.Timer(0.2, lambda: os.write(2, b"late\n")); t.start()
    held.settle(quiet_s=0.5)                     # waits for the late write
held.{verdict}()
print("after", file=sys.stderr)
drop_unraisable_from("noisy_read", mentioning=("/run/checkpoints/12/",))
class Pending:
    def __await__(self):
        yield
async def noisy_read():
    try:
        await Pending()
    finally:
        raise ValueError("read error")
async def other():
    try:
        await Pending()
    finally:
        raise ValueError("kept error")
for f in (noisy_read, other):
    c = f(); c.send(None); del c                 # closed unfinished: reports through unraisablehook
import logging
for name in ("noisy_read", "other"):            # what asyncio logs when such a task is collected
    logging.getLogger("asyncio").error("Task exception was never retrieved\nfuture: <Task finished "
                                       f"name='Task-1' coro=<{name}() done> exception=ValueError('{name} lost')>")
for step in (12, 8):                            # a bare Future: only its error names what it read
    logging.getLogger("asyncio").error("Future exception was never retrieved\nfuture: <Future finished "
                                       f"exception=ValueError('Error reading at \"/run/checkpoints/{step}/state/\"')>")
'''


def _stderr(verdict):
    r = subprocess.run([sys.executable, "-c", CODE.replace("{verdict}", verdict)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_a_failed_attempts_output_is_dropped_and_only_named_coroutines_are_silenced():
    err = _stderr("drop")
    assert "from C" not in err and "from python" not in err and "late" not in err
    assert err.startswith("after\n")
    assert "kept error" in err and "other" in err  # another coroutine's report still shows
    assert "read error" not in err and "noisy_read" not in err and "noisy_read lost" not in err
    assert "other lost" in err  # asyncio's report of another task still shows
    assert "checkpoints/12/" not in err  # a bare Future's report naming the dropped path
    assert "checkpoints/8/" in err  # and one naming another path still shows


def test_a_good_attempts_output_is_passed_on_in_order():
    err = _stderr("pass_on")
    assert err.startswith("from C\nfrom python\nlate\nafter\n"), err
