"""train/xla_flags.py: the GPU flags k3jax-train sets, and a flag the user set wins."""

from train.xla_flags import GPU_XLA_OPTIONS, set_gpu_xla_flags


def test_flags_are_added_once_and_the_users_win():
    env = {"XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=true --xla_dump_to=/tmp/d"}
    flags = set_gpu_xla_flags(env).split()
    assert flags.count("--xla_gpu_enable_dynamic_slice_fusion=true") == 1
    assert "--xla_gpu_enable_dynamic_slice_fusion=false" not in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags and "--xla_dump_to=/tmp/d" in flags
    assert set_gpu_xla_flags(env).split() == flags  # a second call adds nothing
    fresh = set_gpu_xla_flags({}).split()
    assert sorted(fresh) == sorted(f"--{k}={str(v).lower()}" for k, v in GPU_XLA_OPTIONS.items())
    assert "--xla_gpu_enable_dynamic_slice_fusion=false" in fresh
