"""Where the time goes: total time per operation from a jax.profiler perfetto trace.

    python -m benchmarks.tools.profile_summary TRACE_DIR [--top 30] [--steps 3] [--hlo step.hlo] [--ops-csv ops.csv]

Reads the newest perfetto_trace.json.gz under TRACE_DIR, keeps the device (GPU/TPU) tracks
when there are any (else the XLA CPU ops), and prints ms per step for the top operations,
grouped by their name with numeric suffixes removed (fusion.12 -> fusion). With --hlo (the
step's optimized HLO, `benchmarks/step/train_step.py --hlo`), a second table puts the time
against the source lines that made each kernel (`benchmarks/tools/hlo_sources.py`). With --ops-csv,
every HLO instruction's kernels (hlo_op, kernel name, ms/step, launches/step, source line):
small enough to bring back from a lease, and with the HLO it names every kernel's bytes there.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import gzip
import json
import os
import re


def load(trace_dir: str):
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise SystemExit(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


# "ragged" only as XLA's ragged-all-to-all: a bare "ragged" also matched tokamax's grouped GEMM
# (ragged_dot_sm90_mosaic_gpu_kernel), which counted the experts' matmuls as collectives
COLLECTIVE = re.compile(r"all-to-all|all_to_all|alltoall|ragged[-_]all[-_]to[-_]all|nccl|all-reduce|all-gather|"
                        r"reduce-scatter|collective-permute|sendrecv", re.IGNORECASE)


def summarize(events, top: int, steps: int, first_device_only: bool = True, sources: dict | None = None,
              ops_csv: str | None = None):
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = sorted(p for p, n in procs.items() if re.search(r"/device:(GPU|TPU)", n))
    if device and first_device_only:  # several GPUs run the same SPMD program: show one
        device = device[:1]
    keep = set(device) or {p for p, n in procs.items() if "CPU" in n or "host" in n.lower()}
    total = collections.Counter()
    count = collections.Counter()
    per_track = collections.Counter()
    coll_track = collections.Counter()
    by_src, src_count = collections.Counter(), collections.Counter()
    by_op, op_count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in keep or "dur" not in e:
            continue
        if sources is not None:
            op = (e.get("args") or {}).get("hlo_op") or e["name"]
            src = sources.get(op, "(no source: " + re.sub(r"[._]\d+$", "", op)[:40] + ")")
            by_src[src] += e["dur"]
            src_count[src] += 1
        name = re.sub(r"[._]\d+$", "", e["name"])
        if ops_csv:
            key = ((e.get("args") or {}).get("hlo_op") or "", e["name"])
            by_op[key] += e["dur"]
            op_count[key] += 1
        track = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        total[name] += e["dur"]
        count[name] += 1
        per_track[track] += e["dur"]
        if COLLECTIVE.search(name):
            coll_track[track] += e["dur"]
    grand = sum(total.values())
    where = procs[device[0]] if device else "host"
    print(f"{'ms/step':>9} {'%':>6} {'calls':>7}  op   ({where}, {steps} steps; tracks may overlap)")
    for name, us in total.most_common(top):
        print(f"{us / 1e3 / steps:9.3f} {100 * us / grand:6.1f} {count[name] // steps:7d}  {name[:110]}")
    if sources is not None:
        print(f"{'ms/step':>9} {'%':>6} {'calls':>7}  source line (innermost frame in this repository)")
        for src, us in by_src.most_common(top):
            print(f"{us / 1e3 / steps:9.3f} {100 * us / grand:6.1f} {src_count[src] // steps:7d}  {src[:110]}")
    if ops_csv:
        with open(ops_csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["hlo_op", "kernel", "ms_per_step", "launches_per_step", "source"])
            for (op, kernel), us in by_op.most_common():
                src = (sources or {}).get(op or kernel, "")
                w.writerow([op, kernel[:200], f"{us / 1e3 / steps:.4f}", f"{op_count[op, kernel] / steps:g}", src])
    print("per track: busy ms/step, of which collectives (all-to-all, all-reduce, ... NCCL kernels)")
    for track, us in per_track.most_common():
        print(f"{us / 1e3 / steps:9.3f} {coll_track[track] / 1e3 / steps:9.3f}  {track[:80]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hlo", default=None, help="the step's optimized HLO text: time by source line too")
    ap.add_argument("--ops-csv", default=None, help="write ms/step per HLO instruction and kernel here")
    a = ap.parse_args()
    sources = None
    if a.hlo:
        from benchmarks.tools.hlo_sources import hlo_sources
        sources = hlo_sources(open(a.hlo).read())
    summarize(load(a.trace_dir), a.top, a.steps, sources=sources, ops_csv=a.ops_csv)


if __name__ == "__main__":
    main()
