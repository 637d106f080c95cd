"""k3jax-plan: will a config train on a mesh? Per-device memory, all-to-all traffic and FLOPs.

    k3jax-plan --config configs/k3.yaml --devices 2048 [--chip h200|h100|v5p|v6e] \
               [--mesh data=1,fsdp=-1,expert=64,tensor=8] [--hbm-gb G] [--batch B] [--seq T] \
               [--compiler auto|target|host] [--json] [--json-out PATH] [key=value ...]
    k3jax-plan --exchange-changes --config configs/k3.yaml --devices 2048 --mesh ... [--json]

The planner compiles the real train step (train.setup), so it sits beside the trainer:
cli.py (this report), estimate.py (parameters, FLOPs, step time), memory.py (the state's
leaves, the host compile's activations), communication.py (the expert exchange, the context
gathers), target.py (compile-only devices), compile.py (the target compile), breakdown.py (the
buffers at its peak), kernels.py (kernels outside any shard_map), optimizer.py (the optimizer's
FLOPs, collectives and seconds).

Nothing is allocated. Two ways to measure the memory, said in the plan's first lines:

Target compile (`--compiler target`; `auto` when the [plan] extra is installed): the whole
sharded train step (micro-batches, the optimizer update, QB, every collective of the mesh) is
lowered on abstract inputs over compile-only devices of the chip, laid out as the machine is
(GPUs in nodes of 8; a TPU slice such as v5p:8x16x16), and compiled by the chip's own
compiler, XLA:GPU or XLA:TPU, on this machine (`train.plan.compile`). Its buffer assignment
is the figure: arguments (the state and the batch) + temporaries + outputs not aliased to the
donated state. The compile stops once XLA has dumped that assignment (in a child process;
the machine code after it cannot change it: `--compile-to-the-end` to check), which took
k3.yaml's GPU plan from 25 to 10 minutes on a busy 2-core machine (4 on an idle one) and lets
XLA:TPU's plan of it end at all (4.5 minutes; its whole compile ran over 45 without ending). The temporaries are
listed by what XLA holds at the peak, each buffer named by the code that made it
(`train.plan.breakdown`). Planning for a GPU, tokamax's Mosaic-GPU
kernels (which need a GPU to compile) are traced through stand-ins that keep what they keep
(`k3jax.ops.planning`); the Triton KDA kernels compile for real.

Host compile (`--compiler host`; the fallback without the extra): one device's forward and
backward, at one device's shapes (tensor-split widths divided by `tensor`, B_local / m rows),
compiled by this machine's XLA (`train.plan.memory`), plus analytic terms for what that
program lacks: FSDP's gathered weights, expert-parallel capacity rows, exact QB's statistics,
the batch, the fused KDA kernels' backward workspace. On a CPU this measured 1.96x the H200's
real peak for k3-small (benchmarks/results/k3-small-2026-12-01/README.md), and the plan's first
line says so.

Notation: D = data*fsdp*expert (the devices that split the batch), B_local = B / D rows per
device, C = context (each row's T tokens in C contiguous shards), m = train.micro_batches,
c = compute-dtype bytes, t = tensor, X = expert.

State (exact in both): every leaf costs prod(shape) * itemsize / (product of the mesh axes its
PartitionSpec uses); in the host compile grads = params, twice with m > 1 (the accumulator and
the micro-batch gradient); the target compile holds them among its temporaries.

All-to-all (`train.plan.communication`, a model of k3jax/layers/expert_parallel.py): per MoE layer the
bytes on each link (the network between nodes, NVLink inside a node, ICI on a TPU), their time at
the chip's link bandwidths (--a2a-gbs / --nvlink-gbs override them), how much of it runs under
which compute (the other chunk's experts, the shared experts) and what stays exposed; with
moe.ep_keep_results / ep_keep_received what remat keeps so the recompute exchanges nothing
(`all_to_all.kept_bytes_per_device`, per layer; the target compile holds it, the host compile
adds the receive buffers as an analytic term).
`flops.all_to_all_seconds_per_step` is the token exchange on every link, serial as XLA schedules
it (one collective in flight), beside `flops.with_remat_recompute_s`;
`flops.all_to_all_exposed_seconds_per_step` what is left after overlap (with the tensor group's
expert-weight gathers, moe.ep_tensor=weights, where not hidden).

FLOPs (`train.plan.estimate`): `k3jax.flops.train_flops_per_token` * B * T per step; the lower
bound on the step time is that divided by devices * peak (remat=full adds about one forward
pass: x4/3).

The optimizer (`train.plan.optimizer`), per device and step, beside the model (`optimizer` in
--json): Muon's Newton-Schulz counted from the buckets the step runs (`train.muon_mesh`:
`newton_schulz.flops_per_device`, `flops_total` for every matrix once, `work_factor` the busiest
device against an even share, `repeated_factor` the devices that orthogonalise each matrix, and
per bucket its matrices, exchange axes, replicas, chunks, FLOPs, bytes and seconds), its
collectives' bytes and seconds on each link (`collective_bytes_per_device`, `collective_seconds`),
QK-Clip's max-logit pass (`qk_clip`), the memory-bound update (`elementwise_bytes_per_device`),
`seconds` by part (`collectives_exposed`: after one chunk's exchange runs under another's
Newton-Schulz), and `seconds_per_step`. The step they make together, in `flops`:
`optimizer_flops_per_device`, `optimizer_seconds_per_step`, `step_seconds` (compute with the
recompute + all-to-all exposed + optimizer), `optimizer_share_of_step`, and `mfu` (the model's
FLOPs at the peak over `step_seconds`).

QAT (model.qat=mxfp4): the target compile's temporaries that the fake quantisation made
(`k3jax/ops/mx.py`) are summed on a line of their own; with the MXFP8 expert wire, the exchange
with bf16 rows is planned beside it (`all_to_all_compute_dtype_wire`, per MoE layer; null without).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax

from k3jax.chips import CHIPS, DEFAULT_CHIP, Chip
from k3jax.config import ConfigError, load_config
from k3jax.local_platform import cpu_unless_accelerator
from k3jax.sharding.mesh import AXES, BATCH_AXES, mesh_shape
from train.plan.communication import (ICI_GBS, NETWORK_GBS, NVLINK_GBS, Exchange, changes_table,
                                      context_gather_bytes, exchange_plan, link_names)
from train.plan.compile import compile_train_step
from train.plan.estimate import config_param_counts, model_flops_per_step, step_compute_seconds
from train.plan.memory import activation_terms, gathered_layer_bytes, state_leaves
from train.plan.optimizer import optimizer_plan
from train.plan.target import FALLBACK_NOTE, compiler_unavailable

HEADROOM = 0.10
QAT_SOURCE = "k3jax/ops/mx.py"  # where QAT's fake quantisation is traced: the breakdown names its buffers by it


TARGETS = ("gpu", "tpu", "cpu")
COMPILERS = ("auto", "target", "host")


def resolve_chip(target: str, chip: str | None) -> Chip | None:
    """The chip planned for: --chip, else the target's default (gpu: h200, tpu: v5p); None
    for --target cpu. A chip of another platform than --target is an error naming --chip."""
    if target == "cpu":
        if chip:
            raise ConfigError(f"--target cpu plans no accelerator, got --chip {chip}", "--chip")
        return None
    name = chip or DEFAULT_CHIP[target]
    if name not in CHIPS:
        raise ConfigError(f"unknown chip {name!r}; known: {', '.join(CHIPS)}", "--chip")
    c = CHIPS[name]
    if c.platform != target:
        raise ConfigError(f"{name} is a {c.platform.upper()}, not a {target.upper()}", "--chip")
    return c


def plan(cfg, num_devices: int, *, hbm_gb: float | None = None, batch: int | None = None, seq: int | None = None,
         peak_tflops: float | None = None, headroom: float = HEADROOM, target: str = "gpu",
         chip: str | None = None, compiler: str = "auto", a2a_gbs: float | None = None,
         nvlink_gbs: float | None = None, activations: bool = True, dump_dir: str | None = None,
         compile_to_the_end: bool = False) -> dict:
    """The whole report as a dict. Raises ConfigError for a config that cannot run on the mesh.

    target/chip: the accelerator the run will use (gpu: h200, h100; tpu: v5p, v6e); its memory
    and peak rate are the defaults of hbm_gb and peak_tflops, its links (between nodes, inside a
    node: the ICI on a TPU) of a2a_gbs and nvlink_gbs. compiler: "target" compiles the
    whole sharded train step with that accelerator's compiler for a topology of num_devices
    (`train.plan.compile`; the [plan] extra), "host" compiles one device's forward and
    backward on this machine's XLA (`train.plan.memory`, with analytic terms), "auto" the
    first where it can. activations=False skips the compile (state, traffic and FLOPs only;
    `fits` then judges the state alone). compile_to_the_end: compile the machine code too and
    read memory_analysis(), instead of stopping after buffer assignment (the same figures on a
    GPU; on a TPU a few MB more, `compile.buffer_assignment_figures`)."""
    if target not in TARGETS:
        raise ConfigError(f"must be one of {', '.join(TARGETS)}, got {target!r}", "--target")
    if compiler not in COMPILERS:
        raise ConfigError(f"must be one of {', '.join(COMPILERS)}, got {compiler!r}", "--compiler")
    the_chip = resolve_chip(target, chip)
    # --target cpu has no chip: its figures are judged against the default GPU's
    judged = the_chip or CHIPS[DEFAULT_CHIP["gpu"]]
    hbm_gb = hbm_gb if hbm_gb is not None else judged.hbm_gb
    peak_tflops = peak_tflops if peak_tflops is not None else judged.peak_bf16_tflops
    why_not = compiler_unavailable(the_chip.platform) if the_chip else "--target cpu"
    if compiler == "target" and why_not:
        raise ConfigError(f"cannot compile for the target here: {why_not}", "--compiler")
    on_target = the_chip is not None and compiler != "host" and why_not is None
    mc = cfg.model
    sizes = mesh_shape(cfg.mesh, num_devices)
    B = batch or cfg.train.batch_size
    T = seq or cfg.data.seq_len
    m = cfg.train.micro_batches
    shards = math.prod(sizes[a] for a in BATCH_AXES)
    C = sizes.get("context", 1)
    if T % C:
        raise ConfigError(f"mesh.context={C} does not divide the sequence of {T} tokens", "mesh.context (--seq)")
    if C > 1 and (T // C) % mc.kda.chunk_size and set(mc.mixers) & {"kda", "gated_deltanet", "deltanet", "linear"}:
        raise ConfigError(f"a context shard of {T // C} tokens is not a multiple of model.kda.chunk_size="
                          f"{mc.kda.chunk_size}", "mesh.context (--seq)")
    if B % shards:
        raise ConfigError(f"batch {B} does not split over data*fsdp*expert = {shards} devices",
                          "train.batch_size (--batch)")
    B_local = B // shards
    if B_local % m:
        raise ConfigError(f"{B_local} rows per device do not split into {m} micro-batches", "train.micro_batches")
    has_moe = any(mc.ffn_kind(i) == "moe" for i in range(mc.num_layers))
    if has_moe and mc.moe.num_experts % sizes["expert"]:
        raise ConfigError(f"{mc.moe.num_experts} experts do not split over mesh.expert={sizes['expert']}",
                          "model.moe.num_experts")

    leaves = state_leaves(cfg, sizes)
    params = sum(lf.bytes for lf in leaves["params"])
    opt = sum(lf.bytes for lf in leaves["opt_state"])
    other = sum(lf.bytes for g in ("rest", "step", "rng") for lf in leaves[g])
    batch_bytes = B_local * T * 5 * 4 / C
    gathered, widest_layer = gathered_layer_bytes(cfg, leaves["params"], sizes)
    hbm = hbm_gb * 1e9
    usable = hbm * (1 - headroom)

    compile_info: dict = {"kind": "none", "name": "none"}
    act_terms: dict[str, float] = {}
    if on_target and activations:
        tc = compile_train_step(cfg, the_chip, num_devices, batch=B, seq=T, dump_dir=dump_dir,
                                to_the_end=compile_to_the_end)
        compile_info = {"kind": "target", "name": f"{tc.compiler} (deviceless)", "chip": the_chip.name,
                        "devices": num_devices, "topology": tc.topology,
                        "program": "the whole sharded train step, one device's program",
                        "figures_from": tc.figures_from, "fusion_autotuner": tc.fusion_autotuner,
                        "unsharded_kernels": list(tc.unsharded_kernels),
                        "lower_s": round(tc.lower_s, 1), "compile_s": round(tc.compile_s, 1)}
        live = [(k, v) for k, v in tc.peak_terms if not k.startswith("arguments")]
        live_total = sum(v for _, v in live)
        act_terms = {f"compiled: {k}": float(v) for k, v in live}
        if tc.temporaries > live_total:  # the allocation's packing beyond the live set at the peak
            act_terms["compiled: temporary allocation beyond the buffers live at the peak"] = \
                float(tc.temporaries - live_total)
        per_device = {"params": params, "optimizer": opt, "other_state": other, "batch": batch_bytes,
                      "arguments": float(tc.arguments), "temporaries": float(tc.temporaries),
                      "outputs_not_aliased": float(tc.outputs_not_aliased), "total": float(tc.total)}
        total = float(tc.total)
        named = {"params": params, "optimizer state": opt, "other state (router bias, step, rng)": other}
        named.update({f"temp: {k.removeprefix('compiled: ')}": v for k, v in act_terms.items()})
        if tc.outputs_not_aliased:
            named["outputs not aliased to donated inputs"] = float(tc.outputs_not_aliased)
        suggestion = None
    else:
        grads = params * (2 if m > 1 else 1)
        if activations:
            act_terms = activation_terms(cfg, sizes, B_local, m, T, gathered, target)
            compile_info = {"kind": "host", "name": f"XLA:{jax.default_backend().upper()} (this machine)",
                            "program": "one device's forward and backward, plus analytic terms"}
            if the_chip is not None:
                compile_info["note"] = FALLBACK_NOTE + (f" ({why_not})" if why_not and compiler != "host" else "")
        act = sum(act_terms.values())
        total = params + grads + opt + other + act
        per_device = {"params": params, "grads": grads, "optimizer": opt, "other_state": other,
                      "activations": act, "total": total}
        named = {"params": params, "grads" + (" (+ accumulator)" if m > 1 else ""): grads, "optimizer state": opt,
                 "other state (router bias, step, rng)": other}
        named.update({f"act: {k}": v for k, v in act_terms.items()})
        suggestion = None
        if total > usable:  # the smallest gradient-accumulation factor that would fit, estimated by
            # scaling the per-micro-batch terms with the micro-batch's rows (not compiled again)
            static = params + 2 * params + opt + other
            per_micro = sum(v for k, v in act_terms.items() if not k.startswith(
                ("analytic: router", "analytic: FSDP", "analytic: the step")))
            fixed = act - per_micro
            for micro in (x for x in range(m + 1, B_local + 1) if B_local % x == 0):
                if static + fixed + per_micro * m / micro <= usable:
                    suggestion = micro
                    break
    largest = sorted(named.items(), key=lambda kv: -kv[1])[:8]

    L_moe = sum(1 for i in range(mc.num_layers) if mc.ffn_kind(i) == "moe")

    gather = context_gather_bytes(mc, sizes, B_local, T)
    n_layers = {"delta_rule_layer": sum(k in ("kda", "gated_deltanet", "deltanet", "linear") for k in mc.mixers),
                "mla_layer": mc.mixers.count("mla"), "softmax_layer": mc.mixers.count("softmax")}
    gather_step = sum(v * n_layers[k] for k, v in gather.items())

    counts = config_param_counts(cfg)
    flops_step = model_flops_per_step(cfg, B, T, counts)
    peak = peak_tflops * 1e12
    step_s = step_compute_seconds(cfg, num_devices, peak_tflops, batch=B, seq=T, counts=counts)
    far = a2a_gbs if a2a_gbs is not None else (the_chip.inter_node_gbs if the_chip else NETWORK_GBS)
    near = nvlink_gbs if nvlink_gbs is not None else (the_chip.intra_node_gbs if the_chip else NVLINK_GBS)
    comm = None  # the expert-parallel exchange (train/plan/communication.py), per MoE layer and step
    if has_moe and sizes["expert"] * sizes["tensor"] > 1:
        comm = exchange_plan(cfg, sizes, B_local * T // C, target=target, peak_tflops=peak_tflops, network_gbs=far,
                             nvlink_gbs=near, ici_gbs=near if target == "tpu" else ICI_GBS, step_compute_s=step_s,
                             moe_layers=L_moe)
    compute_wire = None  # the same exchange with bf16 token rows, beside the MXFP8 wire of qat=mxfp4
    if comm and comm["wire"] == "mxfp8":
        plain = exchange_plan(cfg, sizes, B_local * T // C, target=target, peak_tflops=peak_tflops, network_gbs=far,
                              nvlink_gbs=near, ici_gbs=near if target == "tpu" else ICI_GBS,
                              step_compute_s=step_s, moe_layers=L_moe, exchange=Exchange(mxfp8_wire=False))
        compute_wire = {"wire": plain["wire"], "bytes_per_device": plain["bytes_per_device"],
                        "bytes_per_token": plain["bytes_per_token"],
                        "seconds_per_step": plain["seconds_total"] * L_moe,
                        "exposed_seconds_per_step": plain["exposed_seconds"] * L_moe,
                        "kept_bytes_per_device": plain["kept_bytes_per_device"]}
    a2a = sum(comm["bytes_per_device"].values()) if comm else 0.0
    a2a_s = comm["seconds_total"] * L_moe if comm else 0.0
    exposed_s = comm["exposed_seconds"] * L_moe if comm else 0.0
    # the optimizer (train/plan/optimizer.py): Newton-Schulz, its collectives, QK-Clip, the update
    optimizer = optimizer_plan(
        cfg, sizes, leaves["params"], target=target, peak_tflops=peak_tflops, hbm_tbps=judged.hbm_tbps,
        links_gbs={"ici": near} if target == "tpu" else {"network": far, "nvlink": near},
        devices_per_node=the_chip.devices_per_node if the_chip else judged.devices_per_node, batch=B, seq=T)
    opt_s = optimizer["seconds_per_step"]
    planned_s = step_s + exposed_s + opt_s
    return {
        "config_params": sum(counts.values()),
        "devices": num_devices,
        "mesh": sizes,
        "batch": B, "seq_len": T, "micro_batches": m, "rows_per_device": B_local,
        "tokens_per_step": B * T,
        "tokens_per_device_per_micro_batch": B_local // m * T // C,
        "remat": mc.remat, "qat": mc.qat, "target": target, "chip": the_chip.name if the_chip else None,
        "compiler": compile_info,
        "per_device_bytes": per_device,
        "activation_terms": act_terms,
        "largest_gathered_layer": widest_layer,
        "hbm_bytes": hbm, "headroom": headroom, "usable_bytes": usable,
        "fits": total <= usable,
        "headroom_left": 1 - total / hbm,
        "largest_terms": [{"name": k, "bytes": v, "percent": 100 * v / total} for k, v in largest],
        "suggest_micro_batches": suggestion,
        "moe_layers": L_moe,
        "all_to_all_bytes_per_moe_layer": {
            "per_device": a2a, "all_devices": a2a * num_devices,
            "by_link": comm["bytes_per_device"] if comm else {},
            "per_token_by_link": comm["bytes_per_token"] if comm else {}},
        "all_to_all_bytes_per_step": {"per_device": a2a * L_moe, "all_devices": a2a * L_moe * num_devices},
        "all_to_all_seconds_per_step": a2a_s, "all_to_all_exposed_seconds_per_step": exposed_s,
        "all_to_all": comm,
        "all_to_all_compute_dtype_wire": compute_wire,
        "context_gather_bytes_per_layer": {
            "per_device": gather, "per_step_per_device": gather_step,
            "formula": "delta-rule: B_local*H/t*K*(K+V)*4*(C-1) (+halos); mla: B_local*T*(kv_lora+rope)*c*(C-1)/C; "
                       "x rounds = 2 (+1 with remat)"},
        "flops": {"model_flops_per_step": flops_step, "per_device": flops_step / num_devices,
                  "peak_tflops": peak_tflops,
                  "step_time_lower_bound_s": flops_step / num_devices / peak,
                  "with_remat_recompute_s": step_s,
                  "all_to_all_seconds_per_step": a2a_s, "all_to_all_exposed_seconds_per_step": exposed_s,
                  "optimizer_flops_per_device": optimizer["flops_per_device"],
                  "optimizer_seconds_per_step": opt_s,
                  "step_seconds": planned_s, "optimizer_share_of_step": opt_s / planned_s if planned_s else 0.0,
                  "mfu": flops_step / num_devices / peak / planned_s if planned_s else 0.0},
        "optimizer": optimizer,
    }


def _count(x: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if x >= div:
            return f"{x / div:.4g} {suffix}"
    return f"{x:.0f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def _print(r: dict, config: str) -> None:
    pd = r["per_device_bytes"]
    comp = r["compiler"]
    if comp.get("note"):  # first, so nobody reads the figure below without it
        print(f"NOTE: {comp['note']}")
    # which compiler gave the figures: the first line (after the fallback's note)
    if comp["kind"] == "target":
        print(f"compiled by {comp['name']} for {comp['devices']} x {comp['chip']} (topology {comp['topology']}): "
              f"{comp['program']}; lowered in {comp['lower_s']:.0f} s, compiled in {comp['compile_s']:.0f} s; "
              f"figures from {comp['figures_from']}")
    elif comp["kind"] == "host":
        print(f"compiled by {comp['name']}: {comp['program']}")
    if comp.get("unsharded_kernels"):  # each one's operands gathered whole: the figures include that
        names = ", ".join(sorted(set(comp["unsharded_kernels"])))
        print(f"WARNING: kernels traced outside any shard_map, so each device runs them on whole operands "
              f"({len(comp['unsharded_kernels'])} calls): {names}")
    mesh = " ".join(f"{a}={s}" for a, s in r["mesh"].items())
    chip = f" x {r['chip']}" if r.get("chip") else ""
    print(f"{config}: {_count(r['config_params'])} params on {r['devices']}{chip} devices, mesh {mesh}")
    print(f"  batch {r['batch']} x {r['seq_len']} tokens ({r['tokens_per_step'] / 1e6:.1f} M per step): "
          f"{r['rows_per_device']} rows per device, {r['micro_batches']} micro-batch(es) -> "
          f"{r['tokens_per_device_per_micro_batch']:,} tokens per device per micro-batch; remat={r['remat']}, "
          f"target={r['target']}")
    print("per device:")
    if comp["kind"] == "target":
        for k in ("params", "optimizer", "other_state", "batch"):
            print(f"  {k:<20}{_gb(pd[k]):>14}")
        print(f"  {'= arguments':<20}{_gb(pd['arguments']):>14}  (compiled)")
        print(f"  {'temporaries':<20}{_gb(pd['temporaries']):>14}  (compiled; the buffers live at the peak:)")
        for k, v in sorted(r["activation_terms"].items(), key=lambda kv: -kv[1])[:14]:
            print(f"    {_gb(v):>14}  {k.removeprefix('compiled: ')}")
        rest = sorted(r["activation_terms"].values(), reverse=True)[14:]
        if rest:
            print(f"    {_gb(sum(rest)):>14}  {len(rest)} smaller terms")
        qat = {k: v for k, v in r["activation_terms"].items() if QAT_SOURCE in k}
        if r.get("qat", "none") != "none" or qat:
            print(f"    of these, QAT's fake quantisation ({QAT_SOURCE}): {_gb(sum(qat.values()))} in {len(qat)} "
                  f"term(s) live at the peak")
        if pd["outputs_not_aliased"]:
            print(f"  {'outputs':<20}{_gb(pd['outputs_not_aliased']):>14}  (not aliased to donated inputs)")
    else:
        for k in ("params", "grads", "optimizer", "other_state"):
            print(f"  {k:<14}{_gb(pd[k]):>14}")
        print(f"  {'activations':<14}{_gb(pd['activations']):>14}")
        for k, v in sorted(r["activation_terms"].items(), key=lambda kv: -kv[1]):
            print(f"    {_gb(v):>14}  {k}")
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    print(f"  {'total':<14}{_gb(pd['total']):>14}  of {_gb(r['hbm_bytes'])} HBM, {_gb(r['usable_bytes'])} usable "
          f"after {r['headroom']:.0%} headroom: {verdict} ({r['headroom_left']:.0%} of HBM left)")
    if comp["kind"] != "target":
        print("largest terms:")
        for t in r["largest_terms"]:
            print(f"  {_gb(t['bytes']):>14}  {t['percent']:5.1f}%  {t['name']}")
    if not r["fits"]:
        s = r["suggest_micro_batches"]
        print(f"  try train.micro_batches={s}" if s else
              "  try more micro-batches, more devices, a shorter sequence, or a larger tensor/expert axis")
    comm = r["all_to_all"]
    if comm:
        L = r["moe_layers"]
        print(f"expert-parallel exchange per MoE layer per step, per device ({comm['shards_per_node']} expert "
              f"shard(s) per node, token rows as {comm['wire']}, tensor group shares {comm['tensor']}):")
        for link, b in comm["bytes_per_device"].items():
            print(f"  {link:<8}{_gb(b):>12}  {comm['bytes_per_token'][link] / 1e3:9,.1f} KB per token  "
                  f"{comm['seconds'][link] * 1e3:8.1f} ms at {comm['links_gbs'][link]:g} GB/s")
        if comm["expert_weights_seconds"]:
            w = sum(comm["expert_weights_bytes_per_device"].values())
            print(f"  expert weights gathered over tensor: {_gb(w)}, {comm['expert_weights_seconds'] * 1e3:.1f} ms")
        hidden = ", ".join(f"{v * 1e3:.1f} ms under {k}" for k, v in comm["hidden_seconds"].items())
        print(f"  hidden: {hidden}; exposed {comm['exposed_seconds'] * 1e3:.1f} ms")
        kept = {k: v for k, v in comm["kept_bytes_per_device"].items() if v}
        if kept:  # moe.ep_keep_results / ep_keep_received: remat memory for the recompute's exchange
            what = ", ".join(f"{_gb(v * L)} of {k}" for k, v in kept.items())
            print(f"  kept by remat so the recompute does not exchange them again ({L} layers, one micro-batch): "
                  f"{what}")
        print(f"  x {L} MoE layers: all-to-all {r['all_to_all_seconds_per_step']:.2f} s per step, "
              f"{r['all_to_all_exposed_seconds_per_step']:.2f} s exposed after overlap "
              f"(compute {r['flops']['with_remat_recompute_s']:.2f} s)")
        plain = r.get("all_to_all_compute_dtype_wire")
        if plain:  # the MXFP8 wire against bf16 rows (moe.ep_wire=compute)
            per = ", ".join(f"{k} {_gb(v)} ({plain['bytes_per_token'][k] / 1e3:,.1f} KB per token)"
                            for k, v in plain["bytes_per_device"].items())
            kept = sum(plain["kept_bytes_per_device"].values()) * L
            print(f"  with {plain['wire']} token rows instead (moe.ep_wire=compute): {per} per MoE layer; "
                  f"{plain['seconds_per_step']:.2f} s per step, {plain['exposed_seconds_per_step']:.2f} s exposed; "
                  f"remat keeps {_gb(kept)}")
    g = r["context_gather_bytes_per_layer"]
    if g["per_device"]:
        per = ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in g["per_device"].items())
        print(f"context all-gathers per layer per step, received per device: {per}; "
              f"{_gb(g['per_step_per_device'])} per step")
        print(f"  = {g['formula']}")
    f = r["flops"]
    print(f"model FLOPs per step: {f['model_flops_per_step']:.3e} ({f['per_device']:.3e} per device); "
          f"step time >= {f['step_time_lower_bound_s']:.2f} s at {f['peak_tflops']:g} TFLOP/s "
          f"({f['with_remat_recompute_s']:.2f} s with the remat recompute)")
    _print_optimizer(r)


def _print_optimizer(r: dict) -> None:
    """The optimizer beside the model, per device and step, and the step they make together."""
    o, f = r["optimizer"], r["flops"]
    links = list(o["collective_bytes_per_device"])
    model_bytes: dict[str, float] = {}
    for part in ("bytes_per_device", "expert_weights_bytes_per_device"):  # the exchange's tokens and weights
        for k, v in (r["all_to_all"] or {}).get(part, {}).items():
            model_bytes[k] = model_bytes.get(k, 0.0) + v * r["moe_layers"]
    print(f"per device and step: {'FLOPs':>10} " + " ".join(f"{k + ' GB':>11}" for k in links) + "  seconds")
    recompute = f["with_remat_recompute_s"] / f["step_time_lower_bound_s"] if f["step_time_lower_bound_s"] else 1.0
    print(f"  {'model':<18}{f['per_device'] * recompute:10.3e} "
          + " ".join(f"{model_bytes.get(k, 0.0) / 1e9:11.2f}" for k in links)
          + f"  {f['with_remat_recompute_s']:.3f} compute + {f['all_to_all_exposed_seconds_per_step']:.3f} "
            f"all-to-all exposed (the bytes: the expert exchange's tokens and weights)")
    sec = o["seconds"]
    name = o["name"] + (" per head" if o["per_head"] else "") + (f", QK-Clip {o['qk_clip_tau']:g}" if o["qk_clip_tau"]
                                                                 else "")
    print(f"  {'optimizer':<18}{o['flops_per_device']:10.3e} "
          + " ".join(f"{o['collective_bytes_per_device'][k] / 1e9:11.2f}" for k in links)
          + f"  {o['seconds_per_step']:.3f} ({name}): Newton-Schulz {sec['newton_schulz']:.3f}, its collectives "
            f"{sec['collectives_exposed']:.3f} exposed of {sec['collectives_serial']:.3f}, QK-Clip's max logits "
            f"{sec['qk_clip']:.3f}, elementwise {sec['elementwise']:.3f}")
    ns = o["newton_schulz"]
    if ns["matrices"]:
        top = ns["buckets"][0]
        print(f"  Newton-Schulz: {ns['matrices']:,} matrices in {len(ns['buckets'])} buckets, each orthogonalised "
              f"by {ns['repeated_factor']} device ({ns['flops_total']:.3e} FLOPs in all); the busiest device does "
              f"{ns['work_factor']:.2f}x an even share (zero matrices pad the buckets with fewer matrices than "
              f"devices); largest: {top['matrices']:,} of {top['matrix'][0]} x {top['matrix'][1]} "
              f"({top['example']}), {top['matrices_per_device']} a device, {top['newton_schulz_s'] * 1e3:.1f} ms")
    print(f"planned step: {f['step_seconds']:.2f} s (compute {f['with_remat_recompute_s']:.2f} + all-to-all exposed "
          f"{f['all_to_all_exposed_seconds_per_step']:.2f} + optimizer {f['optimizer_seconds_per_step']:.2f}); "
          f"the optimizer {f['optimizer_share_of_step']:.1%} of it; MFU {f['mfu']:.1%} (model FLOPs at "
          f"{f['peak_tflops']:g} TFLOP/s over the planned step)")


def exchange_changes(cfg, config: str, num_devices: int, as_json: bool) -> None:
    """Print `communication.changes_table` for a config and mesh: the exchange before each of
    its changes and after (the planner's numbers, BENCHMARKS.md; --exchange-changes)."""
    sizes = mesh_shape(cfg.mesh, num_devices)
    B_local = cfg.train.batch_size // math.prod(sizes[x] for x in BATCH_AXES)
    tokens = B_local * cfg.data.seq_len // sizes["context"]
    L = sum(cfg.model.ffn_kind(i) == "moe" for i in range(cfg.model.num_layers))
    rows = changes_table(cfg, sizes, tokens, L, step_compute_s=step_compute_seconds(cfg, num_devices))
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{config} on {num_devices} devices, mesh {sizes}, qat={cfg.model.qat}: per token and MoE layer "
          f"(bytes), and per step ({L} MoE layers, seconds)")
    far, near = link_names("gpu")
    print(f"{'change':48s} {far + ' B':>10s} {near + ' B':>10s} {'weights B':>10s} {far + ' s':>10s} "
          f"{near + ' s':>9s} {'weights s':>10s} {'exposed s':>10s} {'kept GB':>8s}")
    for r in rows:
        b, s = r["bytes_per_token"], r["seconds_per_step"]
        print(f"{r['change']:48s} {b[far]:10,.0f} {b[near]:10,.0f} "
              f"{r['expert_weights_bytes_per_token']:10,.0f} {s[far]:10.2f} {s[near]:9.2f} "
              f"{r['expert_weights_seconds_per_step']:10.2f} {r['exposed_seconds_per_step']:10.2f} "
              f"{r['kept_bytes_per_device'] / 1e9:8.2f}")


def _mesh_overrides(text: str) -> list[str]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        axis, sep, value = item.partition("=")
        if not sep or axis.strip() not in AXES:
            raise ConfigError(f"expected axis=size with axis in {', '.join(AXES)}, got {item!r}", "--mesh")
        out.append(f"mesh.{axis.strip()}={value.strip()}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="k3jax-plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--devices", type=int, required=True, help="total number of accelerators")
    p.add_argument("--mesh", default="",
                   help="data=…,fsdp=…,expert=…,context=…,tensor=… (one may be -1); default: the config's")
    p.add_argument("--chip", choices=sorted(CHIPS), default=None,
                   help="the accelerator (default: h200 for --target gpu, v5p for tpu): its memory, peak and "
                        "links are the defaults below, and the target compile builds for it")
    p.add_argument("--compiler", choices=COMPILERS, default="auto",
                   help="target: the whole sharded step by the chip's own compiler (pip install -e '.[plan]'); "
                        "host: one device's step on this machine's XLA plus analytic terms; auto: target if installed")
    p.add_argument("--hbm-gb", type=float, default=None, help="memory per device in GB (1e9 bytes; default: the chip's)")
    p.add_argument("--batch", type=int, default=None, help="global rows per step (default train.batch_size)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default data.seq_len)")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device dense bf16 peak (default: the chip's)")
    p.add_argument("--headroom", type=float, default=HEADROOM, help="share of HBM kept free (default 0.1)")
    p.add_argument("--target", choices=TARGETS, default=None,
                   help="the accelerator the run will use: picks the code paths traced (gpu: fused KDA kernels)")
    p.add_argument("--a2a-gbs", type=float, default=None,
                   help="per-device network bandwidth between nodes, GB/s a direction (default: the chip's; H200: 50)")
    p.add_argument("--nvlink-gbs", type=float, default=None,
                   help="per-device bandwidth inside a node (TPU: the ICI), GB/s per direction (default: the chip's)")
    p.add_argument("--state-only", action="store_true",
                   help="skip compiling the step for its activations (seconds to minutes): state, traffic, FLOPs")
    p.add_argument("--dump-dir", default=None,
                   help="target compile: keep XLA's dump of the compiled step here (HLO, buffer assignment, live ranges)")
    p.add_argument("--compile-to-the-end", action="store_true",
                   help="target compile: generate the machine code too and read memory_analysis() (the same "
                        "figures on a GPU, a few MB more on a TPU; minutes longer, XLA:TPU's for k3.yaml over 45) "
                        "instead of stopping after XLA's buffer assignment")
    p.add_argument("--exchange-changes", action="store_true",
                   help="instead of the plan: the expert-parallel exchange before each of its changes and after, "
                        "per token and MoE layer and per step (train/plan/communication.py, BENCHMARKS.md)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--json-out", default=None, metavar="PATH",
                   help="also write the report's JSON to PATH (one compile gives the text and the JSON)")
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    a = p.parse_intermixed_args(argv)
    # the plan compiles for compile-only devices, never this machine's: with no GPU or TPU here,
    # JAX's plugins are kept from probing for hardware (--compiler host then runs on the CPU)
    cpu_unless_accelerator()
    try:
        if a.devices <= 0:
            raise ConfigError(f"must be positive, got {a.devices}", "--devices")
        for flag, v in (("--batch", a.batch), ("--seq", a.seq)):
            if v is not None and v <= 0:
                raise ConfigError(f"must be positive, got {v}", flag)
        # --seq is the rows' length: the config's checks (mesh.context) judge that length
        seq = [f"data.seq_len={a.seq}"] if a.seq else []
        cfg = load_config(a.config, _mesh_overrides(a.mesh) + seq + list(a.overrides))
        if a.exchange_changes:
            exchange_changes(cfg, a.config, a.devices, a.json)
            return 0
        target = a.target or (CHIPS[a.chip].platform if a.chip else "gpu")
        r = plan(cfg, a.devices, hbm_gb=a.hbm_gb, batch=a.batch, seq=a.seq, peak_tflops=a.peak_tflops,
                 headroom=a.headroom, target=target, chip=a.chip, compiler=a.compiler, a2a_gbs=a.a2a_gbs,
                 nvlink_gbs=a.nvlink_gbs, activations=not a.state_only, dump_dir=a.dump_dir,
                 compile_to_the_end=a.compile_to_the_end)
    except (ConfigError, FileNotFoundError) as e:
        print(f"k3jax-plan: {e}", file=sys.stderr)
        return 2
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(r, f, indent=2)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        _print(r, a.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
