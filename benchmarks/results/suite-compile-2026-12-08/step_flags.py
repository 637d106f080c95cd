import os, sys, time
os.environ["JAX_PLATFORMS"]="cpu"
sys.path.insert(0, "/work/main/tests"); sys.path.insert(1, "/work/main")
import jax, numpy as np
from k3jax.config import load_config
from train.setup import prepare
from train.state import init_train_state
TINY="/work/main/configs/k3-tiny.yaml"
cfg = load_config(TINY, ["model.layer_pattern=kda+mla","model.attn_res_block_size=2","model.d_model=64","model.moe.latent_dim=32","data.seq_len=32","train.batch_size=8","mesh.num_devices=1"])
setup = prepare(cfg)
with jax.set_mesh(setup.mesh):
    low = setup.train_step(cfg, donate=False).lower(*setup.abstract_args(cfg))
    c1 = time.process_time(); t1=time.perf_counter()
    comp = low.compile()
    c2 = time.process_time(); t2=time.perf_counter()
    state = init_train_state(cfg, setup.spec, setup.tx, shardings=setup.shardings)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.model.vocab_size, (8, 33)).astype(np.int32)
    b = dict(tokens=tok[:, :-1], targets=tok[:, 1:], segment_ids=np.ones((8,32),np.int32), positions=np.tile(np.arange(32,dtype=np.int32),(8,1)), loss_mask=np.ones((8,32),np.float32))
    b = {k: jax.device_put(v, setup.rows) for k,v in b.items()}
    for _ in range(2): state, m = comp(state, b)
    t3=time.perf_counter()
    for _ in range(3): state, m = comp(state, b)
    jax.block_until_ready(m)
    t4=time.perf_counter()
print(f"{os.environ.get('XLA_FLAGS','')!r}: compile {c2-c1:.1f}cpu {t2-t1:.1f}s  run {(t4-t3)/3*1e3:.0f}ms/step loss {float(m['loss']):.6f}", flush=True)
