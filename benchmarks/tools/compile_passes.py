"""Where XLA:GPU's compile of a program goes, from its log: the time of every HLO pass, summed by
pass name, and GpuCompiler's own totals (RunHloPasses, which includes autotuning; RunBackend:
LLVM, PTX and the Triton kernels).

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1,hlo_pass_pipeline=1 python ... 2> compile.log
    python -m benchmarks.tools.compile_passes compile.log [--top 25]

A pass's time is the gap from its "HLO pass NAME" line to the next line its thread logs (the next
pass, or the pipeline's end), so it holds whatever that pass ran (an autotuner's kernels too).
"""

from __future__ import annotations

import argparse
import collections
import re
from datetime import datetime

LINE = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d{6})\s+(\d+) (\S+?):\d+\] (.*)$")
PASS = re.compile(r"^\s*HLO pass (\S+)")
TOTAL = re.compile(r"^(GpuCompiler::\w+) for (\S+) time: .*?\((\d+) us\)")


def parse(lines):
    """-> ({pass name: (seconds, count)}, [(GpuCompiler phase, module, seconds)])."""
    passes = collections.defaultdict(lambda: [0.0, 0])
    totals = []
    open_pass = {}  # thread -> (name, time)
    for raw in lines:
        m = LINE.match(raw.rstrip("\n"))
        if not m:
            continue
        t = datetime.strptime(m.group(2), "%H:%M:%S.%f")
        thread, text = m.group(3), m.group(5)
        if thread in open_pass:
            name, t0 = open_pass.pop(thread)
            passes[name][0] += (t - t0).total_seconds() % 86400
            passes[name][1] += 1
        p = PASS.match(text)
        if p:
            open_pass[thread] = (p.group(1), t)
        tot = TOTAL.match(text)
        if tot:
            totals.append((tot.group(1), tot.group(2), int(tot.group(3)) / 1e6))
    return {k: tuple(v) for k, v in passes.items()}, totals


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        passes, totals = parse(f)
    for phase, module, s in totals:
        if s >= 0.5:
            print(f"{phase:28s} {s:8.1f} s  {module}")
    print(f"HLO passes, summed by name ({sum(s for s, _ in passes.values()):.1f} s in all):")
    for name, (s, n) in sorted(passes.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {s:8.2f} s  x{n:<5d} {name}")


if __name__ == "__main__":
    main()
