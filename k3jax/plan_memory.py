"""Activation memory of one device's training step, measured by compiling it (k3jax-plan).

The gradient of the loss is compiled for this process's backend, on abstract inputs (nothing
is allocated), for a model with one device's shapes: widths that the sharding rules split
over `tensor` (heads, MLP widths, vocabulary) divided by it, the experts one device holds
under expert parallelism, and the rows one device holds in one micro-batch. XLA's buffer assignment then gives the temporaries of the whole forward
and backward pass as the code runs them: what the backward keeps under the config's remat
policy, the logits and their gradient, attention scores where the code materialises them,
the expert matmuls' padding, every layer's transient buffers. Nothing here re-derives a layer.

Where the target's program cannot be compiled here, the term is analytic and says so:
- FSDP's gathered weights (3 x the largest layer's: in use, prefetched, gradient before its
  reduce-scatter; see `gathered_layer_bytes` in k3jax.plan);
- capacity-dispatched expert parallelism, whose exchange buffers hold capacity_factor x the
  rows the compiled (dropless, one-device) expert path holds;
- the fused GPU KDA kernels (Triton compiles only on a GPU): the compile uses a stand-in with
  their inputs and outputs and what they keep for the backward (their inputs), and their
  backward workspace is added for one layer at a time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config.schema import ModelConfig, replace


def _div(x: int, t: int) -> int:
    """A width split over `tensor` when it divides (the rules replicate it otherwise)."""
    return x // t if t > 1 and x % t == 0 else x


def per_device_model(mc: ModelConfig, tensor: int, expert: int = 1) -> ModelConfig:
    """The model with one device's activation shapes: widths split over `tensor` divided by it
    (head dims resolved first, so each head keeps its width), and under `expert`-way expert
    parallelism the experts one device holds. Its n tokens' n*k (token, expert) rows land, on
    average, on those experts; the compiled dropless path then holds the same rows over the
    same number of experts (at least k + 1 of them, which the router needs)."""
    moe = mc.moe
    changes = {}
    if expert > 1 and moe.num_experts % expert == 0:
        changes["moe.num_experts"] = max(moe.num_experts // expert, moe.top_k + 1)
    if tensor <= 1:
        return replace(mc, **changes) if changes else mc
    shared = moe.shared_hidden or moe.num_shared_experts * moe.expert_hidden
    return replace(mc, **changes, **{
        "vocab_size": _div(mc.vocab_size, tensor),
        "ffn_hidden": _div(mc.ffn_hidden, tensor),
        "kda.head_dim": mc.head_dim("kda"), "kda.num_heads": _div(mc.kda.num_heads, tensor),
        "attention.head_dim": mc.head_dim("attention"),
        "attention.num_heads": _div(mc.attention.num_heads, tensor),
        "attention.num_kv_heads": _div(mc.attention.num_kv_heads or mc.attention.num_heads, tensor),
        "mla.num_heads": _div(mc.mla.num_heads, tensor),
        "moe.expert_hidden": _div(moe.expert_hidden, tensor),
        "moe.shared_hidden": _div(shared, tensor) if shared else 0,
    })


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    temp: int        # XLA's temporaries: the activations and transients of forward + backward
    arguments: int   # the compiled function's inputs (the per-device model's params, a batch)
    outputs: int     # its outputs (the gradients)
    backend: str


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


@functools.lru_cache(maxsize=8)
def compile_gradient(mc: ModelConfig, rows: int, seq: int, target: str, context: int = 1,
                     loss_chunk: int = 0) -> CompiledMemory:
    """Compile d(loss)/d(params) for `rows` x `seq` tokens of model `mc` and read its memory.

    target: the backend the run will use ("gpu", "tpu", "cpu"); it selects the code paths
    (e.g. the fused KDA kernels' and flash attention's stand-ins for "gpu"). The compile itself
    is for this process's backend, which is the target's when planning on the target. context:
    with C > 1, `seq` is one context shard and the program is that shard's
    (`k3jax.layers.context_parallel.planning_context`: the MLA keys of all C shards, the KDA summaries
    of all C shards, collectives as local ops). loss_chunk: `train.loss_chunk`, the LM head's
    sequence chunk in the loss."""
    from k3jax.ops.chunked_loss import chunked_token_losses
    from k3jax.ops.planning import planning_for
    from k3jax.segments import not_padding
    from k3jax.layers.context_parallel import planning_context
    from train.state import model_spec

    spec = model_spec(mc)
    params = _abstract(nnx.to_pure_dict(spec.params))
    rest = _abstract(nnx.to_pure_dict(spec.rest))
    i32 = lambda: jax.ShapeDtypeStruct((rows, seq), jnp.int32)  # noqa: E731
    batch = {"tokens": i32(), "targets": i32(), "segment_ids": i32(), "positions": i32(),
             "loss_mask": jax.ShapeDtypeStruct((rows, seq), jnp.float32)}

    def loss(params, rest, batch):
        model = spec.model_from(params, rest)
        h, _, aux = model.forward(batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"],
                                  token_mask=not_padding(batch["segment_ids"]), head=False)
        ce, _, _, _ = chunked_token_losses(h, model.lm_head.kernel[...], batch["targets"], batch["loss_mask"], 0.0,
                                           chunk=loss_chunk, compute_dtype=model.compute)
        return ce, aux["router_stats"]

    with planning_for(target), planning_context(context):
        compiled = jax.jit(jax.grad(loss, has_aux=True)).lower(params, rest, batch).compile()
    ma = compiled.memory_analysis()
    return CompiledMemory(int(ma.temp_size_in_bytes), int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                          jax.default_backend())


def fused_kda_workspace(mc: ModelConfig, tokens: int, target: str) -> int:
    """The fused kernels' backward workspace for one layer (0 when they do not run there)."""
    from k3jax.layers.kda import chunk_path
    from k3jax.ops.kda_kernels.op import backward_workspace_bytes
    from k3jax.ops.planning import planning_for

    with planning_for(target):
        path = chunk_path(mc)
    if not path or "pallas" not in path:
        return 0
    K = mc.head_dim("kda")
    low = np.dtype(mc.compute_dtype).itemsize < 4
    return backward_workspace_bytes(tokens, mc.kda.num_heads, K, K, mc.kda.chunk_size, low,
                                    keep_intermediates=mc.kda.kernel_residuals == "intermediates")
