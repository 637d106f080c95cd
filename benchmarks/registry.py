"""The benchmarks benchmarks/run.py runs, by name: module, default arguments, how it writes rows.

Adding one: put the module in the folder of what it measures (ops/, step/, decode/, checks/),
give it a `main()` that takes its output path as `--json PATH` (rows as one JSON list: write
them with `benchmarks.bench_util.Rows`) or as `--out DIR`, and add a line here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bench:
    module: str
    defaults: tuple[str, ...] = ()  # arguments before the caller's (a later flag wins)
    output: str | None = "--json"  # "--json": a rows file; "--out": a folder; None: stdout's JSON lines
    doc: str = ""


BENCHMARKS = {
    # operators
    "kda_op": Bench("benchmarks.ops.kda_op", doc="chunk_kda forward / forward+backward per path"),
    "attention": Bench("benchmarks.ops.attention", doc="MLA's flash kernel against the dense XLA form"),
    "attnres_op": Bench("benchmarks.ops.attnres_op", doc="one AttnRes site: XLA forms and kernels"),
    "grouped_matmul": Bench("benchmarks.ops.grouped_matmul", doc="the routed experts' grouped matmul per impl"),
    "short_conv": Bench("benchmarks.ops.short_conv", doc="KDA's short conv backward: XLA against Pallas"),
    "glu_grad": Bench("benchmarks.ops.glu_grad", doc="the experts' GLU backward: XLA against Pallas"),
    "ep_exchange": Bench("benchmarks.ops.ep_exchange", output=None,
                         doc="the expert-parallel exchange on 2+ GPUs: correctness, then time ($OUT)"),
    "qk_clip_max_logits": Bench("benchmarks.ops.qk_clip_max_logits", output=None,
                                doc="QK-Clip's max-logit statistic: memory and time per form"),
    # the training step
    "train_step": Bench("benchmarks.step.train_step", doc="tokens/s, MFU, peak memory, compile time"),
    "k3_small_step": Bench("benchmarks.step.train_step",
                           ("--model", "k3-small", "--steps", "13", "mesh.num_devices=1", "train.batch_size=8"),
                           doc="the k3-small step BENCHMARKS.md times (8 x 4096, one micro-batch, 13 steps)"),
    "optimizer_step": Bench("benchmarks.step.optimizer_step", doc="the optimizer update alone: AdamW, Muon"),
    "memory_breakdown": Bench("benchmarks.step.memory_breakdown", output=None,
                              doc="compile-only memory of a step"),
    "tiny_cpu": Bench("benchmarks.step.tiny_cpu", output=None, doc="k3-tiny's compile and step time"),
    # decoding
    "long_decode": Bench("benchmarks.decode.long_decode", output="--out",
                         doc="long-context decode: hybrid against all-MLA"),
    "decode_kernels": Bench("benchmarks.decode.decode_kernels", output="--out",
                            doc="the kernels one decode step launches, from XLA:GPU's compile"),
    # GPU correctness checks (each verdict a PASS / FAIL line; `checks` runs them all)
    "checks": Bench("benchmarks.checks.all", output="--out", doc="every check below with its limits, < 10 min"),
    "kda_check": Bench("benchmarks.checks.kda_check", doc="fused KDA kernels against float64"),
    "decode_kernels_check": Bench("benchmarks.checks.decode_kernels_check",
                                  doc="the decode kernels against an fp32 form of their math"),
    "gmm_check": Bench("benchmarks.checks.gmm_check", doc="tokamax's grouped GEMMs per launch config"),
    "hf_crosscheck": Bench("benchmarks.checks.hf_crosscheck", output="--out",
                           doc="interchange against fla / transformers; export and import cost"),
    "kernel_tuning_check": Bench("benchmarks.checks.kernel_tuning_check", output=None,
                                 doc="train/kernel_tuning.py against the installed tokamax"),
}
