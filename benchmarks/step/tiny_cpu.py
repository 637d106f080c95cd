"""Compile time and step time of one k3-tiny forward+backward, on whatever backend is present.

    python -m benchmarks.step.tiny_cpu [--batch 8] [--seq 128] [key=value ...]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import load_config
from k3jax.model import create_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/k3-tiny.yaml")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    cfg = load_config(a.config, a.overrides).model
    t0 = time.perf_counter()
    model = create_model(cfg)
    t_init = time.perf_counter() - t0
    graphdef, state = nnx.split(model)

    def loss(state, tokens):
        logits, _ = nnx.merge(graphdef, state)(tokens)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    step = jax.jit(jax.value_and_grad(loss))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (a.batch, a.seq), 0, cfg.vocab_size)
    t0 = time.perf_counter()
    compiled = step.lower(state, tokens).compile()
    t_compile = time.perf_counter() - t0
    jax.block_until_ready(compiled(state, tokens))
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(state, tokens))
        times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    print(f"{a.config} B={a.batch} T={a.seq} backend={jax.default_backend()} jax {jax.__version__}")
    print(f"init {t_init:.2f} s   compile fwd+bwd {t_compile:.2f} s   step {med * 1e3:.1f} ms "
          f"({a.batch * a.seq / med:,.0f} tokens/s)")


if __name__ == "__main__":
    main()
