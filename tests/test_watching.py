"""What a user watches: training time apart from eval and checkpoints, plain log lines off a
terminal, the eval set, one MFU, the compilation cache's directory, tokamax's tuning lines and
the first minutes of a launch (stamped start lines, the eval step compiled beside the train step,
the tuning budget)."""

import io
import json
import logging
import re
import time
from pathlib import Path

import numpy as np
import pytest

from k3jax.config import load_config
from k3jax.config.schema import LoggingConfig
from k3jax.flops import matmul_flops_per_token
from train import cli
from train.checkpoint import Checkpointer
from train.compile_cache import resolve_cache_dir
from train.data.pipeline import build_pipeline
from train.evaluation import EvalSet
from train.kernel_tuning import (KernelTuner, TokamaxLogFilter, miss_summary, quiet_tokamax, record_kind,
                                 tuning_file, untuned_line)
from train.metrics import RunLogger, constant_metrics, draws_bar, peak_device_gib, progress_line
from train.timing import TrainClock, launch_time, process_age_s

from tiny_run import ROOT, SMALL, TINY
ASIDE_S = 100.0  # what the patched eval and checkpoint take on the test's clock
STAMP = re.compile(r"^\[ *\d+\.\d s\] ")  # a start line's seconds since launch


def unstamped(line: str) -> str:
    return STAMP.sub("", line)


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
    assert not any("peak_gib" in r for r in rows)  # XLA:CPU keeps no allocator statistics
    for r in steps:  # one step per line: training time = tokens / rate, far below one aside
        assert tokens_per_step / r["tokens_per_s"] < ASIDE_S / 2, r
    saves = [r["checkpoint_s"] for r in rows if "checkpoint_s" in r]
    evals = [r["eval_s"] for r in rows if "eval_s" in r]
    assert len(saves) == 4 and all(s >= ASIDE_S for s in saves)
    assert len(evals) == 2 and all(s >= ASIDE_S for s in evals)
    assert all("eval_loss" in r for r in rows if "eval_s" in r)


def test_fields_that_cannot_be_nonzero_are_not_logged(timed_run):
    """z_loss off and one device (the dropless experts): neither is written; the MoE's others are."""
    _, rows, _ = timed_run
    steps = [r for r in rows if "loss" in r]
    assert steps and not any("z_loss" in r or "expert_drop_rate" in r for r in steps)
    assert all("max_violation" in r and "accuracy" in r for r in steps)


def test_constant_metrics_from_the_config_and_mesh():
    cfg = load_config(TINY, SMALL)
    assert constant_metrics(cfg, 1) == {"z_loss", "expert_drop_rate"}
    assert constant_metrics(load_config(TINY, SMALL + ["train.z_loss=1e-4"]), 1) == {"expert_drop_rate"}
    assert constant_metrics(cfg, 2) == {"z_loss"}  # the sharded exchange can drop pairs over its capacity
    assert "expert_drop_rate" in constant_metrics(load_config(TINY, SMALL + ["model.moe_every=0"]), 2)


def test_log_off_a_terminal_is_plain_lines(timed_run):
    _, _, text = timed_run
    assert "\r" not in text and "%|" not in text  # no progress-bar redraws
    lines = [unstamped(ln) for ln in text.splitlines()]
    progress = [ln for ln in lines if ln.startswith("step ") and "/16: loss " in ln]
    assert len(progress) == 16 and "tokens/s" in progress[-1] and "eta 0:00" in progress[-1]
    assert any(ln.startswith("eval: 1 batches, ") for ln in lines)
    assert sum(ln.startswith("step ") and ": eval loss " in ln for ln in lines) == 2


class StopAt:
    """A stop flag that is raised at `step`, as SIGTERM would be (train() checks it once a step)."""

    def __init__(self, step):
        self.step, self.checks = step, 0

    @property
    def signal(self):
        self.checks += 1
        return "SIGTERM" if self.checks >= self.step else None


def test_log_windows_align_across_a_resume(timed_run, tmp_path):
    """logging.every=5: a run stopped at step 7 and resumed logs, at 5, 10, 15 and 16, the means of
    the per-step values the uninterrupted timed_run logged (it logs every step) over steps 1-5,
    6-10, 11-15 and 16, which is what an uninterrupted run with logging.every=5 logs there (the
    stopped run's first launch is one up to step 7); k3jax-plot draws those points only."""
    from train.plot import read_metrics, series

    _, whole_rows, _ = timed_run
    per_step = {r["step"]: r for r in whole_rows if "loss" in r}
    every5 = SMALL + ["logging.every=5", "logging.tensorboard=false", f"run_dir={tmp_path}"]
    cli.train(load_config(TINY, every5), stop=StopAt(7))
    assert max(r["step"] for r in read_metrics(tmp_path)) == 7  # it stopped mid-window
    cli.train(load_config(TINY, every5))
    logged = {r["step"]: r for r in read_metrics(tmp_path) if "loss" in r}  # the last line per step
    assert sorted(logged) == [1, 5, 7, 8, 10, 15, 16]
    assert [logged[s]["window_steps"] for s in (1, 7, 8)] == [1, 2, 3]  # window so far; the stop's, then joined
    ends = {5: range(1, 6), 10: range(6, 11), 15: range(11, 16), 16: range(16, 17)}
    for end, steps in ends.items():
        assert logged[end]["window_steps"] == len(steps)
        for key in ("loss", "grad_norm", "lr"):
            want = np.mean([np.float64(per_step[s][key]) for s in steps])
            assert logged[end][key] == pytest.approx(want, rel=2e-6), (key, end)
        want = np.mean([per_step[s]["max_violation"] for s in steps], axis=0)  # per MoE layer
        np.testing.assert_allclose(logged[end]["max_violation"], want, rtol=2e-6)
        assert logged[end]["max_violation_max"] == pytest.approx(max(logged[end]["max_violation"]))
        # the window's largest per-step value per layer, across the stop at step 7 too
        peak = np.max([per_step[s]["max_violation"] for s in steps], axis=0)
        np.testing.assert_allclose(logged[end]["max_violation_peak"], peak, rtol=1e-6)
        assert logged[end]["max_violation_peak_max"] == pytest.approx(peak.max(), rel=1e-6)
        if len(steps) > 1:  # a peak, not a mean: it differs from the mean where the steps differ
            assert np.any(np.asarray(logged[end]["max_violation_peak"]) > np.asarray(logged[end]["max_violation"]))
    x, y = series(read_metrics(tmp_path), "loss")
    assert x.tolist() == list(ends)  # the lines inside a window are left out
    np.testing.assert_allclose(y, [np.mean([per_step[s]["loss"] for s in r]) for r in ends.values()], rtol=2e-6)
    x, y = series(whole_rows, "loss")  # one-step windows: every step drawn
    assert x.tolist() == list(range(1, 17))


def test_a_window_peak_joins_the_carried_lines_peak(tmp_path):
    """logging.every=5, a launch resumed at step 7: the window of steps 6-10 takes its mean over
    all five steps (the carried line's two weighted by its count) and its peak, per layer, as the
    larger of the carried line's peak and the new steps' largest value; a carried line from before
    peaks were logged leaves the peak to the new steps. Hand-computed values."""
    from train.log_window import LogWindow

    def window_at_10(carried: dict) -> dict:
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 7, "window_steps": 2.0, **carried}) + "\n")
        window = LogWindow(5, 7, tmp_path)
        for step, (viol, loss) in enumerate((([0.3, 0.4], 2.0), ([0.2, 1.5], 1.0), ([0.1, 0.2], 3.0)), 8):
            window.add(step, {"max_violation": np.asarray(viol, np.float32), "loss": np.float32(loss)})
        n, values = window.means(10)
        assert n == 5
        return values

    values = window_at_10({"loss": 4.0, "max_violation": [0.5, 0.1], "max_violation_peak": [0.9, 0.2],
                           "max_violation_peak_step": [6.0, 7.0]})
    assert values["loss"] == pytest.approx((2 * 4.0 + 2.0 + 1.0 + 3.0) / 5)
    np.testing.assert_allclose(values["max_violation"], [(2 * 0.5 + 0.6) / 5, (2 * 0.1 + 2.1) / 5], rtol=1e-6)
    np.testing.assert_allclose(values["max_violation_peak"], [0.9, 1.5], rtol=1e-6)  # carried, then step 9
    np.testing.assert_array_equal(values["max_violation_peak_step"], [6, 9])  # and where each peaked
    no_steps = window_at_10({"loss": 4.0, "max_violation": [0.5, 0.1], "max_violation_peak": [0.9, 0.2]})
    assert "max_violation_peak_step" not in no_steps  # the carried peak's step is not known
    older = window_at_10({"loss": 4.0, "max_violation": [0.5, 0.1]})
    np.testing.assert_allclose(older["max_violation_peak"], [0.3, 1.5], rtol=1e-6)
    np.testing.assert_array_equal(older["max_violation_peak_step"], [8, 9])


def test_a_window_names_the_step_of_each_layers_peak(tmp_path):
    """A fresh run, logging.every=4: each window's peak per layer and the step it came at (the
    first on a tie), against values placed by hand; the next window starts afresh."""
    from train.log_window import LogWindow

    window = LogWindow(4, 0, tmp_path)
    per_step = [[0.1, 0.9], [0.7, 0.2], [0.7, 0.9], [0.3, 0.1],  # steps 1-4
                [0.2, 0.3], [0.1, 0.4], [0.5, 0.2], [0.4, 0.6]]  # steps 5-8
    got = []
    for step, viol in enumerate(per_step, 1):
        window.add(step, {"max_violation": np.asarray(viol, np.float32)})
        if step % 4 == 0:
            got.append(window.means(step)[1])
            window.after_line(step)
    np.testing.assert_array_equal(got[0]["max_violation_peak_step"], [2, 1])
    np.testing.assert_allclose(got[0]["max_violation_peak"], [0.7, 0.9])
    np.testing.assert_array_equal(got[1]["max_violation_peak_step"], [7, 8])


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
    assert progress_line(3, 9, {"loss": 2.0, "mfu": 0.2272, "peak_gib": 103.44}) == \
        "step 3/9: loss 2.0000, MFU 22.7%, peak 103.4 GiB"


def test_peak_device_memory_is_the_largest_devices():
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    gib = 2**30
    devices = [Device({"peak_bytes_in_use": 3 * gib, "bytes_in_use": gib}), Device({"peak_bytes_in_use": 5 * gib}),
               Device(None), Device({}), Device(NotImplementedError())]
    assert peak_device_gib(devices) == 5.0
    assert peak_device_gib([Device(None), Device(RuntimeError())]) is None


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
    assert untuned_line(f, "NVIDIA H200") == ("tokamax: 6 kernel shapes (PallasMosaicGpuRaggedDot 6) without a tuned "
                                              "config for NVIDIA H200, using its heuristic configs")
    assert untuned_line(TokamaxLogFilter(), "NVIDIA H200") is None  # nothing missed: nothing said


def test_untuned_run_says_why_in_one_line():
    said = []
    why = "train.compile_cache_dir=off: nowhere to keep tuned configs"
    tuner = KernelTuner(None, "NVIDIA H200", active=True, why_not=why, say=said.append, budget_s=600.0)
    for key in ("a", "b", "a"):
        tuner.log_filter.filter(miss(key))
    assert tuner.after_lowering([]) is False
    assert said == ["tokamax: 2 kernel shapes (PallasMosaicGpuRaggedDot 2) have no tuned config for NVIDIA H200; "
                    f"using its heuristic configs ({why})"]
    off = KernelTuner(None, "cpu", active=False, why_not=None, say=said.append)
    off.log_filter.filter(miss("a"))
    assert off.after_lowering([]) is False and len(said) == 1  # where tokamax does not run: silence


def test_the_default_tunes_nothing_and_says_how_to():
    """A launch does not wait for tuning unless asked: the default budget is 0, the kernels keep
    tokamax's heuristic configs (nothing is tuned, the steps are not lowered again), and one line
    names the setting, with a budget of 2 minutes per kernel."""
    assert load_config(str(ROOT / "configs" / "k3-small.yaml")).train.autotune_budget_s == 0.0
    assert load_config(TINY).train.autotune_budget_s == 0.0
    said = []
    path = Path("/cache/tokamax/0.0.17-jax0.11.2/nvidia_h200.json")
    tuner = KernelTuner(path, "NVIDIA H200", active=True, why_not=None, say=said.append)
    for key in ("a", "b", "c", "a"):
        tuner.log_filter.filter(miss(key))
    assert tuner.after_lowering([object()]) is False and tuner.tuned_s == 0.0
    (line,) = said
    assert line.startswith("tokamax: 3 kernel shapes (PallasMosaicGpuRaggedDot 3) have no tuned config for "
                           "NVIDIA H200: using its heuristic configs. ")
    assert "set train.autotune_budget_s=360 " in line and str(path) in line


def test_a_retired_autotune_key_still_resumes():
    """Checkpoints written before the budget became the only tuning setting carry train.autotune."""
    from k3jax.config import config_from_dict, config_to_dict

    saved = config_to_dict(load_config(TINY))
    saved["train"]["autotune"] = True
    assert config_from_dict(saved).train == load_config(TINY).train


def fake_kernels(seconds: dict):
    """(tune_one, clock): tuning kernel k advances the clock by seconds[k]."""
    now = [0.0]

    def tune_one(k):
        now[0] += seconds[k]
        return f"tuned {k}"

    return tune_one, lambda: now[0]


def test_tuning_starts_a_kernel_only_while_the_longest_so_far_fits():
    """The deadline is checked before each kernel with an estimate of its time, the longest
    tuning so far: with 50 s kernels and 120 s, a and b are tuned (50 + 50 <= 120), c is not
    started at 100 s (100 + 50 > 120), and the launch ends at 100 s, inside its budget."""
    from train.kernel_tuning import tune_within_budget

    tune_one, clock = fake_kernels(dict.fromkeys("abcde", 50.0))
    assert tune_within_budget(list("abcde"), tune_one, 120.0, clock=clock) == (["tuned a", "tuned b"], 3, 50.0)
    assert clock() == 100.0
    # a long kernel raises the estimate: after 30 s and 90 s, 120 s spent + 90 > 150: c waits
    tune_one, clock = fake_kernels({"a": 30.0, "b": 90.0, "c": 10.0})
    assert tune_within_budget(list("abc"), tune_one, 150.0, clock=clock) == (["tuned a", "tuned b"], 1, 90.0)
    # no limit: all of them
    tune_one, clock = fake_kernels(dict.fromkeys("abc", 50.0))
    assert tune_within_budget(list("abc"), tune_one, float("inf"), clock=clock) == (
        ["tuned a", "tuned b", "tuned c"], 0, 50.0)


def test_a_zero_budget_tunes_none_and_a_short_one_tunes_one():
    from train.kernel_tuning import tune_within_budget

    tune_one, clock = fake_kernels(dict.fromkeys("ab", 50.0))
    assert tune_within_budget(list("ab"), tune_one, 0.0, clock=clock) == ([], 2, 0.0) and clock() == 0.0
    # a budget shorter than one kernel still tunes one per launch that asks: each makes progress
    assert tune_within_budget(list("ab"), tune_one, 1.0, clock=clock) == (["tuned a"], 1, 50.0)


def test_a_negative_budget_names_the_key():
    from k3jax.config import ConfigError

    with pytest.raises(ConfigError, match="train.autotune_budget_s"):
        load_config(TINY, ["train.autotune_budget_s=-1"])


# --------------------------------------------------------------------------------------------
# the first minutes of a launch


def test_start_lines_carry_seconds_since_launch(timed_run):
    """Every line up to and including the first step's carries its seconds since launch, in
    order; the compile lines give their own seconds; no line after the first step is stamped."""
    _, rows, text = timed_run
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if unstamped(ln).startswith("step 1/16: loss "))
    stamps = [float(STAMP.match(ln).group(0).strip("[] s")) for ln in lines[:first + 1] if STAMP.match(ln)]
    assert len(stamps) == first + 1 and stamps == sorted(stamps)
    assert not any(STAMP.match(ln) for ln in lines[first + 1:])
    start = [unstamped(ln) for ln in lines[:first]]
    assert start[0].startswith("starting: 16 steps") and start[1].startswith("train state initialized in ")
    assert any(ln.startswith("compiling the train step, and the eval step beside it") for ln in start)
    (compiled,) = [re.match(r"compiled the train step in (\d+\.\d) s \(traced and lowered in (\d+\.\d) s, "
                            r"then XLA's compile (\d+\.\d) s\)$", ln) for ln in start if ln.startswith("compiled the t")]
    total, lowered, xla = map(float, compiled.groups())
    assert abs(total - (lowered + xla)) <= 0.11  # the whole wait is its two parts
    # the eval step's compile is reported at the first eval, after the steps started
    assert sum(re.match(r"compiled the eval step in \d+\.\d s \(beside the train step", ln) is not None
               for ln in lines[first:]) == 1
    (launch,) = [r for r in rows if "compile_s" in r]
    assert launch["step"] == 0 and launch["lower_s"] > 0
    # metrics.jsonl's compile_s is XLA's part, lower_s the tracing: the line's parts
    assert launch["compile_s"] == pytest.approx(xla, abs=0.051) and launch["lower_s"] == pytest.approx(lowered, abs=0.051)
    (first_step,) = [r for r in rows if "first_step_s" in r]
    assert first_step["step"] == 1 and first_step["first_step_s"] == pytest.approx(stamps[-1], abs=0.1)
    assert [r["step"] for r in rows if "eval_compile_s" in r] == [8]


def test_run_logger_stamps_until_the_first_step(tmp_path, capsys):
    t = [12.34]
    log = RunLogger(tmp_path, LoggingConfig(tensorboard=False, progress=False), total_steps=4, start_step=0,
                    launched_at=2.0, now=lambda: t[0])
    log.message("compiling ...")
    t[0] = 130.0
    log.progress(1, {"loss": 2.0})
    log.message("step 2: eval loss 1.9")
    log.close()
    assert capsys.readouterr().out.splitlines() == [
        "[  10.3 s] compiling ...", "[ 128.0 s] step 1/4: loss 2.0000", "step 2: eval loss 1.9"]
    RunLogger(tmp_path, LoggingConfig(tensorboard=False, progress=False), total_steps=4, start_step=0).message("x")
    assert capsys.readouterr().out == "x\n"  # no launch time: no stamps


def test_process_age_from_proc():
    """proc(5): field 22 of /proc/self/stat is the start time in clock ticks since boot; the
    command name (field 2) may hold spaces and parentheses."""
    fields = ["S"] + [str(i) for i in range(4, 22)] + ["5000"] + ["0"] * 20  # fields 3.. ; 22 = 5000
    stat = "4242 (my (odd) cmd) " + " ".join(fields)
    assert process_age_s(stat, "75.50 120.00\n", 100) == pytest.approx(75.5 - 50.0)
    assert process_age_s("garbage", "75.5 1", 100) is None
    assert process_age_s() is None or process_age_s() >= 0.0
    assert launch_time(lambda: 100.0, age_s=7.5) == 92.5
    assert launch_time(lambda: 100.0, age_s=86400.0) == 100.0  # a day of imports: another boot's clock


def test_deferred_compile_gives_the_same_program():
    """A program compiled on a thread or at its first use computes what the one compiled here
    does, bit for bit; a compile error reaches the caller."""
    import jax
    import jax.numpy as jnp

    from train.compile_thread import DeferredCompile

    def f(x):
        return jnp.tanh(x @ x.T).sum(axis=0) * 1.5

    x = jnp.arange(48.0, dtype=jnp.float32).reshape(6, 8) / 7.0
    lowered = jax.jit(f).lower(x)
    here = np.asarray(lowered.compile()(x))
    beside = DeferredCompile(lowered)
    later = DeferredCompile(lowered, background=False)
    assert not later.done() and later.seconds is None
    for pending in (beside, later):
        out = np.asarray(pending.result()(x))
        assert out.tobytes() == here.tobytes() and pending.done() and pending.seconds > 0

    class Broken:
        def compile(self):
            raise ValueError("no such program")

    failing = DeferredCompile(Broken())
    failing.wait()
    with pytest.raises(ValueError, match="no such program"):
        failing.result()


def test_untuned_grouped_gemms_are_said_to_run_k3jaxs_configs():
    """Where k3jax's grouped GEMMs (`K3RaggedDot`) missed tokamax's cache, the line says they run
    k3jax's measured configs, not only tokamax's heuristic ones."""
    class K3RaggedDot:  # the miss record names the op by its class name
        pass

    said = []
    tuner = KernelTuner(Path("/cache/t.json"), "NVIDIA H200", active=True, why_not=None, say=said.append)
    for op, key in ((K3RaggedDot(), "a"), (K3RaggedDot(), "b"), (PallasMosaicGpuRaggedDot(), "c")):
        tuner.log_filter.filter(logging.LogRecord("absl", logging.WARNING, "op.py", 565,
                                                  "Autotuning cache miss for %s on %s with key %s",
                                                  (op, "NVIDIA H200", key), None))
    assert tuner.after_lowering([object()]) is False
    (line,) = said
    assert line.startswith("tokamax: 3 kernel shapes (K3RaggedDot 2, PallasMosaicGpuRaggedDot 1) have no tuned "
                           "config for NVIDIA H200: using its heuristic configs (k3jax's measured configs for the "
                           "grouped GEMMs, K3RaggedDot). ")
