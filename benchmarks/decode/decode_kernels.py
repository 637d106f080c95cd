"""The kernels one decode step launches on an H200, counted from XLA:GPU's own compile, on a CPU.

    python -m benchmarks.decode.decode_kernels --model hybrid --out /tmp/dk/hybrid [key=value ...]
    python -m benchmarks.decode.decode_kernels --model all_mla --batch 12 --out /tmp/dk/mla12
    python -m benchmarks.decode.decode_kernels --from-dump /tmp/dk/hybrid --out /tmp/dk/hybrid   # recount only

Compiles k3-small's on-device decode loop as benchmarks/decode/long_decode.py runs it (`Runner.loop_fn`:
bf16 weights, `decode.decode_loop` over --steps steps, the cache donated) for one H200 without
one attached: the CUDA plugin's compiler on compile-only devices (`train.plan.target`), told the
CUDA driver and runtime versions of the benchmark machine (13.0, driver 580) so that XLA keeps
the command-buffer kinds it would keep there (without versions it drops cuBLAS, custom calls and
conditionals from CUDA graphs). The trace runs under `planning_for("gpu", target_compiler=True)`,
so the decode kernels (Pallas-Triton) are the real ones. Nothing is allocated or run.

What one decode step executes comes from two of XLA's dumps:
- the thunk sequence after XLA's thunk passes (`*thunk_sequence_after_thunk_passes.txt`): what
  the GPU runtime launches, command buffers (CUDA graphs) included. Per step (the body of the
  while loop over steps, nested loops times their trip counts): kernels by thunk kind, how many
  run inside command buffers, the command-buffer launches and the loop iterations the host
  drives. `kernels_per_step` is this count.
- the optimized HLO: every instruction that becomes a thunk, attributed to the source that made
  it (the innermost frame of its stack in a layer file: KDA, MLA, MoE, AttnRes, norms, the dense
  FFN, layer glue, model (embedding, head, cache bookkeeping), sampling), with its file and line.
  Its total (`hlo_kernels_per_step`) counts an async fusion once and a fusion emitting several
  kernels once, so it can differ a little from the thunk count.

Outputs in --out: summary.json, summary.md, hlo.txt (the optimized HLO) and thunks.txt.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax import decode  # noqa: E402
from k3jax.chips import CHIPS  # noqa: E402
from k3jax.config import load_config  # noqa: E402
from k3jax.model import K3Model  # noqa: E402
from k3jax.ops.planning import planning_for  # noqa: E402
from train.plan.target import compiler_unavailable  # noqa: E402
from k3jax.sharding.mesh import AXES  # noqa: E402

from benchmarks.decode.long_decode import all_mla  # noqa: E402

# instructions that become no thunk (aliases, views, host-known values)
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
        "replica-id", "opt-barrier", "add-dependency", "domain",
        "fusion-done", "async-done"}  # an async op's kernel is its start; the done only waits
# control flow: recursed into, not counted itself
CONTROL = {"while", "conditional", "call", "async-update"}

# where a kernel comes from: the innermost frame of its source stack in one of these files names
# its group (a Dense or a norm called from kda.py is KDA's); a layer's own glue (block.py) is
# split by the generic helper it called
SPECIFIC = [
    ("kda", ("layers/kda.py", "layers/conv.py", "decode_kernels/kda_step.py", "ops/kda.py", "ops/delta_rule.py",
             "ops/deltanet.py", "ops/linear_attn.py", "ops/kda_kernels")),
    ("mla", ("layers/mla.py", "layers/rope.py", "decode_kernels/mla_decode.py", "layers/attention.py")),
    ("moe", ("layers/moe.py", "layers/moe_gather.py", "layers/router.py", "layers/qb.py", "layers/expert_pairs.py",
             "ops/grouped_matmul.py", "ops/decode_kernels/moe")),
    ("attnres", ("layers/attnres.py",)),
    ("block", ("layers/block.py",)),
    ("model", ("k3jax/model.py",)),
    ("sampling", ("k3jax/decode.py",)),
]
GENERIC_IN_BLOCK = [("norms", "layers/norms.py"), ("dense_ffn", "layers/activations.py")]


# ----------------------------------------------------------------------------------------
# the HLO


_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")


def parse_frames(text: str) -> dict:
    """The module's stack-frame table -> {frame id: [(file, function, line), ...] innermost first}.
    (HLO text prints each frame's parent as the parent's id + 1, 1 for none.)"""
    files, funcs, locs, frames, sec = {}, {}, {}, {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            sec = line
            continue
        if line.startswith(("ENTRY", "%")):
            break
        m = re.match(r"(\d+) (.*)", line)
        if not m:
            continue
        i, rest = int(m.group(1)), m.group(2)
        if sec == "FileNames":
            files[i] = rest.strip('"')
        elif sec == "FunctionNames":
            funcs[i] = rest.strip('"')
        else:
            d = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", rest)}
            if sec == "FileLocations":
                locs[i] = (files.get(d["file_name_id"], "?"), funcs.get(d["function_name_id"], "?"), d["line"])
            elif sec == "StackFrames":
                frames[i] = (d["file_location_id"], d["parent_frame_id"] - 1)
    chains = {}
    for fid in frames:
        out, f, seen = [], fid, set()
        while f in frames and f not in seen:
            seen.add(f)
            loc, f = frames[f]
            out.append(locs.get(loc, ("?", "?", 0)))
        chains[fid] = out
    return chains


def parse_hlo(text: str) -> tuple[dict, str]:
    """Optimized HLO text -> ({computation: [instruction dict]}, entry name). An instruction:
    name, opcode, calls (called computations by role), trip (known trip count), target (custom
    call), kind (fusion kind / backend kind), frames (its source stack, innermost first), op_name."""
    comps, entry, cur = {}, None, None
    chains = parse_frames(text)
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if cur is None or line.strip() == "}":
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, opcode, rest = m.group(2), m.group(4), m.group(5)
        ins = {"name": name, "opcode": opcode, "calls": {}}
        for role in ("calls", "body", "condition", "to_apply"):
            c = re.search(rf"\b{role}=%?([\w.\-]+)", rest)
            if c:
                ins["calls"][role] = c.group(1)
        b = re.search(r"branch_computations=\{([^}]*)\}", rest)
        if b:
            ins["calls"]["branches"] = [x.strip().lstrip("%") for x in b.group(1).split(",")]
        b = re.search(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", rest)
        if b:
            ins["calls"]["branches"] = [b.group(1), b.group(2)]
        t = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        if t:
            ins["trip"] = int(t.group(1))
        t = re.search(r'custom_call_target="([^"]+)"', rest)
        if t:
            ins["target"] = t.group(1)
        t = re.search(r"kind=(k\w+)", rest)
        if t:
            ins["kind"] = t.group(1)
        t = re.search(r'"kind":"([^"]+)"', rest)
        if t:
            ins["backend_kind"] = t.group(1)
        t = re.search(r'"name":"([^"]+)"', rest)  # a Pallas-Triton kernel's name
        if t and opcode == "custom-call":
            ins["kernel"] = t.group(1)
        t = re.search(r"stack_frame_id=(\d+)", rest)
        ins["frames"] = chains.get(int(t.group(1)), []) if t else []
        t = re.search(r'op_name="([^"]+)"', rest)
        if t:
            ins["op_name"] = t.group(1)
        comps[cur].append(ins)
    return comps, entry


def label(ins: dict) -> str:
    """What kind of thunk an instruction becomes."""
    op = ins["opcode"]
    if op == "fusion":
        bk = ins.get("backend_kind", "")
        if "triton" in bk or "cublas" in bk or "cudnn" in bk or "custom" in bk:
            return f"fusion:{bk}"
        return "fusion"
    if op == "custom-call":
        t = ins.get("target", "?")
        return f"custom-call:{t}" + (f"[{ins['kernel']}]" if ins.get("kernel") else "")
    return op


def _short(path: str) -> str:
    m = re.search(r"((?:k3jax|benchmarks|jax/_src)/.*)", path)
    return m.group(1) if m else path


def attribute(ins: dict) -> tuple[str, str]:
    """(group, source) of an instruction: the innermost frame in a SPECIFIC file names the group;
    the source is that frame (file:line function) plus the innermost frame when it differs."""
    frames = ins.get("frames") or []
    for i, (f, fn, line) in enumerate(frames):
        for g, files in SPECIFIC:
            if any(x in f for x in files):
                where = f"{_short(f)}:{line} {fn.split('.')[-1]}"
                inner = frames[0]
                if i:
                    where += f" <- {_short(inner[0])}:{inner[2]}"
                if g == "block":
                    g = next((name for name, x in GENERIC_IN_BLOCK if any(x in fr[0] for fr in frames[:i])),
                             "layer_glue")
                return g, where
    if frames:
        f, fn, line = frames[0]
        return "other", f"{_short(f)}:{line} {fn}"
    return "other", ins.get("op_name", "?")[-80:]


def count(comps: dict, comp: str, mult: int, out: list):
    """Append (instruction, times per step) for every thunk-making instruction reachable from
    `comp`, run `mult` times: loops multiply by their trip counts, a conditional counts its
    largest branch."""
    for ins in comps.get(comp, []):
        op = ins["opcode"]
        if op in FREE:
            continue
        if op == "while":
            trip = ins.get("trip")
            n = trip if trip is not None else 1
            count(comps, ins["calls"]["body"], mult * n, out)
            if trip is None:  # the condition runs every iteration and once more
                count(comps, ins["calls"]["condition"], mult * (n + 1), out)
            continue
        if op == "conditional":
            branches = []
            for br in ins["calls"].get("branches", []):
                b: list = []
                count(comps, br, mult, b)
                branches.append(b)
            out.extend(max(branches, key=lambda b: sum(m for _, m in b), default=[]))
            continue
        if op == "call":
            count(comps, ins["calls"].get("to_apply") or ins["calls"].get("calls"), mult, out)
            continue
        if op in CONTROL:
            continue
        out.append((ins, mult))


def step_loop(comps: dict, entry: str, steps: int) -> dict:
    """The while loop over decode steps: the entry's while whose trip count is `steps`
    (the outermost one when several are)."""
    cands = []

    def walk(comp, depth):
        for ins in comps.get(comp, []):
            if ins["opcode"] == "while":
                cands.append((depth, ins))
            for role, c in ins["calls"].items():
                if ins["opcode"] == "while":
                    continue
                for cc in (c if isinstance(c, list) else [c]):
                    walk(cc, depth + 1)

    walk(entry, 0)
    for _, ins in sorted(cands, key=lambda x: x[0]):
        if ins.get("trip") == steps:
            return ins
    raise RuntimeError(f"no while loop with trip count {steps} in the entry computation "
                       f"(found {[(i['name'], i.get('trip')) for _, i in cands]})")


# ----------------------------------------------------------------------------------------
# the thunks (what the GPU runtime executes), from XLA's dump


CONTAINERS = {"kCommandBuffer", "kWhile", "kConditional", "kAsyncStart", "kDynamicSliceFusion", "kSequential"}
NOT_KERNELS = {"kAsyncDone", "kWaitForStreams", "kCommandBuffer", "kWhile", "kConditional", "kAsyncStart",
               "kDynamicSliceFusion", "kSequential"}


def parse_thunks(sequence: str, metadata: str) -> list:
    """XLA's thunk_sequence_after_thunk_passes.txt -> a tree: [{"id", "kind", "name" (the HLO
    instruction it runs, from thunk_metadata.txt), "children": [...], "role": None | "condition"
    | "body"}]. Nesting is by indentation; a while's thunks sit under "condition:" / "body:"."""
    names = dict(re.findall(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)', metadata))
    names = {int(v): k for k, v in names.items()}
    root = {"kind": "root", "children": [], "indent": -1}
    stack, role = [root], None
    for line in sequence.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        m = re.match(r"\s*(\d+): (k\w+)", line)
        if not m:
            r = re.match(r"\s*(condition|body):", line)
            if r:
                role = r.group(1)
            continue
        tid, kind = int(m.group(1)), m.group(2)
        while stack[-1]["indent"] >= indent:
            stack.pop()
        node = {"id": tid, "kind": kind, "name": names.get(tid, "") if tid else "", "children": [],
                "indent": indent, "role": role if stack[-1]["kind"] == "kWhile" else None}
        stack[-1]["children"].append(node)
        stack.append(node)
        role = None if kind != "kWhile" else role
    return root["children"]


def thunk_counts(tree: list, trips: dict, steps: int) -> dict:
    """Per decode step, from the thunk tree: kernels by kind, command-buffer launches, kernels
    inside / outside command buffers, host-driven loop iterations. trips: HLO while name ->
    known trip count (the step loop is the one with `steps`)."""
    loop, loop_in_graph = None, False

    def find(nodes, in_graph):
        nonlocal loop, loop_in_graph
        for n in nodes:
            if loop is None and n["kind"] == "kWhile" and trips.get(n["name"]) == steps:
                loop, loop_in_graph = n, in_graph
            find(n["children"], in_graph or n["kind"] == "kCommandBuffer")

    find(tree, False)
    if loop is None:
        raise RuntimeError(f"no kWhile thunk with trip count {steps} (whiles: "
                           f"{ {k: v for k, v in trips.items()} })")
    out = {"kernels": collections.Counter(), "graph_launches": 0, "in_graphs": 0, "outside_graphs": 0,
           "host_loop_iterations": 0, "async": 0, "names": collections.Counter()}

    def walk(nodes, mult, in_graph):
        for n in nodes:
            k = n["kind"]
            if k == "kWhile":
                trip = trips.get(n["name"])
                body = [c for c in n["children"] if c["role"] != "condition"]
                cond = [c for c in n["children"] if c["role"] == "condition"]
                t = trip or 1
                if not in_graph:
                    out["host_loop_iterations"] += mult * t
                walk(body, mult * t, in_graph)
                if trip is None:
                    walk(cond, mult * (t + 1), in_graph)
                continue
            if k == "kCommandBuffer":
                if not in_graph:
                    out["graph_launches"] += mult
                walk(n["children"], mult, True)
                continue
            if k in ("kAsyncStart", "kAsyncDone"):
                out["async"] += mult
            if k in NOT_KERNELS:
                walk(n["children"], mult, in_graph)
                continue
            out["kernels"][k] += mult
            out["names"][re.sub(r"[._]\d+$", "", n["name"] or k)] += mult
            out["in_graphs" if in_graph else "outside_graphs"] += mult
            walk(n["children"], mult, in_graph)

    body = [c for c in loop["children"] if c["role"] != "condition"]
    walk(body, 1, loop_in_graph)  # a loop inside a command buffer (WHILE commands): all of it is one graph
    return {"kernels_per_step": sum(out["kernels"].values()), "step_loop_inside_graph": loop_in_graph, "by_thunk_kind": dict(out["kernels"].most_common()),
            "graph_launches_per_step": out["graph_launches"], "kernels_in_graphs": out["in_graphs"],
            "kernels_outside_graphs": out["outside_graphs"], "host_loop_iterations_per_step":
            out["host_loop_iterations"], "async_events_per_step": out["async"],
            "top_names": dict(out["names"].most_common(25))}


def layer_kinds(cfg) -> dict:
    """How many layers of each kind (mixer, ffn) one step runs: for the per-layer division."""
    kinds = collections.Counter(cfg.mixers)
    ffn = collections.Counter(cfg.ffn_kind(i) for i in range(cfg.num_layers))
    return {"mixer": dict(kinds), "ffn": dict(ffn), "layers": cfg.num_layers}


def summarize(text: str, steps: int, cfg, thunks: dict | None) -> dict:
    """The counts of one compiled decode loop (see the module docstring)."""
    comps, entry = parse_hlo(text)
    loop = step_loop(comps, entry, steps)
    items: list = []
    count(comps, loop["calls"]["body"], 1, items)
    per_kind = collections.Counter()
    by_group = collections.defaultdict(collections.Counter)
    by_source = collections.Counter()
    for ins, mult in items:
        lab = label(ins)
        g, src = attribute(ins)
        per_kind[lab] += mult
        by_group[g][lab] += mult
        by_source[(g, src, lab)] += mult
    kinds = layer_kinds(cfg)
    per_layer = {"kda": kinds["mixer"].get("kda", 0), "mla": kinds["mixer"].get("mla", 0),
                 "moe": kinds["ffn"].get("moe", 0), "dense_ffn": kinds["ffn"].get("dense", 0),
                 "attnres": kinds["layers"], "norms": kinds["layers"], "layer_glue": kinds["layers"]}
    groups = {}
    for g, c in sorted(by_group.items(), key=lambda x: -sum(x[1].values())):
        total = sum(c.values())
        n = per_layer.get(g)
        groups[g] = {"total": total, "per_layer": round(total / n, 2) if n else None, **dict(c.most_common())}
    trips = {ins["name"]: ins.get("trip") for c in comps.values() for ins in c if ins["opcode"] == "while"}
    out = {"hlo_kernels_per_step": sum(per_kind.values()), "by_group": groups, "by_kind": dict(per_kind.most_common()),
           "by_source": [{"group": g, "source": s, "kind": k, "per_step": n}
                         for (g, s, k), n in sorted(by_source.items(), key=lambda x: (x[0][0], -x[1], x[0][1]))],
           "layers": kinds}
    if thunks is not None:
        out.update(thunk_counts(parse_thunks(thunks["sequence"], thunks["metadata"]), trips, steps))
    return out


def report(s: dict) -> str:
    """summary.md"""
    lines = [f"# Kernels per decode step: {s['model']}, batch {s['batch']}, k3-small, one H200 "
             f"(XLA:GPU deviceless, jax {s['jax']})", ""]
    if "kernels_per_step" in s:
        lines += [f"**{s['kernels_per_step']} kernels per step** (thunks: {s['by_thunk_kind']}); "
                  f"{s['kernels_in_graphs']} inside command buffers, {s['kernels_outside_graphs']} outside; "
                  f"{s['graph_launches_per_step']} command-buffer launches and {s['host_loop_iterations_per_step']} "
                  f"host-driven loop iterations per step; {s['async_events_per_step']} async start/done; "
                  f"the loop over steps inside a command buffer: {s['step_loop_inside_graph']}.", ""]
    lines += [f"HLO: {s['hlo_kernels_per_step']} kernel-making instructions per step; layers {s['layers']}; "
              f"XLA options {s['xla_options']}; overrides {s['overrides']}", "",
              "| group | kernels / step | per layer | of which |", "|---|---|---|---|"]
    for g, c in s["by_group"].items():
        rest = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("total", "per_layer"))
        lines.append(f"| {g} | {c['total']} | {c['per_layer'] if c['per_layer'] is not None else ''} | {rest} |")
    lines += ["", "| group | source | kind | per step |", "|---|---|---|---|"]
    lines += [f"| {r['group']} | {r['source']} | {r['kind']} | {r['per_step']} |" for r in s["by_source"]]
    if "top_names" in s:
        lines += ["", "Thunks by name (per step): " + ", ".join(f"{k} {v}" for k, v in s["top_names"].items())]
    lines += ["", f"Compile: lower {s['lower_s']} s, compile {s['compile_s']} s; temporaries {s['temp_bytes']} bytes"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# the compile


def build(a):
    overrides = list(a.overrides)
    if not any(o.startswith("model.param_dtype=") for o in overrides):
        overrides.append("model.param_dtype=bfloat16")
    if a.model == "all_mla":
        pattern = load_config(a.config, overrides).model.layer_pattern
        overrides.append(f"model.layer_pattern={all_mla(pattern)}")
    return load_config(a.config, overrides)


# the benchmark machine (BENCHMARKS.md: driver 580.159, jax-cuda13): XLA's command-buffer
# conversion keeps cuBLAS, custom calls and conditionals in CUDA graphs only for versions it knows
CUDA_VERSION = "13.0.0"


def h200_mesh():
    """A one-device mesh over a compile-only H200 that knows the CUDA versions; every axis has
    size 1, so no layer sees a mesh (k3jax.ops.mesh_axes.active_mesh)."""
    import numpy as np
    from jax.experimental import topologies

    versions = "".join(f'  {k}: "{CUDA_VERSION}"\n' for k in ("driver_version", "runtime_version",
                                                             "compile_time_toolkit_version"))
    config = CHIPS["h200"].gpu_target_config().replace("gpu_device_info {\n", "gpu_device_info {\n" + versions, 1)
    topo = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
    devs = np.asarray(topo.devices[:1]).reshape((1,) * len(AXES))
    return jax.sharding.Mesh(devs, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def compile_loop(cfg, *, batch: int, context: int, steps: int, options: dict):
    """The compiled decode loop for one H200 (deviceless): long_decode.Runner.loop_fn."""
    mesh = h200_mesh()
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    def on_dev(tree):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)
    # the mesh carries the compile-only device, which Pallas-Triton reads its target from
    with planning_for("gpu", target_compiler=True), jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        cache = jax.eval_shape(lambda: abstract.init_cache(batch, context))

        @functools.partial(jax.jit, donate_argnums=(2,))
        def run(state, token, cache, index):
            B = token.shape[0]
            cache = dict(cache, index=index, next_position=jnp.full((B,), index, jnp.int32))
            return decode.decode_loop(nnx.merge(graphdef, state), token, cache, steps=steps)

        t0 = time.perf_counter()
        lowered = run.lower(on_dev(state), on_dev(jax.ShapeDtypeStruct((batch,), jnp.int32)), on_dev(cache),
                            on_dev(jax.ShapeDtypeStruct((), jnp.int32)))
        t1 = time.perf_counter()
        compiled = lowered.compile(compiler_options=options)
        t2 = time.perf_counter()
    return compiled, t1 - t0, t2 - t1


def read_dump(folder: str) -> dict | None:
    """The thunk sequence and metadata XLA dumped for jit_run in `folder`, or None."""
    import glob

    seq = glob.glob(os.path.join(folder, "*jit_run*thunk_sequence_after_thunk_passes.txt"))
    meta = glob.glob(os.path.join(folder, "*jit_run*thunk_metadata.txt"))
    if not (seq and meta):
        return None
    with open(seq[0]) as f, open(meta[0]) as g:
        return {"sequence": f.read(), "metadata": g.read()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/k3-small.yaml")
    p.add_argument("--model", choices=("hybrid", "all_mla"), default="hybrid")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096, help="cache slots (the kernel count does not depend on it)")
    p.add_argument("--steps", type=int, default=4, help="steps in the compiled loop (its trip count)")
    p.add_argument("--xla-option", action="append", default=[],
                   help="an XLA debug option for this compile, key=value (e.g. "
                        "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                        "DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE)")
    p.add_argument("--full-codegen", action="store_true",
                   help="optimise LLVM IR and PTX (slower; the HLO and the thunks, so the counts, do not change)")
    p.add_argument("--from-dump", default=None, help="recount a folder this tool wrote before (hlo.txt, "
                   "thunks.txt, thunk_metadata.txt) instead of compiling")
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="config key=value")
    a = p.parse_args(argv)
    cfg = build(a)
    options = {} if a.full_codegen else {"xla_backend_optimization_level": 0,
                                         "xla_llvm_disable_expensive_passes": True,
                                         "xla_gpu_disable_gpuasm_optimizations": True}
    for kv in a.xla_option:
        k, _, v = kv.partition("=")
        options[k] = {"true": True, "false": False}.get(v.lower(), v)
    os.makedirs(a.out, exist_ok=True)
    if a.from_dump:
        with open(os.path.join(a.from_dump, "hlo.txt")) as f:
            text = f.read()
        thunks = None
        if os.path.exists(os.path.join(a.from_dump, "thunks.txt")):
            with open(os.path.join(a.from_dump, "thunks.txt")) as f, \
                    open(os.path.join(a.from_dump, "thunk_metadata.txt")) as g:
                thunks = {"sequence": f.read(), "metadata": g.read()}
        lower_s = compile_s = temp = None
    else:
        why = compiler_unavailable("gpu")
        if why:
            raise SystemExit(f"decode_kernels: cannot compile for an H200 here: {why}")
        import shutil
        import tempfile

        dump = tempfile.mkdtemp(prefix="decode-kernels-")
        options.update(xla_dump_to=dump, xla_dump_hlo_module_re="jit_run", xla_dump_hlo_as_text=True)
        try:
            compiled, lower_s, compile_s = compile_loop(cfg, batch=a.batch, context=a.context, steps=a.steps,
                                                        options=options)
            thunks = read_dump(dump)
        finally:
            shutil.rmtree(dump, ignore_errors=True)
        for k in ("xla_dump_to", "xla_dump_hlo_module_re", "xla_dump_hlo_as_text"):
            options.pop(k)
        text = compiled.as_text()
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
        with open(os.path.join(a.out, "hlo.txt"), "w") as f:
            f.write(text)
        if thunks:
            with open(os.path.join(a.out, "thunks.txt"), "w") as f:
                f.write(thunks["sequence"])
            with open(os.path.join(a.out, "thunk_metadata.txt"), "w") as f:
                f.write(thunks["metadata"])
    s = summarize(text, a.steps, cfg.model, thunks)
    s.update(model=a.model, batch=a.batch, context=a.context, steps=a.steps, overrides=a.overrides,
             xla_options={k: str(v) for k, v in options.items()}, lower_s=lower_s and round(lower_s, 1),
             compile_s=compile_s and round(compile_s, 1), temp_bytes=temp,
             decode_impl=cfg.model.decode_impl, jax=jax.__version__)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    md = report(s)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
