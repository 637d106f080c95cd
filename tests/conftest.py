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


# Seconds each of the slowest files took in the full suite (2026-12-08: wall seconds per file, setup
# to teardown, summed over both workers' tests, on this 2-core machine while other work shared it;
# benchmarks/results/suite-compile-2026-12-08/): the workers take whole files (--dist loadfile),
# longest first, so that no long file starts last while the other worker idles. test_train_run
# also goes before test_watching, whose run's programs it compiles into the shared cache (tiny_run.py).
# Files not listed keep their order, after these.
FILE_SECONDS = {"test_sharding.py": 477, "test_train_run.py": 375, "test_plan.py": 359, "test_model.py": 354,
                "test_context_parallel.py": 237, "test_multihost.py": 189, "test_relayout.py": 188,
                "test_kda_kernels.py": 178, "test_decode_fast.py": 128, "test_train_step.py": 112,
                "test_ops_kda.py": 110, "test_qk_clip.py": 100, "test_moe_metrics.py": 88, "test_moe_qat.py": 85,
                "test_ladder.py": 82, "test_short_conv_grad.py": 81, "test_ep_keep.py": 76, "test_attnres.py": 73,
                "test_watching.py": 69, "test_micro_batches.py": 59, "test_interchange.py": 55, "test_moe.py": 41,
                "test_attention_layer.py": 37, "test_resume_contract.py": 35, "test_delta_rule_conditioning.py": 33,
                "test_check_decode_kernels.py": 32, "test_data.py": 31, "test_ops_mx.py": 31,
                "test_scan_outputs.py": 30}


def pytest_collection_modifyitems(config, items):
    """Longest files first (FILE_SECONDS); the order within a file is kept. Needs
    --no-loadscope-reorder (pyproject.toml), else xdist orders files by their number of tests."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable
