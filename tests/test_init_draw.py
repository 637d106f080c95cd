"""k3jax.layers.common.materialize: a model's parameters drawn from their `init` metadata in one
random draw per distribution; that draw computed once into a buffer (not fused into every
parameter's slice of it) unless it is larger than MATERIALIZED_DRAW_MAX."""

from pathlib import Path

import jax
import numpy as np
from flax import nnx

import k3jax.layers.common as common
from k3jax.config import load_config
from k3jax.model import K3Model

TINY = Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml"
CFG = load_config(TINY, ["model.layer_pattern=kda + mla", "model.attn_res_block_size=1", "model.d_model=32",
                         "model.moe.latent_dim=16"]).model


def _draw(abstract):
    """-> (the lowered program's text, the drawn state): traced once, compiled once."""
    lowered = jax.jit(lambda: common.materialize(abstract, jax.random.PRNGKey(3))).lower()
    return lowered.as_text(), lowered.compile()()


def test_each_parameter_follows_its_init_and_the_buffer_changes_no_value(monkeypatch):
    abstract = nnx.split(nnx.eval_shape(lambda: K3Model(CFG, rngs=nnx.Rngs(0))))[1]
    text, drawn = _draw(abstract)
    assert "optimization_barrier" in text  # a small model's draw: one buffer
    monkeypatch.setattr(common, "MATERIALIZED_DRAW_MAX", 0)  # every draw "too large": fused as before
    text, fused = _draw(abstract)
    assert "optimization_barrier" not in text
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    pairs = list(zip(jax.tree.leaves(abstract, is_leaf=is_var), jax.tree.leaves(drawn, is_leaf=is_var),
                     jax.tree.leaves(fused, is_leaf=is_var)))
    kinds = set()
    for spec, a, b in pairs:
        x, y = np.asarray(a.get_value(), np.float64), np.asarray(b.get_value(), np.float64)
        np.testing.assert_array_equal(x, y)  # same random bits, either way
        init = spec.get_metadata().get("init") or ("fill", 0.0)
        kinds.add(init[0])
        assert x.shape == spec.get_value().shape
        if init[0] == "fill":
            assert np.all(x == init[1])
        elif init[0] == "normal" and x.size >= 1024:  # sample std within 5 standard errors
            std = init[1]
            assert abs(x.std() / std - 1) < 5 / np.sqrt(2 * x.size), (x.std(), std)
            assert abs(x.mean()) < 5 * std / np.sqrt(x.size)
        elif init[0] == "uniform":
            _, low, high, log = init
            lo, hi = (np.log(low), np.log(high)) if log else (low, high)
            assert np.all((x >= lo - 1e-6) & (x <= hi + 1e-6)), (x.min(), x.max(), lo, hi)
    assert {"normal", "uniform", "fill"} <= kinds  # the test met each kind
    # different parameters take different slices of the draw: no two normal tensors start alike
    starts = [np.asarray(a.get_value()).ravel()[:4].tobytes() for s, a, _ in pairs
              if (s.get_metadata().get("init") or ("",))[0] == "normal"]
    assert len(set(starts)) == len(starts)
