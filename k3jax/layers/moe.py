"""Stable LatentMoE: routed experts in a latent space, plus shared experts.

    z = W_down x                      [N, l]   (no projection when latent_dim == 0: l = d)
    u = sum_{e in topk(x)} p_e W2_e act(W1_e z, W3_e z)
    y = W_up RMSNorm_l(u) + shared(x)

The router sees the full-width x. The expert computation is a pure function of (z, routing,
weights) so that the expert-parallel version (`k3jax.layers.expert_parallel`: shard_map, a
node-aware exchange) replaces `routed_experts_dropless` under a mesh without touching the
module. The shared experts do not depend on the routed ones, so XLA runs them while the routed
rows are in flight. With model.qat=mxfp4 both fake-quantize
the expert GEMMs (MXFP4 weights, MXFP8 inputs; `k3jax.ops.mx`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from k3jax.layers import decode_gemv, qb
from k3jax.layers.activations import GatedMLP, apply_glu, glu_spec
from k3jax.layers.common import EMBED, EXPERT, EXPERT_MLP, LATENT, Dense, Dtypes, normal_param
from k3jax.layers.ep_exchange import mesh_platform
from k3jax.layers.expert_pairs import combine_pairs, dispatch_rows, sort_pairs
from k3jax.layers.expert_parallel import routed_experts_sharded
from k3jax.layers.moe_gather import routed_experts_gathered, use_gathered
from k3jax.layers.norms import RMSNorm
from k3jax.layers.router import Router
from k3jax.layers.token_sharding import constrain_tokens, flat_token_axes, flatten_tokens, unflatten_tokens
from k3jax.ops.decode_kernels import moe_experts
from k3jax.ops.decode_kernels.common import interpret
from k3jax.ops.grouped_matmul import grouped_glu_mlp
from k3jax.ops.mesh_axes import active_mesh
from k3jax.ops.mx import ExpertQuant, expert_quant
from k3jax.ops.remat_names import EXPERT_OUT

MOE_ROUTED_OUTPUT = "moe_routed_output"  # the name remat may keep (moe.ep_keep_results)


def routed_experts_dropless(z, topk_idx, topk_weight, w1, w3, w2, glu, compute_dtype=jnp.float32,
                            gmm: str = "auto", gmm_block: int = 512, qat: ExpertQuant | None = None,
                            weight_grad: str = "pallas", glu_grad: str = "xla"):
    """Dropless single-device dispatch. z [N,l], topk_idx [N,k] int, topk_weight [N,k] fp32,
    w1/w3 [E,l,H], w2 [E,H,l] -> u [N,l] fp32.

    The N*k (token, expert) pairs are sorted by expert so each expert's rows are contiguous,
    and grouped matmuls (`k3jax.ops.grouped_matmul`, group sizes = per-expert counts) run
    every pair; no capacity, nothing dropped. qat: the experts' fake quantization (see
    `grouped_glu_mlp`; the weights are quantized once, before the grouped matmul).
    """
    n_exp = w1.shape[0]
    order, _, _ = sort_pairs(topk_idx)
    group_sizes = jnp.bincount(topk_idx.reshape(-1), length=n_exp).astype(jnp.int32)
    # fp32 expert outputs: the weighted combine (and the norm after it) run in fp32
    rows = dispatch_rows(z.astype(compute_dtype), order, topk_idx.shape[-1])
    out = grouped_glu_mlp(rows, w1, w3, w2, group_sizes,
                          functools.partial(apply_glu, glu), compute_dtype=compute_dtype, impl=gmm, block=gmm_block,
                          qat=qat, weight_grad=weight_grad, glu_spec=glu, glu_grad=glu_grad)
    # both kept by remat=save_dots (k3jax.ops.remat_names): the combine's backward reads out, the
    # norm after it the sum
    out = checkpoint_name(out, EXPERT_OUT)
    return checkpoint_name(combine_pairs(out, order, topk_weight), EXPERT_OUT)


def routed_experts_dense_reference(z, topk_idx, topk_weight, w1, w3, w2, glu, compute_dtype=jnp.float32,
                                   qat: ExpertQuant | None = None):
    """Same result as `routed_experts_dropless`, computing every expert on every token and
    weighting by a dense [N,E] combine matrix (zero off the top-k)."""
    n_tok = z.shape[0]
    n_exp = w1.shape[0]
    combine = jnp.zeros((n_tok, n_exp), jnp.float32)
    combine = combine.at[jnp.arange(n_tok)[:, None], topk_idx].add(topk_weight.astype(jnp.float32))
    cd = compute_dtype
    zc = z.astype(cd)
    if qat is not None:
        w1, w3, w2, zc = qat.weight(w1), qat.weight(w3), qat.weight(w2), qat.input(zc)
    a = jnp.einsum("nd,edh->enh", zc, w1.astype(cd), preferred_element_type=cd)
    b = jnp.einsum("nd,edh->enh", zc, w3.astype(cd), preferred_element_type=cd)
    if qat is None:
        h = apply_glu(glu, a, b)
    else:
        h = qat.input(apply_glu(glu, a.astype(jnp.float32), b.astype(jnp.float32))).astype(cd)
    out = jnp.einsum("enh,ehd->end", h, w2.astype(cd), preferred_element_type=jnp.float32)
    return jnp.einsum("ne,end->nd", combine, out)


def routing_stats_sharded(scores, topk_idx, bias, mask, cutoff=None, **kw) -> dict:
    """`qb.routing_stats` of tokens split over the mesh (`constrain_tokens`): each device counts
    its own tokens and the counts are summed over the devices (one psum of E x bins numbers), so
    no device ever holds every token's [E] margins; the exact estimator's per-token scores stay
    split like the tokens. cutoff [N] (optional): each token's QB cutoff, as `qb.routing_stats`
    takes it. Without a mesh, `qb.routing_stats` itself."""
    mesh = active_mesh()
    axes = flat_token_axes(scores.shape[0], mesh) if mesh is not None else ()
    if not axes:
        return qb.routing_stats(scores, topk_idx, bias, mask, cutoff=cutoff, **kw)
    split = {"scores": P(axes, None), "mask": P(axes)}

    def local(scores, topk_idx, mask, bias, cutoff):
        stats = qb.routing_stats(scores, topk_idx, bias, mask, cutoff=cutoff, **kw)
        return {k: v if k in split else jax.lax.psum(v, axes) for k, v in stats.items()}

    keys = jax.eval_shape(lambda: qb.routing_stats(scores, topk_idx, bias, mask, cutoff=cutoff, **kw)).keys()
    return jax.shard_map(local, mesh=mesh, in_specs=(P(axes, None), P(axes, None), P(axes), P(),
                                                     None if cutoff is None else P(axes)),
                         out_specs={k: split.get(k, P()) for k in keys},
                         check_vma=False)(scores, topk_idx, mask, bias, cutoff)


class Experts(nnx.Module):
    """Stacked routed-expert weights: w1 (gate) / w3 (up) [E,l,H], w2 (down) [E,H,l].

    The input axis is named LATENT even when latent_dim == 0 (then l = d_model), so expert
    weights shard the same way with or without the latent projections.
    """

    def __init__(self, num_experts: int, width: int, hidden: int, *, rngs: nnx.Rngs, std: float,
                 dtypes: Dtypes):
        self.w1 = normal_param(rngs, (num_experts, width, hidden), (EXPERT, LATENT, EXPERT_MLP), std, dtypes.param)
        self.w3 = normal_param(rngs, (num_experts, width, hidden), (EXPERT, LATENT, EXPERT_MLP), std, dtypes.param)
        self.w2 = normal_param(rngs, (num_experts, hidden, width), (EXPERT, EXPERT_MLP, LATENT), std, dtypes.param)


class StableLatentMoE(nnx.Module):
    """Checkpoint names follow `block_sparse_moe.*` of the K3 release (experts w1 = gate,
    w3 = up, w2 = down)."""

    def __init__(self, model_cfg, *, rngs: nnx.Rngs):
        moe = model_cfg.moe
        d = model_cfg.d_model
        dt = Dtypes.of(model_cfg)
        std = model_cfg.init_std
        self.latent = moe.latent_dim > 0
        width = moe.latent_dim if self.latent else d
        self.gate = Router(model_cfg, rngs=rngs)
        if self.latent:
            self.routed_expert_down_proj = Dense(d, width, (EMBED, LATENT), rngs=rngs, std=std, dtypes=dt)
            self.routed_expert_up_proj = Dense(width, d, (LATENT, EMBED), rngs=rngs, std=std, dtypes=dt)
        else:
            self.routed_expert_down_proj = None
            self.routed_expert_up_proj = None
        # the "Stable" norm only exists in latent space (Kimi Linear has neither)
        use_norm = self.latent and moe.latent_norm
        self.routed_expert_norm = (RMSNorm(width, eps=model_cfg.rms_norm_eps, axis_name=LATENT)
                                   if use_norm else None)
        self.experts = Experts(moe.num_experts, width, moe.expert_hidden, rngs=rngs, std=std, dtypes=dt)
        shared = moe.shared_hidden or moe.num_shared_experts * moe.expert_hidden
        self.shared_experts = GatedMLP(d, shared, model_cfg, rngs=rngs) if shared > 0 else None
        self.glu = glu_spec(model_cfg)
        self.compute = dt.compute
        self.top_k = moe.top_k
        # without balancing only the load is counted: the estimators' statistics would be
        # unused, and need top_k < num_experts (the (k+1)-th score), which balance=none does not
        self.qb_estimator = moe.qb_estimator if moe.balance == "quantile" else "load"
        self.qb_bins = moe.qb_bins
        self.qb_range = float(moe.qb_range)
        self.ep_dispatch, self.ep_capacity_factor = moe.ep_dispatch, float(moe.ep_capacity_factor)
        self.ep_wire, self.ep_chunks, self.ep_devices_per_node = moe.ep_wire, moe.ep_chunks, moe.ep_devices_per_node
        self.ep_tensor, self.ep_keep_results = moe.ep_tensor, moe.ep_keep_results
        self.ep_keep_received = moe.ep_keep_received
        self.expert_nodes = moe.expert_nodes if moe.max_nodes_per_token else 0
        self.gmm, self.gmm_block, self.gmm_weight_grad = moe.grouped_matmul, moe.gmm_block, moe.gmm_weight_grad
        self.glu_grad = moe.glu_grad
        self.qat = expert_quant(model_cfg.qat, model_cfg.qat_scale_rule)  # None, or MXFP4 weights / MXFP8 inputs

    def _decode_projections(self, xf):
        """In a decode step (k3jax.layers.decode_gemv), everything the MoE computes from its
        input x in one gemv launch: the router's logits (fp32 operands, as Router's HIGHEST
        matmul), the latent down projection and the shared experts' gate and up halves, fp32.
        None elsewhere."""
        if not decode_gemv.active():
            return None
        names, weights, dtypes = ["router"], [self.gate.weight[...]], [jnp.float32]
        if self.latent:
            names.append("down")
            weights.append(self.routed_expert_down_proj.kernel[...])
            dtypes.append(self.compute)
        if self.shared_experts is not None:
            names += ["gate", "up"]
            weights += [self.shared_experts.gate_proj.kernel[...], self.shared_experts.up_proj.kernel[...]]
            dtypes += [self.shared_experts.gate_proj.compute] * 2
        ys = decode_gemv.project(xf, weights, dtypes)
        return None if ys is None else dict(zip(names, ys))

    def _decode_experts(self, logits, bias, z):
        """u [N, l] fp32 of a decode step's tokens through `moe_experts.routed_experts_decode`
        (routing from the logits, as Router; the routed experts' GLU MLPs, weighted), the
        weights and the bias read in place from their stacked arrays; None where the kernels do
        not apply (node-limited routing, shapes they do not take)."""
        if self.gate.max_nodes:
            return None
        ex = self.experts
        (w1, l1), (w3, l3), (w2, l2), (b, lb) = (decode_gemv.stacked(a) for a in (
            ex.w1[...], ex.w3[...], ex.w2[...], bias))
        if moe_experts.unsupported_reason(logits, z, w1) is not None:
            return None
        return moe_experts.routed_experts_decode(logits, b, z, w1, w3, w2, top_k=self.top_k, scaling=self.gate.scaling,
                                                 glu=self.glu, dtype=self.compute, layers=(l1, l3, l2, lb),
                                                 interpret=interpret())

    def __call__(self, x, bias, *, token_mask=None, residual=None):
        """x [B,T,d], bias [E] fp32 (this layer's QB row), token_mask [B,T] bool (False =
        padding; it only keeps padding out of the routing stats); residual [B,T,d] (optional): added
        to y (a decode step's residual stream: inside the shared experts' down projection's
        kernel) -> (y [B,T,d], stats).

        On a mesh x arrives as the residual stream holds it (`constrain_rows`: each device its
        own tokens, sequence-parallel over tensor), and everything per token stays there: the
        router, the latent projections and norm, the routing statistics (`routing_stats_sharded`)
        and the expert exchange run on the device's own tokens; only the shared experts, split
        over tensor like any MLP, gather their tokens over tensor."""
        B, T, d = x.shape
        xf = constrain_tokens(flatten_tokens(x))  # each device's own tokens, in mesh order
        pre = self._decode_projections(xf)  # a decode step: router, down and shared inputs in one launch
        logits = None if pre is None else pre["router"]
        # the histogram estimator's per-token cutoff comes from the router's own top-(k+1)
        cutoff = None
        if self.qb_estimator == "histogram":
            topk_idx, topk_weight, scores, cutoff = (constrain_tokens(a) for a in
                                                     self.gate(xf, bias, with_cutoff=True, logits=logits))
        else:
            topk_idx, topk_weight, scores = (constrain_tokens(a) for a in self.gate(xf, bias, logits=logits))
        if pre is not None and self.latent:
            z = pre["down"].astype(self.compute)
        else:
            z = self.routed_expert_down_proj(xf) if self.latent else xf.astype(self.compute)
        z = constrain_tokens(z)
        ex = self.experts
        mesh = active_mesh()
        if mesh is None and self.qat is None and use_gathered(B * T, self.top_k, ex.w1.shape[0]):
            # few tokens (a decode step): read only the routed experts' weights; in a decode step
            # with the kernels, routing and experts in two kernels (moe_experts), else XLA
            u = None if pre is None else self._decode_experts(pre["router"], bias,
                                                              pre["down"] if self.latent else xf)
            if u is None:
                u = routed_experts_gathered(z, topk_idx, topk_weight, ex.w1[...], ex.w3[...], ex.w2[...], self.glu,
                                            self.compute)
            dropped = jnp.zeros((), jnp.float32)
        elif mesh is None:
            u = routed_experts_dropless(z, topk_idx, topk_weight, ex.w1[...], ex.w3[...], ex.w2[...],
                                        self.glu, self.compute, self.gmm, self.gmm_block, qat=self.qat,
                                        weight_grad=self.gmm_weight_grad, glu_grad=self.glu_grad)
            dropped = jnp.zeros((), jnp.float32)
        else:  # one shard_map over the mesh: node-aware exchange over `expert`, local grouped matmuls
            u, drop_frac = routed_experts_sharded(z, topk_idx, topk_weight, ex.w1[...], ex.w3[...], ex.w2[...],
                                                  self.glu, self.compute, mesh=mesh,
                                                  capacity_factor=self.ep_capacity_factor,
                                                  dispatch=self.ep_dispatch, gmm=self.gmm,
                                                  gmm_block=self.gmm_block, qat=self.qat, wire=self.ep_wire,
                                                  weight_grad=self.gmm_weight_grad, glu_grad=self.glu_grad,
                                                  devices_per_node=self.ep_devices_per_node,
                                                  chunks=self.ep_chunks if mesh_platform(mesh) != "cpu" else 1,
                                                  expert_nodes=self.expert_nodes,
                                                  tensor=self.ep_tensor, keep_received=self.ep_keep_received)
            dropped = drop_frac * topk_idx.size
        if self.ep_keep_results:  # remat keeps it (k3jax/model.py): the recompute skips the exchange's return
            u = checkpoint_name(u, MOE_ROUTED_OUTPUT)
        norm = self.routed_expert_norm
        fast = None
        if self.latent and residual is not None and self.shared_experts is not None:
            # a decode step: the raw fp32 output, added (rounded first) in the shared down kernel
            fast = decode_gemv.project(u, [self.routed_expert_up_proj.kernel[...]], [self.compute],
                                       norm=None if norm is None else norm.weight[...],
                                       eps=1e-6 if norm is None else norm.eps)
        if fast is not None:
            y = fast[0]
        elif self.latent:  # the norm (fp32 in, fp32 out) folded into the projection's kernel in a decode step
            y = decode_gemv.dense_group(u, [self.routed_expert_up_proj], norm=norm)[0]
        else:
            y = (u if self.routed_expert_norm is None else self.routed_expert_norm(u)).astype(self.compute)
        y = constrain_tokens(y)
        if residual is not None:  # a decode step: y + shared + residual, the adds in the shared down kernel
            res = flatten_tokens(residual)
            if self.shared_experts is not None:
                y = self.shared_experts(xf, pre=None if pre is None else (pre["gate"], pre["up"]), addends=(y, res))
            else:
                y = y + res
        elif self.shared_experts is not None:
            with jax.named_scope("shared_experts"):  # profiles and the schedule (benchmarks/tools/a2a_schedule.py)
                # both ends pinned whole over tensor, then scattered back: the backward's cotangent
                # is gathered over tensor before the down projection's transpose (XLA otherwise
                # met the tensor-split tokens and tensor-split hidden there by gathering every
                # token of the micro-batch on every device: 60 GB per MoE layer for k3.yaml)
                shared = self.shared_experts(constrain_tokens(xf, sequence_parallel=False),
                                             pre=None if pre is None else (pre["gate"], pre["up"]))
                y = y + constrain_tokens(constrain_tokens(shared, sequence_parallel=False))
        mask = jnp.ones((B * T,), bool) if token_mask is None else flatten_tokens(token_mask).astype(bool)
        stats = routing_stats_sharded(scores, topk_idx, bias, constrain_tokens(mask), cutoff, top_k=self.top_k,
                                      estimator=self.qb_estimator, bins=self.qb_bins, value_range=self.qb_range)
        stats["dropped"] = jax.lax.stop_gradient(dropped)  # (token, expert) pairs over capacity
        stats["pairs"] = jnp.asarray(topk_idx.size, jnp.float32)  # every routed pair, padding tokens too
        return unflatten_tokens(y, B, T), stats
