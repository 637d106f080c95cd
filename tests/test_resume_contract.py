"""The resume contract: a resumed run continues the schedule it was on, refuses (with the
config keys that differ) what cannot be restored or would move the learning rate, a config
error leaves nothing behind, and compile time stays out of tokens/s."""

import json
import math
from pathlib import Path

import pytest

from k3jax.config import ConfigError, load_config
from train.checkpoint import resume_schedule
from train.cli import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "k3-tiny.yaml")
SMALL = ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2", "model.d_model=64", "model.moe.latent_dim=32",
         "data.seq_len=32", "train.batch_size=4", "checkpoint.every=3", "logging.every=1", "logging.eval_every=0",
         "logging.progress=false", "optimizer.warmup_steps=2", "optimizer.lr=1e-3", "optimizer.min_lr_ratio=0.1",
         "mesh.num_devices=1"]


def cosine(step, peak, floor, warm, length):
    """The cosine schedule by hand: linear warmup to peak, then half a cosine to floor."""
    if step < warm:
        return peak * (step + 1) / warm
    frac = min(max((step - warm) / (length - warm), 0.0), 1.0)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * frac))


def test_raising_train_steps_keeps_the_schedule(tmp_path):
    saved = load_config(TINY, ["train.steps=300", "optimizer.decay_steps=300"])
    later = load_config(TINY, ["train.steps=600"])
    resumed = resume_schedule(saved, later, 299, "ckpt")
    assert resumed.optimizer.decay_steps == 300 and resumed.train.steps == 600
    # a checkpoint from before decay_steps existed (0 saved) was on a train.steps-long schedule
    old = load_config(TINY, ["train.steps=300"])
    assert resume_schedule(old, later, 299, "ckpt").optimizer.decay_steps == 300


def test_a_learning_rate_jump_is_refused_with_both_rates():
    saved = load_config(TINY, ["train.steps=300", "optimizer.decay_steps=300"])
    longer = load_config(TINY, ["train.steps=600", "optimizer.decay_steps=600"])
    o = saved.optimizer
    want_old = cosine(150, o.lr, o.lr * o.min_lr_ratio, o.warmup_steps, 300)
    want_new = cosine(150, o.lr, o.lr * o.min_lr_ratio, o.warmup_steps, 600)
    with pytest.raises(ConfigError, match="would change the learning rate") as e:
        resume_schedule(saved, longer, 150, "ckpt")
    assert f"{want_old:.6g}" in str(e.value) and f"{want_new:.6g}" in str(e.value)
    assert "optimizer.decay_steps: checkpoint 300 -> requested 600" in str(e.value)
    allowed = load_config(TINY, ["train.steps=600", "optimizer.decay_steps=600", "optimizer.allow_lr_change=true"])
    assert resume_schedule(saved, allowed, 150, "ckpt").optimizer.decay_steps == 600
    with pytest.raises(ConfigError, match="optimizer.lr: checkpoint 0.003 -> requested 0.001"):
        resume_schedule(saved, load_config(TINY, ["optimizer.lr=1e-3"]), 150, "ckpt")


def test_wsd_extends_in_its_stable_phase():
    """WSD holds the peak until the last decay_fraction of the schedule: lengthening it while
    still in the stable phase moves nothing now and starts the decay later."""
    saved = load_config(TINY, ["optimizer.schedule=wsd", "train.steps=300", "optimizer.decay_steps=300"])
    longer = load_config(TINY, ["optimizer.schedule=wsd", "train.steps=600", "optimizer.decay_steps=600"])
    assert resume_schedule(saved, longer, 200, "ckpt").optimizer.decay_steps == 600  # stable until 244
    with pytest.raises(ConfigError, match="would change the learning rate"):
        resume_schedule(saved, longer, 280, "ckpt")  # already decaying


def rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_cli_resume_keeps_the_schedule_and_refuses_a_new_optimizer(tmp_path, capsys):
    run = tmp_path / "run"
    assert train_main(["--config", TINY, *SMALL, f"run_dir={run}", "train.steps=6"]) == 0
    captured = capsys.readouterr()
    assert "compiling the train step" in captured.out + captured.err  # the console is not silent
    first = rows(run)
    # compile time is logged on its own line, before any step; tokens/s starts after it
    assert "compile_s" in first[0] and "loss" not in first[0] and first[0]["compile_s"] > 0
    assert all("compile_s" not in r for r in first[1:])
    assert "decay_steps: 6" in (run / "config.yaml").read_text()

    # train further: the schedule stays 6 steps long, so steps 7-9 run at the floor
    assert train_main(["--config", TINY, *SMALL, f"run_dir={run}", "train.steps=9"]) == 0
    lr = {r["step"]: r["lr"] for r in rows(run) if "lr" in r}
    for step in range(1, 10):  # metrics' lr is the rate of the update that produced `step`
        assert lr[step] == pytest.approx(cosine(step - 1, 1e-3, 1e-4, 2, 6), rel=1e-5), step
    assert "decay_steps: 6" in (run / "config.yaml").read_text()

    # another optimizer: refused up front, naming the key, no Orbax traceback
    rc = train_main(["--config", TINY, *SMALL, f"run_dir={run}", "train.steps=12", "optimizer.name=muon"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot be restored" in err and "optimizer.name: checkpoint 'adamw' -> requested 'muon'" in err
    assert "Traceback" not in err
    # gradient clipping switched off changes the optimizer state's layout too
    rc = train_main(["--config", TINY, *SMALL, f"run_dir={run}", "train.steps=12", "optimizer.grad_clip=0"])
    assert rc == 2 and "optimizer.grad_clip: checkpoint 1.0 -> requested 0.0" in capsys.readouterr().err


def test_a_config_error_leaves_nothing_behind(tmp_path, capsys):
    run = tmp_path / "run"
    rc = train_main(["--config", TINY, *SMALL, f"run_dir={run}", "train.steps=3",
                     "data.sources=[{type: text, paths: [/no/such/dir/*.txt]}]"])
    assert rc == 2 and "/no/such/dir" in capsys.readouterr().err
    assert not run.exists()
    rc = train_main(["--config", TINY, *SMALL, f"run_dir={run}", "train.steps=3", "mesh.data=3"])
    assert rc == 2 and not run.exists()
