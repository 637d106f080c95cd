"""The linear-attention mixer layer: KDA and its lineage behind one interface.

kind    recurrence                 decay gate                      q/k features
kda     delta rule (chunk_kda)     per channel  [B,T,H,K]          l2-norm
gated_deltanet  delta rule         per head     [B,T,H]            l2-norm
deltanet        delta rule         none                            l2-norm
linear  additive (no delta)        none                            ELU+1 (in the op)

Everything else is shared so the lineage is compared on equal terms: q/k/v
projections with a causal short conv + SiLU, sigmoid beta, the output RMSNorm over
head_dim gated by sigmoid(G) (full-rank `g_proj` in K3, low-rank `g_a_proj`/`g_b_proj`
in Kimi Linear), and `o_proj`. Parameter names follow the K3 release checkpoint.

Decay gates, z = f_b(f_a x) + dt_bias per channel (or a_proj x + dt_bias
per head for gated DeltaNet):
    lower_bound (K3):   g = lb * sigmoid(exp(A_log) * z)      in (lb, 0)
    softplus (Kimi L.): g = -exp(A_log) * softplus(z)         in (-inf, 0)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax import ops
from k3jax.config import ConfigError
from k3jax.layers import decode_gemv
from k3jax.layers.cache import LayerCache
from k3jax.layers.common import EMBED, HEAD_DIM, HEADS, LORA, Dense, Dtypes, fill_param, uniform_param
from k3jax.layers.conv import ShortConv
from k3jax.layers.norms import l2_normalize, rms_normalize
from k3jax.layers import context_parallel as cp
from k3jax.ops.decode_kernels import kda_layer, kda_step
from k3jax.ops.decode_kernels.common import interpret, log_once, resolve_impl
from k3jax.ops.kda_kernels.common import Tuning
from k3jax.ops.remat_names import KDA_OUT

L2_EPS = 1e-6  # q and k's l2 norm: eps inside the sum, as fla's l2norm (k3jax.layers.norms.l2_normalize)

LINEAR_MIXERS = ("kda", "gated_deltanet", "deltanet", "linear")

_OPS = {  # kind -> (chunked form, recurrent form)
    "kda": (ops.chunk_kda, ops.recurrent_kda),
    "gated_deltanet": (ops.chunk_gated_deltanet, ops.recurrent_gated_deltanet),
    "deltanet": (ops.chunk_deltanet, ops.recurrent_deltanet),
    "linear": (ops.chunk_linear_attn, ops.recurrent_linear_attn),
}


def chunk_path(model_cfg) -> str | None:
    """Which form of the chunked operator this model's delta-rule layers take on this backend:
    "pallas (fused kernels)" or "xla (<why not the kernels>)"; None without such layers. The
    training CLI and the benchmarks report it (`model.kda.impl`)."""
    from k3jax.ops.delta_rule import select_impl
    from k3jax.ops.kda_kernels import unsupported_reason

    kinds = [k for k in set(model_cfg.mixers) if k in LINEAR_MIXERS and k != "linear"]
    if not kinds:
        return None
    c = model_cfg.kda
    x = jax.ShapeDtypeStruct((1, 1, c.num_heads, model_cfg.head_dim("kda")), jnp.bfloat16)
    paths = set()
    for kind in sorted(kinds):
        decay = {"kda": "channel", "gated_deltanet": "scalar"}.get(kind)
        bound = c.gate_lower_bound if (decay and c.gate == "lower_bound") else None
        args = dict(decay=decay, delta=True, decay_bound=bound, chunk_size=c.chunk_size)
        try:
            impl = select_impl(c.impl, x, x, name=kind, **args)
        except ValueError as e:  # impl=pallas where the kernels cannot run: name the key
            raise ConfigError(str(e), "model.kda.impl") from None
        if impl == "pallas":
            paths.add("pallas (fused kernels)")
        else:
            why = unsupported_reason(x, x, **args) if jax.default_backend() == "gpu" and c.impl != "xla" else None
            paths.add(f"xla ({why or ('model.kda.impl=xla' if c.impl == 'xla' else jax.default_backend())})")
    return ", ".join(sorted(paths))


def _call_op(fn, kind, q, k, v, g, beta, **kw):
    """fn with the lineage's positional signature: (q, k, v[, g][, beta])."""
    args = [q, k, v] + ([g] if kind in ("kda", "gated_deltanet") else []) + ([beta] if kind != "linear" else [])
    return fn(*args, **kw)


class DeltaMixer(nnx.Module):
    """x [B,T,d] (input_layernorm output) -> y [B,T,d]; cache = {state [B,H,K,K] fp32, conv_q/k/v [B,W-1,P]}."""

    def __init__(self, model_cfg, kind: str, *, rngs: nnx.Rngs):
        if kind not in LINEAR_MIXERS:
            raise ValueError(f"DeltaMixer: unknown kind {kind!r}; expected one of {LINEAR_MIXERS}")
        c = model_cfg.kda
        dt = Dtypes.of(model_cfg)
        d, H, K = model_cfg.d_model, c.num_heads, model_cfg.head_dim("kda")
        P = H * K
        std = model_cfg.init_std
        self.kind, self.num_heads, self.head_dim = kind, H, K
        self.gate_form, self.lower_bound = c.gate, c.gate_lower_bound
        self.chunk_size, self.eps, self.impl = c.chunk_size, model_cfg.rms_norm_eps, c.impl
        self.tuning = Tuning(keep_intermediates=int(c.kernel_residuals == "intermediates"))
        self.decode_impl = model_cfg.decode_impl
        self.compute = dt.compute
        dense = lambda i, o, axes, heads=0: Dense(i, o, axes, rngs=rngs, std=std, dtypes=dt, heads=heads)  # noqa: E731

        # q/k/v/g/o hold H heads' projections on their flat [H*K] side (`heads` metadata)
        self.q_proj = dense(d, P, (EMBED, HEADS), H)
        self.k_proj = dense(d, P, (EMBED, HEADS), H)
        self.v_proj = dense(d, P, (EMBED, HEADS), H)
        self.conv_size = c.conv_size
        if c.conv_size:
            self.q_conv1d = ShortConv(P, c.conv_size, rngs=rngs, impl=c.conv_impl)
            self.k_conv1d = ShortConv(P, c.conv_size, rngs=rngs, impl=c.conv_impl)
            self.v_conv1d = ShortConv(P, c.conv_size, rngs=rngs, impl=c.conv_impl)
        if kind != "linear":
            self.b_proj = dense(d, H, (EMBED, HEADS))
        if kind == "kda":
            rank = c.gate_rank or K
            self.f_a_proj = dense(d, rank, (EMBED, LORA))
            self.f_b_proj = dense(rank, P, (LORA, HEADS))
            self.A_log = uniform_param(rngs, (H,), (HEADS,), c.a_init_min, c.a_init_max, log=True)
            self.dt_bias = fill_param((P,), (HEADS,), c.dt_bias_init)
        elif kind == "gated_deltanet":
            self.a_proj = dense(d, H, (EMBED, HEADS))
            self.A_log = uniform_param(rngs, (H,), (HEADS,), c.a_init_min, c.a_init_max, log=True)
            self.dt_bias = fill_param((H,), (HEADS,), c.dt_bias_init)
        if c.output_gate == "full":
            self.g_proj = dense(d, P, (EMBED, HEADS), H)
        else:
            rank = c.output_gate_rank or K
            self.g_a_proj = dense(d, rank, (EMBED, LORA))
            self.g_b_proj = dense(rank, P, (LORA, HEADS), H)
            if c.output_gate_bias:  # fla's KDA layer: g_proj.1 has a bias, zero at init
                self.g_bias = fill_param((P,), (HEADS,), 0.0)
        self.o_norm = fill_param((K,), (HEAD_DIM,), 1.0)
        self.o_proj = dense(P, d, (HEADS, EMBED), H)

    # ----------------------------------------------------------------------------------

    def _decode_projections(self, x) -> dict | None:
        """In a decode step (k3jax.layers.decode_gemv), the projections of x in one gemv launch:
        q, k, v, the full-rank output gate's logits (fp32) and the decay's low-rank f_a. None
        elsewhere (b_proj's H outputs are too few for the kernel's blocks and stay in XLA)."""
        if not decode_gemv.active():
            return None
        names = ["q", "k", "v"]
        denses = [self.q_proj, self.k_proj, self.v_proj]
        outs = [None, None, None]
        if hasattr(self, "g_proj"):
            names.append("g")
            denses.append(self.g_proj)
            outs.append(jnp.float32)
        if self.kind == "kda":
            names.append("f_a")
            denses.append(self.f_a_proj)
            outs.append(None)
        return dict(zip(names, decode_gemv.dense_group(x, denses, out_dtypes=outs)))

    def _decay(self, x, pre: dict | None = None):
        """Log-decay g in fp32: [B,T,H,K] (kda) or [B,T,H] (gated_deltanet)."""
        B, T, _ = x.shape
        if self.kind == "kda":
            f_a = self.f_a_proj(x) if pre is None else pre["f_a"]
            z = self.f_b_proj(f_a, out_dtype=jnp.float32).reshape(B, T, self.num_heads, self.head_dim)
            z = z + self.dt_bias[...].reshape(self.num_heads, self.head_dim)
            A = jnp.exp(self.A_log[...])[:, None]
        else:
            z = self.a_proj(x, out_dtype=jnp.float32) + self.dt_bias[...]
            A = jnp.exp(self.A_log[...])
        if self.gate_form == "lower_bound":
            return self.lower_bound * jax.nn.sigmoid(A * z)
        return -A * jax.nn.softplus(z)

    def _features(self, x, segment_ids, cache, mesh, pre: dict | None = None):
        """Projected, convolved q, k, v [B,T,H,K] and the next conv windows. mesh: the context-
        parallel mesh (the convs take their halo from the upstream shard), or None. pre:
        `_decode_projections(x)`."""
        B, T, _ = x.shape
        out, windows = [], {}
        for name in ("q", "k", "v"):
            h = getattr(self, f"{name}_proj")(x) if pre is None else pre[name]
            # q and k are l2-normalised per head (linear attention's ELU+1 feature map lives in its op)
            qk = name != "v" and self.kind != "linear"
            normalized = False
            if self.conv_size:
                prev = None if cache is None else cache[f"conv_{name}"]
                conv = getattr(self, f"{name}_conv1d")
                if mesh is not None:
                    h, windows[f"conv_{name}"] = cp.short_conv(conv.weight[...], h, segment_ids, prev, mesh,
                                                               impl=conv.impl)
                elif qk:  # the conv and the norm under one backward (k3jax.layers.conv)
                    h, windows[f"conv_{name}"] = conv.normalized(h, segment_ids, prev, self.head_dim, L2_EPS)
                    normalized = True
                else:
                    h, windows[f"conv_{name}"] = conv(h, segment_ids, prev)
            h = h.reshape(B, T, self.num_heads, self.head_dim)
            if qk:
                h = (h if normalized else l2_normalize(h, L2_EPS)).astype(self.compute)
            out.append(h)
        q, k, v = out
        return q, k, v, windows

    def __call__(self, x, *, segment_ids, positions=None, cache=None, ctx=None, residual=None):
        """x [B,T,d]; segment_ids [B,T]; cache/ctx for prefill and decode (see layers/cache.py);
        residual [B,T,d] (optional): added to the output (in a decode step, by o_proj's kernel).

        Returns (y [B,T,d], next cache or None).
        """
        if cache is not None and x.shape[1] == 1 and decode_gemv.active():
            out = self._decode_layer(x, segment_ids, cache, ctx, residual)  # one kernel, projections to gate
            if out is not None:
                return out
        y, cache = self._forward(x, segment_ids=segment_ids, cache=cache, ctx=ctx)
        return (y if residual is None else y + residual), cache

    def _forward(self, x, *, segment_ids, cache=None, ctx=None):
        B, T, _ = x.shape
        view = single = fresh = None
        fused_step = False
        if cache is not None:
            view, single = LayerCache.of(cache)
            fused_step = T == 1 and self._step_kernel(view)
            # a new segment on the first token starts from an empty state and window (the fused
            # step zeroes its state itself: it reads the state only once)
            fresh = segment_ids[:, 0] != ctx.prev_segment_ids
            cache = {name: jnp.where(fresh.reshape((B,) + (1,) * (a.ndim - 2)), 0, view.get(name))
                     for name, a in view.arrays.items() if not (fused_step and name == "state")}
        # context parallelism: tokens split over mesh.context (whole shards of >= W-1 tokens)
        mesh = cp.context_mesh()
        if not cp.splits(mesh, T, max(self.conv_size - 1, 1)):
            mesh = None  # e.g. a decode step (T = 1): run on the whole row
        pre = self._decode_projections(x) if cache is not None and T == 1 else None
        q, k, v, windows = self._features(x, segment_ids, cache, mesh, pre)
        args = [q, k, v]
        if self.kind in ("kda", "gated_deltanet"):
            args.append(self._decay(x, pre))
        if self.kind != "linear":
            args.append(jax.nn.sigmoid(self.b_proj(x, out_dtype=jnp.float32)))
        chunk_fn, recurrent_fn = _OPS[self.kind]
        fn = recurrent_fn if (cache is not None and T == 1) else chunk_fn
        extra = {}
        if self.kind in ("kda", "gated_deltanet") and self.gate_form == "lower_bound":
            extra["decay_bound"] = self.lower_bound  # g > lower_bound by construction
        if self.kind != "linear":
            extra["impl"] = self.impl  # fused GPU kernels (auto) or XLA; the recurrent form ignores it
            extra["tuning"] = self.tuning  # what the fused kernels keep for the backward
        h0 = None if cache is None or fused_step else cache["state"]
        if fused_step:
            o, state = self._fused_step(view, q, k, v, args, fresh)
            view = view.put_stacked("state", state)
        elif mesh is not None and fn is chunk_fn:
            g_arg, b_arg = (args[3] if self.kind in ("kda", "gated_deltanet") else None), (
                args[-1] if self.kind != "linear" else None)
            op = functools.partial(_call_op, chunk_fn, self.kind, chunk_size=self.chunk_size, **extra)
            o, state = cp.recurrence(op, q, k, v, g_arg, b_arg, initial_state=h0, segment_ids=segment_ids,
                                     mesh=mesh)
        else:
            o, state = fn(*args, initial_state=h0, segment_ids=segment_ids, chunk_size=self.chunk_size, **extra)
        o = checkpoint_name(o, KDA_OUT)  # kept by remat=save_dots: the fused forward kernels do not run again

        # output norm over head_dim (weight shared by heads), gated by sigmoid(G), in fp32
        if hasattr(self, "g_proj"):
            G = self.g_proj(x, out_dtype=jnp.float32) if pre is None else pre["g"]
        else:
            G = self.g_b_proj(self.g_a_proj(x), out_dtype=jnp.float32)
            if hasattr(self, "g_bias"):
                G = G + self.g_bias[...]
        G = G.reshape(B, T, self.num_heads, self.head_dim)
        o = rms_normalize(o, self.eps) * self.o_norm[...] * jax.nn.sigmoid(G)
        y = self.o_proj(o.reshape(B, T, -1).astype(self.compute))
        if cache is None:
            return y, None
        if not fused_step:
            view = view.put("state", state)
        for name, w in windows.items():
            view = view.put(name, w)
        return y, view.result(single)

    def _decode_layer(self, x, segment_ids, cache, ctx, residual=None):
        """A decode step (one token per row) through `kda_decode_layer`: the input projections in
        one gemv launch (k3jax.layers.decode_gemv; XLA's dots past its rows), then one kernel for
        the convs, the l2 norms, the decay gate, beta, the state update and the gated output norm,
        then o_proj. None where the kernel does not apply (other kinds, no conv, a low-rank output
        gate, shapes it does not take): the caller takes the general path."""
        if self.kind != "kda" or not self.conv_size or not hasattr(self, "g_proj"):
            return None
        view, single = LayerCache.of(cache)
        windows = tuple(view.stacked(f"conv_{n}") for n in ("q", "k", "v"))
        f_a_shape = jax.ShapeDtypeStruct(x.shape[:1] + (self.f_a_proj.kernel.shape[-1],), x.dtype)
        if kda_layer.unsupported_reason(view.stacked("state"), x, f_a_shape, windows) is not None:
            return None
        B = x.shape[0]
        denses = [self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.f_a_proj]
        ys = decode_gemv.project(x, [d.kernel[...] for d in denses], [d.compute for d in denses])
        if ys is None:  # more rows than the gemv kernel takes: XLA's dots
            ys = [d(x, out_dtype=jnp.float32 if d is self.g_proj else None) for d in denses]
        proj = {n: y[:, 0] for n, y in zip(("q", "k", "v", "g", "f_a"), ys)}
        weights = {"conv_q": self.q_conv1d.weight, "conv_k": self.k_conv1d.weight, "conv_v": self.v_conv1d.weight,
                   "f_b": self.f_b_proj.kernel, "dt_bias": self.dt_bias, "A_log": self.A_log,
                   "b": self.b_proj.kernel, "o_norm": self.o_norm}
        params = {n: decode_gemv.stacked(w[...]) for n, w in weights.items()}  # read in place
        o, state, windows = kda_layer.kda_decode_layer(
            proj, x[:, 0], segment_ids[:, 0], ctx.prev_segment_ids, view.stacked("state"), windows, params,
            layer=view.layer, gate=self.gate_form,
            lower_bound=self.lower_bound, eps=self.eps, dtype=self.compute, interpret=interpret())
        view = view.put_stacked("state", state)
        for n, w in zip(("q", "k", "v"), windows):
            view = view.put_stacked(f"conv_{n}", w)
        return self.o_proj(o[:, None], residual=residual), view.result(single)

    def _step_kernel(self, view) -> bool:
        """Whether a decode step runs the fused kernel (model.decode_impl), logging once why not."""
        if resolve_impl(self.decode_impl) != "pallas":
            return False
        why = "linear attention has no delta rule" if self.kind == "linear" else kda_step.unsupported_reason(
            view.stacked("state"))
        if why and self.decode_impl == "pallas":
            raise ValueError(f"model.decode_impl=pallas: the fused {self.kind} step cannot run: {why}")
        if why:
            log_once(f"{self.kind} decode: XLA step ({why})")
        return not why

    def _fused_step(self, view, q, k, v, args, fresh):
        """One token through `kda_decode_step` on the stacked state -> (o [B,1,H,V], state [R,B,H,K,V])."""
        B, _, H, K = q.shape
        if self.kind == "kda":
            g = args[3][:, 0]
        elif self.kind == "gated_deltanet":
            g = jnp.broadcast_to(args[3][:, 0, :, None], (B, H, K))
        else:  # deltanet: no decay
            g = jnp.zeros((B, H, K), jnp.float32)
        if self.kind in ("kda", "gated_deltanet") and self.gate_form == "lower_bound":
            g = jnp.maximum(g, self.lower_bound)  # as the recurrent form clamps at its bound
        o, state = kda_step.kda_decode_step(view.stacked("state"), view.layer, q[:, 0], k[:, 0], v[:, 0], g,
                                            args[-1][:, 0], fresh, scale=K ** -0.5, interpret=interpret())
        return o[:, None].astype(v.dtype), state

    def init_cache(self, batch: int, max_len: int, dtype):
        del max_len  # constant-size state: the point of linear attention
        P = self.num_heads * self.head_dim
        cache = {"state": jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), jnp.float32)}
        if self.conv_size:
            for name in ("q", "k", "v"):
                cache[f"conv_{name}"] = jnp.zeros((batch, self.conv_size - 1, P), dtype)
        return cache
