"""benchmarks/decode/long_decode.py's largest batch against the allocator failures of the 2026-12-01
all-MLA 1M row (benchmarks/decode/device_memory.py's docstring): the probes ask only for what is free,
a failure that leaves memory held stops the row at once, an out-of-memory shrinks the batch by
the bytes missing plus the step's temporaries, and nothing of a probe or an attempt stays alive.

A CPU has no allocator limit: the device is a fake one (free bytes from a limit, out-of-memory
raised by a stand-in for the compiled decode loop), so nothing here compiles the model. The
fakes stand where the GPU's runtime stands; the code under test is long_decode's own."""

import gc
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.decode import device_memory as dm
from benchmarks.decode import long_decode as ld

# the failed row: 139.63 GB free before the probes, 10.74 GB of cache per sequence at 1M
FREE_1M, SEQ_1M = 139633308928, 10741612552
OOM_48B = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 48B with allocator GPU_0_bfc on device 0."


class Stop(Exception):
    pass


class FakeDevice:
    """A GPU allocator seen through free_bytes: `limit` bytes free at the start, less what a
    failed execution kept (`held`)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def free(self) -> int:
        return self.limit - self.held


class FakeLoop:
    """A stand-in for Runner.loop_fn(steps): lower(...).compile() gives a callable with
    memory_analysis(); a call of more than `runs_up_to` sequences raises an out-of-memory
    naming `oom_text` (and keeps `leak` bytes on the device, as the failed execution did)."""

    def __init__(self, device, steps, runs_up_to, temp, oom_text, leak=0):
        self.device, self.steps, self.runs_up_to, self.temp = device, steps, runs_up_to, temp
        self.oom_text, self.leak, self.lowered_batches = oom_text, leak, []

    def lower(self, state, token, cache, index):
        self.lowered_batches.append(token.shape[0])
        return self

    def compile(self):
        return self

    def memory_analysis(self):
        return SimpleNamespace(temp_size_in_bytes=self.temp, output_size_in_bytes=100, alias_size_in_bytes=100)

    def __call__(self, state, token, cache, index):
        B = token.shape[0]
        if B > self.runs_up_to or self.device.held:
            scratch = jnp.ones((B, 256))  # noqa: F841 - alive in this frame, so in the error's traceback
            self.device.held += self.leak
            raise RuntimeError(self.oom_text)
        return jnp.zeros((self.steps, B), jnp.int32), cache


@pytest.fixture(autouse=True)
def frozen_heap():
    """The objects alive before each test (the rest of the suite's, in the same xdist worker)
    are left out of the garbage collections it makes (the code under test's and stray_arrays'):
    over that heap each gc.collect() took seconds (this file: 2.7 s alone, ~40 s late in the full
    suite). Garbage made during the test, error tracebacks' cycles included, is collected as
    before, and arrays alive before it are in its dm.baseline() anyway."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def runner(monkeypatch):
    """A Runner without a model: cache figures, free bytes, the probes' allocations and the
    compiled loop are the fakes'; jax's cache clearing is counted, not done (it would make the
    rest of the suite compile again)."""
    r = ld.Runner.__new__(ld.Runner)
    r.bench = SimpleNamespace(args=SimpleNamespace(timed_calls=1, largest_need_s=45.0), log=lambda msg: None,
                              chip=ld.CHIPS["h200"], left=lambda: 1e9)
    r.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=512))
    r.state = {}
    r.w = {"dense": 1, "per_expert_layer": 0, "moe_layers": 0, "num_experts": 1, "top_k": 1, "embed_row": 0}
    r.probed = []
    # stand-in caches: small real arrays, so what stays alive shows in jax.live_arrays()
    monkeypatch.setattr(ld.Runner, "cache_shapes", lambda self, B, L: {"x": jax.ShapeDtypeStruct((B, 64), jnp.float32)})
    monkeypatch.setattr(ld.Runner, "synthetic_cache", lambda self, B, L: {"x": jnp.zeros((B, 64), jnp.float32)})
    monkeypatch.setattr(ld, "SETTLE_S", 0.05)
    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
    r.cleared = cleared
    return r


def use(monkeypatch, runner, device: FakeDevice, per_seq: int):
    """The fake device's free bytes, `per_seq` bytes of cache a sequence, and probes that fit
    by the fake's count (recording what they asked for)."""
    monkeypatch.setattr(dm, "free_bytes", device.free)
    monkeypatch.setattr(dm, "memory_stats", lambda: {"bytes_limit": device.limit})
    monkeypatch.setattr(ld, "cache_figures", lambda model, L: {"total": per_seq, "per_slot": per_seq // L, "fixed": 0})

    def fits(self, B, L, reserve):
        self.probed.append((B, reserve))
        return B * per_seq + reserve <= device.free()

    monkeypatch.setattr(ld.Runner, "fits", fits)


def stray_arrays(keep):
    gc.collect()
    return [x for x in dm.live_arrays(keep)]


def test_probes_ask_only_for_what_the_allocator_has(monkeypatch, runner):
    """At the failed row's figures the old bisection asked for 13 sequences (139.64 GB, more
    than the 139.63 GB free): an allocation that could only fail, and whose failure left the
    allocator full. Every probe must fit the free bytes by their own count, and the search must
    still end at the largest batch that does: 12."""
    device = FakeDevice(FREE_1M)
    use(monkeypatch, runner, device, SEQ_1M)
    loop = FakeLoop(device, 16, runs_up_to=0, temp=0, oom_text=OOM_48B)

    def lower(*a):
        loop.lowered_batches.append(a[1].shape[0])
        raise Stop

    monkeypatch.setattr(loop, "lower", lower)
    monkeypatch.setattr(ld.Runner, "loop_fn", lambda self, steps: loop)
    with pytest.raises(Stop):
        runner.largest_batch(1048576, 16, 4096)
    assert runner.probed, "no probe was made"
    over = [(B, r) for B, r in runner.probed if B * SEQ_1M + r > FREE_1M]
    assert not over, f"probes asked for more than the {FREE_1M} bytes free: {over}"
    assert loop.lowered_batches == [12]  # (139.63 GB - 4.19 GB reserve) / 10.74 GB = 12.6


def test_memory_held_after_a_failure_stops_the_row_at_once(monkeypatch, runner):
    """The failed row: after one out-of-memory the allocator stayed full, and the old code went
    on to two more attempts (each failing on a 40- or 32-byte allocation after the allocator's
    10 s wait). Now the row stops after the first, names the bytes held, and leaves no array of
    the attempt alive."""
    device = FakeDevice(FREE_1M)
    use(monkeypatch, runner, device, SEQ_1M)
    loop = FakeLoop(device, 16, runs_up_to=0, temp=176512968, oom_text=OOM_48B, leak=FREE_1M)
    monkeypatch.setattr(ld.Runner, "loop_fn", lambda self, steps: loop)
    keep = dm.baseline()
    out = runner.largest_batch(1048576, 16, 4096)
    assert "not returned" in out["error"], out
    assert [a["batch"] for a in out["attempts"]] == [12]
    assert out["checks"][-1]["held_bytes"] == FREE_1M
    assert not stray_arrays(keep)
    assert runner.cleared, "jax's caches were not cleared after the failed attempt"


def test_out_of_memory_shrinks_by_the_bytes_missing_plus_temporaries(monkeypatch, runner):
    """1 GB a sequence, 20 GB free: reserve max(2 GiB, 3 % of 20 GB) = 2,147,483,648 B, so the
    probes end at 17 ((20e9 - 2.147e9) // 1e9). Batch 17 runs out of memory naming 2.5 GiB; with
    0.5 GB of temporaries the batch drops by ceil((2.684e9 + 0.5e9) / 1e9) = 4 to 13 (the free
    bytes would allow (20e9 - 2.147e9 - 2.684e9) // 1e9 = 15), which runs."""
    device = FakeDevice(20 * 10**9)
    use(monkeypatch, runner, device, 10**9)
    loop = FakeLoop(device, 4, runs_up_to=14, temp=5 * 10**8,
                    oom_text="RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.50GiB")
    monkeypatch.setattr(ld.Runner, "loop_fn", lambda self, steps: loop)
    keep = dm.baseline()
    out = runner.largest_batch(4096, 4, 4096)
    assert out.get("error") is None, out
    assert out["batch"] == 13 and out["cap"] == 17
    assert [a["batch"] for a in out["attempts"]] == [17, 13]
    assert out["attempts"][0]["next_batch"] == 13 and "2.50GiB" in out["attempts"][0]["error"]
    assert loop.lowered_batches == [17, 13]
    assert out["tokens_per_s"] > 0
    assert not stray_arrays(keep)


def test_temporaries_over_the_reserve_shrink_before_anything_is_allocated(monkeypatch, runner):
    """The compiled step needs 6 GB beside the cache (more than the 2 GiB reserve the probes
    held back): with 20 GB free and 1 GB a sequence the batch becomes (20e9 - 6e9 - 1 GiB) // 1e9
    = 12 without running the 17."""
    device = FakeDevice(20 * 10**9)
    use(monkeypatch, runner, device, 10**9)
    loop = FakeLoop(device, 4, runs_up_to=100, temp=6 * 10**9, oom_text=OOM_48B)
    monkeypatch.setattr(ld.Runner, "loop_fn", lambda self, steps: loop)
    out = runner.largest_batch(4096, 4, 4096)
    assert out["batch"] == 12, out
    assert "shrunk" in out["attempts"][0] and loop.lowered_batches == [17, 12]


class TinyCacheModel:
    """A model's init_cache: a small state, a latent cache of L slots, the bookkeeping."""

    def init_cache(self, B, L):
        return {"layers": [{"state": jnp.zeros((B, 8), jnp.float32), "latent": jnp.zeros((B, L, 4), jnp.bfloat16)}],
                "index": jnp.zeros((), jnp.int32), "segment_ids": jnp.full((B, L), -1, jnp.int32),
                "next_position": jnp.zeros((B,), jnp.int32)}


def test_synthetic_cache_is_the_model_cache_filled_and_a_failure_leaves_nothing():
    r = ld.Runner.__new__(ld.Runner)
    r.model = TinyCacheModel()
    cache = r.synthetic_cache(3, 16)
    want = dict(TinyCacheModel().init_cache(3, 16), segment_ids=jnp.ones((3, 16), jnp.int32))
    assert jax.tree.structure(cache) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(cache), jax.tree.leaves(want)):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    dm.release(cache)
    del cache, want
    keep = dm.baseline()
    # a latent of 2**57 slots (2**60 bytes, past any address space) cannot be allocated; the index before it can
    with pytest.raises(Exception) as err:
        r.synthetic_cache(1, 2**57)
    assert ld.is_oom(err.value), err.value
    dm.forget(err.value)
    del err
    assert not stray_arrays(keep)


def test_forget_frees_what_an_error_traceback_held():
    keep = dm.baseline()

    def fail():
        held = jnp.ones((1000,))  # noqa: F841 - a local of a frame in the traceback
        raise RuntimeError(OOM_48B)

    try:
        fail()
    except RuntimeError as e:
        kept = e  # an error kept past its except block keeps its frames' arrays
    assert len(stray_arrays(keep)) == 1
    text = dm.forget(kept)
    assert "48B" in text and kept.__traceback__ is None
    assert not stray_arrays(keep)


def test_prefill_roofline_is_the_larger_floor():
    """Hand counts against the H200 constants (989 TFLOP/s, 4.8 TB/s): 989e12 FLOPs take 1 s; five
    chunks of 0.48 TB of weights and a 0.24 TB cache move 2.64 TB, 0.55 s: compute-bound at 1 s.
    With ten times the chunks (4.8 TB + 0.24 TB: 1.05 s) memory is the floor."""
    from k3jax.chips import CHIPS

    s, bound = ld.prefill_roofline(989e12, 480e9, 5, 240e9, CHIPS["h200"])
    assert bound == "compute" and abs(s - 1.0) < 1e-12
    s, bound = ld.prefill_roofline(989e12, 480e9, 10, 240e9, CHIPS["h200"])
    assert bound == "memory" and abs(s - 5.04e12 / 4.8e12) < 1e-12


def sweep_device(monkeypatch, runner, free: int, *, max_batch: int = 16, impl: str = "pallas", runs_up_to: int = 100,
                 temp: int = 10**8, leak: int = 0) -> FakeLoop:
    """A batch sweep's fakes: `free` bytes on the device, 1 GB of cache a sequence, the fused
    step's rule (model.decode_fused on, its batch limit, decode_impl), and the compiled loop."""
    device = FakeDevice(free)
    use(monkeypatch, runner, device, 10**9)
    runner.model.cfg.decode_fused = True
    runner.model.cfg.decode_fused_max_batch = max_batch
    runner.model.cfg.decode_impl = impl
    loop = FakeLoop(device, 4, runs_up_to=runs_up_to, temp=temp, oom_text=OOM_48B, leak=leak)
    monkeypatch.setattr(ld.Runner, "loop_fn", lambda self, steps: loop)
    return loop


def test_batch_sweep_measures_each_batch_in_order_and_names_the_step(monkeypatch, runner):
    """1 GB a sequence, 20 GB free (reserve 2 GiB): batches 2, 4, 8 and 16 run, in increasing order
    whatever order they were asked in; the fused step up to decode_fused_max_batch = 8, the plain
    one at 16; 30 (30 GB of cache) is skipped without compiling, and ends the sweep."""
    loop = sweep_device(monkeypatch, runner, 20 * 10**9, max_batch=8)
    keep = dm.baseline()
    out = runner.batch_sweep(4096, 4, [16, 4, 30, 2, 8])
    rows = out["rows"]
    assert [r["batch"] for r in rows] == [2, 4, 8, 16, 30]
    assert [r["fused"] for r in rows] == [True, True, True, False, False]
    assert all(r["tokens_per_s"] > 0 and 0 < r["roofline_fraction"] for r in rows[:4])
    # tokens/s is the batch's tokens per step over the step's time: tokens/s x s/step = batch
    assert all(abs(r["tokens_per_s"] * r["ms_per_step"] / 1e3 - r["batch"]) < 1e-9 * r["batch"] for r in rows[:4])
    assert "skipped" in rows[4] and "tokens_per_s" not in rows[4]
    assert loop.lowered_batches == [2, 4, 8, 16]
    assert not stray_arrays(keep)


def test_batch_sweep_stops_at_the_first_out_of_memory(monkeypatch, runner):
    """A batch of 8 runs out of memory (the loop runs up to 5): its row carries the error, and 12,
    which would fail too, is never compiled."""
    loop = sweep_device(monkeypatch, runner, 20 * 10**9, max_batch=16, runs_up_to=5)
    keep = dm.baseline()
    rows = runner.batch_sweep(4096, 4, [2, 4, 8, 12])["rows"]
    assert [r["batch"] for r in rows] == [2, 4, 8]
    assert "48B" in rows[2]["error"] and "tokens_per_s" not in rows[2]
    assert loop.lowered_batches == [2, 4, 8]
    assert not stray_arrays(keep)


def test_batches_and_parts_are_checked_before_anything_runs(capsys):
    import argparse

    assert ld.batch_list("8,16, 24") == [8, 16, 24]
    for bad in ("8,x", "0,4", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            ld.batch_list(bad)
    with pytest.raises(SystemExit):
        ld.main(["--out", "/nonexistent/never-made", "--parts", "decode1,sweep"])
    assert "--parts: unknown sweep" in capsys.readouterr().err


def test_summary_lists_each_chosen_batch_with_its_step(tmp_path):
    rows = [{"batch": 16, "fused": True, "tokens_per_s": 100.0, "roofline_fraction": 0.5},
            {"batch": 48, "fused": False, "skipped": "cache 48.00 GB + 2.15 GB > 20.00 GB free"}]
    results = [{"device_kind": "fake", "records": [{"context": 4096, "model": "hybrid", "cache_bytes_per_sequence": 1e9,
                                                    "decode_batches": {"rows": rows}}]}]
    ld.summarize(results, str(tmp_path))
    text = (tmp_path / "summary.md").read_text()
    assert "| 4,096 | hybrid | 16 | 100.0 | 50 % | fused |" in text
    assert "| 4,096 | hybrid | 48 | n/a | n/a | plain: cache 48.00 GB + 2.15 GB > 20.00 GB free |" in text


def test_batch_sweep_labels_the_plain_step_when_the_kernels_are_off(monkeypatch, runner):
    """model.decode_impl=xla (as run_model sets it when the kernel check fails) runs the plain
    step at every batch, whatever decode_fused says: no row may claim the fused one."""
    sweep_device(monkeypatch, runner, 20 * 10**9, max_batch=8, impl="xla")
    rows = runner.batch_sweep(4096, 4, [2, 4])["rows"]
    assert [r["fused"] for r in rows] == [False, False] and all(r["tokens_per_s"] > 0 for r in rows)


def test_batch_sweep_skips_a_batch_whose_step_does_not_fit_after_compiling(monkeypatch, runner):
    """18 GB free, 1 GB a sequence, 6 GB of temporaries: both batches pass the check before
    compiling (cache + the 2 GiB reserve), then need the cache + 6 GB + 1 GiB of margin: batch 4
    (11.07 GB) runs; batch 12 (19.07 GB > 18 GB) is compiled, found too large and not run, and
    ends the sweep (14 is never compiled)."""
    loop = sweep_device(monkeypatch, runner, 18 * 10**9, max_batch=16, temp=6 * 10**9)
    calls, run_at = [], ld.Runner._run_at
    monkeypatch.setattr(ld.Runner, "_run_at", lambda self, *a: (calls.append(a[1]), run_at(self, *a))[1])
    rows = runner.batch_sweep(4096, 4, [4, 12, 14])["rows"]
    assert [r["batch"] for r in rows] == [4, 12]
    assert rows[0]["tokens_per_s"] > 0 and "for the step" in rows[1]["skipped"]
    assert loop.lowered_batches == [4, 12] and calls == [4]


def test_batch_sweep_stops_when_memory_is_not_returned(monkeypatch, runner):
    """An out-of-memory that leaves 5 GB held on the device (the 2026-12-01 failure): the row says
    so, and no larger batch is compiled."""
    loop = sweep_device(monkeypatch, runner, 20 * 10**9, max_batch=16, runs_up_to=3, leak=5 * 10**9)
    rows = runner.batch_sweep(4096, 4, [2, 4, 8])["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    assert rows[1]["held_bytes"] == 5 * 10**9 and "not returned" in rows[1]["error"]
    assert loop.lowered_batches == [2, 4]


def test_batch_sweep_keeps_its_rows_when_a_compile_fails_or_time_runs_out(monkeypatch, runner):
    """A failure other than an out-of-memory (a compile error at batch 8) ends the sweep with the
    rows before it and the error in its own row; a budget with less than --largest-need-s left
    starts no further batch."""
    loop = sweep_device(monkeypatch, runner, 20 * 10**9)
    lower = loop.lower

    def failing_lower(state, token, cache, index):
        if token.shape[0] == 8:
            raise RuntimeError("INTERNAL: ptxas failed")
        return lower(state, token, cache, index)

    loop.lower = failing_lower
    rows = runner.batch_sweep(4096, 4, [2, 4, 8, 16])["rows"]
    assert [r["batch"] for r in rows] == [2, 4, 8]
    assert rows[1]["tokens_per_s"] > 0 and "ptxas" in rows[2]["error"]
    # 100 s left before the second sweep's first batch, 30 s (< 45 s needed) after it
    runner.bench.left = lambda: 100.0 if len(loop.lowered_batches) < 3 else 30.0
    rows = runner.batch_sweep(4096, 4, [2, 4, 16])["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    assert rows[0]["tokens_per_s"] > 0 and "time budget" in rows[1]["skipped"]
