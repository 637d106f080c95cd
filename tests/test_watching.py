"""What a user watches: training time apart from eval and checkpoints, plain log lines off a
terminal, the eval set, one MFU, the compilation cache's directory and tokamax's tuning lines."""

import io
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from k3jax.config import load_config
from k3jax.config.schema import LoggingConfig
from k3jax.flops import matmul_flops_per_token, peak_tflops
from train import cli
from train.checkpoint import Checkpointer
from train.compile_cache import resolve_cache_dir
from train.data.pipeline import build_pipeline
from train.evaluation import EvalSet
from train.kernel_tuning import (KernelTuner, TokamaxLogFilter, miss_summary, quiet_tokamax, record_kind,
                                 tuning_file)
from train.metrics import RunLogger, draws_bar, progress_line
from train.timing import TrainClock

from tiny_run import ROOT, SMALL, TINY
ASIDE_S = 100.0  # what the patched eval and checkpoint take on the test's clock


class FakeClock:
    """perf_counter plus the seconds the test says passed."""

    def __init__(self):
        self.extra = 0.0

    def __call__(self):
        return time.perf_counter() + self.extra


# --------------------------------------------------------------------------------------------
# the training clock


def test_train_clock_sets_asides_apart():
    t = [0.0]
    clock = TrainClock(now=lambda: t[0])
    clock.start()
    t[0] = 3.0  # three seconds of steps
    with clock.aside("eval"):
        t[0] = 10.0
    t[0] = 12.0  # two more seconds of steps
    with clock.aside("checkpoint"):
        t[0] = 40.0
    assert clock.lap() == pytest.approx(5.0)  # 40 s of wall time, 35 of them aside
    assert clock.aside_seconds == {"eval": pytest.approx(7.0), "checkpoint": pytest.approx(28.0)}
    t[0] = 41.5
    assert clock.lap() == pytest.approx(1.5)  # asides count once, in their own lap


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
    """A run whose every eval and checkpoint takes ASIDE_S on its clock, logging to a pipe."""
    mp = pytest.MonkeyPatch()
    clock = FakeClock()
    save, evaluate = Checkpointer.save, EvalSet.evaluate

    def slow_save(self, *a, **k):
        clock.extra += ASIDE_S
        return save(self, *a, **k)

    def slow_evaluate(self, *a, **k):
        clock.extra += ASIDE_S
        return evaluate(self, *a, **k)

    mp.setattr(Checkpointer, "save", slow_save)
    mp.setattr(EvalSet, "evaluate", slow_evaluate)
    mp.setattr(cli, "TrainClock", lambda: TrainClock(now=clock))
    out = io.StringIO()
    mp.setattr("sys.stdout", out)  # not a terminal, as under nohup
    run_dir = tmp_path_factory.mktemp("timed")
    try:
        cfg = load_config(TINY, SMALL + ["logging.progress=true", "logging.tensorboard=false", f"run_dir={run_dir}"])
        cli.train(cfg)
    finally:
        mp.undo()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, rows, out.getvalue()


def test_tokens_per_s_counts_training_steps_only(timed_run):
    cfg, rows, _ = timed_run
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    steps = [r for r in rows if "tokens_per_s" in r]
    assert [r["step"] for r in steps] == list(range(1, 17))
    for r in steps:  # one step per line: training time = tokens / rate, far below one aside
        assert tokens_per_step / r["tokens_per_s"] < ASIDE_S / 2, r
    saves = [r["checkpoint_s"] for r in rows if "checkpoint_s" in r]
    evals = [r["eval_s"] for r in rows if "eval_s" in r]
    assert len(saves) == 4 and all(s >= ASIDE_S for s in saves)
    assert len(evals) == 2 and all(s >= ASIDE_S for s in evals)
    assert all("eval_loss" in r for r in rows if "eval_s" in r)


def test_log_off_a_terminal_is_plain_lines(timed_run):
    _, _, text = timed_run
    assert "\r" not in text and "%|" not in text  # no progress-bar redraws
    lines = text.splitlines()
    progress = [ln for ln in lines if ln.startswith("step ") and "/16: loss " in ln]
    assert len(progress) == 16 and "tokens/s" in progress[-1] and "eta 0:00" in progress[-1]
    assert any(ln.startswith("eval: 1 batches, ") for ln in lines)
    assert sum(ln.startswith("step ") and ": eval loss " in ln for ln in lines) == 2


def test_bar_only_on_a_terminal(tmp_path, capsys):
    class Stream(io.StringIO):
        def __init__(self, tty):
            super().__init__()
            self.tty = tty

        def isatty(self):
            return self.tty

    tty, pipe = Stream(True), Stream(False)
    assert draws_bar(True, (tty, tty)) and not draws_bar(False, (tty, tty))
    assert not draws_bar(True, (tty, pipe)) and not draws_bar(True, (pipe, tty)) and not draws_bar(True, (object(),))
    cfg = LoggingConfig(tensorboard=False, progress=True)
    values = {"loss": 2.5, "tokens_per_s": 1234.4, "mfu": 0.1449, "lr": 3e-3}
    lines = RunLogger(tmp_path, cfg, total_steps=10, start_step=0, streams=(pipe, pipe))
    assert lines.bar is None
    lines.progress(1, values)
    lines.progress(5, values)
    lines.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 1/10: loss 2.5000, 1,234 tokens/s, MFU 14.5%, lr 3.00e-03"
    assert out[1].startswith("step 5/10: loss 2.5000, ") and ", eta 0:" in out[1]
    bar = RunLogger(tmp_path, cfg, total_steps=10, start_step=0, streams=(tty, tty))
    assert bar.bar is not None  # the terminal keeps its bar
    bar.progress(1, values)
    bar.close()
    assert "tok_s=1,234" in capsys.readouterr().err


def test_progress_line_format():
    assert progress_line(20, 300, {"loss": 3.45211, "tokens_per_s": 12345.6}, eta_s=83) == \
        "step 20/300: loss 3.4521, 12,346 tokens/s, eta 1:23"
    assert progress_line(1, 2, {"loss": 1.0}, eta_s=3725) == "step 1/2: loss 1.0000, eta 1:02:05"


# --------------------------------------------------------------------------------------------
# the eval set


def write_docs(root, n, length):
    """n text files; document i is 'd{i}w0 d{i}w1 ...', so any 12 bytes of it name it and place it."""
    root.mkdir()
    texts = []
    for i in range(n):
        words, j = [], 0
        while sum(len(w) + 1 for w in words) < length:
            words.append(f"d{i}w{j}")
            j += 1
        texts.append(" ".join(words)[:length])
        (root / f"{i:03d}.txt").write_text(texts[-1])
    return texts


def eval_pieces(cfg, batches, split="eval"):
    """The `split` stream's first `batches` batches as the texts of their pieces."""
    from test_data import segments

    p = build_pipeline(cfg, split=split)
    out = [bytes(t for t in toks.tolist() if t < 256).decode() for _ in range(batches)
           for _, _, toks, _, _ in segments(next(p))]
    p.close()
    return out


def test_eval_rows_mix_documents_never_repeat_and_ignore_the_seed(tmp_path):
    from test_data import config, text_source

    texts = write_docs(tmp_path / "docs", 60, 400)
    cfg = config([text_source(tmp_path / "docs")], seq_len=32, eval_fraction=0.5, batch_size=8)
    pieces = eval_pieces(cfg, 4)
    docs = set()
    for piece in pieces:
        if len(piece) >= 12:
            (doc,) = [i for i, t in enumerate(texts) if piece in t]
            docs.add(doc)
    # 30 held-out documents of 13 pieces: in document order the 32 rows would come from 3
    assert len(docs) >= 10
    assert len(set(pieces)) == len(pieces)  # one window of one pass: no piece twice
    reseeded = config([text_source(tmp_path / "docs")], seq_len=32, eval_fraction=0.5, batch_size=8, seed=7)
    assert eval_pieces(reseeded, 4) == pieces  # every run of a corpus: the same eval rows


def test_train_batches_mix_documents(tmp_path):
    """A batch of consecutive pieces of one document (as before data.shuffle_window) trains the
    model on one file at a time; the window spreads the pieces over the batches."""
    from test_data import config, text_source

    texts = write_docs(tmp_path / "docs", 60, 400)

    def docs_per_batch(window):
        cfg = config([text_source(tmp_path / "docs")], seq_len=32, batch_size=8,
                     **{"data.shuffle_window": window})
        pieces = eval_pieces(cfg, 4, split="train")
        return [len({i for p in pieces[b * 8:(b + 1) * 8] if len(p) >= 12
                     for i, t in enumerate(texts) if p in t}) for b in range(4)]

    assert max(docs_per_batch(0)) <= 3  # document order: 8 rows of 13-piece documents
    assert min(docs_per_batch(1 << 20)) >= 5


# --------------------------------------------------------------------------------------------
# MFU


def test_peaks_are_the_dense_bf16_specs():
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("TPU v5 lite") == 197.0 and peak_tflops("cpu") is None


def test_6n_counts_active_experts():
    """More experts at the same top_k add only router columns (d_model x E per MoE layer) to the
    per-token matmul work; 6 x all non-embedding parameters would add the new experts too."""
    small = load_config(TINY).model
    big = load_config(TINY, ["model.moe.num_experts=32"]).model
    moe_layers = sum(small.ffn_kind(i) == "moe" for i in range(small.num_layers))
    router = moe_layers * small.d_model * (32 - 16)
    assert matmul_flops_per_token(big) - matmul_flops_per_token(small) == pytest.approx(6 * router)


# --------------------------------------------------------------------------------------------
# the compilation cache's directory


def test_compile_cache_dir():
    home = str(Path("~").expanduser())
    assert resolve_cache_dir("auto", {}, jax_setting="") == Path(home) / ".cache" / "k3jax" / "jax"
    assert resolve_cache_dir("auto", {"XDG_CACHE_HOME": "/x"}, jax_setting="") == Path("/x/k3jax/jax")
    assert resolve_cache_dir("auto", {"JAX_COMPILATION_CACHE_DIR": "/j", "XDG_CACHE_HOME": "/x"},
                             jax_setting="") == Path("/j")
    assert resolve_cache_dir("auto", {}, jax_setting="/configured") == Path("/configured")
    assert resolve_cache_dir("~/c", {"JAX_COMPILATION_CACHE_DIR": "/j"}, jax_setting="/j") == Path(home) / "c"
    assert resolve_cache_dir("off", {"JAX_COMPILATION_CACHE_DIR": "/j"}) is None
    assert tuning_file(Path("/c"), "NVIDIA H200", "0.0.17", "0.11.2") == \
        Path("/c/tokamax/0.0.17-jax0.11.2/nvidia_h200.json")


# --------------------------------------------------------------------------------------------
# tokamax's autotuning records


class PallasMosaicGpuRaggedDot:  # stands in for tokamax's op in its records
    pass


def miss(key):
    """The record tokamax 0.0.17 logs through absl on each cache miss (ops/op.py)."""
    return logging.LogRecord("absl", logging.WARNING, "op.py", 565, "Autotuning cache miss for %s on %s with key %s",
                             (PallasMosaicGpuRaggedDot(), "NVIDIA H200", key), None)


def test_record_kind():
    assert record_kind(miss('{"lhs":"bf16[1,2]"}')) == ("miss", "PallasMosaicGpuRaggedDot", '{"lhs":"bf16[1,2]"}')
    failed = logging.LogRecord("absl", logging.ERROR, "api.py", 1, "Failed to autotune for op %s",
                               ("TritonRaggedDot(config=None)",), None)
    assert record_kind(failed) == ("failure", "TritonRaggedDot", "")
    other = logging.LogRecord("absl", logging.WARNING, "x.py", 1, "something else %s", ("x",), None)
    assert record_kind(other) is None


def test_cache_misses_are_counted_not_printed():
    """136 records over 6 kernel shapes (k3-small's step) -> nothing printed, one summary."""
    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    absl = logging.getLogger("absl")
    absl.addHandler(handler)
    try:
        with quiet_tokamax(TokamaxLogFilter()) as f:
            for i in range(136):
                absl.handle(miss(f'{{"lhs":"bf16[{i % 6},768]"}}'))
            absl.warning("an unrelated warning")
        absl.handle(miss("after"))  # the filter is gone after the block
    finally:
        absl.removeHandler(handler)
    assert seen.getvalue().splitlines()[0] == "an unrelated warning"
    assert "Autotuning cache miss" in seen.getvalue().splitlines()[1] and len(seen.getvalue().splitlines()) == 2
    assert f.missed() == 6 and miss_summary(f.misses) == "6 kernel shapes (PallasMosaicGpuRaggedDot 6)"


def test_untuned_run_says_why_in_one_line():
    said = []
    tuner = KernelTuner(None, "NVIDIA H200", active=True, why_not="train.autotune=false", say=said.append)
    for key in ("a", "b", "a"):
        tuner.log_filter.filter(miss(key))
    assert tuner.after_lowering([]) is False
    assert said == ["tokamax: 2 kernel shapes (PallasMosaicGpuRaggedDot 2) have no tuned config for NVIDIA H200; "
                    "using its heuristic configs (train.autotune=false)"]
    off = KernelTuner(None, "cpu", active=False, why_not=None, say=said.append)
    off.log_filter.filter(miss("a"))
    assert off.after_lowering([]) is False and len(said) == 1  # where tokamax does not run: silence


def test_tuning_stops_starting_kernels_when_the_budget_is_spent():
    """Each fake kernel takes 50 s of a fake clock: a 120 s budget tunes three (the third starts
    at 100 s < 120 s and is never cut short), leaves two for the next launch; 0 tunes all."""
    from train.kernel_tuning import tune_within_budget

    now = [0.0]

    def tune_one(k):
        now[0] += 50.0
        return f"tuned {k}"

    results, left = tune_within_budget(list("abcde"), tune_one, 120.0, clock=lambda: now[0])
    assert results == ["tuned a", "tuned b", "tuned c"] and left == 2 and now[0] == 150.0
    now[0] = 0.0
    assert tune_within_budget(list("abcde"), tune_one, 0.0, clock=lambda: now[0]) == ([f"tuned {k}" for k in "abcde"], 0)
    now[0] = 0.0
    # a budget shorter than one kernel still tunes one per launch: every launch makes progress
    assert tune_within_budget(list("ab"), tune_one, 1.0, clock=lambda: now[0]) == (["tuned a"], 1)
