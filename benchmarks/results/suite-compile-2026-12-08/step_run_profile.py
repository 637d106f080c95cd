import os, sys, time, glob, gzip, json, collections
os.environ["JAX_PLATFORMS"]="cpu"
sys.path.insert(0, "/work/main")
import jax, numpy as np
from k3jax.config import load_config
from train.setup import prepare
from train.state import init_train_state
cfg = load_config("/work/main/configs/k3-tiny.yaml", sys.argv[1:] + ["mesh.num_devices=1"])
setup = prepare(cfg)
B, T = cfg.train.batch_size, cfg.data.seq_len
with jax.set_mesh(setup.mesh):
    comp = setup.train_step(cfg, donate=False).lower(*setup.abstract_args(cfg)).compile()
    state = init_train_state(cfg, setup.spec, setup.tx, shardings=setup.shardings)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.model.vocab_size, (B, T+1)).astype(np.int32)
    b = dict(tokens=tok[:, :-1], targets=tok[:, 1:], segment_ids=np.ones((B,T),np.int32), positions=np.tile(np.arange(T,dtype=np.int32),(B,1)), loss_mask=np.ones((B,T),np.float32))
    b = {k: jax.device_put(v, setup.rows) for k,v in b.items()}
    for _ in range(2): s2, m = comp(state, b)
    jax.block_until_ready(m)
    t0=time.perf_counter()
    for _ in range(3): s2, m = comp(state, b)
    jax.block_until_ready(m); print("step ms", (time.perf_counter()-t0)/3*1e3, flush=True)
    jax.profiler.start_trace("/tmp/fx/tr", create_perfetto_trace=True)
    for _ in range(2): s2, m = comp(state, b)
    jax.block_until_ready(m)
    jax.profiler.stop_trace()
f = glob.glob("/tmp/fx/tr/**/*.trace.json.gz", recursive=True)[-1]
ev = json.load(gzip.open(f))
evs = ev["traceEvents"] if isinstance(ev, dict) else ev
d = collections.Counter(); n = collections.Counter()
for e in evs:
    if e.get("ph") == "X":
        d[e["name"]] += e.get("dur", 0); n[e["name"]] += 1
for k, v in d.most_common(40): print(f"{v/2e3:9.2f} ms/step {n[k]//2:6d}  {k[:110]}")
import re
agg = collections.Counter(); cnt = collections.Counter()
for k, v in d.items():
    if k.startswith(("Thunk", "$", "Pjit", "Common")): continue
    base = re.sub(r"[.]\d+$", "", k)
    agg[base] += v; cnt[base] += n[k]
tot = sum(agg.values())
print("total kernel ms/step", tot/2e3)
for k, v in agg.most_common(30): print(f"{v/2e3:9.2f} ms/step {cnt[k]//2:6d}  {k}")
