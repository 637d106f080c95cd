"""Where each generated figure of BENCHMARKS.md and README.md comes from (benchmarks/tools/record.py).

A table is its header, its rows and the commands that made their files; a cell is literal text
or a figure read from a file under benchmarks/results/ (`J` a JSON/JSONL key, `T` a regular
expression's group in a text file, `Agg` over a JSONL file) and formatted. `FIGURES` are the
figures the prose of both documents quotes inside `<!--fig:NAME-->...<!--/fig-->`.

To add a figure: put the results folder under benchmarks/results/ (with its README.md), add a row
or a table here, a `<!-- record:NAME -->` / `<!-- /record:NAME -->` pair in BENCHMARKS.md for a
new table, then `python -m benchmarks.tools.record` writes it and `--check` keeps it honest.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.tools.record import (Agg, Cat, Const, Div, Fig, J, Range, Spec, Sub, Sum, T, Table, ms, pct,
                                     ratio)

I23 = "issue23-close-2026-12-03"
K4 = "kernels-2026-12-04"
STEP_I23_1 = f"{I23}/1-step-muon-train/step_new.json"
STEP_I23_3 = f"{I23}/3-intra-sweep/step_new.json"
STEP_I23_4 = f"{I23}/4-optimizer-step/step_new.json"
STEP_K4_1 = f"{K4}/1-ab-keep-router/step_new.json"
STEP_K4_2 = f"{K4}/2-ab-profile-tune/step_new.json"
STEP_K4_4 = f"{K4}/4-unrolled-new/step_new.json"
TRAIN = f"{I23}/1-step-muon-train/metrics.jsonl"
OP = f"{I23}/2-op-compile"
FLA_STEP = f"{K4}/3-fla-peer"
ATTN = "k3-small-2026-12-01/attention.json"
GLUE = "k3-small-step-2026-12-01/glue"
LD = "long-decode-2026-12-01/results.json"
LDB = "long-decode-2026-12-01b"
DF = "decode-fused-2026-12-01"
DB = "decode-batches-2026-12-06"
OPT = f"{I23}/4-optimizer-step/optimizer.json"
LMS = "ladder-lm-seeds/ladder.json"  # 1,600 steps, seeds 0 and 1, every rung (H100, 2026-12-07)
MLA_POS = "ladder-lm-seeds/cpu-mla-position"
CAB = "compile-ab-h100-2026-12-07/1-gpu"  # the first compile, three variants, one H100 lease
LCPU2 = "ladder-cpu-2026-12-06/ladder.json"  # every rung, both seeds, one ledger
ZOO = "ladder-zoology-2026-12-06/ladder.json"
# each rung and width's best learning rate in ZOO (train/ladder/runs.best_lrs, as its ladder.md shows it)
ZOO_BEST = {("softmax", 128): 0.001, ("softmax", 256): 0.001, ("softmax_conv", 128): 0.0032,
            ("softmax_conv", 256): 0.001, ("linear", 128): 0.001, ("linear", 256): 0.001, ("deltanet", 128): 0.001,
            ("deltanet", 256): 0.001, ("gated_deltanet", 128): 0.001, ("gated_deltanet", 256): 0.01,
            ("kda", 128): 0.0032, ("kda", 256): 0.001, ("hybrid", 128): 0.01, ("hybrid", 256): 0.01,
            ("mla", 128): 0.0032, ("mla", 256): 0.001}
HF = "hf-crosscheck-2026-12-01"
EXCH = "k3-exchange-2026-12-03"
PLAN_GPU = "k3-plan-2026-12-03b/k3_h200x2048.txt"
PLAN_TPU = "k3-plan-2026-12-03b/k3_v5p2048.txt"
SFT_GPU = "k3-plan-2026-12-03b/k3-sft_h200x2048.txt"
SFT_TPU = "k3-plan-2026-12-03b/k3-sft_v5p2048.txt"
H1 = "unrolled-h100-2026-12-07"  # one H100: the layer layouts, Muon's rank share, the KDA operator, k3jax-train
SCANNED_H1, UNROLLED_H1 = f"{H1}/1-scan-ab/scan_true.json", f"{H1}/1-scan-ab/scan_false.json"
TL = "traced-layers-h100-2026-12-07/1-gpu"  # one H100: k3jax-train beside the benchmark, after the log-line fix
BENCH_H1, TRAIN_H1 = f"{TL}/bench16_new.json", f"{TL}/train_metrics.jsonl"
SMALL_STEP = ("python benchmarks/run.py k3_small_step      # train_step.py --model k3-small --steps 13 "
              "mesh.num_devices=1 train.batch_size=8")

SHAPES = ((8, 4096), (2, 16384), (1, 65536))
# the rungs the ladder ledgers quoted here hold (train/ladder/sizes.py RUNGS as of 2026-12-07; a rung added
# there later has no row in these ledgers)
RUNGS = ("softmax", "softmax_conv", "linear", "deltanet", "gated_deltanet", "kda", "hybrid", "mla")


def tok(path):
    return Fig(J(path, "tokens_per_s"), "{:,}")


def step_cells(path):
    """ms/step, tokens/s, MFU, peak GiB, compile s (traced and lowered) of a train_step.py JSON."""
    return (ms(path), tok(path), pct(J(path, "mfu")), Fig(J(path, "peak_gb"), "{:.1f}"),
            Cat(Fig(J(path, "compile_s"), "{:.1f}"), " (", Fig(J(path, "lower_s"), "{:.1f}"), ")"))


STEP_HEAD = ("ms/step", "tokens/s", "MFU", "peak GiB", "compile s (traced + lowered)")
DEFAULT_STEPS = (STEP_K4_2, STEP_K4_4, STEP_I23_1, STEP_I23_3, STEP_I23_4)


def kda(name, B, T_, what):
    return J(f"{OP}/{name}_op.json", f"[B={B},T={T_},what={what}].ms")


def ld(model, ctx, part, key):
    return J(LD, f"records[model={model},context={ctx}].{part}.{key}")


def big(path, key):
    return J(path, f"records[0].decode_largest_batch.{key}")


def b1(path, ctx, key):
    return J(path, f"records[context={ctx}].decode_largest_batch.{key}")


def batch_row(folder, batch, key):
    """One row of long_decode --parts batches in decode-batches-2026-12-06/<folder>."""
    return J(f"{DB}/{folder}/results.json", f"records[0].decode_batches.rows[batch={batch}].{key}")


def lms_mean(rung, step):
    """The mean over seeds 0 and 1 of LMS's held-out loss at one eval step."""
    return mean(*(J(LMS, f"rows[rung={rung},task=lm,seed={seed},step={step}].eval_loss") for seed in (0, 1)))


def lms_cell(rung, step):
    """"mean (seed 0 and 1's range)" of LMS's held-out loss at one eval step."""
    return Cat(Fig(lms_mean(rung, step), "{:.3f}"), " (", Range(tuple(
        J(LMS, f"rows[rung={rung},task=lm,seed={seed},step={step}].eval_loss") for seed in (0, 1)), "{:.3f}"), ")")


def compile_phase(variant, phase):
    """GpuCompiler's seconds in `phase` (RunHloPasses | RunBackend) for the step module, one CAB variant."""
    return T(f"{CAB}/{variant}_passes.txt", rf"{phase}\s+([\d.]+) s\s+jit_step")


def mean(*values):
    return Div(Sum(*values), Const(len(values)))


def cpu_mean(path, rung, task, seed=None):
    sel = "" if seed is None else f",seed={seed}"  # a ledger of several seeds
    return Fig(mean(*(J(path, f"rows[rung={rung},task={task},pairs={p},seq_len=32{sel}].accuracy")
                      for p in (2, 4, 8))), "{:.3f}")


def zoo_mean(rung, d, seed):
    """Mean MQAR accuracy at the trained length (16/32/64 pairs @ 256) of one run of ZOO."""
    lr = ZOO_BEST[rung, d]
    return Fig(mean(*(J(ZOO, f"rows[rung={rung},task=mqar,d_model={d},lr={lr},seed={seed},pairs={p},seq_len=256]"
                           ".accuracy") for p in (16, 32, 64))), "{:.3f}")


def exch(q, i, key):
    return J(f"{EXCH}/k3_exchange_qat_{q}.json", f"[{i}].{key}")


def tables() -> list[Table]:
    t = []
    # --- 1. the k3-small step ------------------------------------------------------------------
    t.append(Table("step", ("lease", "tree") + STEP_HEAD, (
        ("2026-12-04, 2", "fb1a356") + step_cells(STEP_K4_2),
        ("2026-12-04, 4", "61fd6bd (the same code)") + step_cells(STEP_K4_4),
        ("2026-12-03, 1 (emptied compilation cache)", "5ca34ca") + step_cells(STEP_I23_1),
        ("2026-12-03, 3 (after the operator sweep)", "c3ae8a5") + step_cells(STEP_I23_3),
        ("2026-12-03, 4 (after the optimizer benchmark)", "d05d9e4") + step_cells(STEP_I23_4),
    ), (SMALL_STEP,)))
    t.append(Table("step_variants", ("variant (lease)", "ms/step", "the default in that lease", "time against it"),
        tuple(
        (name, ms(p), ms(base), ratio(J(p, "step_ms"), J(base, "step_ms"), 3)) for name, p, base in (
            ("per-head Muon, `optimizer.name=muon optimizer.muon_per_head=true` (2026-12-03, 1)",
             f"{I23}/1-step-muon-train/step_muon.json", STEP_I23_1),
            ("XLA's dynamic-slice fusion on (2026-12-03, 1)", f"{I23}/1-step-muon-train/step_dsf.json", STEP_I23_1),
            ("kernel 1's phase 1 unrolled (2026-12-03, 3)", f"{I23}/3-intra-sweep/step_unroll.json", STEP_I23_3),
            ("`model.kda.kernel_residuals=inputs`: fla's recompute (2026-12-04, 1)",
             f"{K4}/1-ab-keep-router/step_inputs.json", STEP_K4_1),
        )), (SMALL_STEP + " optimizer.name=muon optimizer.muon_per_head=true   # and so on",)))
    prev1, names1, inputs1 = (f"{K4}/1-ab-keep-router/step_{n}.json" for n in ("prev", "names", "inputs"))
    pb = f"{K4}/2-ab-profile-tune/profile_bytes.txt"

    def line_ms(where):
        """The ms column of the one profile line whose kind and source start with `where`."""
        return T(pb, r"^\s+([\d.]+)\s.*\s" + where)
    t.append(Table("step_profile", ("where (2026-12-04, lease 2, profiled)", "ms per step"), (
        ("all kernels", Fig(T(pb, r"^([\d.]+) ms of kernels per step"), "{:.1f}")),
        ("Pallas, Triton and Mosaic kernels", Fig(T(pb, r"by kind: kernel ([\d.]+)"), "{:.1f}")),
        ("of them KDA's fused kernels", Fig(line_ms(r"kernel\s+k3jax/ops/kda_kernels/op.py"), "{:.1f}")),
        ("of them the experts' grouped GEMMs (tokamax's forward and dx, k3jax's dw)", Fig(Sum(
            line_ms(r"kernel\s+k3jax/ops/grouped_matmul.py:167 grouped_matmul_kernel < k3jax/ops/grouped_matmul.py:300"),
            line_ms(r"kernel\s+k3jax/ops/grouped_matmul.py:167 grouped_matmul_kernel < k3jax/ops/grouped_matmul.py:305"),
            line_ms(r"kernel\s+k3jax/ops/tokamax_ragged_dot.py:99")), "{:.1f}")),
        ("XLA's glue (fusions around the kernels; in brackets its bytes at 4 TB/s)",
         Cat(Fig(T(pb, r"glue ([\d.]+), matmul"), "{:.1f}"), " (",
             Fig(T(pb, r"^glue: [\d.]+ ms measured, ([\d.]+) ms at"), "{:.1f}"), ")")),
        ("cuBLAS matmuls", Fig(T(pb, r"matmul ([\d.]+), \(not"), "{:.1f}")),
        ("not an HLO kernel (device copies of the scans' kept outputs)", Fig(T(pb, r"\(not an HLO kernel\) ([\d.]+)"),
                                                                           "{:.1f}")),
    ), ("XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m benchmarks.step.train_step --model k3-small --steps 5 "
        "--profile /tmp/trace --hlo /tmp/step.hlo mesh.num_devices=1 train.batch_size=8",
        "python -m benchmarks.tools.profile_bytes ops.csv.gz step.hlo.gz")))
    t.append(Table("train_run", ("step", "loss", "tokens/s", "MFU", "peak GiB"), tuple(
        (str(s), Fig(J(TRAIN, f"[step={s},loss].loss"), "{:.3f}"), Fig(J(TRAIN, f"[step={s},loss].tokens_per_s"),
            "{:,.0f}"),
         pct(J(TRAIN, f"[step={s},loss].mfu")), Fig(J(TRAIN, f"[step={s},loss].peak_gib"), "{:.1f}"))
        for s in (10, 20, 30, 40)), (
        "k3jax-train --config configs/k3-small.yaml train.steps=40 logging.every=10 logging.eval_every=40",)))
    # --- 2. the KDA operator against fla -----------------------------------------------------------
    inv, fo = f"{H1}/2-muon-train-inverse/inverse.json", f"{H1}/3-profile-fla/fla_op.json"  # the H100 lease

    def k3_h100(B, T_, what):
        return J(inv, f"[B={B},T={T_},what={what},tuning=default].ms")

    def fla_h100(B, T_, what):
        return J(fo, f"[B={B},T={T_},what={what}].ms")
    t.append(Table("kda_op", ("B×T×H, d = 128", "pass", "H200: fla safe gate ms", "k3jax fused ms", "k3jax / fla",
                              "k3jax XLA GB", "H100: fla ms", "k3jax ms", "k3jax / fla"), tuple(
        (f"{B}×{T_}×16", what, Fig(kda("fla", B, T_, what), "{:.3f}"), Fig(kda("k3jax", B, T_, what), "{:.3f}"),
         ratio(kda("fla", B, T_, what), kda("k3jax", B, T_, what)),
         Fig(J(f"{OP}/k3jax_op.json", f"[B={B},T={T_},what={what}].xla_gb"), "{:.2f}"),
         Fig(fla_h100(B, T_, what), "{:.3f}"), Fig(k3_h100(B, T_, what), "{:.3f}"),
         ratio(fla_h100(B, T_, what), k3_h100(B, T_, what)))
        for B, T_ in SHAPES for what in ("fwd", "fwd+bwd")), (
        "python benchmarks/run.py kda_op --profile /tmp/op_profiles     # H200, 2026-12-03, one lease",
        "python .device/fla_kda_op.py --variants safe --json fla_op.json     # fla's side (../shared/bench)",
        "python -m benchmarks.ops.kda_op --impl pallas --tune ';intra_inverse=1'   # H100, 2026-12-07; fla in its own slot")))
    # --- 3. the fla-shaped step ---------------------------------------------------------------------
    k = f"{FLA_STEP}/k3jax_fla_peer_save_dots.json"
    f = f"{FLA_STEP}/fla_model.json"
    t.append(Table("fla_step", ("fla's KDA-340M shape, 8×4096, one H200, one lease", "tokens/s", "ms/step", "peak GiB",
                                "compile s"), (
        ("k3jax, `model.kda.gate=lower_bound model.remat=save_dots`", tok(k), ms(k), Fig(J(k, "peak_gb"), "{:.1f}"),
         Fig(J(k, "compile_s"), "{:.1f}")),
        ("fla 0.6.0, `safe_gate=True, lower_bound=-5`", Fig(J(f, "kda-peer-340m-safe-gate.tokens_per_s"), "{:,}"),
         ms(f, "kda-peer-340m-safe-gate.step_ms"), Fig(J(f, "kda-peer-340m-safe-gate.peak_mem_gb"), "{:.1f}"), "—"),
    ), ("REMAT=save_dots FLA_TIMEOUT=420 bash benchmarks/env/run_gpu.sh model",)))
    # --- 4. kernels ---------------------------------------------------------------------------------
    t.append(Table("attention", ("B×T", "kernel fwd ms", "kernel fwd+bwd ms", "XLA fwd ms", "XLA fwd+bwd ms",
                                 "fwd+bwd speed-up", "kernel fwd TFLOP/s, dense-equivalent †", "XLA temporaries GB"),
                   tuple((f"{B}×{T_}", *(Fig(J(ATTN, f"[impl={i},batch={B},seq={T_}].{c}"), "{:.3f}")
                                          for i in ("kernel", "xla") for c in ("fwd_ms", "fwd_bwd_ms")),
                          ratio(J(ATTN, f"[impl=xla,batch={B},seq={T_}].fwd_bwd_ms"),
                                J(ATTN, f"[impl=kernel,batch={B},seq={T_}].fwd_bwd_ms"), 1),
                          Fig(J(ATTN, f"[impl=kernel,batch={B},seq={T_}].fwd_tflops_causal"), "{:,.1f}"),
                          Fig(J(ATTN, f"[impl=xla,batch={B},seq={T_}].temp_gb_fwd_bwd"), "{:.2f}"))
                         for B, T_ in ((2, 4096), (8, 4096), (1, 16384))),
                   ("bash benchmarks/env/run_gpu.sh kernels     # python benchmarks/run.py attention",)))
    cfg = ("config.block_m=128,config.block_n=128,config.block_k=64,config.num_stages=2,config.persistent=false,"
           "config.grid_minor_dim=0,config.grid_tile_width=1")  # k3jax's SM90_DOT
    sweep_f = "gmm-2026-12-02/1-sweep/gmm_configs.json"
    dwf = "gmm-2026-12-02b/1-pallas-dw/gmm_check_pallas.json"
    dots = tuple((label, Fig(J(sweep_f, f"calls.{c}.rows[0].ms"), "{:.3f}"), Fig(J(sweep_f,
        f"calls.{c}.rows[{cfg}].ms"), "{:.3f}"),
                  ratio(J(sweep_f, f"calls.{c}.rows[0].ms"), J(sweep_f, f"calls.{c}.rows[{cfg}].ms")))
                 for label, c in (("forward, gate or up [M,768]·[64,768,512]", "fwd_up"),
                                  ("forward, down (fp32 out)", "fwd_down"), ("dx of gate or up", "dx_up"),
                                  ("gate and up as one GEMM", "fwd_up_cat"), ("its dx", "dx_up_cat")))
    tok_dw, k3_dw = "tokamax 64x64x64 (with its transpose)", "pallas grouped_dw 64x128x128x4x3"
    dws = tuple((f"weight gradient, N = {n:,} (tokamax: its 64×64×64 tile and its transpose of x)",
                 Fig(J(dwf, f"dw_timing[n={n},kernel={tok_dw}].ms"), "{:.3f}"),
                 Fig(J(dwf, f"dw_timing[n={n},kernel={k3_dw}].ms"), "{:.3f}"),
                 ratio(J(dwf, f"dw_timing[n={n},kernel={tok_dw}].ms"), J(dwf, f"dw_timing[n={n},kernel={k3_dw}].ms")))
                for n in (512, 1024))
    t.append(Table("gmm", ("grouped GEMM, 262,144 rows, 64 experts, bf16", "tokamax ms",
                           "k3jax ms (128×128 tiles, block_k 64, 2 stages; dw: the Pallas kernel)", "speed-up"),
                   dots + dws,
                   ("python benchmarks/results/gmm-2026-12-02/gmm_configs.py --budget-s 470 --json gmm_configs.json"
                    "   # the record",
                    "python benchmarks/run.py gmm_check --dw-pallas     # the weight gradient's timing and errors")))
    g1 = "gmm-2026-12-02/3-check-and-profile/gmm_check.json"

    def err(path, routing, call, config):
        sel = f"results[routing={routing},call={call},config={config}]"
        return Cat(Fig(J(path, sel + ".max_rel"), "{:.1e}"), " / ", Fig(J(path, sel + ".norm_rel"), "{:.1e}"))
    t.append(Table("gmm_check", ("weight gradient against the fp32 padded-block form (max / norm relative error)",
                                 "uniform routing", "skewed, empty groups, 5,000 unrouted rows"), (
        ("tokamax's sm90 fallback tile (64×64, block_k 128, 2 stages), morning lease",
         err(g1, "uniform", "dw", "heuristic"), err(g1, "skewed_padded", "dw", "heuristic")),
        ("tokamax at 64×64×64, morning lease", err(g1, "uniform", "dw", "64x64x64"), err(g1, "skewed_padded", "dw",
            "64x64x64")),
        ("tokamax at 64×64×64, afternoon lease", err(dwf, "uniform", "dw", "64x64x64"),
         err(dwf, "skewed_padded", "dw", "64x64x64")),
        ("k3jax's Pallas kernel (any of 9 launch settings)", err(dwf, "uniform", "dw",
            "pallas grouped_dw 64x128x128x4x3"),
         err(dwf, "skewed_padded", "dw", "pallas grouped_dw 64x128x128x8x3")),
    ), ("python benchmarks/run.py gmm_check     # two leases: the error of one tokamax tile moved between them",)))
    ar = f"{GLUE}/attnres_op.json"
    t.append(Table("attnres", ("valid blocks n", "old autodiff form ms", "XLA form ms", "kernels ms",
                               "kernels against the XLA form"), tuple(
        (str(n), *(Fig(J(ar, f"[n={n},form={fm}].fwd_bwd_ms"), "{:.3f}") for fm in ("before (autodiff)", "xla",
            "kernel")),
         ratio(J(ar, f"[n={n},form=xla].fwd_bwd_ms"), J(ar, f"[n={n},form=kernel].fwd_bwd_ms")))
        for n in (1, 2, 3, 4)),
            ("python benchmarks/run.py attnres_op     # one site, B=8 T=4096 d=1536, 4 block slots",)))
    sc = f"{K4}/1-ab-keep-router/short_conv.json"
    glu = "kernels-2026-12-02c/3-reworked/glu_grad.json"
    t.append(Table("short_conv", ("backward at [8, 4096, 1536], bf16", "XLA ms", "kernel ms", "kernel against XLA"), (
        ("short conv, two-pass kernel (the default)", Fig(J(sc, "backward[form=xla].ms"), "{:.3f}"),
         Fig(J(sc, "backward[form=pallas 16x64 w4 tiles8 s1 two_pass].ms"), "{:.3f}"),
         ratio(J(sc, "backward[form=xla].ms"), J(sc, "backward[form=pallas 16x64 w4 tiles8 s1 two_pass].ms"))),
        ("q/k short conv with the l2 norm's backward inside, two-pass", Fig(J(sc,
            "normalized_backward[form=xla].ms"), "{:.3f}"),
         Fig(J(sc, "normalized_backward[form=pallas 16x128 w4 tiles8 two_pass].ms"), "{:.3f}"),
         ratio(J(sc, "normalized_backward[form=xla].ms"), J(sc,
             "normalized_backward[form=pallas 16x128 w4 tiles8 two_pass].ms"))),
        ("experts' GLU [262,144, 1,024] (XLA autodiff then; opt-in kernel)", Fig(J(glu, "xla_ms"), "{:.3f}"),
         Fig(J(glu, "kernel_ms"), "{:.3f}"), ratio(J(glu, "xla_ms"), J(glu, "kernel_ms"))),
    ), ("python benchmarks/run.py short_conv --backward-only --sweep '16,64,4,8,1,two_pass' "
        "--norm-sweep '16,4,8,two_pass'",
        "python benchmarks/run.py glu_grad")))
    # --- 5. the optimizer -----------------------------------------------------------------------------
    t.append(Table("muon", ("the update alone, k3-small (2026-12-03, 4)", "ms", "Newton–Schulz TFLOP/s"), (
        ("AdamW", Fig(J(OPT, "[variant=adamw].ms"), "{:.2f}"), "—"),
        ("per-head Muon", Fig(J(OPT, "[variant=muon_head].ms"), "{:.2f}"), "—"),
        ("its Newton–Schulz alone (19.3 TFLOP a step)", Fig(J(OPT, "[variant=ns_now].ms"), "{:.2f}"),
         Fig(J(OPT, "[variant=ns_now].tflops"), "{:.1f}")),
        ("Newton–Schulz before the batched chains (8295de7)", Fig(J(OPT, "[variant=ns_before].ms"), "{:.2f}"),
         Fig(J(OPT, "[variant=ns_before].tflops"), "{:.1f}")),
    ), ("python benchmarks/run.py optimizer_step --variants adamw,muon_head --ns --ceiling",)))
    t.append(Table("ns_ceiling", ("chain (matrices × shape)", "Newton–Schulz ms", "TFLOP/s", "Gram alone TFLOP/s",
                                  "A·A alone", "P·X alone", "5 × the three alone, ms"), tuple(
        (Fig(J(OPT, f"[{i}].chain"), "{}"), *(Fig(J(OPT, f"[{i}].{key}"), fmt) for key, fmt in (
            ("ns_ms", "{:.2f}"), ("ns_tflops", "{:.0f}"), ("gram_tflops", "{:.0f}"), ("a_a_tflops", "{:.0f}"),
            ("p_x_tflops", "{:.0f}"), ("products_alone_ms", "{:.2f}"))))
        for i in (6, 7, 4, 5, 9, 8))))  # the chains by size (optimizer.json's ceiling rows)
    # --- 6. compile time -------------------------------------------------------------------------------
    t.append(Table("compile", ("k3-small's step, unrolled, 8 × 4,096 in 2 micro-batches, one H100, each from an "
                               "empty cache", "step ms", "compile s, all", "of it traced + lowered s",
                               "XLA's HLO passes / backend s"), tuple(
        (label, Fig(J(f"{CAB}/{v}.json", "step_ms"), "{:.1f}"), Fig(J(f"{CAB}/{v}.json", "compile_s"), "{:.1f}"),
         Fig(J(f"{CAB}/{v}.json", "lower_s"), "{:.1f}"),
         Cat(Fig(compile_phase(v, "RunHloPasses"), "{:.1f}"), " / ", Fig(compile_phase(v, "RunBackend"), "{:.1f}")))
        for label, v in (("default", "default"), ("XLA's autotuner off (`--xla_gpu_autotune_level=0`)", "autotune0"),
                         ("XLA's Triton GEMM fusions off", "no_triton_gemm"))),
        ("bash benchmarks/results/compile-ab-h100-2026-12-07/lease11.sh   # train_step.py --model k3-small --steps 13 "
         "mesh.num_devices=1 train.batch_size=8 train.micro_batches=2, per variant",)))
    # --- 7. decode ------------------------------------------------------------------------------------
    rows = []
    for ctx, label in ((32768, "32k"), (131072, "128k"), (1048576, "1M")):
        for model, mname in (("hybrid", "hybrid"), ("all_mla", "all-MLA")):
            lb = (big(f"{LDB}/{model}_largest_1M.json", "batch"), big(f"{LDB}/{model}_largest_1M.json", "tokens_per_s"),
                  big(f"{LDB}/{model}_largest_1M.json", "roofline_fraction")) if ctx == 1048576 else \
                (ld(model, ctx, "decode_largest_batch", "batch"), ld(model, ctx, "decode_largest_batch",
                    "tokens_per_s"),
                 ld(model, ctx, "decode_largest_batch", "roofline_fraction"))
            rows.append((label, mname, Fig(J(LD, f"records[model={model},context={ctx}].cache_bytes_per_sequence"),
                                           "{:.3f}", 1e-9),
                         Fig(ld(model, ctx, "prefill", "tokens_per_s"), "{:,.0f}"),
                         Fig(ld(model, ctx, "decode_batch1", "ms_per_step"), "{:.2f}"),
                         pct(ld(model, ctx, "decode_batch1", "roofline_fraction"), 0),
                         Fig(lb[0], "{:,}"), Fig(lb[1], "{:,.1f}"), pct(lb[2], 0)))
    t.append(Table("decode_long", ("context", "model", "cache GB / sequence", "prefill tokens/s", "batch-1 ms/step",
                                   "of roofline", "largest batch", "tokens/s there", "of roofline"), tuple(rows), (
        "python benchmarks/run.py long_decode --model hybrid     # then --model all_mla; one command each",
        "python benchmarks/run.py long_decode --model all_mla --parts largest --contexts 1048576"
        "   # the 1M batch rows")))
    t.append(Table("decode_b1", ("hybrid, batch 1", "fused step ms", "old step ms, same method and lease",
                                 "the step of the table above ms", "fused against that step", "fused of roofline"),
                                     tuple(
        (label, Fig(b1(f"{DF}/h_b1/results.json", ctx, "ms_per_step"), "{:.2f}"),
         Fig(b1(f"{DF}/h_b1_old/results.json", ctx, "ms_per_step"), "{:.2f}"),
         Fig(ld("hybrid", ctx, "decode_batch1", "ms_per_step"), "{:.2f}"),
         ratio(ld("hybrid", ctx, "decode_batch1", "ms_per_step"), b1(f"{DF}/h_b1/results.json", ctx, "ms_per_step")),
         pct(b1(f"{DF}/h_b1/results.json", ctx, "roofline_fraction"), 0))
        for ctx, label in ((32768, "32k"), (1048576, "1M"))), (
        "python benchmarks/run.py long_decode --model hybrid --parts largest --contexts 32768,1048576 --max-batch 1 "
        "--largest-steps 64    # and model.decode_fused=false",)))
    def sweep_row(label, batch, plain, fused):
        return (label, str(batch), Fig(batch_row(plain, batch, "ms_per_step"), "{:.2f}") if plain else "—",
                Fig(batch_row(fused, batch, "ms_per_step"), "{:.2f}"),
                Fig(batch_row(fused, batch, "tokens_per_s"), "{:,.1f}"),
                pct(batch_row(fused, batch, "roofline_fraction"), 0))
    t.append(Table("decode_batch", ("1M, one H200 lease (2026-12-06)", "batch", "plain step ms", "fused step ms",
                                    "fused tokens/s", "fused of roofline"), (
        *(sweep_row("hybrid", b, None, "hybrid_default") for b in (13, 16)),
        *(sweep_row("hybrid", b, "hybrid_default", "hybrid_fused64") for b in (24, 32, 48)),
        sweep_row("all-MLA (its largest batch)", 12, None, "all_mla")),
        ("python benchmarks/run.py long_decode --model hybrid --parts batches --batches 13,16,24,32,48 "
         "--contexts 1048576 model.decode_fused_max_batch=16   # and =64 (the default); all_mla --batches 12",)))
    # --- 8. memory ------------------------------------------------------------------------------------
    GiB = 1 / 2 ** 30
    fp_full = "kernels-2026-12-03/3-profile-steps/step_fla_peer.json"
    fp_plan = "k3-plan-2026-12-03/fla_peer_h200_{}.txt"
    plan_total = r"^\s+total\s+([\d.]+) GB"
    GB_GiB = 1e9 / 2 ** 30
    t.append(Table("memory", ("one H200, one micro-batch", "planned GiB", "measured peak GiB", "planned / measured"), (
        *((label, Fig(J(plan, "per_device_bytes.total"), "{:.2f}", GiB), Fig(J(meas, "peak_gb"), "{:.1f}"),
           Fig(Div(J(plan, "per_device_bytes.total"), J(meas, "peak_gb")), "{:.3f}", GiB))
          for label, plan, meas in (
              ("k3-small B8×4096 (code of 2026-12-01 night)", "k3-plan-2026-12-02/k3-small_b8_h200.json",
               "k3-small-step-2026-12-01/steps/adamw_b8.json"),
              ("k3-small B2×4096 (the same)", "k3-plan-2026-12-02/k3-small_b2_h200.json",
               "k3-small-step-2026-12-01/steps/adamw_b2.json"))),
        ("fla-shaped step, `model.remat=full` (2026-12-03)", Fig(T(fp_plan.format("full"), plan_total), "{:.2f}",
            GB_GiB),
         Fig(J(fp_full, "peak_gb"), "{:.1f}"),
         Fig(Div(T(fp_plan.format("full"), plan_total), J(fp_full, "peak_gb")), "{:.3f}", GB_GiB)),
        ("fla-shaped step, `save_dots`: planned 2026-12-03, measured 2026-12-04 (the KDA kernels keep more since)",
         Fig(T(fp_plan.format("save_dots"), plan_total), "{:.2f}", GB_GiB),
         Fig(J(f"{FLA_STEP}/k3jax_fla_peer_save_dots.json", "peak_gb"), "{:.1f}"), "not the same code"),
    ), ("k3jax-plan --config configs/k3-small.yaml --devices 1 --batch 8 --target gpu --chip h200 "
        "train.micro_batches=1 --json"
        "   # CPU machine",
        "k3jax-plan --config configs/k3-tiny.yaml --devices 1 --chip h200 <train_step.py's FLA_PEER overrides> "
        "model.remat=full")))
    # --- 9. the planner on configs/k3.yaml ------------------------------------------------------------
    def plan_row(label, path):
        return (label, Fig(T(path, r"^\s+params\s+([\d.]+) GB"), "{:.2f}"), Fig(T(path,
            r"^\s+optimizer\s+([\d.]+) GB"), "{:.2f}"),
                Fig(T(path, r"^\s+temporaries\s+([\d.]+) GB"), "{:.2f}"), Fig(T(path, r"^\s+total\s+([\d.]+) GB"),
                    "{:.2f}"),
                Cat(Fig(T(path, r"^\s+total\s+[\d.]+ GB\s+of ([\d.]+) GB HBM"), "{:.0f}"), " GB, ",
                    Fig(T(path, r"fits \((\d+)% of HBM left\)"), "{:.0f}"), " % left"),
                Cat(Fig(T(path, r"lowered in (\d+) s"), "{:.0f}"), " + ", Fig(T(path, r"compiled in (\d+) s"),
                    "{:.0f}")))
    t.append(Table("plan_k3", ("configs/k3.yaml on 2,048 devices, per device", "params GB", "optimizer GB",
                               "temporaries GB", "total GB", "fits in", "lowered + compiled s"), (
        plan_row("k3.yaml (per-head Muon, QK-Clip 100), H200, XLA:GPU deviceless (4 micro-batches)", PLAN_GPU),
        plan_row("k3.yaml, TPU v5p-4096, XLA:TPU, `train.micro_batches=8 model.moe.ep_keep_received=false`", PLAN_TPU),
        plan_row("k3-sft.yaml (QAT: MXFP4 weights, MXFP8 activations and wire), H200, XLA:GPU", SFT_GPU),
        plan_row("k3-sft.yaml, TPU v5p-4096, XLA:TPU, the same overrides", SFT_TPU),
    ), ("k3jax-plan --config configs/k3.yaml --devices 2048 --chip h200             # 2-core CPU machine, no GPU",
        "k3jax-plan --config configs/k3.yaml --devices 2048 --chip v5p --target tpu train.micro_batches=8 "
        "model.moe.ep_keep_received=false")))
    ex_rows = [(label, Fig(exch(q, i, "bytes_per_token.network"), "{:,.0f}"),
                Fig(exch(q, i, "seconds_per_step.network"), "{:.2f}"), Fig(exch(q, i,
                    "expert_weights_seconds_per_step"),
                                                                           "{:.2f}"),
                Fig(exch(q, i, "exposed_seconds_per_step"), "{:.2f}"), Fig(exch(q, i, "kept_bytes_per_device"),
                    "{:.2f}",
                                                                           1e-9))
               for label, q, i in (
                   ("before: every tensor rank sends every token (bf16)", "none", 0),
                   ("each tensor rank its 1/8, the group gathers its experts' weights (`auto`)", "none", 2),
                   ("+ one row per (token, node), fanned out inside the node", "none", 4),
                   ("+ remat keeps the exchange's results (`moe.ep_keep_results`)", "none", 5),
                   ("**+ and the rows received (`moe.ep_keep_received`): k3.yaml as it is**", "none", 6),
                   ("the same with `model.qat=mxfp4` (MXFP8 rows)", "mxfp4", 6),
                   ("optional: `moe.max_nodes_per_token=4` (changes K3's routing)", "none", 7))]
    t.append(Table("plan_exchange", ("expert all-to-all, k3.yaml on 2,048 H200s, each change on the one above",
                                     "network B / token / MoE layer", "network s / step", "weight gathers s (NVLink)",
                                     "exposed s / step", "kept by remat GB"), tuple(ex_rows), (
        "k3jax-plan --exchange-changes --json --config configs/k3.yaml --devices 2048 "
        "--mesh data=1,fsdp=-1,expert=64,tensor=8"
        "   # and model.qat=mxfp4",)))
    # --- 10. the ladder and the recipe ----------------------------------------------------------------
    MiB = 1 / 2 ** 20
    t.append(Table("ladder_lm", ("rung", "params", "held-out loss at 12.9 M tokens", "25.7 M", "38.6 M", "51.4 M",
                                 "decode state MiB @ 4k / 128k"), tuple(
        (r, Fig(J(LMS, f"rungs.{r}.params"), "{:,}"), *(lms_cell(r, step) for step in (400, 800, 1200, 1600)),
         Cat(Fig(J(LMS, f"rows[rung={r},task=cost].state_bytes_4k"), "{:,.2f}", MiB), " / ",
             Fig(J(LMS, f"rows[rung={r},task=cost].state_bytes_128k"), "{:,.2f}", MiB)))
        for r in RUNGS),
        ("k3jax-ladder --size h200 --seeds 0,1 --parallel 4 --out $OUT/lm --stop-after 545   # H100; again to resume "
         "(benchmarks/results/ladder-lm-seeds/lease10.sh)",)))
    t.append(Table("ladder_cpu", ("rung", "recall @ 32 tokens, seed 0", "seed 1", "overwrite, seed 0", "seed 1",
                                  "CPU LM held-out loss (seed 0)"), tuple(
        (r, *(cpu_mean(LCPU2, r, task, seed) for task in ("mqar", "mqar_overwrite") for seed in (0, 1)),
         Fig(J(LCPU2, f"rows[rung={r},task=lm,tokens=1220765,seed=0].eval_loss"), "{:.3f}"))
        for r in RUNGS),
        ("k3jax-ladder --size cpu --seeds 0,1 --tasks mqar,mqar_overwrite && k3jax-ladder --size cpu --tasks lm "
         "--seeds 0     # 2-core CPU, 2026-12-06",)))
    t.append(Table("ladder_zoology", ("rung", "d 128: best lr", "recall, seed 0 / 1", "d 256: best lr",
                                      "recall, seed 0 / 1"), tuple(
        (r, *(c for d in (128, 256) for c in (f"{ZOO_BEST[r, d]:g}", Cat(zoo_mean(r, d, 0), " / ", zoo_mean(r, d, 1)))))
        for r in RUNGS),
        ("bash benchmarks/results/ladder-zoology-2026-12-06/parallel.sh <rungs> <rungs> ...   # four processes "
         "on one H200; then k3jax-ladder --merge",)))
    rs = "recipe-k3-small-2026-12-06"
    t.append(Table("recipe", ("k3-small, 160 steps × 16 × 4,096 (10.5 M tokens), seed 0, one H100",
                              "eval loss @ 20 / 60 / 100 / 160", "gap to bf16 @ 160", "train loss, last 20 steps",
                              "tokens/s (median)", "max_violation, mean over layers from step 50"), tuple(
        (label, Cat(*(x for st in (20, 60, 100, 160) for x in (
            " / " if st != 20 else "", Fig(J(f"{rs}/recipe.json", f"variants.{v}.eval_loss.{st}"), "{:.3f}")))),
         Fig(J(f"{rs}/recipe.json", f"variants.{v}.gap_to_bf16.160"), "{:+.4f}"),
         Fig(J(f"{rs}/recipe.json", f"variants.{v}.train_loss_last20"), "{:.4f}"),
         Fig(J(f"{rs}/recipe.json", f"variants.{v}.tokens_per_s_median"), "{:,.0f}"),
         Fig(Agg(f"{rs}/{v}/metrics.jsonl", "max_violation", "mean_since", 50), "{:.2f}"))
        for label, v in (("bf16 compute, AdamW (k3-small as configured)", "bf16"),
                         ("+ MXFP4 QAT (`model.qat=mxfp4`)", "qat"),
                         ("+ MXFP4 QAT, per-head Muon, QK-Clip tau 100: K3's recipe", "recipe"))),
        ("python -m train.ladder.recipe --variant bf16 --out $OUT/recipe --scratch /dev/shm "
         "--set train.micro_batches=4   # then --variant qat, --variant recipe; --report --out DIR",)))
    # --- 11. expert balance ---------------------------------------------------------------------------
    acc = "qb-accept-2026-12-06"
    acc_rows = []
    for label, side in (("before: the tree at 4bc07ef (lr 3e-3 / 20 warmup, linear-bin histogram)", "before"),
                        ("after: this tree's defaults (lr 1e-3 / 100 warmup, asinh-bin histogram)", "after")):
        path = f"{acc}/{side}_metrics.jsonl"
        acc_rows.append((label, Fig(Agg(path, "max_violation", "max_since", 50), "{:.2f}"),
                         Fig(Agg(path, "max_violation", "mean_since", 50), "{:.2f}"),
                         Fig(J(f"{acc}/summary.json", f"{side}.mean_over_layers_last"), "{:.2f}"),
                         Cat(Fig(J(path, "[step=100,eval_loss].eval_loss"), "{:.3f}"), " / ",
                             Fig(J(path, "[step=200,eval_loss].eval_loss"), "{:.3f}"), " / ",
                             Fig(J(path, "[step=300,eval_loss].eval_loss"), "{:.3f}")),
                         Fig(J(f"{acc}/summary.json", f"{side}.tokens_per_s"), "{:,.0f}")))
    t.append(Table("balance_accept", ("k3-small, 300 steps, one H100, 2026-12-06 (one lease)",
                                      "worst layer from step 50", "mean over layers from step 50",
                                      "mean over layers at step 300", "eval loss at 100 / 200 / 300",
                                      "tokens/s, steps 21-300"),
                   tuple(acc_rows),
                   ("bash benchmarks/results/qb-accept-2026-12-06/lease_a.sh   # then lease_b.sh; "
                    "EXTRA=train.micro_batches=4 on an H100",)))
    # --- 12. interchange and two GPUs -----------------------------------------------------------------
    s = f"{HF}/summary.json"
    t.append(Table("interchange", ("check (one H200, 2026-12-01)", "result"), (
        ("fla `KDAForCausalLM` → `k3jax-import`, fp32 logits, T = 128: max / L2 relative error (goal ≤ 2e-3)",
         Cat(Fig(J(s, "fla.logits_T128.max_rel_err"), "{:.2e}"), " / ", Fig(J(s, "fla.logits_T128.rel_l2_err"),
             "{:.1e}"))),
        ("the same, T = 37 (one chunk)", Fig(J(s, "fla.logits_T37.max_rel_err"), "{:.1e}")),
        ("`k3jax-export --layout fla_kda` → fla: logits bitwise equal", Fig(J(s,
            "fla.roundtrip_into_fla.bitwise_equal"), "{}")),
        ("greedy decoding from the import: first token equals fla's (only the first is compared)",
         Fig(J(s, "fla.decode.first_token_matches"), "{}")),
        ("one MLA layer against transformers' `DeepseekV3Attention`, max relative error",
         Range(tuple(J(s, f"mla.{k}.max_rel_err") for k in ("q_lora64_nope", "q_lora64_rope", "q_lora0_nope",
             "q_lora0_rope")),
               "{:.1e}")),
    ), ("python benchmarks/run.py hf_crosscheck",)))
    tm = f"{HF}/timing_k3_small_cpu.json"
    t.append(Table("interchange_cost", ("k3-small (1,536 M parameters), 2-core CPU", "wall s", "peak host RSS GB",
                                        "written GB"), tuple(
        (label, Fig(J(tm, f"timing.{k}.wall_s"), "{:.1f}"), Fig(J(tm, f"timing.{k}.peak_rss_gb"), "{:.1f}"),
         Fig(J(tm, f"timing.{k}.bytes"), "{:.2f}", 1e-9) if "export" in k else "—")
        for label, k in (("`k3jax-export` bf16", "export_bf16"), ("`k3jax-export --mxfp4`", "export_mxfp4"),
                         ("`k3jax-import` bf16", "import_bf16"), ("`k3jax-import` MXFP4", "import_mxfp4"))),
        ("python benchmarks/run.py hf_crosscheck --parts timing",)))
    eq = "x2-session/equivalence.txt"

    def eqv(step, col):
        return T(eq, r"^\s+%d\s+" % step + r"\s+".join(["(\\S+)" if i == col else "\\S+" for i in range(3)]) + r"\s*$")
    runs = (("1 GPU", 0, range(1, 7)), ("2 GPUs, expert=2", 1, range(1, 3)),
            ("1 GPU, restored from the 2-GPU run's step 2", 2, range(3, 7)))
    t.append(Table("two_gpu", ("k3-small, 8×1024: loss at step", *map(str, range(1, 7))), tuple(
        (label, *(Fig(eqv(st, c), "{:.6f}") if st in steps else "—" for st in range(1, 7))) for label, c,
            steps in runs),
        ("OUT=$OUT bash benchmarks/results/x2-session/h200x2_session.sh     # nvidia-h200-x2; the record",)))
    # --- the H100 lease of 2026-12-07 (issue 42, 43) --------------------------------------------------
    t.append(Table("step_layout", ("layer layout (one H100, 2026-12-07, one lease)",) + STEP_HEAD
                   + ("loss at step 15", "time against scanned"), tuple(
        (label,) + step_cells(path) + (Fig(J(path, "loss"), "{:.3f}"),
                                       ratio(J(path, "step_ms"), J(SCANNED_H1, "step_ms"), 3))
        for label, path in (("scanned, `model.scan_layers=true` (the default before)", SCANNED_H1),
                            ("unrolled, `model.scan_layers=false` (the default now)", UNROLLED_H1))),
        ("JAX_COMPILATION_CACHE_DIR=/tmp/empty-$o python -m benchmarks.step.train_step --model k3-small --steps 13 "
         "mesh.num_devices=1 train.batch_size=8 train.micro_batches=2 model.scan_layers=$o   # o = true, false; "
         "the record: benchmarks/results/unrolled-h100-2026-12-07/1-scan-ab/lease1.sh",)))
    oh = {"scanned": f"{H1}/2-muon-train-inverse/opt.json", "unrolled": f"{H1}/4-muon-unrolled-batch16/opt_unrolled.json"}
    t.append(Table("muon_h100", ("the update alone, k3-small (one H100, 2026-12-07)", "scanned ms", "unrolled ms",
                                 "Newton–Schulz TFLOP/s (scanned)"), (
        ("AdamW", *(Fig(J(o, "[variant=adamw].ms"), "{:.2f}") for o in oh.values()), "—"),
        ("per-head Muon", *(Fig(J(o, "[variant=muon_head].ms"), "{:.2f}") for o in oh.values()), "—"),
        ("its Newton–Schulz alone (19.3 TFLOP)", *(Fig(J(o, "[variant=ns_now].ms"), "{:.2f}") for o in oh.values()),
         Fig(J(oh["scanned"], "[variant=ns_now].tflops"), "{:.1f}")),
        ("one rank's share of it at data=8 (2.58 TFLOP, 29 chunks), measured",
         *(Fig(J(o, "[variant=ns_rank_of_8].ms"), "{:.2f}") for o in oh.values()),
         Fig(J(oh["scanned"], "[variant=ns_rank_of_8].tflops"), "{:.1f}")),
        ("the all-gather of the orthogonalised updates (2.59 GB at NVLink's rate), modelled",
         *(Fig(J(o, "[variant=ns_rank_of_8].all_gather_ms_modelled"), "{:.2f}") for o in oh.values()), "—"),
    ), ("python -m benchmarks.step.optimizer_step --variants adamw,muon_head --ns --ranks 8 [model.scan_layers=false]",)))
    return t


def figures() -> dict:
    f = {}
    f["step.tokens"] = Range(tuple(J(p, "tokens_per_s") for p in DEFAULT_STEPS), "{:.1f}", 1e-3)
    f["step.ms"] = Range(tuple(J(p, "step_ms") for p in DEFAULT_STEPS), "{:.1f}")
    f["step.mfu"] = Range(tuple(J(p, "mfu") for p in DEFAULT_STEPS), "{:.1f}", 100)
    f["step.peak"] = Range(tuple(J(p, "peak_gb") for p in DEFAULT_STEPS), "{:.1f}")
    f["muon.ratio"] = ratio(J(f"{I23}/1-step-muon-train/step_muon.json", "step_ms"), J(STEP_I23_1, "step_ms"), 2)
    f["muon.ms"] = ms(f"{I23}/1-step-muon-train/step_muon.json")
    f["muon.adamw_ms"] = ms(STEP_I23_1)
    f["ns.chain_tflops"] = Range(tuple(J(OPT, f"[{i}].ns_tflops") for i in (4, 5, 6, 7)), "{:.0f}")
    f["fla.full_peak"] = Fig(J("kernels-2026-12-03/3-profile-steps/step_fla_peer.json", "peak_gb"), "{:.1f}")
    f["dsf.cost"] = Fig(Div(Sub(J(f"{I23}/1-step-muon-train/step_dsf.json", "step_ms"), J(STEP_I23_1, "step_ms")),
                            J(STEP_I23_1, "step_ms")), "{:.1f} %", 100)
    prev2 = f"{K4}/2-ab-profile-tune/step_prev.json"
    f["round.total"] = Fig(Sub(J(prev2, "step_ms"), J(STEP_K4_2, "step_ms")), "{:.1f}")
    f["round.peak_cost"] = Fig(Sub(J(STEP_K4_2, "peak_gb"), J(prev2, "peak_gb")), "{:.1f}")
    f["train.tokens"] = Range(tuple(J(TRAIN, f"[step={s},loss].tokens_per_s") for s in (10, 20, 30, 40)), "{:.1f}",
        1e-3)
    f["train.peak"] = Fig(J(TRAIN, "[step=40,loss].peak_gib"), "{:.1f}")
    f["train.eval"] = Fig(J(TRAIN, "[step=40,eval_loss].eval_loss"), "{:.3f}")
    # k3jax-train's compile_s is XLA's part; its wait adds the tracing and lowering (lower_s)
    f["train.compile"] = Fig(Sum(J(TRAIN, "[step=0,compile_s].compile_s"), J(TRAIN, "[step=0,compile_s].lower_s")),
                             "{:.1f}")
    f["train.first_step"] = Fig(J(TRAIN, "[first_step_s].first_step_s"), "{:.1f}")
    f["kda.fwdbwd"] = Range(tuple(Div(kda("fla", B, T_, "fwd+bwd"), kda("k3jax", B, T_, "fwd+bwd")) for B,
        T_ in SHAPES),
                            "{:.2f}", unit="×")
    f["kda.fwd"] = Range(tuple(Div(kda("fla", B, T_, "fwd"), kda("k3jax", B, T_, "fwd")) for B, T_ in SHAPES),
                         "{:.2f}", unit="×")
    k, fl = f"{FLA_STEP}/k3jax_fla_peer_save_dots.json", f"{FLA_STEP}/fla_model.json"
    f["fla.ratio"] = ratio(J(k, "tokens_per_s"), J(fl, "kda-peer-340m-safe-gate.tokens_per_s"))
    f["fla.k3jax"] = Fig(J(k, "tokens_per_s"), "{:.1f} k", 1e-3)
    f["fla.fla"] = Fig(J(fl, "kda-peer-340m-safe-gate.tokens_per_s"), "{:.1f} k", 1e-3)
    f["fla.peak"] = Fig(J(k, "peak_gb"), "{:.1f}")
    f["fla.fla_peak"] = Fig(J(fl, "kda-peer-340m-safe-gate.peak_mem_gb"), "{:.1f}")
    f["attn.speedup"] = Range(tuple(Div(J(ATTN, f"[impl=xla,batch={B},seq={T_}].fwd_bwd_ms"),
                                        J(ATTN, f"[impl=kernel,batch={B},seq={T_}].fwd_bwd_ms"))
                                    for B, T_ in ((2, 4096), (8, 4096), (1, 16384))), "{:.1f}", unit="×")
    f["attn.bwd_over_fwd"] = Range(tuple(Div(J(ATTN, f"[impl=kernel,batch={B},seq={T_}].fwd_bwd_ms"),
                                             J(ATTN, f"[impl=kernel,batch={B},seq={T_}].fwd_ms"))
                                         for B, T_ in ((2, 4096), (8, 4096), (1, 16384))), "{:.1f}", unit="×")
    f["attn.bf16_out"] = Fig(J(ATTN, "[check,dtype=bfloat16].out"), "{:.1e}")
    f["attn.bf16_grad"] = Range(tuple(J(ATTN, f"[check,dtype=bfloat16].{g}") for g in ("dq", "dk", "dv")), "{:.1e}")
    f["compile.autotune_passes"] = Fig(Sub(compile_phase("default", "RunHloPasses"),
                                           compile_phase("autotune0", "RunHloPasses")), "{:.0f}")
    f["compile.autotune_slowdown"] = Fig(Div(J(f"{CAB}/autotune0.json", "step_ms"), J(f"{CAB}/default.json", "step_ms")),
                                         "{:.1f}")
    f["compile.notriton_saving"] = Fig(Sub(J(f"{CAB}/default.json", "compile_s"),
                                           J(f"{CAB}/no_triton_gemm.json", "compile_s")), "{:.1f}")
    f["attn.dense_tflops"] = Fig(J(ATTN, "[impl=kernel,batch=1,seq=16384].fwd_tflops_causal"), "{:,.1f}")
    f["conv.xla_step"] = ms("kernels-2026-12-02d/3-variants/step_xla_conv.json")
    f["conv.step"] = ms("kernels-2026-12-02d/3-variants/step_new.json")
    f["glu.kernel_step"] = ms("kernels-2026-12-02d/3-variants/step_glu_kernel.json")
    f["compile.first"] = Range(tuple(J(p, "compile_s") for p in (STEP_I23_1, f"{OP}/step_notriton.json", STEP_I23_4,
                                                                 STEP_K4_1, STEP_K4_2)), "{:.1f}")
    f["compile.lower"] = Range(tuple(J(p, "lower_s") for p in (STEP_I23_1, f"{OP}/step_notriton.json", STEP_I23_4,
                                                               STEP_K4_1, STEP_K4_2)), "{:.1f}")
    f["first.step"] = Range(tuple(J(f"first-hour-2026-12-01b/{n}_metrics.jsonl", "[first_step_s].first_step_s")
                                  for n in ("lease1_first_launch", "lease2_first_launch")), "{:.0f}")
    f["first.compile"] = Range(tuple(Sum(J(f"first-hour-2026-12-01b/{n}_metrics.jsonl", "[step=0].compile_s"),
                                         J(f"first-hour-2026-12-01b/{n}_metrics.jsonl", "[step=0].lower_s"))
                                     for n in ("lease1_first_launch", "lease2_first_launch")), "{:.1f}")
    f["first.tokens"] = Range(tuple(J(f"first-hour-2026-12-01b/{n}_metrics.jsonl",
        f"[step={st},tokens_per_s].tokens_per_s")
                                    for n in ("lease1_first_launch", "lease2_first_launch") for st in (5, 10, 15,
                                        20, 25, 30)),
                              "{:.1f}", 1e-3)
    f["first.second"] = Fig(J("first-hour-2026-12-01b/lease2_second_launch_metrics.jsonl",
        "[first_step_s].first_step_s"),
                            "{:.0f}")
    f["decode.b1_gain"] = Range(tuple(Div(ld("hybrid", c, "decode_batch1", "ms_per_step"),
                                          b1(f"{DF}/h_b1/results.json", c, "ms_per_step")) for c in (32768, 1048576)),
                                "{:.2f}", unit="×")
    f["decode.b1_same_method"] = Range(tuple(Div(b1(f"{DF}/h_b1_old/results.json", c, "ms_per_step"),
                                                 b1(f"{DF}/h_b1/results.json", c, "ms_per_step")) for c in (32768,
                                                     1048576)),
                                       "{:.2f}", unit="×")
    f["decode.old_method_slower"] = Range(tuple(Div(Sub(b1(f"{DF}/h_b1_old/results.json", c, "ms_per_step"),
                                                        ld("hybrid", c, "decode_batch1", "ms_per_step")),
                                                    ld("hybrid", c, "decode_batch1", "ms_per_step"))
                                                for c in (32768, 1048576)), "{:.0f}", 100, unit=" %")
    f["decode.fused_1m_roofline"] = pct(b1(f"{DF}/h_b1/results.json", 1048576, "roofline_fraction"), 0)
    f["decode.b48_gain"] = Fig(Sub(Div(batch_row("hybrid_default", 48, "ms_per_step"),
                                       batch_row("hybrid_fused64", 48, "ms_per_step")), Const(1)), "{:.0f} %", 100)
    f["decode.b32_slower"] = Fig(Sub(Div(batch_row("hybrid_fused64", 32, "ms_per_step"),
                                         batch_row("hybrid_default", 32, "ms_per_step")), Const(1)), "{:.0f} %", 100)
    f["decode.ratio_defaults"] = ratio(batch_row("hybrid_fused64", 48, "tokens_per_s"),
                                       batch_row("all_mla", 12, "tokens_per_s"))
    f["decode.ratio_old"] = ratio(big(f"{LDB}/hybrid_largest_1M.json", "tokens_per_s"),
                                  big(f"{LDB}/all_mla_largest_1M.json", "tokens_per_s"))
    f["decode.cache_ratio"] = Fig(Div(J(LD, "records[model=hybrid,context=1048576].cache_bytes_per_sequence"),
                                      J(LD, "records[model=all_mla,context=1048576].cache_bytes_per_sequence")),
                                          "{:.3f}")
    f["decode.prefill_ratio"] = ratio(ld("hybrid", 1048576, "prefill", "tokens_per_s"),
                                      ld("all_mla", 1048576, "prefill", "tokens_per_s"))
    f["plan.k3_total"] = Fig(T(PLAN_GPU, r"^\s+total\s+([\d.]+) GB"), "{:.2f}")
    f["plan.k3_left"] = Fig(T(PLAN_GPU, r"fits \((\d+)% of HBM left\)"), "{:.0f}")
    f["plan.v5p_total"] = Fig(T(PLAN_TPU, r"^\s+total\s+([\d.]+) GB"), "{:.2f}")
    f["plan.v5p_left"] = Fig(T(PLAN_TPU, r"fits \((\d+)% of HBM left\)"), "{:.0f}")
    f["plan.a2a"] = Fig(T(PLAN_GPU, r"all-to-all ([\d.]+) s per step"), "{:.2f}")
    f["plan.a2a_exposed"] = Fig(T(PLAN_GPU, r"([\d.]+) s exposed after overlap"), "{:.2f}")
    f["plan.compute"] = Fig(T(PLAN_GPU, r"\(compute ([\d.]+) s\)"), "{:.2f}")
    for name, path in (("k3", PLAN_GPU), ("v5p", PLAN_TPU), ("sft", SFT_GPU), ("sft_v5p", SFT_TPU)):
        f[f"plan.{name}_opt_s"] = Fig(T(path, r"^planned step: [\d.]+ s \(compute [\d.]+ \+ all-to-all exposed [\d.]+ \+ optimizer ([\d.]+)\)"), "{:.2f}")
        f[f"plan.{name}_step_s"] = Fig(T(path, r"^planned step: ([\d.]+) s"), "{:.2f}")
        f[f"plan.{name}_opt_share"] = Fig(T(path, r"the optimizer ([\d.]+)% of it"), "{:.1f}")
        f[f"plan.{name}_mfu"] = Fig(T(path, r"; MFU ([\d.]+)% \(model FLOPs"), "{:.1f}")
    gen = "qb-accept-2026-12-06"
    f["gen.small_b1"] = Fig(T(f"{gen}/generate_b1.log", r"k3jax-generate: ([\d,.]+) tokens/s"), "{:,.1f}")
    f["gen.small_b8"] = Fig(T(f"{gen}/generate_b8.log", r"k3jax-generate: ([\d,.]+) tokens/s"), "{:,.1f}")
    f["first.h100_compile"] = Fig(Sum(T(f"{gen}/after.log", r"compiled the train step in ([\d.]+) s"),
                                      T(f"{gen}/after.log", r"traced and lowered in ([\d.]+) s")), "{:.1f}")
    f["first.h100_step"] = Fig(T(f"{gen}/after.log", r"^\[\s*([\d.]+) s\] step 1/300"), "{:.1f}")
    chk = "checks-h100-2026-12-06b/hf_summary.json"
    f["hf.tf32_on"] = Fig(J(chk, "fla.logits_T128.max_rel_err"), "{:.2e}")
    f["hf.tf32_off"] = Fig(J(chk, "fla_ieee.logits_T128.max_rel_err"), "{:.2e}")
    f["hf.decode_match"] = Fig(J(chk, "fla.decode.matching"), "{:.0f}")
    f["qb.after_mean"] = Fig(Agg(f"{gen}/after_metrics.jsonl", "max_violation", "mean_since", 50), "{:.2f}")
    f["qb.before_mean"] = Fig(Agg(f"{gen}/before_metrics.jsonl", "max_violation", "mean_since", 50), "{:.2f}")
    rep = "qb-replay-2026-12-06/summary.json"
    f["qb.frozen_mean"] = Fig(J(rep, "replay.frozen300_rate1.mean_over_layers_avg_from_50"), "{:.2f}")
    f["qb.steps_mean"] = Fig(J(rep, "live.live_defaults_every_step.mean_over_layers_avg_from_50"), "{:.2f}")
    f["qb.frozen_r"] = Fig(J(rep, "replay.frozen300_rate1.corr_with_live_per_step"), "{:.2f}")
    f["qb.frozen_191"] = Fig(J(rep, "replay.frozen300_rate1.step191_mean"), "{:.2f}")
    f["qb.live_191"] = Fig(J(rep, "live.live_defaults_every_step.step191_mean"), "{:.2f}")
    f["qb.cpu_b8"] = Fig(J(rep, "cpu_tiny64.b8.mean_over_layers_avg"), "{:.2f}")
    f["qb.cpu_b128"] = Fig(J(rep, "cpu_tiny64.b128.mean_over_layers_avg"), "{:.2f}")
    f["qb.frozen_rate05"] = Fig(J(rep, "replay.frozen300_rate05.mean_over_layers_avg_from_50"), "{:.2f}")
    f["qb.live_rate05"] = Fig(J(rep, "live.live_rate05.mean_over_layers_avg_from_50"), "{:.2f}")
    rj = "recipe-k3-small-2026-12-06/recipe.json"
    for v in ("qat", "recipe"):
        f[f"recipe.{v}_gap"] = Fig(J(rj, f"variants.{v}.gap_to_bf16.160"), "{:+.3f}")
        f[f"recipe.{v}_speed"] = Fig(Div(J(rj, f"variants.{v}.tokens_per_s_median"),
                                          J(rj, "variants.bf16.tokens_per_s_median")), "{:.2f}")
    f["recipe.max_logit"] = Fig(J(rj, "variants.recipe.qk_clip.max_logit"), "{:.1f}")
    f["recipe.qat_gaps"] = Range(tuple(J(rj, f"variants.qat.gap_to_bf16.{st}") for st in range(20, 161, 20)),
                                 "{:+.3f}", sep=" to ")
    f["plan.sft_total"] = Fig(T(SFT_GPU, r"^\s+total\s+([\d.]+) GB"), "{:.2f}")
    f["plan.sft_v5p_total"] = Fig(T(SFT_TPU, r"^\s+total\s+([\d.]+) GB"), "{:.2f}")
    for r in RUNGS:
        f[f"ladder.{r}"] = Fig(lms_mean(r, 1600), "{:.3f}")
    for name, ledger, rung in (("nope", "nope", "mla"), ("rope", "rope", "mla"), ("softmax", "nope", "softmax")):
        f[f"ladder.cpu_mla_{name}"] = Fig(J(f"{MLA_POS}/{ledger}_ladder.json",
                                            f"rows[rung={rung},task=lm,tokens=1220765].eval_loss"), "{:.3f}")
    f["x2.step1"] = Fig(Div(Sub(T("x2-session/equivalence.txt", r"^\s+1\s+\S+\s+(\S+)"),
                                T("x2-session/equivalence.txt", r"^\s+1\s+(\S+)")),
                            T("x2-session/equivalence.txt", r"^\s+1\s+(\S+)")), "{:.1e}")
    f["x2.step2"] = Fig(Div(Sub(T("x2-session/equivalence.txt", r"^\s+2\s+(\S+)"),
                                T("x2-session/equivalence.txt", r"^\s+2\s+\S+\s+(\S+)")),
                            T("x2-session/equivalence.txt", r"^\s+2\s+(\S+)")), "{:.1e}")
    zero_files = (TRAIN, "first-hour-2026-12-01b/lease1_first_launch_metrics.jsonl",
                  "recipe-k3-tiny-2026-12-01/recipe.metrics.jsonl")
    f["balance.zero_logged"] = Fig(Sum(*(Agg(p, "z_loss", "count") for p in zero_files)), "{:.0f}")
    f["balance.zero_nonzero"] = Fig(Sum(*(Agg(p, "z_loss", "count_positive") for p in zero_files),
                                        *(Agg(p, "expert_drop_rate_max", "count_positive") for p in zero_files)),
                                    "{:.0f}")
    # the H100 lease of 2026-12-07: the layer layouts, Muon's rank share, k3jax-train beside the benchmark
    f["layout.speedup"] = ratio(J(SCANNED_H1, "step_ms"), J(UNROLLED_H1, "step_ms"))
    f["layout.scanned_ms"], f["layout.unrolled_ms"] = ms(SCANNED_H1), ms(UNROLLED_H1)
    f["layout.d2d"] = Fig(T(f"{H1}/3-profile-fla/profile_unrolled.txt", r"^\s+([\d.]+)\s+[\d.]+\s+\d+\s+MemcpyD2D$"),
                          "{:.1f}")
    f["layout.compile_scanned"] = Fig(J(SCANNED_H1, "compile_s"), "{:.1f}")
    f["layout.compile_unrolled"] = Fig(J(UNROLLED_H1, "compile_s"), "{:.1f}")
    log1, log3 = f"{H1}/2-muon-train-inverse/train.log", f"{H1}/5-train-beside-bench/train_every59.log"
    f["layout.train_compile"], f["layout.train_compile_fresh"] = (
        Fig(Sum(T(lg, r"compiled the train step in ([\d.]+) s"), T(lg, r"traced and lowered in ([\d.]+) s")), "{:.1f}")
        for lg in (log1, log3))
    f["train_h1.bench"] = Fig(J(BENCH_H1, "tokens_per_s"), "{:,}")
    f["train_h1.mean"] = Fig(Agg(TRAIN_H1, "tokens_per_s", "mean_last", 5), "{:,.0f}")
    f["kda_h100.fwd"] = Range(tuple(Div(J(f"{H1}/3-profile-fla/fla_op.json", f"[B={B},T={T_},what=fwd].ms"),
                                        J(f"{H1}/2-muon-train-inverse/inverse.json",
                                          f"[B={B},T={T_},what=fwd,tuning=default].ms")) for B, T_ in SHAPES),
                              "{:.2f}", unit="×")
    lines = tuple(T(f"{TL}/train.log", rf"^step {n}/60: loss [\d.]+, ([\d,]+) tokens/s") for n in (20, 30, 40, 50))
    f["train_h1.lines"] = Range(lines, "{:,.0f}")
    f["train_h1.lines_ratio"] = Range(tuple(Div(v, J(BENCH_H1, "tokens_per_s")) for v in lines), "{:.3f}", unit="×")
    f["train_h1.last"] = Fig(T(f"{TL}/train.log", r"^step 60/60: loss [\d.]+, ([\d,]+) tokens/s"), "{:,.0f}")
    f["train_h1.last_balance"] = Fig(T(f"{TL}/train.log", r"^step 60/60: .* balance ([\d.]+) \(MoE"), "{:.2f}")
    f["layout.train_compile_traced"] = Fig(Sum(T(f"{TL}/train.log", r"traced and lowered in ([\d.]+) s"),
                                               T(f"{TL}/train.log", r"then XLA's compile ([\d.]+) s")), "{:.1f}")
    f["layout.train_lower_traced"] = Fig(T(f"{TL}/train.log", r"traced and lowered in ([\d.]+) s"), "{:.1f}")
    f["layout.train_lower_before"] = Fig(T(f"{H1}/5-train-beside-bench/train.log", r"traced and lowered in ([\d.]+) s"), "{:.1f}")
    f["train_h1.ratio"] = ratio(Agg(TRAIN_H1, "tokens_per_s", "mean_last", 5), J(BENCH_H1, "tokens_per_s"))
    ou = f"{H1}/4-muon-unrolled-batch16/opt_unrolled.json"
    muon_extra = Sub(J(ou, "[variant=muon_head].ms"), J(ou, "[variant=adamw].ms"))
    f["muon_h1.one_gpu"] = ratio(Sum(J(UNROLLED_H1, "step_ms"), muon_extra), J(UNROLLED_H1, "step_ms"), 3)
    f["muon_h1.ns_ms"] = Fig(J(ou, "[variant=ns_now].ms"), "{:.2f}")
    f["muon_h1.muon_ms"] = Fig(J(ou, "[variant=muon_head].ms"), "{:.2f}")
    f["muon_h1.rank_ms"] = Fig(J(ou, "[variant=ns_rank_of_8].ms"), "{:.2f}")
    f["muon_h1.ranks_gather"] = Fig(J(ou, "[variant=ns_rank_of_8].all_gather_ms_modelled"), "{:.2f}")
    rank_extra = Sum(Sub(muon_extra, J(ou, "[variant=ns_now].ms")), J(ou, "[variant=ns_rank_of_8].ms"))
    f["muon_h1.ranks_overlapped"] = ratio(Sum(J(UNROLLED_H1, "step_ms"), rank_extra), J(UNROLLED_H1, "step_ms"), 3)
    f["muon_h1.ranks_exposed"] = ratio(Sum(J(UNROLLED_H1, "step_ms"), rank_extra,
                                           J(ou, "[variant=ns_rank_of_8].all_gather_ms_modelled")),
                                       J(UNROLLED_H1, "step_ms"), 3)
    return f


# figures README.md states that are no measurement: the chips' specs and the H200's matmul rate
README_CONSTANTS = ("989 TFLOP/s", "816 TFLOP/s")


def spec(results: Path) -> Spec:
    return Spec(tables={t.name: t for t in tables()}, figures=figures(), readme_constants=README_CONSTANTS,
                results=results)
