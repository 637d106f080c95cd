"""Muon's Newton-Schulz on fake 8-device CPU meshes: the compiled per-device FLOPs (XLA's cost
analysis) against the one-device program's, and the largest difference from one device's result.
k3-tiny cut to one KDA and one MLA layer (25 Muon leaves, per-head Muon), fp32 Newton-Schulz.

    PYTHONPATH=. python benchmarks/results/k3-plan-2026-12-03b/muon_fake_mesh.py
"""
import os
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from k3jax.config import MeshConfig, load_config  # noqa: E402
from k3jax.model_spec import model_spec  # noqa: E402
from k3jax.sharding import make_mesh  # noqa: E402
from k3jax.sharding.rules import fit_spec  # noqa: E402
from train.muon import orthogonalize  # noqa: E402
from train.optimizer import muon_dimension_numbers, muon_partition_spec, muon_view  # noqa: E402

cfg = load_config("configs/k3-tiny.yaml", ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2",
                                           "model.d_model=64", "model.moe.latent_dim=32", "optimizer.name=muon",
                                           "optimizer.muon_per_head=true"])
leaves, dims, specs = [], [], []
rng = np.random.default_rng(0)
for path, var in nnx.to_flat_state(model_spec(cfg.model, 0).params):
    d = muon_dimension_numbers(path, var, True)
    if d is None:
        continue
    shape, _ = muon_view(var, True)
    leaves.append(jnp.asarray(rng.standard_normal(shape), jnp.float32))
    dims.append(d)
    specs.append(muon_partition_spec(var, True))
fn = lambda *x: orthogonalize(list(x), dims, steps=5, specs=specs, dtype=jnp.float32)  # noqa: E731
one = jax.jit(fn).lower(*leaves).compile()
flops_one = one.cost_analysis()["flops"]
want = one(*leaves)
print(f"one device: {flops_one:.4e} FLOPs, {len(leaves)} leaves")
for sizes in [dict(data=1, fsdp=2, expert=2, tensor=2), dict(data=2, fsdp=2, expert=1, tensor=2),
              dict(data=1, fsdp=8, expert=1, tensor=1), dict(data=1, fsdp=1, expert=8, tensor=1),
              dict(data=1, fsdp=1, expert=1, tensor=8), dict(data=8, fsdp=1, expert=1, tensor=1)]:
    mesh = make_mesh(MeshConfig(**sizes))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, NamedSharding(mesh, fit_spec(s, x.shape, mesh))) for x, s in zip(leaves, specs)]
        t0 = time.time()
        compiled = jax.jit(fn).lower(*args).compile()
        got = compiled(*args)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want))
    text = compiled.as_text()
    print(f"{sizes}: per device {compiled.cost_analysis()['flops'] / flops_one:.3f} x one device's FLOPs "
          f"(ideal 0.125); {text.count('all-to-all(')} all-to-alls, {text.count('all-gather(')} all-gathers; "
          f"max |difference| {err:.1e}; compiled in {time.time() - t0:.0f} s")
