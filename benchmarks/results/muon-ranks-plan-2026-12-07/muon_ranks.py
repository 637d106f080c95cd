"""Per-head Muon's Newton-Schulz on k3-small when the update is sharded over N data-parallel
ranks (mesh data=N, parameters replicated): train/muon_mesh's buckets and chunks for that mesh,
the FLOPs of the busiest rank, and the bytes of the replicas' all-gather of the results. Pure
shapes: nothing is run. A record of the 2026-12-07 session (no GPU lease came); the measured
form is `python -m benchmarks.step.optimizer_step --variants adamw,muon_head --ns --ranks 8`.

    PYTHONPATH=. python benchmarks/results/muon-ranks-plan-2026-12-07/muon_ranks.py > ranks.txt
"""
import math
import types

import jax
import jax.numpy as jnp

import train.muon as muon
from benchmarks.step.optimizer_step import per_head_leaves
from k3jax.sharding.mesh import AXES
from train.muon_mesh import exchange_schedule
from train.plan.memory import fake_mesh
from train.plan.optimizer import ns_flops

cfg, _, shapes, dims, specs = per_head_leaves(types.SimpleNamespace(config="configs/k3-small.yaml", overrides=[]))
steps = cfg.optimizer.muon_ns_steps
leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
one = muon.plan_groups(leaves, dims, specs)
total = sum(sum(math.prod(one.layouts[i].batch) for i in idx) * ns_flops(*one.layouts[idx[0]].matrix, steps)
            for idx in one.chains.values())
print(f"one device: {len(one.chains)} chains, {total / 1e12:.3f} TFLOP")
for n in (2, 4, 8, 16):
    sizes = {ax: 1 for ax in AXES} | {"data": n}
    groups = muon.plan_groups(leaves, dims, specs, mesh=fake_mesh(sizes))
    flop = gather = 0.0
    chunks = 0
    for b in groups.buckets:
        replicas = math.prod(sizes[x] for x in b.replicas)
        share, plan = exchange_schedule(b.batch, replicas, tuple(sizes[x] for _, x in b.exchanges))
        chunks += len(plan)
        flop += sum(ch.matrices for ch in plan) * ns_flops(b.rows, b.cols, steps)
        gather += (replicas - 1) * share * math.prod(b.piece) * 2  # bf16 results
    print(f"data={n}: {len(groups.buckets)} buckets, {chunks} chunks, {flop / 1e12:.3f} TFLOP per rank "
          f"({flop * n / total:.3f} x an even share), all-gather {gather / 1e9:.3f} GB received per rank")
