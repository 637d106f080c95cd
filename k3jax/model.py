"""The K3 decoder: embedding, scanned stages of decoder layers, output AttnRes site, lm_head.

    model = K3Model(cfg.model, rngs=nnx.Rngs(0))
    logits, aux = model(tokens, segment_ids=seg)          # logits [B,T,V] fp32
    aux["router_stats"]                                    # per MoE layer, stacked [L_moe, ...]
    model(tokens, mla_max_logits=True)[1]["mla_max_logits"]  # per MLA layer [L_mla, H] (QK-Clip)

Decoding (prefill + decode_step) lives in `k3jax.decode`; it reuses `forward` with a cache.
The Quantile-Balancing router bias is one `RouterBias` array [L_moe, E] owned here
(state, not a parameter); the train step updates it from `router_stats`.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.attnres import AttnResSite
from k3jax.layers import decode_gemv
from k3jax.layers.block import DecoderLayer
from k3jax.layers.cache import DecodeContext, LayerCache
from k3jax.layers.context_parallel import planning_context_size
from k3jax.layers.decode_gemv import decode_step_scope
from k3jax.layers.common import EMBED, VOCAB, Dense, Dtypes, RouterBias, materialize, normal_param
from k3jax.layers.expert_parallel import MOE_EXCHANGE_RECEIVED
from k3jax.layers.moe import MOE_ROUTED_OUTPUT
from k3jax.layers.norms import RMSNorm
from k3jax.layout import Stage, num_attn_res_blocks, plan_stages
from k3jax.ops.planning import current_planning
from k3jax.ops.remat_names import SAVED_BY_SAVE_DOTS
from k3jax.segments import DEFAULT_ID, positions_from_segments
from k3jax.layers.token_sharding import constrain_rows, gather_tokens
from k3jax.layers.weight_gather import gather_layer_weights

CACHE_ALIGN = 64  # decode caches hold a multiple of this many slots

# named only with moe.ep_keep_results / moe.ep_keep_received: the expert exchange's results and
# what its dispatch received, kept so the recompute does not exchange them again
EXCHANGE_KEPT = (MOE_ROUTED_OUTPUT, MOE_EXCHANGE_RECEIVED)
_KEEP = jax.checkpoint_policies.save_only_these_names(*EXCHANGE_KEPT)
REMAT_POLICIES = {
    # save nothing but each layer's input (and what moe.ep_keep_results / ep_keep_received
    # name): recompute the layer in the backward pass
    "full": _KEEP,
    # the products of matmuls without batch dims, and the outputs of the kernels and custom
    # VJPs the policy cannot see into (KDA, flash attention, grouped GEMMs, fp32-output
    # matmuls), by name: k3jax.ops.remat_names
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*SAVED_BY_SAVE_DOTS, *EXCHANGE_KEPT)),
}


def trace_context() -> tuple:
    """What a layer's trace depends on besides its graph, state and arguments: k3jax-plan's
    planning contexts (k3jax.ops.planning, k3jax.layers.context_parallel), read at trace time."""
    return (current_planning(), planning_context_size())


@functools.lru_cache(maxsize=64)
def traced_layer(graphdef, policy, static: tuple, context: tuple):
    """One decoder layer as a function (state, carry, arrays) -> (carry, cache, aux), checkpointed
    under `policy` (None: not checkpointed), built once per kind of layer.

    Why: an unrolled stack (model.scan_layers=false) calls the same few kinds of layer many times.
    The same function object lets jit's trace cache return one jaxpr per kind, and JAX's AD and
    lowering caches (keyed on that jaxpr) then differentiate and lower it once instead of per layer:
    k3-small's unrolled train step (8 x 4096) traced and lowered in 30.5 s -> 16.2 s on a 2-core
    CPU, and k3jax-train's in 14.5 -> 9.3 s on an H100's host (benchmarks/results/
    traced-layers-h100-2026-12-07/). `inline=True` puts the layer's equations back into the
    caller's jaxpr, so XLA sees the same program as before: without it the nested calls cost
    XLA's passes more than the tracing saved (73.6 -> 86.5 s on that CPU). `static` (sorted
    (key, value) pairs: push, max_logits) and `context` are part of the key because they change
    the trace."""
    kw = dict(static)

    def run(state, carry, arrays):
        return nnx.merge(graphdef, state)(carry, cache=None, ctx=None, **arrays, **kw)

    if policy is not None:
        run = jax.checkpoint(run, policy=policy, prevent_cse=False)
    return jax.jit(run, inline=True)


class Unit(nnx.Module):
    """One repetition of a stage's layers (unrolled inside the scan body).

    push: which layers close an AttnRes block, when every repetition does it at the same
    layers (`Stage.static_pushes`); None when it depends on the repetition, which then passes
    its first layer's index and each layer decides (first_layer + j) % block_size == 0."""

    def __init__(self, cfg, specs, push: tuple[bool, ...] | None, *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(cfg, m, f, rngs=rngs) for m, f in specs])
        self.block_size = cfg.attn_res_block_size
        self.push = push
        self.moe_slots = tuple(j for j, (_, f) in enumerate(specs) if f == "moe")
        self.remat = cfg.remat

    def _apply(self, layer, carry, **kw):
        """One layer; under remat, a checkpoint per layer: the unit's backward pass keeps only
        the layer inputs (the AttnRes block buffer is one shared array, not a copy per layer).
        Without a cache, through `traced_layer` (one trace per kind of layer)."""
        if kw.get("cache") is not None or kw.get("ctx") is not None:
            return layer(carry, **kw)  # decoding (a cache, its context): no backward pass, no checkpoint
        kw.pop("cache"), kw.pop("ctx")
        arrays = {k: kw.pop(k) for k in ("bias", "segment_ids", "positions", "token_mask")}
        if isinstance(kw["push"], jax.Array):  # decided per repetition inside a scan: traced
            arrays["push"] = kw.pop("push")
        graphdef, state = nnx.split(layer)
        policy = None if self.remat == "none" else REMAT_POLICIES[self.remat]
        run = traced_layer(graphdef, policy, tuple(sorted(kw.items())), trace_context())
        return run(state, carry, arrays)

    def __call__(self, carry, *, biases, caches, segment_ids, positions, token_mask, ctx, max_logits=False,
                 first_layer=None, rep=None):
        """-> (carry, caches, aux): aux[name] stacks that output of the layers that have it,
        in layer order ("router_stats" [m_moe, ...], "mla_max_logits" [m_mla, H]).

        first_layer: int32 scalar, this repetition's first layer index (dynamic pushes only).
        caches: per unit layer, the stage's stacked cache arrays [R, ...]; rep (int32 scalar):
        this repetition, the slice each layer reads and writes (`LayerCache`)."""
        new_caches, per_layer = [], {}
        for j, layer in enumerate(self.layers):
            bias = biases[self.moe_slots.index(j)] if j in self.moe_slots else None
            push = self.push[j] if self.push is not None else (first_layer + j) % self.block_size == 0
            cache = None if caches is None else LayerCache(caches[j], rep)
            carry, c, aux = self._apply(layer, carry, push=push, bias=bias, segment_ids=segment_ids,
                                        positions=positions, token_mask=token_mask,
                                        cache=cache, ctx=ctx, max_logits=max_logits)
            carry = {k: constrain_rows(v, 1 if k == "blocks" else 0) if v.ndim > 1 else v for k, v in carry.items()}
            new_caches.append(c)
            for k, v in aux.items():
                per_layer.setdefault(k, []).append(v)
        aux = {k: jax.tree.map(lambda *x: jnp.stack(x), *v) for k, v in per_layer.items()}
        return carry, (None if caches is None else new_caches), aux


class StackedUnits(nnx.Module):
    """`repeat` copies of a Unit with stacked parameters, run by `lax.scan`."""

    def __init__(self, cfg, stage: Stage, *, rngs: nnx.Rngs):
        push = stage.static_pushes(cfg.attn_res_block_size)

        @nnx.split_rngs(splits=stage.repeat)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r):
            return Unit(cfg, stage.unit, push, rngs=r)

        self.units = make(rngs)
        self.remat = cfg.remat
        self.dynamic_push = push is None
        self.first_layers = tuple(stage.layer_index(r, 0) for r in range(stage.repeat))
        self.repeat = stage.repeat

    def __call__(self, carry, *, biases, caches, segment_ids, positions, token_mask, ctx, max_logits=False):
        graphdef, state = nnx.split(self.units)
        if caches is not None:
            # the stacked caches ride in the carry: each layer updates the slots it writes in
            # place (LayerCache); as scanned inputs/outputs every repeat would copy its cache
            # so do the parameters: each repeat slices them itself (decode_gemv.slice_stacked), so
            # the decode kernels can read a weight in place from its stacked array
            def cached_body(carry_caches, xs):
                carry, caches = carry_caches
                b, rep, first = xs
                with decode_gemv.stacked_scope():
                    unit = nnx.merge(graphdef, gather_layer_weights(decode_gemv.slice_stacked(state, rep)))
                    carry, caches, aux = unit(carry, biases=b, caches=caches, segment_ids=segment_ids,
                                              positions=positions, token_mask=token_mask, ctx=ctx, rep=rep,
                                              first_layer=first)
                return (carry, caches), aux

            reps = jnp.arange(self.repeat, dtype=jnp.int32)
            firsts = jnp.asarray(self.first_layers, jnp.int32) if self.dynamic_push else None
            (carry, caches), aux = jax.lax.scan(cached_body, (carry, caches), (biases, reps, firsts))
            return carry, (caches, aux)

        def body(carry, xs):
            unit_state, b, c, first = xs
            unit = nnx.merge(graphdef, gather_layer_weights(unit_state))
            carry, c, aux = unit(carry, biases=b, caches=c, segment_ids=segment_ids, positions=positions,
                                 token_mask=token_mask, ctx=ctx, max_logits=max_logits, first_layer=first)
            return carry, (c, aux)

        if self.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        first = jnp.asarray(self.first_layers, jnp.int32) if self.dynamic_push else None
        xs = (state, biases, caches, first)
        if self.repeat == 1:
            # one repetition (model.scan_layers=false puts every layer here): call the body once
            # instead of a scan of length 1. Same program, but tracing skips the scan's
            # linearize fixpoint, and lowering k3-small's step took 10.1 -> 7.8 s on a 2-core CPU
            carry, ys = body(carry, jax.tree.map(lambda x: x[0], xs))
            return carry, jax.tree.map(lambda y: y[None], ys)
        return jax.lax.scan(body, carry, xs)


class K3Model(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        problems = cfg.check()
        if problems:
            key, msg = problems[0]
            raise ValueError(f"model.{key}: {msg}")
        self.cfg = cfg
        dt = Dtypes.of(cfg)
        self.compute = dt.compute
        self.plan = plan_stages(cfg)
        self.embed_tokens = normal_param(rngs, (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED), cfg.init_std, dt.param)
        self.stages = nnx.List([StackedUnits(cfg, st, rngs=rngs) for st in self.plan])
        self.num_blocks = num_attn_res_blocks(cfg)
        if self.num_blocks:
            self.output_attn_res = AttnResSite(cfg.d_model, eps=cfg.rms_norm_eps, impl=cfg.attn_res_impl)
        self.norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, axis_name=EMBED)
        self.lm_head = Dense(cfg.d_model, cfg.vocab_size, (EMBED, VOCAB), rngs=rngs, std=cfg.init_std, dtypes=dt)
        self.moe_per_stage = tuple(len([1 for _, f in st.unit if f == "moe"]) for st in self.plan)
        self.num_moe_layers = sum(n * st.repeat for n, st in zip(self.moe_per_stage, self.plan))
        if self.num_moe_layers:
            self.router_bias = RouterBias(jnp.zeros((self.num_moe_layers, cfg.moe.num_experts), jnp.float32))

    # ------------------------------------------------------------------------------------

    def __call__(self, tokens, *, segment_ids=None, positions=None, token_mask=None, mla_max_logits: bool = False):
        """tokens [B,T] int -> (logits [B,T,V] fp32, aux): aux["router_stats"] stacked per MoE
        layer, aux["mla_max_logits"] [L_mla, H] fp32 per MLA layer in layer order: each head's
        largest scaled pre-softmax logit over the batch (QK-Clip's statistic, no gradient),
        computed only when `mla_max_logits` (static) is set; None otherwise or without such layers."""
        logits, _, aux = self.forward(tokens, segment_ids=segment_ids, positions=positions, token_mask=token_mask,
                                      mla_max_logits=mla_max_logits)
        return logits, aux

    def forward(self, tokens, *, segment_ids=None, positions=None, token_mask=None, caches=None, ctx=None,
                mla_max_logits: bool = False, head: bool = True):
        """-> (logits [B,T,V] fp32, caches, aux); head=False (static) returns the final norm's
        output [B,T,d] in place of the logits, for a loss that applies lm_head itself in
        chunks (`k3jax.ops.chunked_loss`)."""
        B, T = tokens.shape
        if segment_ids is None:  # one document per row (the segment contract: k3jax/segments.py)
            segment_ids = jnp.full((B, T), DEFAULT_ID, jnp.int32)
        if positions is None:
            positions = positions_from_segments(segment_ids)
        x = constrain_rows(jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.compute))
        if self.num_blocks:
            carry = {"prefix": x, "blocks": jnp.zeros((self.num_blocks,) + x.shape, x.dtype),
                     "num_blocks": jnp.zeros((), jnp.int32)}
        else:
            carry = {"h": x}
        bias_all = self.router_bias[...] if self.num_moe_layers else None
        offset, new_caches, per_layer = 0, [], {}
        for s, (stage, stacked) in enumerate(zip(self.plan, self.stages)):
            m = self.moe_per_stage[s]
            biases = None
            if m:
                biases = bias_all[offset:offset + m * stage.repeat].reshape(stage.repeat, m, -1)
                offset += m * stage.repeat
            carry, (c, aux) = stacked(carry, biases=biases, caches=None if caches is None else caches[s],
                                      segment_ids=segment_ids, positions=positions, token_mask=token_mask, ctx=ctx,
                                      max_logits=mla_max_logits)
            new_caches.append(c)
            for k, v in aux.items():  # [repeat, per unit, ...] -> [layers of the stage, ...], layer order
                per_layer.setdefault(k, []).append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), v))
        fused_head = head and decode_gemv.active()  # a decode step: the norm folded into a kernel
        if fused_head and self.num_blocks:  # the output AttnRes site and the norm: one kernel
            h = self.output_attn_res.mix_norm(carry["blocks"], carry["num_blocks"], carry["prefix"], self.norm)
            logits = self.lm_head(h, out_dtype=jnp.float32)
        elif fused_head:  # the norm and the head: one gemv kernel
            logits = decode_gemv.dense_group(carry["h"], [self.lm_head], out_dtypes=[jnp.float32], norm=self.norm)[0]
        else:
            if self.num_blocks:
                h = self.output_attn_res(carry["blocks"], carry["num_blocks"], carry["prefix"])
            else:
                h = carry["h"]
            h = gather_tokens(self.norm(h))  # the vocabulary-parallel head reads every token
            logits = self.lm_head(h, out_dtype=jnp.float32) if head else h
        aux = {k: jax.tree.map(lambda *a: jnp.concatenate(a), *per_layer[k]) if k in per_layer else None
               for k in ("router_stats", "mla_max_logits")}
        return logits, (None if caches is None else new_caches), aux

    # ------------------------------------------------------------------------------------
    # decode cache

    def init_cache(self, batch: int, max_len: int, dtype=None):
        """Zeroed decode state for `batch` sequences of up to `max_len` tokens.

        layers: per stage, per unit layer, the mixer's cache stacked over the stage's repeats;
        index: next cache slot; segment_ids [B,S] (-1 = empty); next_position [B].
        S is max_len rounded up to a multiple of CACHE_ALIGN (the attention kernels walk the
        cache in blocks of 64 slots; the extra slots stay empty).
        """
        dtype = dtype or self.compute
        max_len = -(-max_len // CACHE_ALIGN) * CACHE_ALIGN
        layers = []
        for stacked in self.stages:
            graphdef, state = nnx.split(stacked.units)
            per_rep = jax.vmap(lambda st: [l.self_attn.init_cache(batch, max_len, dtype)
                                           for l in nnx.merge(graphdef, st).layers])
            layers.append(per_rep(state))
        return {"layers": layers, "index": jnp.zeros((), jnp.int32),
                "segment_ids": jnp.full((batch, max_len), -1, jnp.int32),
                "next_position": jnp.zeros((batch,), jnp.int32)}

    def forward_cached(self, tokens, cache, *, segment_ids=None, last_only: bool = False):
        """Run tokens [B,T] (T >= 1) on top of `cache`; returns (logits [B,T,V], next cache).
        last_only (static): logits of the last token only, [B,1,V] (a prefill chunk: the
        [B,T,V] fp32 logits of a long chunk would outweigh everything else it computes).

        segment_ids [B,T] (optional) may start new documents; by default the tokens continue
        each row's last document. Positions continue inside a document and restart at 0.
        """
        B, T = tokens.shape
        index = cache["index"]
        prev = jnp.where(index > 0, jax.lax.dynamic_index_in_dim(cache["segment_ids"], index - 1, 1, False), -1)
        if segment_ids is None:
            segment_ids = jnp.broadcast_to(jnp.where(prev >= 0, prev, DEFAULT_ID)[:, None], (B, T))
        start = jnp.where(segment_ids[:, 0] == prev, cache["next_position"], 0)
        positions = positions_from_segments(segment_ids, start)
        kv_seg = jax.lax.dynamic_update_slice(cache["segment_ids"], segment_ids.astype(jnp.int32), (0, index))
        # the first slot of the first token's document: nothing before it is visible to the call
        first_slot = jnp.argmax(kv_seg == segment_ids[:, :1], axis=1).astype(jnp.int32)
        ctx = DecodeContext(index=index, kv_segment_ids=kv_seg, prev_segment_ids=prev, first_slot=first_slot)
        # one token per row: the projections take the gemv kernel (k3jax.layers.decode_gemv)
        scope = decode_step_scope(self.cfg, B) if T == 1 else contextlib.nullcontext()
        with scope:
            logits, layers, _ = self.forward(tokens, segment_ids=segment_ids, positions=positions,
                                             caches=cache["layers"], ctx=ctx, head=not last_only)
        if last_only:
            logits = self.lm_head(logits[:, -1:], out_dtype=jnp.float32)
        return logits, {"layers": layers, "index": index + T, "segment_ids": kv_seg,
                        "next_position": positions[:, -1] + 1}


def create_model(cfg, seed: int = 0, *, shardings=None) -> K3Model:
    """Build a K3Model with every parameter drawn in one compiled program (`materialize`).

    Same distributions as constructing `K3Model` directly, but one fused random draw
    (fast to compile), and `shardings` creates each array directly on its devices.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(seed))))
    init = jax.jit(lambda: materialize(abstract, jax.random.PRNGKey(seed)), out_shardings=shardings)
    return nnx.merge(graphdef, init())
