"""The routing statistics QB receives on the GPU kernel path against those of the XLA forms, on
one trained checkpoint and one batch: per MoE layer, the largest score difference, the share of
(token, expert) selections that differ, and the violation each path's load gives.

    python stats_kernel_vs_xla.py RUN_DIR OUT.json
"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from train.interchange.rundir import load_run_weights
from k3jax.layers import qb
from k3jax.segments import not_padding
from train.data.sharded import ShardedData
from train.setup import prepare
from train.step import BATCH_KEYS

XLA = ("model.kda.impl=xla", "model.kda.conv_impl=xla", "model.mla.impl=xla", "model.attn_res_impl=xla",
       "model.moe.grouped_matmul=ragged")
run_dir, out = sys.argv[1], sys.argv[2]
rows = {}
for name, overrides in (("kernel", ()), ("xla", XLA)):
    cfg, params, rest = load_run_weights(run_dir, overrides=("train.batch_size=8", "train.micro_batches=1") + overrides)
    spec = prepare(cfg).spec
    data = ShardedData(cfg, split="train", process_index=0, process_count=1)
    batch = {k: jnp.asarray(v) for k, v in next(data).items() if k in BATCH_KEYS}

    @jax.jit
    def stats(params, rest, batch):
        model = spec.model_from(params, rest)
        _, _, aux = model.forward(batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"],
                                  token_mask=not_padding(batch["segment_ids"]), head=False)
        return aux["router_stats"]
    rows[name] = jax.device_get(stats(params, rest, batch))
k, x = rows["kernel"], rows["xla"]
res = {"violation_kernel": np.asarray(qb.max_violation(k["load"])).tolist(),
       "violation_xla": np.asarray(qb.max_violation(x["load"])).tolist(),
       "load_l1_share": (np.abs(k["load"] - x["load"]).sum(-1) / (2 * k["load"].sum(-1))).tolist(),
       "hist_l1_share": (np.abs(k["hist"] - x["hist"]).sum((-1, -2)) / (2 * k["hist"].sum((-1, -2)))).tolist()
       if "hist" in k else None,
       "score_mean_abs_diff": (np.abs(k["score_sum"] - x["score_sum"]).sum(-1) / k["tokens"] / k["load"].shape[-1]).tolist()}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res))
