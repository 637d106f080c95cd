"""The glue between kernels, per source region: k3-small's train step compiled for an H200.

    python -m benchmarks.tools.glue_regions --out glue.txt [--hlo step.hlo] [--json glue.json] [overrides]
    python -m benchmarks.tools.glue_regions --micro --out micro.txt [model.attn_res_impl=xla]  # AttnRes + norms alone
    python -m benchmarks.tools.glue_regions --from-hlo step.hlo     # an HLO written by train_step.py --hlo

Compiles `configs/k3-small.yaml`'s train step (8 x 4096, one micro-batch, one device, AdamW) with
XLA:GPU for a compile-only H200 on this machine (`train.plan.target`; the `[plan]` extra), with
machine-code optimisation off (fusion, layout and scheduling, what this counts, come before it;
about 10 minutes on a busy 2-core CPU), then reads the optimised HLO: every kernel the step
launches, each while body counted as many times as XLA knows it runs. A kernel is a top-level
instruction of a computation the GPU runs instruction by instruction (the entry, while bodies,
called and branch computations): a fusion, a custom call, a copy, a sort, ... Matmuls (cuBLAS /
Triton GEMM fusions, dot custom calls) are left out; custom kernels (Triton/Mosaic: KDA, AttnRes,
flash attention) are counted beside the fusions ("custom"). Per kernel: bytes read (its
operands; an operand read only through slices counts as the slices, a buffer updated in place
as the update) + written (its result), what a memory-bound kernel costs at HBM speed (for a
custom kernel an upper bound: all of its operands and results once), and the fp32 bytes it writes.

Each kernel is put against the source that made it: the most common innermost stack frame in
this repository among the instructions it fuses that compute something (`benchmarks/tools/hlo_sources.py`),
grouped into regions (AttnRes, RMSNorm, KDA prologue, ...; a norm goes to its caller's region
unless the caller is the residual stream), and split forward / backward by its op_name
(backward ops are under `transpose(`; the forward recomputed under remat counts as forward).
The figures are XLA:GPU's program, not a profile: they say how many kernels and bytes, not how
long each takes; `bytes / 4.8 TB/s` is the floor for a memory-bound kernel
(`benchmarks/tools/glue_calibrate.py` scales them by a profile of the same program).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import time
from typing import NamedTuple

from benchmarks.tools.hlo_sources import hlo_sources

DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "s32": 4, "u32": 4, "s16": 2,
               "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
               "f4e2m1fn": 1, "f8e8m0fnu": 1}
SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
HBM_BYTES_PER_S = 4.8e12  # H200

# (region, test on "path:line function") in order: the first match names the region
REGIONS = [
    ("AttnRes", lambda s: "layers/attnres.py" in s or "ops/attnres_mix.py" in s),
    ("RMSNorm (layer input, final)", lambda s: "layers/norms.py" in s),
    ("KDA prologue/epilogue", lambda s: "layers/kda.py" in s or "layers/conv.py" in s),
    ("KDA kernels (glue inside)", lambda s: "ops/kda" in s or "ops/delta_rule" in s or "ops/deltanet" in s),
    ("MoE router/QB", lambda s: any(f in s for f in ("layers/router.py", "layers/qb.py"))),
    ("MoE dispatch/experts", lambda s: any(f in s for f in ("layers/moe", "expert_pairs", "grouped_matmul",
                                                              "layers/activations.py", "expert_parallel"))),
    ("MLA / attention", lambda s: any(f in s for f in ("layers/mla.py", "layers/attention.py", "rope.py",
                                                        "flash_attention", "softmax_attn", "context_attn"))),
    ("loss / lm_head", lambda s: "chunked_loss" in s),
    ("embedding / model", lambda s: "k3jax/model.py" in s),
    ("block / scan carry", lambda s: "layers/block.py" in s or "token_sharding" in s),
    ("dense projections", lambda s: "layers/common.py" in s),
    ("optimizer", lambda s: s.startswith(("train/optimizer", "train/muon", "train/step.py:82"))
     or "optax" in s),
    ("train step", lambda s: s.startswith("train/")),
]
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
             "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
             "get-dimension-size", "async-done", "copy-done", "send-done", "recv-done", "all-reduce-done",
             "all-gather-done", "collective-permute-done"}
MATMUL_CALLS = re.compile(r"cublas|gemm|matmul|\$dot|cudnn", re.IGNORECASE)


def nbytes(text: str) -> int:
    total = 0
    for dt, dims in SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dt]
    return total


def f32_bytes(text: str) -> int:
    return sum(nbytes(f"f32[{dims}]") for dt, dims in SHAPE.findall(text) if dt == "f32")


def split_computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps, cur, entry = {}, None, None
    for line in text.split("\n"):
        m = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if line.startswith("}"):
            cur = None
        elif cur is not None and line.strip():
            comps[cur].append(line)
    return comps, entry


INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")


def parse_instr(line: str):
    """-> (name, result type text, opcode, rest) or None. The result type may be a tuple."""
    m = INSTR.match(line)
    if not m:
        return None
    return m.group(1), m.group(2), m.group(3), m.group(4)


def operand_names(rest: str) -> list[str]:
    """The %names an instruction reads (optimised HLO prints operands without their types)."""
    return re.findall(r"%([\w.\-]+)", operand_text(rest))


def operand_text(rest: str) -> str:
    """The operand list of an instruction (up to its matching closing parenthesis)."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i]
    return rest


def kernel_bytes(rest: str, rtype: str, body: list[str], types: dict[str, str]) -> tuple[int, int]:
    """(bytes read, bytes written) by one kernel. An operand the fused computation reads only
    through slices counts as those slices; the buffer a dynamic-update-slice updates in place
    (its operand 0, aliased to the result) is neither read nor rewritten: only the update is."""
    operands = [nbytes(types.get(o, "")) for o in operand_names(rest)]
    if not body:
        return sum(operands), nbytes(rtype)
    instrs = [p for p in map(parse_instr, body) if p]
    params = {}
    for name, t, op, r in instrs:
        if op == "parameter":
            params[name] = int(re.match(r"(\d+)", r).group(1))
    users = collections.defaultdict(list)
    for name, t, op, r in instrs:
        for i, o in enumerate(operand_names(r)):
            users[o].append((op, i, t, name))
    read = 0
    in_place, updates = set(), 0
    for pname, idx in params.items():
        us = users.get(pname, [])
        full = operands[idx] if idx < len(operands) else 0
        if us and all(op in ("dynamic-slice", "slice") for op, *_ in us):
            read += min(full, sum(nbytes(t) for _, _, t, _ in us))
        elif us and all(op == "dynamic-update-slice" and i == 0 for op, i, *_ in us):
            in_place.add(pname)
        else:
            read += full
    written = nbytes(rtype)
    if in_place:
        dus = [(t, r) for name, t, op, r in instrs if op == "dynamic-update-slice"
               and operand_names(r)[0] in in_place]
        buffers = sum(nbytes(t) for t, _ in dus)
        upd = 0
        for t, r in dus:
            u = operand_names(r)[1]
            upd += nbytes(next((tt for n, tt, _, _ in instrs if n == u), ""))
        written = written - buffers + upd
    return read, written


def kernel_multiplicities(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """Computations the GPU steps through, with how many times each runs per step."""
    mult = collections.Counter({entry: 1})
    order = [entry]
    seen = {entry}
    while order:
        comp = order.pop(0)
        for line in comps[comp]:
            p = parse_instr(line)
            if not p:
                continue
            _, _, op, rest = p
            callees = []
            if op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                n = int(trip.group(1)) if trip else 1
                body = re.search(r"body=%([\w.\-]+)", rest).group(1)
                cond = re.search(r"condition=%([\w.\-]+)", rest).group(1)
                callees = [(body, n), (cond, n + 1)]
            elif op == "call":
                callees = [(c, 1) for c in re.findall(r"to_apply=%([\w.\-]+)", rest)]
            elif op == "conditional":
                # each branch counted once: an upper bound where only one runs
                callees = [(c, 1) for c in re.findall(r"%([\w.\-]+)", re.search(
                    r"branch_computations=\{([^}]*)\}", rest).group(1))] if "branch_computations" in rest else []
                callees += [(c, 1) for c in re.findall(r"(?:true|false)_computation=%([\w.\-]+)", rest)]
            elif op == "async-start":
                callees = [(c, 1) for c in re.findall(r"calls=%([\w.\-]+)", rest)]
            for c, n in callees:
                if c in comps:
                    mult[c] += mult[comp] * n
                    if c not in seen:
                        seen.add(c)
                        order.append(c)
    return mult


def classify(op: str, rest: str, fused_body: list[str]) -> str:
    """"matmul" | "kernel" (Triton/Mosaic custom kernels) | "collective" | "glue"."""
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else ""
        if MATMUL_CALLS.search(target):
            return "matmul"
        return "kernel"
    if op == "fusion":
        if "kind=kCustom" in rest and ('"kind":"__triton_gemm' in rest or "__cublas" in rest
                                       or '"kind":"__cudnn' in rest or any(" dot(" in l for l in fused_body)):
            return "matmul"
        if any(" dot(" in l or " convolution(" in l for l in fused_body):
            return "matmul"
        return "glue"
    if op in ("dot", "convolution"):
        return "matmul"
    if re.match(r"all-|reduce-scatter|collective|send|recv|ragged-all", op):
        return "collective"
    return "glue"


PLUMBING = {"parameter", "constant", "bitcast", "broadcast", "convert", "copy", "tuple", "get-tuple-element",
            "dynamic-update-slice", "dynamic-slice", "slice", "reshape", "transpose", "iota", "select", "compare"}
GENERIC = ("k3jax/model.py:145", "k3jax/model.py:128", "train/step.py:79")  # the scans: where their plumbing comes from


def fusion_source(name: str, body: list[str], sources: dict[str, str]) -> str | None:
    """Where a kernel comes from. A fusion's own metadata is its root's, often the scan's
    dynamic-update-slice that stores a result for the backward pass (model.py's scan line):
    take instead the most common source among the fused instructions that compute something
    (not data movement), ignoring the scans' own lines; its root's when there are none."""
    votes = collections.Counter()
    for line in body:
        p = parse_instr(line)
        if not p or p[2] in PLUMBING:
            continue
        src = sources.get(p[0])
        if src and not src.startswith(GENERIC):
            votes[src] += 1
    if votes:
        return votes.most_common(1)[0][0]
    return sources.get(name)


def region_of(src: str | None) -> str:
    """src: "frame < caller < ..." (innermost first). A norm belongs to its caller's region
    (KDA's l2 norm and output norm, MLA's and the latent MoE's norms) unless the caller is the
    decoder layer or the model (the residual-stream norms: their own row)."""
    if src is None:
        return "(no source)"
    if src.startswith(GENERIC):
        return "scan stacking (saved, sliced)"
    frames = src.split(" < ")
    if "layers/norms.py" in frames[0]:
        caller = next((f for f in frames[1:] if "layers/norms.py" not in f), "")
        if caller and not caller.startswith(("k3jax/layers/block.py", "k3jax/model.py", "benchmarks/")):
            frames = [caller]
    for name, test in REGIONS:
        if test(frames[0]):
            return name
    if frames[0].startswith("benchmarks/tools/glue_regions.py") and frames[0].endswith("micro_attn_res"):
        return "AttnRes"
    if frames[0].startswith("benchmarks/tools/glue_regions.py") and frames[0].endswith("micro_rms_norm"):
        return "RMSNorm (layer input, final)"
    if frames[0].startswith("benchmarks/tools/glue_regions.py"):
        return "micro: stand-ins, scan"
    return "other: " + frames[0].split(":")[0]


class Kernel(NamedTuple):
    """One kernel XLA emitted, as `kernels` reads it from the optimized HLO."""
    name: str      # the HLO instruction (a profile's hlo_op)
    runs: int      # launches per step (while bodies: as many times as XLA knows they run)
    kind: str      # classify(): "matmul" | "kernel" | "collective" | "glue"
    read: int      # bytes per launch (kernel_bytes)
    written: int
    rtype: str     # its result type (a fusion's root's)
    converts: int  # fp32 converts inside a fusion
    source: str | None  # fusion_source(): "path:line function < caller < ..." (3 frames)
    phase: str     # "fwd" | "bwd" (op_name under transpose(; a remat recompute is fwd)


def kernels(text: str):
    """Every kernel of a step's optimized HLO text (top-level instructions of the computations
    the GPU steps through, no plumbing, no AllocateBuffer), as `Kernel`s."""
    comps, entry = split_computations(text)
    sources = hlo_sources(text, depth=3)
    for comp, n in kernel_multiplicities(comps, entry).items():
        types = {}
        for line in comps[comp]:
            p = parse_instr(line)
            if p:
                types[p[0]] = p[1]
        for line in comps[comp]:
            p = parse_instr(line)
            if not p:
                continue
            name, rtype, op, rest = p
            if op in NO_KERNEL or op.endswith("-done") or 'custom_call_target="AllocateBuffer"' in rest:
                continue  # AllocateBuffer: an uninitialised buffer (lax.empty), no kernel
            called = re.search(r"calls=%([\w.\-]+)", rest)
            is_fusion = op in ("fusion", "fusion-start")  # fusion-start: an async fusion (its -done is no kernel)
            body = comps.get(called.group(1), []) if (called and is_fusion) else []
            kind = classify("fusion" if is_fusion else op, rest, body)
            root = next((l for l in body if l.lstrip().startswith("ROOT")), "")
            if root:  # the fused computation's result (an async fusion's own result also lists its operands)
                rtype = parse_instr(root)[1]
            read, written = kernel_bytes(rest, rtype, body, types)
            converts = sum(1 for l in body if " convert(" in l and ("f32[" in l.split(" = ")[1].split(" convert(")[0]
                                                                     or "f32[" in l.split(" convert(")[1]))
            phase = "bwd" if re.search(r'op_name="[^"]*transpose\(', rest) else "fwd"
            yield Kernel(name, n, kind, read, written, rtype, converts, fusion_source(name, body, sources), phase)


def analyse(text: str) -> dict:
    rows = collections.defaultdict(lambda: collections.Counter())
    by_line = collections.defaultdict(lambda: collections.Counter())
    totals = collections.Counter()
    for k in kernels(text):
        n = k.runs
        totals[{"kernel": "custom"}.get(k.kind, k.kind) + " kernels"] += n
        if k.kind not in ("glue", "kernel"):
            continue
        line_key = " < ".join((k.source or "(no source)").split(" < ")[:2])
        for key, table in ((region_of(k.source), rows), (line_key, by_line)):
            t = table[key]
            t["kernels"] += n
            t[k.phase + " kernels"] += n
            t["bytes"] += (k.read + k.written) * n
            t["f32 written"] += f32_bytes(k.rtype) * n
            t["converts"] += k.converts * n
            t["custom"] += n * (k.kind == "kernel")
        if k.kind == "kernel":
            totals["custom kernel bytes"] += (k.read + k.written) * n
            continue
        totals["glue bytes"] += (k.read + k.written) * n
        totals["glue f32 written"] += f32_bytes(k.rtype) * n
        totals["glue converts"] += k.converts * n
    return {"totals": dict(totals), "regions": {k: dict(v) for k, v in rows.items()},
            "lines": {k: dict(v) for k, v in by_line.items()}}


def report(res: dict, top_lines: int = 40) -> str:
    out = []
    t = res["totals"]
    out.append("kernels per step: " + ", ".join(f"{k} {v}" for k, v in sorted(t.items()) if "kernels" in k))
    out.append(f"glue: {t.get('glue bytes', 0) / 1e9:.1f} GB read+written "
               f"({t.get('glue bytes', 0) / HBM_BYTES_PER_S * 1e3:.1f} ms at 4.8 TB/s), "
               f"{t.get('glue f32 written', 0) / 1e9:.1f} GB of it written as fp32, "
               f"{t.get('glue converts', 0)} fp32 converts inside glue fusions; custom (Triton/Mosaic) kernels "
               f"{t.get('custom kernel bytes', 0) / 1e9:.1f} GB (operands + results: an upper bound)")
    out.append("rows: non-matmul kernels (glue fusions and custom kernels, `custom` of them) by source region")
    out.append("")
    out.append(f"{'region':<28} {'kernels':>8} {'fwd':>5} {'bwd':>5} {'custom':>6} {'GB r+w':>8} {'ms@4.8':>7} "
               f"{'GB f32 w':>9} {'cvt':>6}")
    for reg, r in sorted(res["regions"].items(), key=lambda kv: -kv[1]["bytes"]):
        out.append(f"{reg[:28]:<28} {r['kernels']:>8} {r.get('fwd kernels', 0):>5} {r.get('bwd kernels', 0):>5} "
                   f"{r.get('custom', 0):>6} "
                   f"{r['bytes'] / 1e9:>8.2f} {r['bytes'] / HBM_BYTES_PER_S * 1e3:>7.2f} "
                   f"{r['f32 written'] / 1e9:>9.2f} {r['converts']:>6}")
    out.append("")
    out.append(f"top {top_lines} source lines by glue bytes")
    for src, r in sorted(res["lines"].items(), key=lambda kv: -kv[1]["bytes"])[:top_lines]:
        out.append(f"{r['kernels']:>6} {r['bytes'] / 1e9:>8.2f} GB {r['f32 written'] / 1e9:>6.2f} f32  {src[:130]}")
    return "\n".join(out)


@contextlib.contextmanager
def k3_small_on_h200(overrides: list[str], batch: int):
    """configs/k3-small.yaml (with `overrides`) on one compile-only H200, `batch` rows in one
    micro-batch: yields (cfg, setup) with the target's mesh and planning context set
    (`train.plan.target`; the `[plan]` extra). Compile inside it with train.xla_flags.GPU_XLA_OPTIONS."""
    import jax

    from k3jax.chips import CHIPS
    from k3jax.config import load_config
    from k3jax.ops.planning import planning_for
    from k3jax.sharding.mesh import AXES, mesh_shape
    from train.plan.target import target_mesh
    from train.setup import prepare

    cfg = load_config("configs/k3-small.yaml", ["mesh.num_devices=1", f"train.batch_size={batch}",
                                                "train.micro_batches=1"] + overrides)
    sizes = mesh_shape(cfg.mesh, 1)
    mesh = target_mesh(CHIPS["h200"], 1, tuple(sizes[a] for a in AXES), AXES)
    with planning_for("gpu", target_compiler=True):
        setup = prepare(cfg, mesh=mesh)
        with jax.set_mesh(mesh):
            yield cfg, setup


def compile_step_text(overrides: list[str], batch: int) -> tuple[str, float]:
    from train.plan.compile import PLAN_CODEGEN_OPTIONS
    from train.xla_flags import GPU_XLA_OPTIONS

    t0 = time.perf_counter()
    with k3_small_on_h200(overrides, batch) as (cfg, setup):
        lowered = setup.train_step(cfg).lower(*setup.abstract_args(cfg))
        compiled = lowered.compile(compiler_options=GPU_XLA_OPTIONS | PLAN_CODEGEN_OPTIONS)
    return compiled.as_text(), time.perf_counter() - t0


def compile_micro_text(batch: int, seq: int = 4096, d: int = 1536, layers: int = 16, block_size: int = 4,
                       impl: str = "auto"):
    """AttnRes and the residual-stream norms alone, as k3-small runs them: `layers` decoder
    layers (two AttnRes sites, two RMSNorms each, blocks closed every `block_size` layers)
    scanned `block_size` at a time, remat as model.remat=save_dots (a checkpoint per layer and
    per scan body), the mixer and the FFN each stood in for by one [d, d] bf16 matmul; the
    output site and the final norm; forward and backward. Compiles in about a minute where the
    whole step takes ten; the AttnRes and RMSNorm rows are the step's, per layer."""
    import jax
    import jax.numpy as jnp

    from k3jax.chips import CHIPS
    from k3jax.layers.attnres import attn_res_pass, push_block
    from k3jax.ops.attnres_mix import resolve_impl
    from k3jax.ops.planning import planning_for
    from k3jax.layers.norms import rms_norm
    from k3jax.model import REMAT_POLICIES
    from train.plan.compile import PLAN_CODEGEN_OPTIONS
    from train.plan.target import target_mesh
    from k3jax.sharding.mesh import AXES
    from train.xla_flags import GPU_XLA_OPTIONS

    eps, policy = 1e-5, REMAT_POLICIES["save_dots"]
    nb = -(-layers // block_size)

    # named wrappers: a custom VJP's backward ops carry their call site's frames, and these
    # names put them in the AttnRes and RMSNorm rows (region_of)
    def micro_attn_res(blocks, n, prefix, gamma, w):
        return attn_res_pass(blocks, n, prefix, gamma * w, eps, resolve_impl(impl, blocks, prefix))

    def micro_rms_norm(h, w):
        return rms_norm(h, w, eps)

    def layer(p, carry, push: bool):
        prefix, blocks, n = carry
        h, blocks = micro_attn_res(blocks, n, prefix, p["attn_gamma"], p["attn_w"])
        if push:
            blocks, n = push_block(blocks, n, prefix)
            prefix = jnp.zeros_like(prefix)
        prefix = prefix + micro_rms_norm(h, p["in_norm"]) @ p["mixer"]
        h, blocks = micro_attn_res(blocks, n, prefix, p["mlp_gamma"], p["mlp_w"])
        return prefix + micro_rms_norm(h, p["post_norm"]) @ p["ffn"], blocks, n

    def body(carry, unit):
        for j in range(block_size):
            pj = jax.tree.map(lambda a: a[j], unit)
            carry = jax.checkpoint(lambda p, c, push=(j == 0): layer(p, c, push), policy=policy,
                                   prevent_cse=False)(pj, carry)
        return carry, None

    def loss(params, x):
        carry = (x, jnp.zeros((nb,) + x.shape, x.dtype), jnp.zeros((), jnp.int32))
        carry, _ = jax.lax.scan(jax.checkpoint(body, policy=policy, prevent_cse=False), carry, params["layers"])
        prefix, blocks, n = carry
        h = micro_attn_res(blocks, n, prefix, params["out_gamma"], params["out_w"])[0]
        y = micro_rms_norm(h, params["norm"])
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    R = layers // block_size
    f32, bf16 = jnp.float32, jnp.bfloat16
    vec = lambda: jax.ShapeDtypeStruct((R, block_size, d), f32)  # noqa: E731
    params = {"layers": {"attn_gamma": vec(), "attn_w": vec(), "mlp_gamma": vec(), "mlp_w": vec(),
                         "in_norm": vec(), "post_norm": vec(),
                         "mixer": jax.ShapeDtypeStruct((R, block_size, d, d), bf16),
                         "ffn": jax.ShapeDtypeStruct((R, block_size, d, d), bf16)},
              "out_gamma": jax.ShapeDtypeStruct((d,), f32), "out_w": jax.ShapeDtypeStruct((d,), f32),
              "norm": jax.ShapeDtypeStruct((d,), f32)}
    mesh = target_mesh(CHIPS["h200"], 1, (1,) * len(AXES), AXES)  # one compile-only H200 (Triton needs its chip)
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    put = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), t)  # noqa: E731
    t0 = time.perf_counter()
    # planning for the GPU: AttnRes takes its GPU path (model.attn_res_impl)
    with planning_for("gpu", target_compiler=True), jax.set_mesh(mesh):
        lowered = jax.jit(jax.value_and_grad(loss)).lower(put(params),
                                                          put(jax.ShapeDtypeStruct((batch, seq, d), bf16)))
    compiled = lowered.compile(compiler_options=GPU_XLA_OPTIONS | PLAN_CODEGEN_OPTIONS)
    return compiled.as_text(), time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-hlo", default=None, help="analyse this optimised HLO text instead of compiling")
    ap.add_argument("--hlo", default=None, help="keep the compiled step's optimised HLO here")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", action="store_true", help="AttnRes and the norms alone (compile_micro_text)")
    ap.add_argument("--out", default=None, help="write the table here too")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.from_hlo:
        text, secs = open(a.from_hlo).read(), 0.0
    else:
        impl = next((o.split("=", 1)[1] for o in a.overrides if o.startswith("model.attn_res_impl=")), "auto")
        text, secs = compile_micro_text(a.batch, impl=impl) if a.micro else compile_step_text(a.overrides, a.batch)
        if a.hlo:
            open(a.hlo, "w").write(text)
    res = analyse(text)
    res["compile_s"] = round(secs, 1)
    table = report(res)
    what = "AttnRes + RMSNorm micro (16 layers, stand-in mixers)" if a.micro else "k3-small train step"
    head = (f"{what}, {a.batch} x 4096, XLA:GPU for a compile-only H200"
            f"{' (compile ' + str(round(secs)) + ' s)' if secs else ''}; overrides: {a.overrides}")
    print(head + "\n" + table)
    if a.out:
        open(a.out, "w").write(head + "\n" + table + "\n")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
