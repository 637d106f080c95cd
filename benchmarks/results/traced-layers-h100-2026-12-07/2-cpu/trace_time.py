import sys, time, cProfile, pstats
from benchmarks.tools.glue_regions import k3_small_on_h200
with k3_small_on_h200(sys.argv[1:], 8) as (cfg, setup):
    step = setup.train_step(cfg)
    args = setup.abstract_args(cfg)
    t0 = time.perf_counter()
    pr = cProfile.Profile(); pr.enable()
    traced = step.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    pr.disable()
    print(f"traced {t1-t0:.1f} s, lowered {t2-t1:.1f} s", flush=True)
    pr.dump_stats("/tmp/trace.prof")
