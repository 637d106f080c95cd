"""Device meshes and logical-axis rules (the model pins activations with k3jax.layers.token_sharding)."""

from k3jax.sharding.mesh import AXES, BATCH_AXES, make_mesh, mesh_shape
from k3jax.sharding.rules import RULES, batch_sharding, fit_spec, logical_to_spec, param_specs, state_shardings

__all__ = ["AXES", "BATCH_AXES", "RULES", "batch_sharding", "fit_spec", "logical_to_spec", "make_mesh",
           "mesh_shape", "param_specs", "state_shardings"]
