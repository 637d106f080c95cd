"""Training: data pipeline, train step, optimizer, checkpoints and the `k3jax-train` command."""
