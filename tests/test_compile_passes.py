"""benchmarks/tools/compile_passes.py: pass times from an XLA log, against durations worked out by hand."""

from benchmarks.tools.compile_passes import parse

LOG = """\
I1203 05:58:41.000000    11 hlo_pass_pipeline.cc:211]   HLO pass priority-fusion
I1203 05:58:41.500000    22 hlo_pass_pipeline.cc:211]   HLO pass algsimp
I1203 05:58:42.250000    11 hlo_pass_pipeline.cc:211]   HLO pass algsimp
not a log line: ignored
I1203 05:58:42.750000    22 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module m: post
I1203 05:58:44.250000    11 gpu_compiler.cc:2345] GpuCompiler::RunHloPasses for jit_step time: 3.25 s (3250000 us) (cumulative: 3.25 s, max: 3.25 s, #called: 1)
I1203 23:59:59.500000    33 hlo_pass_pipeline.cc:211]   HLO pass dce
I1204 00:00:00.250000    33 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module n: post
"""


def test_pass_times_are_gaps_to_the_same_threads_next_line():
    passes, totals = parse(LOG.splitlines(keepends=True))
    # thread 11: priority-fusion 41.0 -> 42.25; algsimp 42.25 -> 44.25. Thread 22: algsimp 41.5 -> 42.75.
    # Thread 33: dce across midnight, 23:59:59.5 -> 00:00:00.25
    assert passes["priority-fusion"] == (1.25, 1)
    assert passes["algsimp"][1] == 2 and abs(passes["algsimp"][0] - (2.0 + 1.25)) < 1e-9
    assert abs(passes["dce"][0] - 0.75) < 1e-9
    assert totals == [("GpuCompiler::RunHloPasses", "jit_step", 3.25)]
