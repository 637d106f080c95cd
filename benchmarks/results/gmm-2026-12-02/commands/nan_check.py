# k3-small's step with the weight-gradient kernel at a chosen block_k (diagnostic for a NaN loss)
import runpy, sys
block_k = int(sys.argv.pop(1))
import k3jax.ops.grouped_matmul_configs as c
c.SM90_CONTRACT.update(block_k=block_k)
sys.argv[0] = "benchmarks/train_step.py"
runpy.run_path("benchmarks/train_step.py", run_name="__main__")
