"""The eval set: held-out batches drawn once at start-up and kept on the devices.

Every evaluation of a run reads the same rows, so its curve moves only with the model. The
rows come from the eval split (documents held out by `data.eval_fraction`, shuffled in a
window of about one pass so that each batch mixes documents; train/data/pipeline.py) and
number `logging.eval_batches` x `train.batch_size`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


class EvalSet:
    def __init__(self, data, batches: int, put: Callable[[dict], dict]):
        """data: the eval split's batches (ShardedData); put: host batch -> global device arrays."""
        host = [next(data) for _ in range(batches)]
        # each row holds one piece or more: more of this host's rows than one pass over its
        # documents has pieces means the set repeats some
        self.repeats = sum(len(b["tokens"]) for b in host) > data.pieces_per_pass
        self.documents = data.documents
        self.batches = [put(b) for b in host]
        # target tokens, all hosts: a sum over the global arrays (every process runs it)
        self.tokens = int(sum(jax.device_get(jnp.sum(b["loss_mask"])) for b in self.batches))

    def describe(self, every: int) -> str:
        docs = f" drawn from the {self.documents:,} held-out documents" if self.documents else ""
        note = (" (more rows than the held-out documents fill: some repeat; raise data.eval_fraction)"
                if self.repeats else "")
        return (f"eval: {len(self.batches)} batches, {self.tokens:,} target tokens{docs}, the same rows every "
                f"{every} steps{note}")

    def evaluate(self, eval_fn, state) -> dict:
        """Mean loss / accuracy per target token over the eval set."""
        tot = {"loss_sum": 0.0, "correct": 0.0, "tokens": 0.0}
        outs = [eval_fn(state, b) for b in self.batches]  # dispatched together, read once
        for out in jax.device_get(outs):
            for k in tot:
                tot[k] += float(out[k])
        n = max(tot["tokens"], 1.0)
        return {"loss": tot["loss_sum"] / n, "accuracy": tot["correct"] / n}

