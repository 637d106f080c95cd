import os, sys, re, collections
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
open("/tmp/fx/step.hlo","w").write(txt)
# computations: count instructions in non-fusion computations that are "kernels": fusion, and non-trivial ops
comps = re.split(r"\n(?=\S.*\{\n)", txt)
kern = collections.Counter(); total=0
for c in comps:
    head = c.split("\n",1)[0]
    if "fused_computation" in head or head.startswith("HloModule"): 
        if not head.startswith("HloModule"): continue
    for line in c.split("\n")[1:]:
        m = re.match(r"\s+(?:ROOT )?\S+ = \S+ (\w[\w-]*)\(", line)
        if not m: continue
        op = m.group(1)
        if op in ("parameter","get-tuple-element","tuple","constant","bitcast","copy-start","copy-done"): continue
        total += 1
        src = re.search(r'source_file="([^"]+)" source_line=(\d+)', line)
        name = re.search(r'op_name="([^"]+)"', line)
        key = (src.group(1).split("/work/main/")[-1].split("site-packages/")[-1] if src else "?")
        kern[key] += 1
print("kernels", total)
for k,v in kern.most_common(30): print(v, k)
