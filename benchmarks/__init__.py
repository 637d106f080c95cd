"""k3jax's benchmark suite (benchmarks/README.md): run one with `python benchmarks/run.py NAME`."""
