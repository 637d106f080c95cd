"""Is k3-small's remaining expert imbalance the data or the router's movement? Replays the
training batches through frozen checkpoints, with Quantile Balancing running as in training
(one step late) but no optimizer step: the router does not move, so the violation left is
what the batch-to-batch change in content alone gives.

Per replay (a checkpoint step and a QB update rate) and step t = 1..N: route batch t with the
replay's current bias (starting from the checkpoint's), record each MoE layer's max_violation,
hot expert and its share, then update the bias from batch t's statistics as train/step.py does
(micro-batches merged, the run's estimator; rate 1 = Su's rule, r < 1: b + r (b~ - b)). The
batches are the run's own training batches (same config, seed and loader, from step 1); every
replay sees the same batch at each step.

    python replay_frozen.py RUN_DIR OUT.jsonl [--steps 300] [--replays 190:1,300:1,300:0.5]
"""
import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers import qb
from train.data.sharded import ShardedData
from train.interchange.rundir import load_run_weights
from train.setup import prepare
from train.step import BATCH_KEYS, model_losses, split_micro_batches

p = argparse.ArgumentParser()
p.add_argument("run_dir"); p.add_argument("out")
p.add_argument("--steps", type=int, default=300)
p.add_argument("--replays", default="300:1", help="checkpoint_step:rate,...")
p.add_argument("--set", action="append", default=[])
a = p.parse_args()
replays = [(int(s), float(r)) for s, r in (x.split(":") for x in a.replays.split(","))]
weights = {}
for s in sorted({s for s, _ in replays}):
    weights[s] = load_run_weights(a.run_dir, step=s, overrides=tuple(a.set))
cfg = weights[replays[0][0]][0]
spec = prepare(cfg).spec
moe, micro = cfg.model.moe, cfg.train.micro_batches


@jax.jit
def replay_step(params, rest, batch, rate):
    model = spec.model_from(params, rest)
    mbs = split_micro_batches({k: batch[k] for k in BATCH_KEYS}, micro)

    def one(_, mb):
        *_, aux = model_losses(model, mb, cfg, 0.0)
        return None, aux["router_stats"]
    _, stats = jax.lax.scan(one, None, mbs)
    stats = functools.reduce(qb.merge_stats, [jax.tree.map(lambda x: x[i], stats) for i in range(micro)])
    bias = rest["router_bias"]
    target = qb.quantile_balance_update_stacked(stats, bias, top_k=moe.top_k, estimator=moe.qb_estimator,
                                                value_range=moe.qb_range)  # Su's rule: b~ - mean
    load = stats["load"]
    return {**rest, "router_bias": bias + rate * (target - bias)}, {
        "max_violation": qb.max_violation(load), "hot_expert": jnp.argmax(load, -1),
        "hot_share": jnp.max(load, -1) / jnp.sum(load, -1) * moe.top_k}


def read(data):
    return {k: jnp.asarray(v) for k, v in next(data).items() if k in BATCH_KEYS}


data = ShardedData(cfg, split="train", process_index=0, process_count=1)
rests = [weights[s][2] for s, _ in replays]
t0 = time.time()
batch = read(data)
with open(a.out, "w") as f:
    for step in range(1, a.steps + 1):
        outs = []
        for i, (s, rate) in enumerate(replays):  # dispatched; the next batch is read meanwhile
            rests[i], m = replay_step(weights[s][1], rests[i], batch, jnp.float32(rate))
            outs.append(m)
        if step < a.steps:
            batch = read(data)
        for (s, rate), m in zip(replays, jax.device_get(outs)):
            row = {"step": step, "checkpoint": s, "rate": rate, **{k: np.asarray(v).tolist() for k, v in m.items()}}
            f.write(json.dumps(row) + "\n")
        f.flush()
        if step % 25 == 0:
            print(f"step {step} at {time.time() - t0:.0f} s", flush=True)
