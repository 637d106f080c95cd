"""The expert-parallel exchange in XLA:GPU's compiled schedule: which collectives are asynchronous,
and which GEMMs run between each one's start and done.

Compiles one MoE layer of a config (forward and backward, remat none or --remat) for a GPU cluster without
devices (a deviceless H200 topology: JAX_PLATFORMS=cpu works, no GPU needed) and reads the
scheduled HLO: every `*-start` / `*-done` pair in program order, with the compute XLA placed in
between. Stages are named in the code (`ep_dispatch<c>`, `ep_experts<c>`, `ep_combine<c>` for
chunk c, `shared_experts`), so the report says whose GEMMs hide whose transfer.

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python -m benchmarks.tools.a2a_schedule \\
        --config configs/k3.yaml --hosts 2 --mesh expert=2,tensor=8 [--rows 1] [--seq 4096] \\
        [--flags lhs|default] [--remat none|full] [--hlo out.txt] [key=value ...]

--remat full checkpoints the layer with the model's policy (k3jax.model.REMAT_POLICIES), so the
backward pass runs its forward again; the summary's `exchange_collectives` counts the
collectives issued by the exchange's stages (ep_dispatch*, ep_combine*, forward, recompute and
backward): with model.moe.ep_keep_results and ep_keep_received (k3.yaml's defaults) the recompute
issues none, and the count equals --remat none's; set both false to see the recompute's.

The GPU is `--chip` (default h200), described to XLA:GPU by `k3jax.chips`. --flags lhs compiles with XLA's latency-hiding scheduler (what `train` sets on GPUs,
train/xla_flags.py); default: XLA's own
defaults (no latency-hiding scheduler: most collectives end up synchronous).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time


DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s64": 8, "u8": 1, "s8": 1, "pred": 1,
               "f8e4m3fn": 1}
SCOPES = re.compile(r"(ep_dispatch\d+|ep_experts\d+|ep_combine\d+|shared_experts)")


def _instructions(hlo: str) -> list[str]:
    """The entry computation's instructions in schedule order."""
    lines, inside = [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            if " = " in line:
                lines.append(line.strip())
    return lines


def _name(line):
    return line.split(" = ")[0].replace("ROOT ", "").strip().lstrip("%")


def _opcode(line):
    m = re.search(r" ([a-z][a-z0-9\-]*)\(", line.split(" = ", 1)[1])
    return m.group(1) if m else "?"


def _bytes(line, by_name=None):
    """Bytes a collective sends: its first operand's array (a start's result tuple lists it first)."""
    if by_name is not None:
        args = line.split(" = ", 1)[1]
        first = re.search(r"\(%([\w.\-]+)", args)
        if first and first.group(1) in by_name:
            return _bytes(by_name[first.group(1)])
    m = re.search(r"(\w+)\[([\d,]*)\]", line.split(" = ", 1)[1])
    if not m:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * DTYPE_BYTES.get(m.group(1), 4)


def _scope(line, by_name=None, depth=8):
    """The named stage an instruction belongs to, from its op_name; an instruction without one
    (XLA's ragged all-to-all keeps none) takes its nearest operand's."""
    m = re.search(r'op_name="([^"]*)"', line)
    tags = SCOPES.findall(m.group(1)) if m else []
    if tags or by_name is None or depth == 0:
        bwd = m is not None and "transpose(" in m.group(1)
        return (tags[-1] if tags else "other") + (" (bwd)" if bwd else "")
    args = line.split(" = ", 1)[1]
    for name in re.findall(r"%([\w.\-]+)", args[args.find("("):]):
        if name in by_name:
            found = _scope(by_name[name], by_name, depth - 1)
            if not found.startswith("other"):
                return found
    return "other"


def _in_exchange(line, by_name) -> bool:
    """Whether a collective is one of the exchange's (issued in ep_dispatch* / ep_combine*): by its
    own op_name, or by its operands' for one without (XLA's ragged all-to-all)."""
    m = re.search(r'op_name="([^"]*)"', line)
    scope = (SCOPES.findall(m.group(1)) or ["other"])[-1] if m else _scope(line, by_name)
    return scope.startswith(("ep_dispatch", "ep_combine"))


def _is_gemm(line):
    return "gemm" in line or "__cublas" in line or "__cudnn$matmul" in line


COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")


def schedule_report(hlo: str, min_bytes: int = 1 << 20) -> dict:
    ins = _instructions(hlo)
    ops = [_opcode(x) for x in ins]
    names = [_name(x) for x in ins]
    by_name = dict(zip(names, ins))
    pairs, sync = [], []
    for i, op in enumerate(ops):
        if op in COLLECTIVES:
            sync.append({"op": op, "bytes": _bytes(ins[i], by_name), "scope": _scope(ins[i], by_name)})
        if not op.endswith("-start") or op[:-6] not in COLLECTIVES:
            continue
        kind = op[:-6]
        j = next(j for j in range(i + 1, len(ins))
                 if ops[j] == kind + "-done" and re.search("%" + re.escape(names[i]) + r"[,)]", ins[j]))
        gemms = collections.Counter(_scope(ins[x]) for x in range(i + 1, j) if _is_gemm(ins[x]))
        pairs.append({"op": kind, "name": names[i], "bytes": _bytes(ins[i], by_name), "scope": _scope(ins[i], by_name),
                      "ops_between": j - i - 1, "gemms_between": dict(gemms)})
    big = [p for p in pairs if p["bytes"] >= min_bytes]
    hidden = [p for p in big if p["gemms_between"]]
    big_sync = [s for s in sync if s["bytes"] >= min_bytes]
    exchange = collections.Counter(op[:-6] if op.endswith("-start") else op for op, line in zip(ops, ins)
                                   if (op in COLLECTIVES or op[:-6] in COLLECTIVES and op.endswith("-start"))
                                   and _in_exchange(line, by_name))
    return {"async": pairs, "sync": sync,
            "summary": {"async_collectives": len(pairs), "sync_collectives": len(sync),
                        "exchange_collectives": dict(sorted(exchange.items())),
                        f"async_over_{min_bytes >> 20}MiB": len(big),
                        "with_gemms_inside": len(hidden),
                        "bytes_async": sum(p["bytes"] for p in big),
                        "bytes_with_gemms_inside": sum(p["bytes"] for p in hidden),
                        "bytes_sync": sum(s["bytes"] for s in big_sync)}}


def _print(rep: dict, min_bytes: int):
    print(f"{'collective':18s} {'issued by':26s} {'MiB sent':>8s} {'ops':>4s}  GEMMs scheduled between start and done")
    for p in rep["async"]:
        if p["bytes"] < min_bytes:
            continue
        g = ", ".join(f"{n}x {k}" for k, n in sorted(p["gemms_between"].items())) or "-"
        print(f"{p['op']:18s} {p['scope']:26s} {p['bytes'] / 2**20:8.1f} {p['ops_between']:4d}  {g}")
    for s in rep["sync"]:
        if s["bytes"] >= min_bytes:
            print(f"{s['op']:18s} {s['scope']:26s} {s['bytes'] / 2**20:8.1f}  SYNCHRONOUS")
    print(json.dumps(rep["summary"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/k3.yaml")
    p.add_argument("--hosts", type=int, default=2, help="nodes of the chip's GPUs (8)")
    p.add_argument("--chip", default="h200", help="a GPU of k3jax.chips")
    p.add_argument("--mesh", default="expert=2,tensor=8", help="axis=size for data,fsdp,expert,context,tensor")
    p.add_argument("--rows", type=int, default=1, help="rows per device")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--flags", choices=("lhs", "default"), default="lhs")
    p.add_argument("--remat", choices=("none", "full", "save_dots"), default="none",
                   help="checkpoint the layer with the model's policy (the backward runs its forward again)")
    p.add_argument("--hlo", default=None, help="write the compiled HLO here")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--min-mib", type=float, default=1.0)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax.chips import CHIPS
    from k3jax.config import load_config
    from k3jax.layers.moe import StableLatentMoE
    from k3jax.ops.mesh_axes import AXES, BATCH_AXES, CONTEXT
    from k3jax.ops.planning import planning_for
    from k3jax.sharding.rules import param_specs
    from train.xla_flags import GPU_SCHEDULER_OPTIONS

    from k3jax.model import REMAT_POLICIES

    cfg = load_config(a.config, [f"model.remat={a.remat}"] + a.overrides)
    shape = dict(data=1, fsdp=1, expert=1, context=1, tensor=1)
    for item in filter(None, a.mesh.split(",")):
        k, v = item.split("=")
        shape[k.strip()] = int(v)
    n = 1
    for v in shape.values():
        n *= v
    chip = CHIPS[a.chip]
    if n != a.hosts * chip.devices_per_node:
        raise SystemExit(f"--mesh has {n} devices, --hosts {a.hosts} x {chip.devices_per_node} GPUs is not that")
    topo = topologies.get_topology_desc(platform="cuda", target_config=chip.gpu_target_config(),
                                        topology=chip.gpu_topology(n))
    mesh = topologies.make_mesh(topo, tuple(shape[x] for x in AXES), AXES)
    mesh = jax.sharding.Mesh(mesh.devices, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))

    abstract = nnx.eval_shape(lambda: StableLatentMoE(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    specs = param_specs(state, mesh)
    params = jax.tree.map(lambda s, v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, s)),
                          specs, nnx.to_pure_dict(state), is_leaf=lambda s: isinstance(s, P))
    rows = a.rows * shape["data"] * shape["fsdp"] * shape["expert"]
    x = jax.ShapeDtypeStruct((rows, a.seq, cfg.model.d_model), jnp.dtype(cfg.model.compute_dtype),
                             sharding=NamedSharding(mesh, P(BATCH_AXES, CONTEXT, None)))
    bias = jax.ShapeDtypeStruct((cfg.model.moe.num_experts,), jnp.float32, sharding=NamedSharding(mesh, P()))

    def loss(params, x, bias):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, params)
        y, _ = nnx.merge(graphdef, st)(x, bias)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grad = jax.grad
    if a.remat != "none":  # prevent_cse: in the model the recompute runs in the backward's scan, apart from the
        # forward; one layer's program would otherwise let XLA merge the two. The loss is returned, as
        # the train step does, so the forward is not dead code beside the recompute
        loss = jax.checkpoint(loss, policy=REMAT_POLICIES[a.remat], prevent_cse=True)
        grad = jax.value_and_grad
    options = GPU_SCHEDULER_OPTIONS if a.flags == "lhs" else None
    t0 = time.time()
    with planning_for("gpu"), jax.set_mesh(mesh):
        compiled = jax.jit(grad(loss, argnums=(0, 1))).lower(params, x, bias).compile(options)
    hlo = compiled.as_text()
    print(f"{a.config}: one MoE layer, forward + backward (remat {a.remat}), {a.rows} x {a.seq} tokens per device, "
          f"mesh {shape} on {a.hosts} nodes of {chip.name}; XLA flags: {options or 'defaults'}; compiled in {time.time() - t0:.0f} s")
    rep = schedule_report(hlo, int(a.min_mib * 2**20))
    _print(rep, int(a.min_mib * 2**20))
    if a.hlo:
        open(a.hlo, "w").write(hlo)
    if a.json:
        open(a.json, "w").write(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
