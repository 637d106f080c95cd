"""Per-head Muon's Newton-Schulz on k3-small when the update is sharded over N data-parallel
ranks (mesh data=N, parameters replicated): what one rank runs, as the planner counts it
(`train.plan.optimizer.rank_share`: train/muon_mesh's buckets and chunks), and the bytes of the
replicas' all-gather of the results, on H200 nodes of 8. Pure shapes: nothing is run. A record
of the 2026-12-07 session (no GPU lease came); the measured form is
`python -m benchmarks.step.optimizer_step --variants adamw,muon_head --ns --ranks 8`.

    PYTHONPATH=. python benchmarks/results/muon-ranks-plan-2026-12-07/muon_ranks.py > ranks.txt
"""
import math
import types

import jax
import jax.numpy as jnp

from benchmarks.step.optimizer_step import per_head_leaves
from k3jax.chips import CHIPS
from k3jax.sharding.mesh import AXES
from train.muon import layout
from train.plan.optimizer import ns_flops, rank_share

cfg, _, shapes, dims, specs = per_head_leaves(types.SimpleNamespace(config="configs/k3-small.yaml", overrides=[]))
leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
h200 = CHIPS["h200"]
plan = lambda n: rank_share(leaves, dims, specs, {ax: 1 for ax in AXES} | {"data": n},  # noqa: E731
                            steps=cfg.optimizer.muon_ns_steps, itemsize=jnp.dtype(cfg.optimizer.muon_dtype).itemsize,
                            links_gbs={"nvlink": h200.intra_node_gbs, "network": h200.inter_node_gbs},
                            devices_per_node=h200.devices_per_node)
total = sum(math.prod(lay.batch) * ns_flops(*lay.matrix, cfg.optimizer.muon_ns_steps)
            for lay in (layout(x, d) for x, d in zip(leaves, dims)))
print(f"one device: {total / 1e12:.3f} TFLOP")
for n in (2, 4, 8, 16):
    p = plan(n)
    gather = ", ".join(f"{link} {b / 1e9:.3f} GB" for link, b in p["all_gather_bytes"].items())
    print(f"data={n}: {p['buckets']} buckets, {len(p['chunks'])} chunks, {p['flops'] / 1e12:.3f} TFLOP per rank "
          f"({p['flops'] * n / total:.3f} x an even share), all-gather received per rank: {gather} "
          f"({p['all_gather_s'] * 1e3:.2f} ms at the chip table's bandwidths)")
