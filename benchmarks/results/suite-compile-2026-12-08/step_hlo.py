"""The tiny train step compiled by XLA:CPU at the suite's flags, its HLO written for
step_kernels_by_source.py (python step_kernels_by_source.py /tmp/fx/step.hlo 1 60)."""
import os, sys
os.environ["JAX_PLATFORMS"]="cpu"
os.environ["XLA_FLAGS"]="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_force_host_platform_device_count=8"
sys.path.insert(0, "/work/main")
import jax
from k3jax.config import load_config
from train.setup import prepare
TINY="/work/main/configs/k3-tiny.yaml"
cfg = load_config(TINY, ["model.layer_pattern=kda+mla","model.attn_res_block_size=2","model.d_model=64","model.moe.latent_dim=32","data.seq_len=32","train.batch_size=8","mesh.num_devices=1"]+sys.argv[1:])
setup = prepare(cfg)
with jax.set_mesh(setup.mesh):
    comp = setup.train_step(cfg, donate=False).lower(*setup.abstract_args(cfg)).compile()
txt = comp.as_text()
os.makedirs("/tmp/fx", exist_ok=True)
open("/tmp/fx/step.hlo", "w").write(txt)
