"""The training program end to end: exact resume after SIGKILL (its stale run_dir lock taken
over) and SIGTERM, a second launch refused while the first lives, a damaged newest checkpoint
passed over, clear errors with no traceback, QB in the run, MQAR learning, QAT following the
plain loss, NaN stop, plotting, and sampling from the run (k3jax-generate)."""

import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.config.schema import replace
from train.interchange.rundir import load_model
from train.checkpoint_manifest import MANIFEST
from train.cli import main as train_main
from train.cli import train
from train.data.tokenizers import ByteTokenizer
from train.generate import TextStream, sample
from train.generate import main as generate_main
from train.plot import main as plot_main

from tiny_run import SMALL, TINY


def cli(run_dir, *extra):
    return [sys.executable, "-m", "train", "--config", TINY, *SMALL, f"run_dir={run_dir}", *extra]


def cached_env(cache_dir):
    """The runs share JAX's persistent compilation cache: the same program compiles once
    (and a cached executable computes bit-identical results). The suite's cache when there is
    one (tests/conftest.py): test_watching.py's run compiles these programs too (tiny_run.py)."""
    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR") or cache_dir
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache_dir), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def losses(run_dir) -> dict[int, float]:
    """step -> loss, the last line per step winning (a resumed run re-logs the steps after its checkpoint)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


def final_state(run_dir, step=16):
    mgr = ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", item_names=("state", "data", "config"))
    return mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


def interrupt(run_dir, sig, env, after_step=4, timeout=300):
    """Start a run, wait until checkpoint `after_step` is complete, then send `sig`."""
    proc = subprocess.Popen(cli(run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    target = Path(run_dir) / "checkpoints" / str(after_step)
    t0 = time.time()
    while not target.is_dir():
        if proc.poll() is not None or time.time() - t0 > timeout:
            raise AssertionError(f"run ended before checkpoint {after_step}:\n{proc.stdout.read()}")
        time.sleep(0.01)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    a, b, c = base / "uninterrupted", base / "killed", base / "terminated"
    env = cached_env(base / "jax-cache")
    subprocess.run(cli(a), check=True, capture_output=True, text=True, env=env)
    rc, out = interrupt(b, signal.SIGKILL, env)
    assert rc == -signal.SIGKILL, out
    # a half-written checkpoint left by a crash must be ignored on resume
    junk = b / "checkpoints" / "15.orbax-checkpoint-tmp-1234567890"
    junk.mkdir(parents=True)
    (junk / "garbage").write_text("not a checkpoint")
    killed_at = max(losses(b))
    relaunched = subprocess.run(cli(b), check=True, capture_output=True, text=True, env=env)
    rc, out = interrupt(c, signal.SIGTERM, env)
    assert rc == 0 and "SIGTERM: saved a checkpoint" in out, out
    subprocess.run(cli(c), check=True, capture_output=True, text=True, env=env)
    return a, b, c, killed_at, relaunched.stdout + relaunched.stderr


def test_exact_resume_after_sigkill_and_sigterm(runs):
    a, b, c, killed_at, relaunched = runs
    ref = losses(a)
    assert sorted(ref) == list(range(1, 17))
    assert killed_at < 16  # the kill landed mid-run
    # the killed run left its lock; its pid is gone, so the relaunch took it over, in one line
    took = [line for line in relaunched.splitlines() if "took over" in line]
    assert len(took) == 1 and "k3jax-train.lock" in took[0] and "no longer running" in took[0], relaunched
    assert not any((run / "k3jax-train.lock").exists() for run in (a, b, c))  # released at each exit
    for run in (b, c):
        got = losses(run)
        assert sorted(got) == list(range(1, 17))
        assert all(got[s] == ref[s] for s in range(1, 17)), (run.name, got, ref)  # bitwise: exact floats
        sa, sb = final_state(a), final_state(run)
        for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
            np.testing.assert_array_equal(x, y)


def test_run_folder_contents_and_qb_bias_history(runs):
    a = runs[0]
    assert (a / "config.yaml").is_file() and any((a / "tensorboard").iterdir())
    assert load_config(a / "config.yaml").model.d_model == 64  # the resolved config is loadable
    assert sorted(int(p.name) for p in (a / "checkpoints").iterdir() if p.name.isdigit()) == [8, 12, 16]
    biases = [np.asarray(final_state(a, s)["rest"]["router_bias"]) for s in (8, 12, 16)]
    assert all(np.abs(b).max() > 0 for b in biases)
    assert not np.allclose(biases[0], biases[1]) and not np.allclose(biases[1], biases[2])
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in rows) and all("max_violation" in r for r in rows if "loss" in r)


def test_refuses_mismatched_or_finished_checkpoint(runs, capsys):
    a = runs[0]
    assert train_main(["--config", TINY, *SMALL, f"run_dir={a}", "model.d_model=32", "model.moe.latent_dim=16"]) == 2
    err = capsys.readouterr().err
    assert "different model" in err and "model.d_model: checkpoint 64 -> requested 32" in err
    assert train_main(["--config", TINY, *SMALL, f"run_dir={a}"]) == 2
    assert "already >= train.steps=16" in capsys.readouterr().err


# A process that holds a run directory as k3jax-train does (train.run_lock), until its stdin closes.
HOLD = ("import sys; from train.run_lock import acquire; lock = acquire(sys.argv[1]); print('held', flush=True); "
        "sys.stdin.read(); lock.release()")


def checkpoint_files(run) -> dict[str, bytes]:
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted((run / "checkpoints").rglob("*"))
            if p.is_file()}


def test_a_second_launch_is_refused_while_the_first_lives(runs, tmp_path):
    """While another live process owns run_dir, a launch exits 2 in one line naming the holder
    and touches none of its checkpoints. Launched without JAX_PLATFORMS, as a user would on a
    CPU machine with the [plan] extra: no plugin tracebacks, no libtpu errors."""
    a = runs[0]
    before = checkpoint_files(a)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(a)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        env = {k: v for k, v in cached_env(tmp_path / "jax-cache").items() if k != "JAX_PLATFORMS"}
        r = subprocess.run(cli(a, "train.steps=24"), capture_output=True, text=True, env=env)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert r.stderr.strip().splitlines() == [line for line in r.stderr.splitlines() if line.startswith("k3jax-train")]
    assert len(r.stderr.strip().splitlines()) == 1 and f"pid {holder.pid} on host {socket.gethostname()}" in out
    for noise in ("Traceback", "cuDNN", "TPU_WORKER_HOSTNAMES", "libtpu"):
        assert noise not in out, out
    assert checkpoint_files(a) == before
    assert not (a / "k3jax-train.lock").exists()  # the holder gave it back


def damage(step_dir) -> None:
    """What the issue found: the step's array files overwritten with 100 random bytes. All of
    them: which three the issue's sorted listing picked depends on the files' random names, and
    some of a step's files are not read by a restore, so damaging a few fails only sometimes."""
    rng = np.random.default_rng(0)
    for f in sorted((step_dir / "state" / "ocdbt.process_0" / "d").iterdir()):
        f.write_bytes(rng.bytes(100))


def rows_after_resume(run) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = max(i for i, r in enumerate(lines) if "resumed_from" in r)
    return lines[last:]


def test_a_damaged_newest_checkpoint_costs_only_its_steps(runs, tmp_path):
    """Step 16 damaged (its integrity record catches it) and step 12 damaged with its record
    removed (as a checkpoint of an earlier version: its restore fails). The relaunch names each
    in one warning line with the reason, moves both to checkpoints/damaged/ (kept whole), resumes
    from step 8, logs that, and its losses 9-16 equal the uninterrupted run's bit for bit."""
    a = runs[0]
    run = tmp_path / "run"
    shutil.copytree(a, run)
    ckpts = run / "checkpoints"
    damage(ckpts / "16")
    damage(ckpts / "12")
    (ckpts / "12" / MANIFEST).unlink()
    kept = {s: sorted(p.relative_to(ckpts / s) for p in (ckpts / s).rglob("*")) for s in ("12", "16")}
    r = subprocess.run(cli(run), capture_output=True, text=True, env=cached_env(tmp_path / "jax-cache"))
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in out, out
    warned = [line for line in r.stderr.splitlines() if "is damaged" in line]
    assert len(warned) == 2, out
    assert "step 16" in warned[0] and "differ from their record" in warned[0] and "100 bytes" in warned[0]
    assert "step 12" in warned[1] and "does not restore" in warned[1]
    assert "resuming from step 8" in r.stdout
    moved = {p.name.split("-")[0]: p for p in (ckpts / "damaged").iterdir()}
    assert sorted(moved) == ["12", "16"]
    assert {s: sorted(p.relative_to(moved[s]) for p in moved[s].rglob("*")) for s in moved} == kept
    after = rows_after_resume(run)
    assert after[0] == {"step": 8, "resumed_from": 8}
    assert [r["damaged_checkpoint"] for r in after if "damaged_checkpoint" in r] == [16, 12]
    got, ref = {r["step"]: r["loss"] for r in after if "loss" in r}, losses(a)
    assert sorted(got) == list(range(9, 17)) and all(got[s] == ref[s] for s in got), (got, ref)
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [8, 12, 16]  # saved again


def test_no_checkpoint_restores_exit_2_in_one_message(runs, tmp_path, capfd):
    """Every step damaged: exit 2, one message naming each step's reason, no traceback, nothing
    moved. k3jax-generate on it: one line on the process's stderr (fd 2, where TensorStore's threads
    write) saying the model cannot be loaded."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    for step in ("8", "12", "16"):
        damage(run / "checkpoints" / step)
    r = subprocess.run(cli(run), capture_output=True, text=True, env=cached_env(tmp_path / "jax-cache"))
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out, out
    assert len(r.stderr.strip().splitlines()) == 1 and "no checkpoint restores" in r.stderr
    assert all(f"step {s}: its files differ" in r.stderr for s in (16, 12, 8))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["12", "16", "8"]
    assert generate_main([str(run), "--step", "8", "--max-new-tokens", "2"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    # the manifest refuses it, whatever Orbax would make of the damaged bytes
    assert len(err) == 1 and err[0].startswith(f"k3jax-generate: {run}/checkpoints/8: its files differ from when "
                                               f"it was saved"), err
    # without its record (a checkpoint of an earlier version), Orbax's own failure, in one line
    (run / "checkpoints" / "12" / MANIFEST).unlink()
    assert generate_main([str(run), "--step", "12", "--max-new-tokens", "2"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"k3jax-generate: {run}/checkpoints/12: it does not restore ("), err


PROMPT = "import os\ndef "


@pytest.fixture(scope="module")
def generated(runs):
    """Run a's model, a greedy sample and a seeded one (temperature 1) from PROMPT, and the
    model's logits over each sample computed in one full forward pass (no cache): the logits
    that predicted each new token."""
    model = load_model(runs[0])
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])
    prompt = np.array([list(PROMPT.encode())], np.int32)
    T = prompt.shape[1]

    def full_logits(new):
        seq = np.concatenate([prompt, new], axis=1)[:, :-1]
        return np.asarray(forward(state, jnp.asarray(seq)))[0, T - 1:]

    greedy = sample(model, prompt, max_new_tokens=12, temperature=0.0)
    drawn = sample(model, prompt, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=3)
    return {"greedy": (greedy, full_logits(greedy)), "drawn": (drawn, full_logits(drawn))}


def test_generate_greedy_is_the_argmax_of_the_full_forward(generated):
    """Greedy sampling (prefill, then the cached decode steps, streamed) picks at every position
    the argmax of the full forward's logits over the same tokens (up to rounding ties)."""
    greedy, logits = generated["greedy"]
    picked = logits[np.arange(12), greedy[0]]
    assert greedy.shape == (1, 12) and np.all(picked >= logits.max(-1) - 1e-4), (greedy, logits.argmax(-1))


def test_generate_draws_each_token_from_its_seeded_key(generated):
    """At temperature 1, the i-th token is jax.random.categorical of the full forward's logits
    under fold_in(PRNGKey(seed), i): the seed alone decides the sample."""
    drawn, logits = generated["drawn"]
    want = [int(jax.random.categorical(jax.random.fold_in(jax.random.PRNGKey(3), i), logits[i][None])[0])
            for i in range(12)]
    assert drawn[0].tolist() == want
    assert len(set(want)) > 3  # a varied sample: the check is not of one repeated token


def test_generate_cli_streams_the_text_and_repeats_a_seed(runs, generated, tmp_path, capsys):
    """k3jax-generate with the fixture's seed prints the prompt and the same sample's text, then
    its speed; a run directory with no checkpoint yet, or none at all, gets one line."""
    a = runs[0]
    args = [str(a), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "1", "--top-p", "1", "--seed", "3"]
    assert generate_main(args) == 0
    out, err = capsys.readouterr()
    text = io.StringIO()
    stream = TextStream(ByteTokenizer(), text)
    for t in generated["drawn"][0][0]:
        stream.add(int(t))
    stream.flush()
    assert out == PROMPT + text.getvalue() + "\n"
    assert "tokens/s (11 decode steps x 1 rows" in err and "Traceback" not in err
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    shutil.copy(a / "config.yaml", empty / "config.yaml")
    for where, says in ((empty, "holds no checkpoint yet"), (tmp_path / "nothing", "no such run directory")):
        assert generate_main([str(where)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


def test_generate_cli_says_tokamax_misses_in_one_line(runs, monkeypatch, capsys, caplog):
    """tokamax's absl warning for each decode shape without a tuned config (a GPU with the [gpu]
    extra) reaches no handler, so no terminal shows it amid the text; the distinct shapes are
    counted in one line after the speed line. Emulated here: the records tokamax logs, emitted
    while k3jax-generate samples."""
    import train.generate as generate_module

    real_sample = generate_module.sample

    def sample_with_misses(*args, **kwargs):
        for key in ('{"lhs":"bf16[56,768]"}', '{"lhs":"bf16[56,512]"}', '{"lhs":"bf16[56,512]"}'):
            logging.getLogger("absl").warning("Autotuning cache miss for %s on %s with key %s",
                                              "K3RaggedDot(config=None)", "NVIDIA H200", key)
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(generate_module, "sample", sample_with_misses)
    with caplog.at_level(logging.WARNING):
        assert generate_main([str(runs[0]), "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert not [r for r in caplog.records if "Autotuning cache miss" in r.getMessage()]
    assert "Autotuning cache miss" not in err
    said = [ln for ln in err.splitlines() if "tokamax:" in ln]
    assert len(said) == 1 and "2 kernel shapes (K3RaggedDot 2) without a tuned config" in said[0], said


def test_clear_errors(tmp_path, capsys):
    def run(*extra):
        rc = train_main(["--config", TINY, *SMALL, f"run_dir={tmp_path / 'r'}", *extra])
        return rc, capsys.readouterr().err
    rc, err = run("train.stepz=3")
    assert rc == 2 and "did you mean 'train.steps'" in err
    rc, err = run("data.sources=[{type: text, paths: [/no/such/dir/*.txt]}]")
    assert rc == 2 and "data.sources.0.paths" in err and "/no/such/dir" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc, err = run(f"data.sources=[{{type: text, paths: [{empty}]}}]")
    assert rc == 2 and "empty.jsonl" in err
    rc, err = run("model.vocab_size=128")  # the byte tokenizer needs 257 ids
    assert rc == 2 and "data.tokenizer" in err and "model.vocab_size" in err


def test_plot(runs, tmp_path):
    out = tmp_path / "loss.png"
    assert plot_main([str(runs[0]), str(runs[1]), "-o", str(out)]) == 0
    assert out.stat().st_size > 10_000


def test_mqar_loss_falls(tmp_path, monkeypatch):
    """A short k3-tiny run on multi-query associative recall lowers its loss.

    Two of k3-tiny's layers (a dense KDA layer, then an MLA layer with its MoE), at its widths:
    the loss falls by 0.45 in 24 steps (the 8-layer model: 0.43; bound 0.3), and the step
    compiles in a quarter of the 8-layer model's time, which was most of this test's 40 s.

    Also: with a peak set, every line logs MFU, and the model's parameters are counted once per
    launch, not at each line (~1 s a line for k3-small unrolled, with the device idle): neither
    k3jax-train nor k3jax.flops counts again. MFU / tokens_per_s is then the same on every line,
    3 x (2 x active matmul params + k3jax.flops' mixer FLOPs) per token, with the active matmul
    parameters summed here from the parameter counts (routed experts at top_k / num_experts)."""
    import k3jax.flops as flops
    from train import cli as train_cli

    calls = []
    counted = flops.param_counts
    counting = lambda model: calls.append(1) or counted(model)  # noqa: E731
    monkeypatch.setattr(flops, "param_counts", counting)
    monkeypatch.setattr(train_cli, "param_counts", counting)
    cfg = load_config(TINY, ["data.sources=[{type: mqar, mqar_pairs: 8, mqar_queries: 8}]", "data.seq_len=32",
                             "model.layer_pattern=kda+mla", "model.attn_res_block_size=2", "mesh.num_devices=1",
                             "train.steps=24", "train.batch_size=8", "optimizer.warmup_steps=2", "logging.every=1", "logging.eval_every=0",
                             "logging.progress=false", "checkpoint.every=24", "logging.peak_tflops=100",
                             f"run_dir={tmp_path}"])
    train(cfg)
    got = losses(tmp_path)
    first, last = np.mean([got[s] for s in (1, 2, 3)]), np.mean([got[s] for s in range(20, 25)])
    assert last < first - 0.3, (first, last)  # uniform over the vocab is ln 512 = 6.24
    assert len(calls) == 1, f"the parameters were counted {len(calls)} times for 24 lines"
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    per_token = {round(d["mfu"] * 100e12 / d["tokens_per_s"], 3) for d in lines if "mfu" in d}
    counts = counted(flops.abstract_model(cfg.model))
    routed = counts.pop("routed_experts") * cfg.model.moe.top_k / cfg.model.moe.num_experts
    matmul = routed + sum(v for k, v in counts.items() if k not in flops._NON_MATMUL)
    assert per_token == {round(3 * (2 * matmul + flops.mixer_flops_per_token(cfg.model, 32)), 3)}

    # The same run logging every 4 steps: a window's last line is written once the next step is
    # queued (train/cli.py), from the window as it stood. Each line is the mean of its 4 steps'
    # lines above (same seed and data: the same steps), in step order, per layer too.
    every4 = tmp_path / "every4"
    train(replace(cfg, **{"logging.every": 4, "run_dir": str(every4)}))
    four = [json.loads(l) for l in (every4 / "metrics.jsonl").read_text().splitlines()]
    four = [d for d in four if "loss" in d]
    assert [d["step"] for d in four] == [1, 4, 8, 12, 16, 20, 24]
    by_step = {d["step"]: d for d in lines if "loss" in d}
    for d in four[1:]:
        steps = range(d["step"] - 3, d["step"] + 1)  # windows are fixed: the line at step 1 left 1-4 open
        assert d["window_steps"] == 4
        for key in ("loss", "accuracy", "grad_norm", "max_violation"):
            want = np.mean([np.asarray(by_step[s][key], np.float64) for s in steps], axis=0)
            np.testing.assert_allclose(d[key], want, rtol=1e-5, err_msg=f"{key} at step {d['step']}")


def test_qat_loss_follows_the_plain_run(runs, tmp_path):
    """model.qat=mxfp4 (MXFP4 expert weights, MXFP8 expert-GEMM inputs) over the plain run's 16
    steps and batches: every step's loss within 0.02 of the plain run's (measured: at most
    0.002), and not equal to it (the quantizers are on)."""
    cfg = load_config(TINY, SMALL + [f"run_dir={tmp_path}", "model.qat=mxfp4", "logging.eval_every=0",
                                     "checkpoint.every=16"])
    train(cfg)
    got, ref = losses(tmp_path), losses(runs[0])
    assert sorted(got) == sorted(ref) == list(range(1, 17))
    gap = np.array([got[s] - ref[s] for s in range(1, 17)])
    assert np.abs(gap).max() < 0.02 and np.abs(gap).max() > 1e-5, gap
    assert ref[16] < ref[1] - 1.0 and got[16] < got[1] - 1.0  # both learn


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    # one MLA layer with its MoE: the loop's check of the step's finite flag does not depend on
    # the model, and this program (an lr that overflows) is compiled for this test alone. In a
    # subprocess: what a user sees at exit, Orbax's background threads included
    run = tmp_path / "run"
    r = subprocess.run(cli(run, "optimizer.lr=1e30", "optimizer.warmup_steps=0", "optimizer.grad_clip=0",
                           "checkpoint.every=1", "logging.eval_every=0", "model.layer_pattern=mla",
                           "model.first_k_dense=0", "model.attn_res_block_size=1"),
                       capture_output=True, text=True, env=cached_env(tmp_path / "jax-cache"))
    err = r.stderr
    assert r.returncode == 3 and "Traceback" not in r.stdout + err, err
    ours = [line for line in err.splitlines() if line.startswith("k3jax-train")]
    assert len(ours) == 1 and "not finite" in ours[0], err  # one message
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and f"(step {steps[-1]})" in err
    state = final_state(run, steps[-1])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))


def test_execution_knobs_may_change_on_resume_but_shapes_may_not():
    from k3jax.config import model_changes

    saved = load_config(TINY).model
    knobs = load_config(TINY, ["model.remat=full", "model.moe.grouped_matmul=blocked", "model.kda.chunk_size=32",
                               "model.moe.ep_dispatch=capacity"]).model
    assert model_changes(saved, knobs) == []
    other = load_config(TINY, ["model.remat=full", "model.moe.top_k=2"]).model
    assert model_changes(saved, other) == [("model.moe.top_k", 4, 2)]
