"""One owner per run directory (train/run_lock.py): a live holder refuses a launch, a gone one
(a dead pid, a reused pid, another host's stopped heartbeat, an unreadable lock) is taken over
with one line; a launch that created run_dir leaves nothing behind. The second signal's exit
(train/cli.py) gives the lock back and ends the process in one line. In-process: no JAX."""

import json
import subprocess
import sys
import threading
import time

import pytest

import train.cli as cli
from train.run_lock import LOCK_NAME, RunDirLocked, acquire, process_start, this_process


def write_lock(run_dir, **changes) -> dict:
    holder = this_process() | changes
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps(holder))
    return holder


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def take(run_dir, **kw):
    said = []
    lock = acquire(run_dir, say=said.append, **kw)
    return lock, said


def test_a_live_holder_refuses_and_its_lock_stays(tmp_path):
    holder = write_lock(tmp_path)  # this very process: alive, same start time
    with pytest.raises(RunDirLocked) as e:
        acquire(tmp_path, say=lambda s: None)
    assert f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}" in str(e.value)
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == holder


@pytest.mark.parametrize("changes,why", [
    ({"pid": "dead"}, "no longer running"),
    ({"proc_start": "1"}, "its pid now belongs to another process"),  # our pid, another process's start
])
def test_a_gone_holder_on_this_host_is_taken_over(tmp_path, changes, why):
    if changes.get("pid") == "dead":
        changes = {"pid": dead_pid()}
    old = write_lock(tmp_path, **changes)
    lock, said = take(tmp_path)
    assert len(said) == 1 and f"took over {tmp_path / LOCK_NAME} from pid {old['pid']}" in said[0] and why in said[0]
    assert json.loads(lock.path.read_text())["pid"] == this_process()["pid"]
    lock.release()
    assert not lock.path.exists() and tmp_path.exists()  # the run_dir existed before: kept


def test_process_start_tells_processes_apart():
    a, b = process_start(dead_pid()), process_start(this_process()["pid"])
    assert a is None and b is not None and b == process_start(this_process()["pid"])


def test_another_hosts_lock_goes_stale_without_its_heartbeat(tmp_path):
    old = write_lock(tmp_path, host="node-elsewhere", pid=1)
    t0 = time.monotonic()
    lock, said = take(tmp_path, stale_s=0.5)
    assert time.monotonic() - t0 >= 0.5
    assert "watching its heartbeat" in said[0] and "heartbeat stopped" in said[1] and old["host"] in said[1]
    lock.release()


def test_another_hosts_live_heartbeat_refuses(tmp_path):
    write_lock(tmp_path, host="node-elsewhere", pid=1)
    stop = threading.Event()

    def beat():  # what the holder's heartbeat thread does
        while not stop.wait(0.05):
            (tmp_path / LOCK_NAME).touch()

    t = threading.Thread(target=beat)
    t.start()
    try:
        with pytest.raises(RunDirLocked, match="node-elsewhere"):
            acquire(tmp_path, say=lambda s: None, stale_s=2.0)
    finally:
        stop.set()
        t.join()


def test_the_holders_heartbeat_moves_the_mtime(tmp_path):
    lock = acquire(tmp_path, heartbeat_s=0.05)
    first = lock.path.stat().st_mtime_ns
    time.sleep(0.3)
    assert lock.path.stat().st_mtime_ns > first
    lock.release()


def test_an_unreadable_lock_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text("{half a lo")
    lock, said = take(tmp_path)
    assert "an unreadable lock" in said[0]
    lock.release()


def test_a_lock_that_made_run_dir_takes_it_away(tmp_path):
    run_dir = tmp_path / "runs" / "new"
    lock = acquire(run_dir)
    assert lock.path.exists()
    lock.release()
    assert not (tmp_path / "runs").exists()  # a launch refused before writing anything leaves nothing
    lock = acquire(run_dir)
    (run_dir / "config.yaml").write_text("x")
    lock.release()
    assert (run_dir / "config.yaml").exists() and not lock.path.exists()


def test_a_second_signal_releases_and_exits_in_one_line(monkeypatch, capsys):
    stop, released, exits = cli._StopFlag(), [], []
    stop.on_exit_now.append(lambda: released.append(True))
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    stop._handle(cli.signal.SIGINT, None)
    assert stop.signal == "SIGINT" and not released and not exits
    stop._handle(cli.signal.SIGTERM, None)
    assert released == [True] and exits == [130]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "stopping after the next step" in err[0] and "SIGTERM again: stopped now" in err[1]
