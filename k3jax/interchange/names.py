"""The K3 release's tensor names and layouts, and where each tensor lives in a k3jax model.

One `Entry` per Hugging Face tensor. The plan is built from the model's *abstract* state
(`jax.eval_shape`), so naming the tensors of the full 2.78 T model allocates nothing.

Layout conventions of the release (PyTorch, HF):
- a linear layer's weight is [out, in]; k3jax kernels are [in, *out] (`kind="linear"`, the
  out axes flattened head-major);
- MLA's o_proj is [d, H*v]; k3jax keeps the heads in the kernel, [H, v, d] (`"heads_out"`);
- a depthwise short conv is [P, 1, W] (torch Conv1d); k3jax stores [W, P] (`"conv"`);
- `self_attn.A_log` is stored F32 zero-padded to a multiple of 128 entries (96 heads are
  written as 128 values); k3jax holds [H] (`"padded"`);
- the embedding is [V, d] in both (`"same"`), as are norm weights and other vectors;
- routed experts are one tensor per expert, `block_sparse_moe.experts.{e}.{w1,w2,w3}.weight`
  (w1 = gate, w3 = up, w2 = down); k3jax stacks them, w1/w3 [E, l, h] and w2 [E, h, l];
- the Quantile-Balancing router bias (k3jax state [L_moe, E]) is the release's
  `block_sparse_moe.gate.e_score_correction_bias` [E], one per MoE layer;
- each AttnRes site is an RMSNorm weight `*_res_norm.weight` [d] and a d->1 linear
  `*_res_proj.weight` [1, d] (k3jax: norm.weight [d], proj.kernel [d, 1]).

Scanned stages stack their layers on leading axes: `Entry.index` holds those leading
indices (the repeat, then the expert for routed experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from flax import nnx

from k3jax.layout import plan_stages
from k3jax.model_spec import model_spec

KINDS = ("same", "linear", "heads_out", "conv", "padded", "reshape")
A_LOG_PAD = 128  # the release stores A_log zero-padded to a multiple of this
# tensors the release keeps in fp32 whatever the export dtype
FP32_SUFFIXES = (".A_log", ".dt_bias", "_conv1d.weight", ".e_score_correction_bias")


@dataclass(frozen=True)
class Entry:
    """One HF tensor: `name`, HF `shape`, and its k3jax source: `group` ("params" or "rest"),
    `leaf` (keys into that pure dict), `index` (leading stacked indices into the leaf; the rest
    of the leaf, `inner`, is this tensor in k3jax layout) and `kind` (the layout relation, see
    the module docstring). `expert`: a routed-expert weight (written MXFP4 with --mxfp4)."""

    name: str
    shape: tuple[int, ...]
    group: str
    leaf: tuple
    index: tuple[int, ...]
    inner: tuple[int, ...]
    kind: str
    expert: bool = False

    @property
    def keep_fp32(self) -> bool:
        return self.name.endswith(FP32_SUFFIXES)


def hf_shape(kind: str, inner: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a k3jax slice of shape `inner` under `kind`."""
    if kind == "linear":
        return (math.prod(inner[1:]), inner[0])
    if kind == "heads_out":
        return (inner[2], inner[0] * inner[1])
    if kind == "conv":
        return (inner[1], 1, inner[0])
    if kind == "padded":
        return (-(-inner[0] // A_LOG_PAD) * A_LOG_PAD,)
    return tuple(inner)


def abstract_state(model_cfg):
    """(params, rest) of a model as nested dicts of ShapeDtypeStruct; nothing is allocated."""
    spec = model_spec(model_cfg)
    return nnx.to_pure_dict(spec.params), nnx.to_pure_dict(spec.rest)


def _get(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def _layer_entries(prefix: str, layer_tree: dict, leaf: tuple, index: tuple, mixer: str) -> list[Entry]:
    """Entries of one decoder layer from its (per-layer) subtree; `index` selects the layer."""
    out = []
    flat = jax.tree_util.tree_flatten_with_path(layer_tree)[0]
    for path, x in flat:
        p = tuple(k.key for k in path)
        inner = tuple(x.shape[len(index):])
        src = leaf + p
        if p[0] in ("self_attention_res", "mlp_res"):  # AttnRes site: {site}_norm / {site}_proj
            name = f"{p[0]}_{p[1]}.weight"
            kind = "linear" if p[-1] == "kernel" else "same"
        elif p[:2] == ("block_sparse_moe", "experts"):  # one tensor per routed expert
            for e in range(inner[0]):
                out.append(Entry(f"{prefix}.block_sparse_moe.experts.{e}.{p[2]}.weight",
                                 hf_shape("linear", inner[1:]), "params", src, index + (e,), inner[1:],
                                 "linear", expert=True))
            continue
        elif p[-1] == "kernel":
            name = ".".join(p[:-1]) + ".weight"
            kind = "heads_out" if (p == ("self_attn", "o_proj", "kernel") and mixer == "mla") else "linear"
        elif p == ("self_attn", "g_bias"):  # fla's bias on the low-rank output gate
            name, kind = "self_attn.g_b_proj.bias", "same"
        elif p == ("self_attn", "o_norm"):
            name, kind = "self_attn.o_norm.weight", "same"
        elif p == ("self_attn", "A_log"):
            name, kind = "self_attn.A_log", "padded"
        elif p[-1] == "weight" and p[-2].endswith("_conv1d"):
            name, kind = ".".join(p), "conv"
        else:  # RMSNorm weights, dt_bias, the router weight
            name = ".".join(p)
            kind = "linear" if p == ("block_sparse_moe", "gate", "weight") else "same"
        out.append(Entry(f"{prefix}.{name}", hf_shape(kind, inner), "params", src, index, inner, kind))
    return out


def release_plan(model_cfg, abstract=None) -> list[Entry]:
    """Every tensor of `model_cfg`'s K3-release checkpoint, in layer order (model-level
    tensors first, lm_head last). `abstract`: (params, rest) from `abstract_state`, if at hand."""
    params, rest = abstract if abstract is not None else abstract_state(model_cfg)
    out = [Entry("model.embed_tokens.weight", tuple(params["embed_tokens"].shape), "params", ("embed_tokens",),
                 (), tuple(params["embed_tokens"].shape), "same")]
    if "output_attn_res" in params:
        for part, kind in (("norm", "same"), ("proj", "linear")):
            key = "weight" if part == "norm" else "kernel"
            inner = tuple(params["output_attn_res"][part][key].shape)
            out.append(Entry(f"model.output_attn_res_{part}.weight", hf_shape(kind, inner), "params",
                             ("output_attn_res", part, key), (), inner, kind))
    moe_ordinal = 0
    for s, stage in enumerate(plan_stages(model_cfg)):
        for rep in range(stage.repeat):
            for j, (mixer, ffn) in enumerate(stage.unit):
                layer = stage.layer_index(rep, j)
                leaf = ("stages", s, "units", "layers", j)
                prefix = f"model.layers.{layer}"
                out += _layer_entries(prefix, _get(params, leaf), leaf, (rep,), mixer)
                if ffn == "moe":
                    E = rest["router_bias"].shape[1]
                    out.append(Entry(f"{prefix}.block_sparse_moe.gate.e_score_correction_bias", (E,), "rest",
                                     ("router_bias",), (moe_ordinal,), (E,), "same"))
                    moe_ordinal += 1
    inner = tuple(params["norm"]["weight"].shape)
    out.append(Entry("model.norm.weight", inner, "params", ("norm", "weight"), (), inner, "same"))
    inner = tuple(params["lm_head"]["kernel"].shape)
    out.append(Entry("lm_head.weight", hf_shape("linear", inner), "params", ("lm_head", "kernel"), (), inner,
                     "linear"))
    return out


def leaf_of(tree: dict, entry: Entry):
    return _get(tree, entry.leaf)
