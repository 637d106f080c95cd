"""Several hosts: 2 processes x 4 CPU devices on 127.0.0.1 train and checkpoint collectively,
then one process with 8 devices resumes; the losses equal a single-process run's.

The model is one KDA layer with Stable LatentMoE: what several processes change (one mesh over
both processes' devices, experts split over expert=4 and rows over data=2 across them, each
process's data shard, the collective checkpoint) does not depend on the depth, and every layer
more lengthens each process's compile of the train step on CI's 2 cores."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--config", str(ROOT / "configs" / "k3-tiny.yaml"), "model.layer_pattern=kda", "model.first_k_dense=0",
          "model.attn_res_block_size=1", "model.d_model=64", "model.moe.latent_dim=32", "data.seq_len=32",
          "train.batch_size=8", "data.num_shards=2", "optimizer.schedule=constant", "optimizer.warmup_steps=0",
          "checkpoint.every=3", "logging.every=1", "logging.eval_every=0", "logging.progress=false",
          "mesh.data=2", "mesh.expert=4", "model.moe.ep_capacity_factor=8"]


def _env(devices: int):
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:  # not the compile-time line
            out[row["step"]] = row["loss"]
    return out


def test_two_processes_then_one(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    train = [sys.executable, "-m", "train", *COMMON]
    subprocess.run(train + ["train.steps=6", f"run_dir={single}"], env=_env(8), check=True, capture_output=True)

    port = _free_port()
    procs = [subprocess.Popen(train + ["train.steps=3", f"run_dir={multi}", f"distributed.coordinator=127.0.0.1:{port}",
                                       "distributed.num_processes=2", f"distributed.process_id={i}"],
                              env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    assert "on 8 cpu device(s)" in outs[0]  # one mesh over both processes' devices
    assert (multi / "checkpoints" / "3").is_dir()

    assert not (multi / "k3jax-train.lock").exists()  # process 0 held it and gave it back
    resumed = subprocess.run(train + ["train.steps=6", f"run_dir={multi}"], env=_env(8), check=True,
                             capture_output=True, text=True)
    assert "resuming from step 3" in resumed.stdout + resumed.stderr
    a, b = _losses(single), _losses(multi)
    assert sorted(b) == list(range(1, 7))
    np.testing.assert_allclose([b[s] for s in range(1, 7)], [a[s] for s in range(1, 7)], rtol=1e-5)


def test_a_held_run_dir_refuses_every_process(tmp_path):
    """Process 0 decides on the run_dir's lock and every process learns it: with the lock held by
    another live process, both processes exit 2 with one line, before either touches the run."""
    run = tmp_path / "run"
    hold = ("import sys; from train.run_lock import acquire; lock = acquire(sys.argv[1]); "
            "print('held', flush=True); sys.stdin.read(); lock.release()")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "train", *COMMON, "train.steps=3", f"run_dir={run}",
                                   f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
                                   f"distributed.process_id={i}"],
                                  env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 2 and "Traceback" not in out + err, out + err
        lines = [line for line in err.splitlines() if line.startswith("k3jax-train")]
        assert len(lines) == 1 and f"pid {holder.pid}" in lines[0] and ("(process 0)" in lines[0]) == (i == 1)
    assert not run.exists()  # the holder made run_dir and took it away: neither process wrote into it
