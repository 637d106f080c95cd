import os
import sys

# The suite is dominated by XLA:CPU compile time, not run time: cheaper codegen makes it
# about 30% faster on CI's 2 cores and changes no result beyond rounding.
# Eight fake CPU devices let the mesh tests run in-process; single-device code uses device 0.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_force_host_platform_device_count=8")

# the tests run on the CPU; with the [plan] extra installed, keep its plugins (libtpu, the CUDA
# plugin) from starting as local backends: the planner's target tests compile for them deviceless
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# tests import their independent references (tests/reference.py) by module name, and the
# benchmarks' helpers they test as the benchmarks package (the repository root)
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    """Share XLA executables between tests (and the training subprocesses they start): the
    suite compiles several identical programs, and compile time dominates it on CI's 2 cores."""
    import tempfile

    import jax

    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if cache is None:  # made here (by the xdist controller; its workers inherit it): removed at the end
        cache = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="k3jax-jax-cache-")
        config._k3jax_cache_made = cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    """Remove the cache directory pytest_configure made (a few hundred MB per run otherwise)."""
    import shutil

    made = getattr(config, "_k3jax_cache_made", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


# Seconds each of the slowest files took in the full suite (2026-12-02, on a shared 2-core machine,
# summed from --durations=0; test_plan, test_decode_fast and test_kda_kernels estimated 2026-12-07
# after tests moved or merged, test_plan_buffer_assignment dropped as cheap): the workers take whole files (--dist loadfile), longest first, so that
# no long file starts last while the other worker idles. Files not listed keep their order, after these.
FILE_SECONDS = {"test_sharding.py": 244, "test_model.py": 157, "test_train_run.py": 103, "test_plan.py": 120,
                "test_multihost.py": 84, "test_context_parallel.py": 84, "test_ops_kda.py": 71,
                "test_decode_fast.py": 50, "test_ladder.py": 53,
                "test_kda_kernels.py": 42, "test_train_step.py": 50, "test_moe_qat.py": 47, "test_moe_metrics.py": 44,
                "test_short_conv_grad.py": 38, "test_ep_keep.py": 35, "test_qk_clip.py": 30, "test_attnres.py": 29,
                "test_micro_batches.py": 28, "test_watching.py": 27, "test_interchange.py": 24,
                "test_resume_contract.py": 20, "test_relayout.py": 90}


def pytest_collection_modifyitems(config, items):
    """Longest files first (FILE_SECONDS); the order within a file is kept. Needs
    --no-loadscope-reorder (pyproject.toml), else xdist orders files by their number of tests."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable
