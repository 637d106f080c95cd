"""Training-step throughput of k3jax: tokens/s, analytic MFU, peak memory, compile time.

    python -m benchmarks.step.train_step --model fla-peer [--profile DIR] [--json out.json]
    python -m benchmarks.step.train_step --model k3-small [key=value ...]

`fla-peer` is the shape of ../shared/bench/fla_model.py's KDAForCausalLM: 24 KDA layers,
hidden 1024, 8 x 128 heads, SwiGLU 2816, vocab 32000, batch 8 x 4096, bf16 compute with fp32
master weights, AdamW. `k3-small` is configs/k3-small.yaml (hybrid + LatentMoE + AttnRes).

`mfu` is the one MFU k3jax quotes everywhere (k3jax.flops.mfu, the same function k3jax-train
logs): model FLOPs (matmuls + KDA chunk + attention) against the chip's dense bf16 spec
(k3jax/chips.py: 989 TFLOP/s on an H200; --peak-tflops overrides it). Beside it, labelled:
`mfu_vs_measured_matmul`, the same FLOPs against what a large bf16 matmul measured on the chip
(k3jax/chips.py's `measured_bf16_matmul_tflops`: 816 TFLOP/s on an H200; where measured), and
`mfu_6n`, fla's convention (6 x parameters per token) with the *active* parameters (routed
experts at top_k / num_experts), so it stays meaningful for an MoE.

The row carries `settings` (benchmarks/bench_util.run_settings: what a comparison of two rows
must share) and `lease` (the machine's lease), and every step's loss: a run whose losses are
not all finite is written as failed (`status` "failed", its timings under "discarded") and
exits 1; benchmarks/tools/compare_runs.py refuses such a row. `attention_flops_share` is the
part of the model FLOPs that is softmax/MLA attention (dense causal): on packed documents the
flash kernel skips some of it, which MFU still counts (k3jax/flops.py). The benchmark's rows
are one document each (the default `--data random`), so there MFU counts only work done;
`--data config` feeds a new batch of the config's train data each step, as k3jax-train does
(packed documents, and the expert loads real text gives), to compare with k3jax-train's lines.

The step is compiled as k3jax-train compiles it (train.setup.compile_steps): with its GPU XLA
flags (train/xla_flags.py; since 2026-12-03, before which the benchmark ran XLA's defaults), through the
compilation cache, with the tokamax kernel configs k3jax-train tuned for this chip on its first
launch when they are there (a line says so); `--autotune` tunes the missing ones here, all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from benchmarks.bench_util import lease_id, run_settings, timing_row
from k3jax.config import load_config
from k3jax.chips import chip_for_device_kind, peak_bf16_tflops
from k3jax.flops import attention_flops_share, matmul_flops_per_token, mfu
from k3jax.model_sizes import param_counts
from k3jax.kernel_paths import kernel_lines
from train.cli import global_batch
from train.compile_cache import enable_compile_cache
from train.data.sharded import ShardedData
from train.kernel_tuning import KernelTuner
from train.metrics import peak_device_gib
from train.setup import compile_steps, prepare
from train.state import init_train_state
from train.xla_flags import set_gpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLA_PEER = [
    "model.vocab_size=32000", "model.d_model=1024", "model.layer_pattern=24*kda", "model.ffn_hidden=2816",
    "model.moe_every=0", "model.activation=swiglu", "model.attn_res_block_size=0", "model.compute_dtype=bfloat16",
    "model.param_dtype=float32", "model.kda.num_heads=8", "model.kda.head_dim=128", "model.kda.chunk_size=64",
    "model.kda.gate=softplus",
    "model.kda.output_gate=low_rank", "model.remat=none", "data.seq_len=4096", "train.batch_size=8",
    "optimizer.name=adamw", "optimizer.lr=3e-4", "mesh.num_devices=1",
]


def build(model: str, overrides: list[str]):
    if model == "fla-peer":
        return load_config(os.path.join(ROOT, "configs", "k3-tiny.yaml"), FLA_PEER + overrides)
    # one micro-batch unless asked: the figures are per step at --batch rows, as BENCHMARKS.md
    # quotes them (configs/k3-small.yaml itself trains 16 rows as 2 micro-batches of 8)
    return load_config(os.path.join(ROOT, "configs", f"{model}.yaml"), ["train.micro_batches=1", *overrides])


MEASURED = ("step_ms", "tokens_per_s", "mfu", "mfu_vs_measured_matmul", "mfu_6n", "loss")  # void on a NaN


def main() -> int:
    set_gpu_xla_flags()  # what k3jax-train sets, before JAX starts its backend
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="fla-peer")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="per-device dense bf16 peak for MFU; 0 = the chip's spec (k3jax/chips.py)")
    ap.add_argument("--autotune", action="store_true",
                    help="tune all of tokamax's kernels that have no config for this chip and keep them (as "
                         "k3jax-train does with train.autotune_budget_s); without it, configs tuned earlier are "
                         "used and nothing is tuned")
    ap.add_argument("--profile", default=None, help="write a jax.profiler trace of 3 steps here")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hlo", default=None, help="write the compiled step's optimized HLO text here "
                    "(profile_summary.py --hlo puts a profile against source lines with it)")
    ap.add_argument("--data", choices=("random", "config"), default="random",
                    help="random: one batch of uniform random tokens, one document a row, every step (the "
                    "figures BENCHMARKS.md quotes); config: a new batch each step from the config's train "
                    "data, as k3jax-train reads it (packed documents, the routing real text gives)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = build(a.model, a.overrides)
    cache_dir = enable_compile_cache(cfg.train.compile_cache_dir)  # before anything compiles
    setup = prepare(cfg)
    mesh, rows = setup.mesh, setup.rows
    B, T = cfg.train.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
    batch = {"tokens": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": np.ones((B, T), np.int32),
             "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
             "loss_mask": np.ones((B, T), np.float32)}
    steps_run = 2 + a.steps + (3 if a.profile else 0)
    if a.data == "config":  # drawn before the clock: the timing is the device's, as k3jax-train's lines
        source = ShardedData(cfg, split="train")
        host_batches = [next(source) for _ in range(steps_run)]
        source.close()
    with jax.set_mesh(mesh):
        if a.data == "config":
            batches = [global_batch(b, rows) for b in host_batches]
        else:
            batches = [{k: jax.device_put(v, rows) for k, v in batch.items()}] * steps_run
        state = init_train_state(cfg, setup.spec, setup.tx, shardings=setup.shardings)
    # the program k3jax-train runs: its compilation cache and tokamax's tuned kernel configs
    tuner = KernelTuner.for_run(cache_dir, processes=jax.process_count(), say=print,
                                budget_s=float("inf") if a.autotune else 0.0, how_to_tune="--autotune")
    compiled = compile_steps(cfg, setup, tuner)
    step, compile_s = compiled.train, compiled.lower_s + compiled.train_compile_s
    if a.hlo:
        open(a.hlo, "w").write(step.as_text())
    with jax.set_mesh(mesh):
        losses = []  # every step's loss, read after the timing (no sync inside it)
        feed = iter(batches)
        for _ in range(2):
            state, m = step(state, next(feed))
            losses.append(m["loss"])
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            state, m = step(state, next(feed))
            losses.append(m["loss"])
        jax.block_until_ready(m)
        dt = (time.perf_counter() - t0) / a.steps
        if a.profile:
            jax.profiler.start_trace(a.profile, create_perfetto_trace=True)
            for _ in range(3):
                state, m = step(state, next(feed))
                losses.append(m["loss"])  # so "loss" below is the last of "losses", profiled steps too
            jax.block_until_ready(m)
            jax.profiler.stop_trace()
    counts = param_counts(setup.spec.abstract_model())
    tok_s = B * T / dt
    total = sum(counts.values())
    kind = jax.devices()[0].device_kind
    peak = a.peak_tflops or peak_bf16_tflops(kind)
    measured = getattr(chip_for_device_kind(kind), "measured_bf16_matmul_tflops", 0.0)
    peak_gib = peak_device_gib(mesh.devices.flat) or 0.0  # as k3jax-train logs it; 0 where none is kept
    kda = cfg.model.kda
    row = dict(model=a.model, gate=kda.gate, remat=cfg.model.remat, kernels=kernel_lines(cfg.model), params=total, step_ms=round(dt * 1e3, 1), tokens_per_s=round(tok_s),
               device=kind, peak_tflops=peak,
               mfu=round(mfu(cfg.model, T, tok_s, peak, mesh.size, counts), 4) if peak else None,
               mfu_vs_measured_matmul=(round(mfu(cfg.model, T, tok_s, measured, mesh.size, counts), 4)
                                       if measured else None),
               mfu_6n=round(matmul_flops_per_token(cfg.model, counts) * tok_s / (peak * 1e12 * mesh.size), 4) if peak else None,
               peak_gb=round(peak_gib, 1), compile_s=round(compile_s, 1), lower_s=round(compiled.lower_s, 1), autotune_s=round(tuner.tuned_s, 1),
               loss=float(m["loss"]), data=a.data, devices=mesh.size, mesh=dict(mesh.shape), batch=[B, T],
               attention_flops_share=round(attention_flops_share(cfg.model, T, counts), 4),
               settings=run_settings(cfg, mesh.size, kind), lease=lease_id(), backend=jax.default_backend(),
               jax=jax.__version__)
    row = timing_row(row, [float(v) for v in losses], MEASURED)
    print(json.dumps(row), flush=True)
    if a.json:
        json.dump(row, open(a.json, "w"), indent=1)
    return 0 if row["status"] == "timed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
