"""Decompose QB's violation at each step into: estimator (re-route the same batch with the new
bias, old weights), batch change (next batch, new bias, old weights) and weight drift (next batch,
new bias, new weights: what the next step actually sees)."""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from k3jax.config import load_config
from k3jax.layers import qb
from k3jax.segments import not_padding
from train.setup import prepare
from train.state import init_train_state
from train.step import BATCH_KEYS, make_train_step
from train.data.sharded import ShardedData

cfg = load_config(sys.argv[1], sys.argv[3:])
steps = int(sys.argv[2])
setup = prepare(cfg)
state = init_train_state(cfg, setup.spec, setup.tx)
step_fn = jax.jit(make_train_step(cfg, setup.spec, setup.tx, setup.schedule))
data = ShardedData(cfg, split="train", process_index=0, process_count=1)

@jax.jit
def route(params, rest, batch):
    model = setup.spec.model_from(params, rest)
    _, _, aux = model.forward(batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"],
                              token_mask=not_padding(batch["segment_ids"]), head=False)
    st = aux["router_stats"]
    return qb.max_violation(st["load"]), qb.router_health(st)

batch = {k: jnp.asarray(v) for k, v in next(data).items() if k in BATCH_KEYS}
out = open(sys.argv[1].replace("/", "_") + ".decomp.jsonl" if False else os.environ.get("DECOMP_OUT", "/tmp/decomp.jsonl"), "w")
for t in range(1, steps + 1):
    new, m = step_fn(state, batch)
    nxt = {k: jnp.asarray(v) for k, v in next(data).items() if k in BATCH_KEYS}
    rest_new_bias = {**state["rest"], "router_bias": new["rest"]["router_bias"]}
    est, _ = route(state["params"], rest_new_bias, batch)
    smp, _ = route(state["params"], rest_new_bias, nxt)
    act, h = route(new["params"], new["rest"], nxt)
    is_router = lambda path: any(getattr(k, "key", None) == "gate" for k in path) and getattr(path[-1], "key", None) == "weight"
    mix_r = jax.tree_util.tree_map_with_path(lambda p, a, b: b if is_router(p) else a, state["params"], new["params"])
    mix_o = jax.tree_util.tree_map_with_path(lambda p, a, b: a if is_router(p) else b, state["params"], new["params"])
    only_router, _ = route(mix_r, new["rest"], nxt)
    only_rest, _ = route(mix_o, new["rest"], nxt)
    row = {"step": t, "loss": float(m["loss"]), "actual_step_viol": np.asarray(m["max_violation"]).tolist(),
           "estimator": np.asarray(est).tolist(), "next_batch": np.asarray(smp).tolist(),
           "next_weights": np.asarray(act).tolist(), "router_only": np.asarray(only_router).tolist(), "rest_only": np.asarray(only_rest).tolist(), "score_std": np.asarray(h["score_std"]).tolist(),
           "saturated": np.asarray(h["saturated"]).tolist()}
    out.write(json.dumps(row) + "\n"); out.flush()
    f = lambda k: " ".join(f"{x:.1f}" for x in row[k])
    print(f"{t:3d} {row['loss']:.3f} | est {f('estimator')} | batch {f('next_batch')} | weights {f('next_weights')} | router {f('router_only')} | rest {f('rest_only')}", flush=True)
    state, batch = new, nxt
