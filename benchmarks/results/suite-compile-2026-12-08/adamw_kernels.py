import os
os.environ["JAX_PLATFORMS"]="cpu"
os.environ["XLA_FLAGS"]="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
import jax, jax.numpy as jnp, re, collections
params = {f"w{i}": jnp.ones((64, 32+i)) for i in range(10)}
def step(p, mu, nu, g, n, lr, t):
    g = jax.tree.map(lambda x: x / n, g)
    norm = jnp.sqrt(sum(jnp.sum(x*x) for x in jax.tree.leaves(g)))
    scale = jnp.minimum(1.0, 1.0 / norm)
    def one(p, m, v, g):
        g = g * scale
        m = 0.9*m + 0.1*g; v = 0.999*v + 0.001*g*g
        u = (m / (1-0.9**t)) / (jnp.sqrt(v/(1-0.999**t)) + 1e-8) + 0.1*p
        return p - lr*u, m, v
    out = jax.tree.map(one, p, mu, nu, g)
    return out
txt = jax.jit(step).lower(params, params, params, params, 2.0, 1e-3, 1.0).compile().as_text()
entry = txt[txt.index("ENTRY"):]
ops = re.findall(r"= \S+ (\w[\w-]*)\(", entry)
print(len(ops), collections.Counter(ops).most_common(8))
