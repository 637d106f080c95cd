"""Memory of one device's training step (k3jax-plan): the train state's leaves as the sharding
rules split them (`state_leaves`, exact), and the activations, measured by compiling the step.

The gradient of the loss is compiled for this process's backend, on abstract inputs (nothing
is allocated), for a model with one device's shapes: widths that the sharding rules split
over `tensor` (heads, MLP widths, vocabulary) divided by it, the experts one device holds
under expert parallelism, and the rows one device holds in one micro-batch. XLA's buffer assignment then gives the temporaries of the whole forward
and backward pass as the code runs them: what the backward keeps under the config's remat
policy, the logits and their gradient, attention scores where the code materialises them,
the expert matmuls' padding, every layer's transient buffers. Nothing here re-derives a layer.

Where the target's program cannot be compiled here, the term is analytic and says so
(`activation_terms`):
- FSDP's gathered weights (3 x the largest layer's: in use, prefetched, gradient before its
  reduce-scatter; `gathered_layer_bytes`);
- capacity-dispatched expert parallelism, whose exchange buffers hold capacity_factor x the
  rows the compiled (dropless, one-device) expert path holds;
- the fused GPU KDA kernels (Triton compiles only on a GPU): the compile uses a stand-in with
  their inputs and outputs and what they keep for the backward (their inputs), and their
  backward workspace is added for one layer at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from k3jax.config.schema import ModelConfig, replace
from k3jax.layers.common import EXPERT
from k3jax.model_spec import model_spec
from k3jax.sharding.mesh import AXES
from k3jax.sharding.rules import state_shardings
from k3jax.tree_paths import plain_path
from train.plan.communication import exchange_plan
from train.plan.estimate import abstract_run

F32 = 4


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


# ------------------------------------------------------------------------------------------
# the train state


def fake_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """A mesh with axis sizes and names only: enough for `state_shardings`, no devices needed."""
    return AbstractMesh(tuple(sizes.get(a, 1) for a in AXES), AXES)


@dataclass(frozen=True)
class Leaf:
    path: tuple
    shape: tuple
    itemsize: int
    spec: tuple          # PartitionSpec entries, one per dim
    axes: tuple | None   # logical axis names of a parameter (trailing dims)
    bytes: float         # per device


def _spec_div(entry, sizes, keep=None) -> int:
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    return math.prod(sizes.get(a, 1) for a in axes if keep is None or keep(a))


def state_leaves(cfg, sizes: dict[str, int]) -> dict[str, list[Leaf]]:
    """Per-device bytes of every leaf of the train state, grouped by top-level key."""
    spec, tx, state, _ = abstract_run(cfg)
    shardings = state_shardings(fake_mesh(sizes), spec, tx, state)
    logical = {plain_path(p): tuple(v.get_metadata().get("axes", ()))
               for p, v in nnx.to_flat_state(spec.params)}
    out: dict[str, list[Leaf]] = {}
    for group in ("params", "rest", "opt_state", "step", "rng"):
        flat_sh = jax.tree_util.tree_flatten_with_path(shardings[group])[0]
        flat = jax.tree_util.tree_flatten_with_path(state[group])[0]
        sh_by_path = {plain_path(p): s for p, s in flat_sh}
        leaves = []
        for p, leaf in flat:
            path = plain_path(p)
            pspec = tuple(sh_by_path[path].spec) if path in sh_by_path else ()
            pspec = pspec + (None,) * (len(leaf.shape) - len(pspec))
            div = math.prod(_spec_div(e, sizes) for e in pspec)
            nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize / div
            leaves.append(Leaf(path, tuple(leaf.shape), leaf.dtype.itemsize, pspec,
                               logical.get(path) if group == "params" else None, nbytes))
        out[group] = leaves
    return out


def gathered_layer_bytes(cfg, leaves: list[Leaf], sizes: dict[str, int]) -> tuple[float, str]:
    """The largest layer's weights as the FSDP all-gathers leave them on a device: sharded only
    over `tensor`, and routed experts over `expert`. Dense kernels are cast to the compute dtype
    before the gather; routed experts (gathered inside the shard_map) and the fp32 router are not."""
    compute = np.dtype(cfg.model.compute_dtype).itemsize
    per_layer: dict[str, float] = {}
    for lf in leaves:
        stacked = lf.path[0] == "stages"
        name = f"layer {lf.path[1]}.{lf.path[4]}" if stacked else str(lf.path[0])
        axes = lf.axes or ()
        named = (None,) * (len(lf.shape) - len(axes)) + tuple(axes)
        div = 1
        for entry, logical in zip(lf.spec, named):
            div *= _spec_div(entry, sizes, lambda a, lg=logical: a == "tensor" or (a == "expert" and lg == EXPERT))
        itemsize = lf.itemsize if EXPERT in axes else min(lf.itemsize, compute)
        reps = lf.shape[0] if stacked else 1
        per_layer[name] = per_layer.get(name, 0.0) + math.prod(lf.shape) / reps * itemsize / div
    name = max(per_layer, key=per_layer.get)
    return per_layer[name], name


# ------------------------------------------------------------------------------------------
# activations (the host compile)


def activation_terms(cfg, sizes: dict[str, int], B_local: int, micro: int, T: int, gathered: float,
                     target: str) -> dict[str, float]:
    """Named activation terms in bytes per device; the first is compiled, the others analytic
    (their names say so). See the module docstring and train/plan/cli.py's."""
    mc = cfg.model
    local = per_device_model(mc, sizes["tensor"], sizes["expert"])
    rows = B_local // micro
    C = sizes.get("context", 1)
    T = T // C  # a context shard
    n = rows * T
    cm = compile_gradient(local, rows, T, target, C, loss_chunk=cfg.train.loss_chunk)
    shard = f", one of {C} context shards (keys and state summaries of all {C})" if C > 1 else ""
    terms = {f"compiled ({cm.backend}): forward + backward of {rows} x {T} tokens at one device's shapes{shard}, "
             f"remat={mc.remat}": float(cm.temp)}
    workspace = fused_kda_workspace(local, n, target)
    if workspace:
        terms["analytic: fused KDA kernels' backward workspace, one layer (Triton compiles only on a GPU)"] = \
            float(workspace)
    moe = mc.moe
    has_moe = any(mc.ffn_kind(i) == "moe" for i in range(mc.num_layers))
    if has_moe and sizes["expert"] > 1 and moe.ep_dispatch == "capacity" and moe.ep_capacity_factor > 1:
        c = np.dtype(mc.compute_dtype).itemsize
        width = moe.latent_dim or mc.d_model
        terms["analytic: expert-parallel capacity rows beyond the dropless ones, one MoE layer"] = \
            (moe.ep_capacity_factor - 1) * n * moe.top_k * (width + 3 * local.moe.expert_hidden) * c
    if has_moe and sizes["expert"] > 1 and moe.ep_keep_received and mc.remat != "none":
        # the compiled one-device program has no exchange: what remat keeps of it, every MoE layer
        L_moe = sum(1 for i in range(mc.num_layers) if mc.ffn_kind(i) == "moe")
        kept = exchange_plan(cfg, sizes, B_local * T, target=target)["kept_bytes_per_device"]["received"]
        terms["analytic: the exchange's receive buffers kept by remat (moe.ep_keep_received), every MoE layer"] = \
            L_moe * kept
    if has_moe and moe.qb_estimator == "exact":
        L_moe = sum(1 for i in range(mc.num_layers) if mc.ffn_kind(i) == "moe")
        terms["analytic: router stats of every micro-batch (exact QB: scores of every token)"] = \
            L_moe * B_local * T * (moe.num_experts * F32 + 1)
    if sizes["fsdp"] * sizes["expert"] * sizes.get("context", 1) > 1:
        terms["analytic: FSDP working set, 3 x the largest layer's gathered weights"] = 3 * gathered
    terms["analytic: the step's batch (5 int32 arrays)"] = B_local * T * 5 * 4
    return terms
