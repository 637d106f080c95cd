"""The optimizer's part of a step, per device (k3jax-plan): Muon's Newton-Schulz FLOPs, its
collectives on each link, QK-Clip's max-logit pass, and the elementwise update, in seconds.

Newton-Schulz is counted from the very buckets the train step runs (`train.muon_mesh`: the
config's Muon leaves, their logical specs fitted to the mesh): per bucket, the whole matrices
each device orthogonalises (`exchange_schedule`: its share over the replicas, its chunks, the
zero matrices that pad a chunk to its exchange), times the FLOPs of one matrix's `ns_steps`
quintic steps on its wide side (rows <= cols):

    per step: A = X X^T (2 r^2 c), A^2 (2 r^3), P X (2 r^2 c)      ns_flops(r, c) = steps (4 r^2 c + 2 r^3)

`newton_schulz.flops_total` is every matrix once; `work_factor` = flops_per_device x devices /
flops_total is how far the busiest device is above an even share (1: none; more where a bucket
has fewer matrices than devices, or a chunk does not fill its exchange: zero matrices);
`repeated_factor` how many devices orthogonalise each matrix (1: each once; the buckets never
repeat one, it is there to say so).

Collectives, per device and direction, each all-to-all of the exchange sending (g-1)/g of its
array (the bucket's matrices in the Newton-Schulz dtype, padded as the code pads them), the
same bytes back, and the all-gather over the replicas receiving (R-1) x the replica's share.
A mesh axis is on NVLink when it and the axes inside it (the mesh's order: data, fsdp, expert,
context, tensor, innermost last) fit in one node, else on the network; on a TPU every axis is
ICI. Seconds: bytes / the link's bandwidth, serial (XLA keeps one collective in flight). On a GPU
the chunks let one chunk's exchange run under another's Newton-Schulz: `collectives_exposed` is
the exposure model of `train.plan.communication.pipeline_exposed` (nothing under the first
dispatch and the last return; the replicas' all-gather exposed). XLA:GPU's schedule of k3.yaml's
step (deviceless, 2026-12-03) runs all 93 of the optimizer's collectives asynchronously, 45 of
them with Newton-Schulz fusions between start and done (7.2 of 12.5 GB of their operands).
XLA:TPU's keeps 90 of them synchronous: on a TPU they are counted exposed in whole.

QK-Clip (optimizer.qk_clip_tau > 0): the blocked max-logit pass of every MLA layer in the
forward (`k3jax.ops.softmax_attn.causal_max_logits`: the query-key products of the blocks at and
below the diagonal, 2 D x block^2 x n(n+1)/2 a row and head, D = qk_nope + qk_rope; once: the
remat recompute does not need it), the max's all-reduce per micro-batch, and the clip itself
(elementwise on two kernels: left out).

Elementwise (memory-bound, at the chip's HBM bandwidth): Muon leaves read the gradient and the
momentum, write the momentum and the bf16 input of Newton-Schulz, read its result and the fp32
parameter and write it (24 B a parameter); AdamW leaves read gradient, both moments and
the parameter and write three (28 B); the global-norm clip reads every gradient (4 B).

`seconds_per_step` = Newton-Schulz at the peak + the collectives left exposed + QK-Clip's
pass at the peak + the elementwise pass: the optimizer's lower bound, added to the plan's step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.sharding.mesh import AXES
from train.muon import plan_groups
from train.muon_mesh import NS_CHUNKS, exchange_schedule
from train.optimizer import muon_dimension_numbers, muon_partition_spec, muon_view
from train.plan.communication import pipeline_exposed
from train.plan.estimate import abstract_run
from train.plan.memory import fake_mesh

MUON_BYTES_PER_PARAM = 24  # g, mu read; mu, bf16 mu_hat written; NS result, param read; param written
ADAMW_BYTES_PER_PARAM = 28  # g, mu, nu, param read; mu, nu, param written
CLIP_BYTES_PER_PARAM = 4  # the global norm reads every gradient
QK_CLIP_BLOCK = 512  # causal_max_logits' default block


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of `steps` quintic Newton-Schulz steps on one matrix, counted on its wide side."""
    r, c = min(rows, cols), max(rows, cols)
    return steps * (4.0 * r * r * c + 2.0 * r ** 3)


def axis_links(sizes: dict[str, int], target: str, devices_per_node: int) -> dict[str, str]:
    """The link each mesh axis's collectives run on: "ici" on a TPU; on GPUs "nvlink" when the
    axis and every axis inside it fit in one node of `devices_per_node`, else "network"."""
    if target == "tpu":
        return {a: "ici" for a in AXES}
    out, inner = {}, 1
    for a in reversed(AXES):  # innermost first
        inner *= sizes.get(a, 1)
        out[a] = "nvlink" if inner <= max(devices_per_node, 1) else "network"
    return out


def muon_leaves(cfg):
    """(names, leaves as ShapeDtypeStructs in the shape Muon sees them, MuonDimensionNumbers,
    logical PartitionSpecs) of the config's Muon parameters; empty for AdamW."""
    if cfg.optimizer.name != "muon":
        return [], [], [], []
    per_head = cfg.optimizer.muon_per_head
    names, leaves, dims, specs = [], [], [], []
    for path, var in nnx.to_flat_state(abstract_run(cfg).spec.params):
        d = muon_dimension_numbers(path, var, per_head)
        if d is None:
            continue
        shape, _ = muon_view(var, per_head)
        names.append("/".join(map(str, path)))
        leaves.append(jax.ShapeDtypeStruct(shape, var.get_value().dtype))
        dims.append(d)
        specs.append(muon_partition_spec(var, per_head))
    return names, leaves, dims, specs


def bucket_traffic(bucket, sizes: dict[str, int], links: dict[str, str], itemsize: int, chunks: int = NS_CHUNKS):
    """(the whole matrices each device orthogonalises, chunk by chunk, {link: bytes sent one way
    by the exchange}, {link: bytes received by the replicas' all-gather}) of one bucket."""
    R = math.prod(sizes[a] for a in bucket.replicas)
    group = tuple(sizes[a] for _, a in bucket.exchanges)
    share, plan = exchange_schedule(bucket.batch, R, group, chunks)
    piece = math.prod(bucket.piece) * itemsize
    exchange: dict[str, float] = {}
    for ch in plan:
        grown = 1  # each all-to-all concatenates a matrix dim: the pieces grow by its axis
        for (_, axis), g, n in zip(bucket.exchanges, group, ch.padded):
            link = links[axis]
            exchange[link] = exchange.get(link, 0.0) + n * grown * piece * (g - 1) / g
            grown *= g
    gather: dict[str, float] = {}
    done = 1
    for a in reversed(bucket.replicas):  # gathered minor axis first
        g = sizes[a]
        gather[links[a]] = gather.get(links[a], 0.0) + (g - 1) * done * share * piece
        done *= g
    return tuple(ch.matrices for ch in plan), exchange, gather


def rank_share(leaves, dims, specs, sizes: dict[str, int], *, steps: int, itemsize: int,
               links_gbs: dict[str, float] | None, devices_per_node: int, chunks: int = NS_CHUNKS) -> dict:
    """What one device of a GPU mesh of `sizes` runs of Muon's Newton-Schulz (`train.muon_mesh`,
    as `optimizer_plan` counts it) for these Muon leaves (ShapeDtypeStructs, their dimension
    numbers and logical specs, as `muon_leaves` gives them): {"buckets", "chunks": [(matrices,
    rows, cols)] in the order they run, wide, "flops", "all_gather_bytes": {link: bytes received},
    "all_gather_s": their time at `links_gbs` (None without)}. benchmarks/step/optimizer_step.py --ranks times
    these chunks on one GPU."""
    if math.prod(sizes.values()) < 2:
        raise ValueError(f"rank_share: a mesh of {sizes} is one device, where train.muon runs chains, not buckets")
    groups = plan_groups(leaves, dims, specs, mesh=fake_mesh(sizes))
    links = axis_links(sizes, "gpu", devices_per_node)
    out = {"buckets": len(groups.buckets), "chunks": [], "flops": 0.0, "all_gather_bytes": {}}
    for bucket in groups.buckets:
        per_chunk, _, gather = bucket_traffic(bucket, sizes, links, itemsize, chunks)
        out["chunks"] += [(n, bucket.rows, bucket.cols) for n in per_chunk]
        out["flops"] += sum(per_chunk) * ns_flops(bucket.rows, bucket.cols, steps)
        for link, b in gather.items():
            out["all_gather_bytes"][link] = out["all_gather_bytes"].get(link, 0.0) + b
    out["all_gather_s"] = None if links_gbs is None else \
        sum(b / (links_gbs[link] * 1e9) for link, b in out["all_gather_bytes"].items())
    return out


def optimizer_plan(cfg, sizes: dict[str, int], param_leaves, *, target: str, peak_tflops: float, hbm_tbps: float,
                   links_gbs: dict[str, float], devices_per_node: int, batch: int, seq: int,
                   chunks: int = NS_CHUNKS) -> dict:
    """The optimizer's FLOPs, collective bytes per link and seconds per device and step (module
    docstring). param_leaves: the parameters' `train.plan.memory.Leaf`s on this mesh (what one
    device updates); links_gbs: {"network"/"nvlink"/"ici": GB/s per direction}."""
    opt = cfg.optimizer
    names, leaves, dims, specs = muon_leaves(cfg)
    muon_names = set(names)
    param_count = sum(lf.bytes / lf.itemsize for lf in param_leaves)
    muon_params = sum(lf.bytes / lf.itemsize for lf in param_leaves if "/".join(map(str, lf.path)) in muon_names)
    num_devices = math.prod(sizes.values())
    links = axis_links(sizes, target, devices_per_node)
    peak = peak_tflops * 1e12
    out: dict = {"name": opt.name, "per_head": bool(opt.muon_per_head), "ns_steps": opt.muon_ns_steps,
                 "ns_dtype": opt.muon_dtype, "qk_clip_tau": opt.qk_clip_tau, "axis_links": links}
    per_link = {link: 0.0 for link in links_gbs}
    ns = {"matrices": 0, "flops_total": 0.0, "flops_per_device": 0.0, "work_factor": 1.0, "repeated_factor": 1,
          "buckets": []}
    collective_s = exposed_s = 0.0
    if leaves:
        groups = plan_groups(leaves, dims, specs, mesh=fake_mesh(sizes))
        itemsize = np.dtype(jnp.dtype(opt.muon_dtype)).itemsize
        for bucket in groups.buckets:
            f1 = ns_flops(bucket.rows, bucket.cols, opt.muon_ns_steps)
            total = sum(math.prod(groups.layouts[i].batch) for i in bucket.leaves)
            per_chunk, exchange, gather = bucket_traffic(bucket, sizes, links, itemsize, chunks)
            per_dev, n_chunks = sum(per_chunk), len(per_chunk)
            for link, b in exchange.items():
                per_link[link] += 2 * b  # there and back
            for link, b in gather.items():
                per_link[link] += b
            dispatch = sum(b / (links_gbs[link] * 1e9) for link, b in exchange.items())
            gather_s = sum(b / (links_gbs[link] * 1e9) for link, b in gather.items())
            q = per_dev * f1 / peak
            collective_s += 2 * dispatch + gather_s
            if target == "tpu":  # XLA:TPU runs them synchronously (module docstring)
                exposed = 2 * dispatch + gather_s
            else:
                exposed = pipeline_exposed(dispatch, dispatch, q, 0.0, n_chunks) + gather_s
            exposed_s += exposed
            ns["matrices"] += total
            ns["flops_total"] += total * f1
            ns["flops_per_device"] += per_dev * f1
            ns["buckets"].append({
                "matrix": [bucket.rows, bucket.cols], "matrices": total, "leaves": len(bucket.leaves),
                "example": names[bucket.leaves[0]],
                "exchange_axes": [a for _, a in bucket.exchanges], "replica_axes": list(bucket.replicas),
                "exchange_group": math.prod(sizes[a] for _, a in bucket.exchanges),
                "replicas": math.prod(sizes[a] for a in bucket.replicas),
                "matrices_per_device": per_dev, "chunks": n_chunks, "flops_per_device": per_dev * f1,
                "newton_schulz_s": q, "collective_bytes_per_device": {k: 2 * v for k, v in exchange.items()}
                | {f"{k} (replicas' all-gather)": v for k, v in gather.items()},
                "collectives_s": 2 * dispatch + gather_s, "exposed_s": exposed})
        if ns["flops_total"]:
            ns["work_factor"] = ns["flops_per_device"] * num_devices / ns["flops_total"]
        ns["buckets"].sort(key=lambda b: -(b["newton_schulz_s"] + b["exposed_s"]))
    ns_s = ns["flops_per_device"] / peak

    qk = {"flops_per_device": 0.0, "all_reduce_bytes_per_device": 0.0, "seconds": 0.0}
    mc = cfg.model
    L_mla = mc.mixers.count("mla")
    if opt.qk_clip_tau > 0 and L_mla:
        m = mc.mla
        D = m.qk_nope_head_dim + m.qk_rope_head_dim
        T = seq // sizes.get("context", 1)
        blk = min(QK_CLIP_BLOCK, T)
        n = -(-T // blk)
        per_row_head = 2.0 * D * blk * blk * (n * (n + 1) // 2)
        rows = batch // math.prod(sizes[a] for a in ("data", "fsdp", "expert"))
        heads = m.num_heads // sizes["tensor"] if m.num_heads % sizes["tensor"] == 0 else m.num_heads
        qk["flops_per_device"] = rows * heads * L_mla * per_row_head
        # one [L_mla, H] fp32 max per micro-batch, all-reduced (a ring moves about twice its bytes)
        qk["all_reduce_bytes_per_device"] = cfg.train.micro_batches * L_mla * m.num_heads * 4 * 2
        qk["seconds"] = qk["flops_per_device"] / peak

    elementwise_bytes = (MUON_BYTES_PER_PARAM * muon_params + ADAMW_BYTES_PER_PARAM * (param_count - muon_params)
                         + (CLIP_BYTES_PER_PARAM * param_count if opt.grad_clip > 0 else 0.0))
    elementwise_s = elementwise_bytes / (hbm_tbps * 1e12)

    seconds = {"newton_schulz": ns_s, "collectives_serial": collective_s, "collectives_exposed": exposed_s,
               "qk_clip": qk["seconds"], "elementwise": elementwise_s}
    out.update({
        "newton_schulz": ns,
        "qk_clip": qk,
        "flops_per_device": ns["flops_per_device"] + qk["flops_per_device"],
        "collective_bytes_per_device": per_link,
        "collective_seconds": {link: b / (links_gbs[link] * 1e9) for link, b in per_link.items()},
        "elementwise_bytes_per_device": elementwise_bytes,
        "seconds": seconds,
        "seconds_per_step": ns_s + exposed_s + qk["seconds"] + elementwise_s,
    })
    return out
