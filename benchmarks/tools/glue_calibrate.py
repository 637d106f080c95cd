"""Profile-calibrated time per region for a compiled step, from the glue_regions.py figures.

    python -m benchmarks.tools.glue_calibrate --profile PROFILE.txt --before BEFORE.hlo AFTER.hlo [--kernel-slowdown 1.3]

PROFILE.txt: profile_summary.py's table for the program BEFORE.hlo is (same code, one lease).
Class-calibrated time per region. Kernel classes by what their fusion does: R (reductions over
the minor dim only: row reductions), C (a reduction over another dim: column / partial
reductions), E (no reduction: elementwise, slices, updates, copies). Each class's slowdown
against 4.8 TB/s is fitted (non-negative least squares) to the 2026-12-01 evening profile's
per-name ms of the same program (before.hlo); custom kernels keep their own name's ratio and
the new AttnRes kernels get an assumed one (--kernel-slowdown). An estimate of where a change
moves time, not a measurement: the fit is rough (per-name residuals of 2x both ways)."""
from __future__ import annotations

import argparse
import collections
import re

import numpy as np

from benchmarks.tools import glue_regions as G
from benchmarks.tools.hlo_sources import hlo_sources

def nnls(A, y, iters: int = 2000):
    """min |A x - y| over x >= 0 (projected gradient; a handful of columns)."""
    x = np.maximum(np.linalg.lstsq(A, y, rcond=None)[0], 0.0)
    step = 1.0 / np.linalg.norm(A, 2) ** 2
    for _ in range(iters):
        x = np.maximum(x - step * A.T @ (A @ x - y), 0.0)
    return x


def cls_of(op, body):
    reds = [l for l in body if " reduce(" in l]
    if not reds: return "E"
    for l in reds:
        dims = re.search(r"dimensions=\{([\d,]*)\}", l).group(1).split(",")
        operand = G.operand_names(l.split(" reduce(")[1] and "reduce(" + l.split(" reduce(")[1])[0]
        shp = None
        for b in body:
            p = G.parse_instr(b)
            if p and p[0] == operand: shp = p[1]
        rank = len(re.search(r"\[([\d,]*)\]", shp).group(1).split(",")) if shp else 1
        if any(int(d) != rank - 1 for d in dims): return "C"
    return "R"

def per_kernel(path):
    text = open(path).read()
    comps, entry = G.split_computations(text)
    mult = G.kernel_multiplicities(comps, entry)
    src = hlo_sources(text, depth=3)
    out = []
    for comp, n in mult.items():
        types = {}
        for line in comps[comp]:
            p = G.parse_instr(line)
            if p: types[p[0]] = p[1]
        for line in comps[comp]:
            p = G.parse_instr(line)
            if not p: continue
            name, rt, op, rest = p
            if op in G.NO_KERNEL or op.endswith("-done"): continue
            called = re.search(r"calls=%([\w.\-]+)", rest)
            isf = op in ("fusion", "fusion-start")
            body = comps.get(called.group(1), []) if (called and isf) else []
            kind = G.classify("fusion" if isf else op, rest, body)
            if kind not in ("glue", "kernel"): continue
            root = next((l for l in body if l.lstrip().startswith("ROOT")), "")
            rtype = G.parse_instr(root)[1] if root else rt
            r, w = G.kernel_bytes(rest, rtype, body, types)
            fam = re.sub(r"[._]\d+$", "", re.sub(r"[._]\d+$", "", name))
            c = cls_of(op, body) if kind == "glue" else "K"
            if kind == "kernel":
                m = re.search(r'/(\w+)/pallas_call"', rest)
                fam = m.group(1) if m else fam
            reg = G.region_of(G.fusion_source(name, body, src))
            out.append((fam, c, reg, (r + w) * n))
    return out

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--before", required=True)
    ap.add_argument("--kernel-slowdown", type=float, default=1.3)
    ap.add_argument("after")
    args = ap.parse_args()
    prof = {}
    for line in open(args.profile):
        m = re.match(r"\s+([\d.]+)\s+[\d.]+\s+(\d+)\s+(\S+)$", line)
        if m and not m.group(3).startswith("("):
            prof[m.group(3)] = float(m.group(1))
    before = per_kernel(args.before)
    fb = collections.defaultdict(lambda: collections.Counter())
    for fam, c, reg, b in before:
        fb[fam][c] += b
    classes = ["R", "C", "E"]
    fams = [f for f in prof if f in fb and sum(fb[f][c] for c in classes) > 2e9 and fb[f]["K"] == 0]
    A = np.array([[fb[f][c] / 4.8e9 for c in classes] for f in fams]); y = np.array([prof[f] for f in fams])
    ratio = nnls(A, y)
    print("fitted slowdown vs 4.8 TB/s:", dict(zip(classes, np.round(ratio, 2))), "families", len(fams))
    for f, a, yy in zip(fams, A, y):
        print(f"  {f:42s} measured {yy:6.2f}  fit {a @ ratio:6.2f}  bytes R/C/E {a[0]:.1f}/{a[1]:.1f}/{a[2]:.1f} ms")
    kratio = {f: prof[f] / (fb[f]["K"] / 4.8e9) for f in prof if fb.get(f) and fb[f]["K"] > 1e9}
    KERNEL = args.kernel_slowdown
    def region_ms(rows):
        t = collections.Counter()
        for fam, c, reg, b in rows:
            r = (KERNEL if fam.startswith("attnres") else kratio.get(fam, 2.0)) if c == "K" else ratio[classes.index(c)]
            t[reg] += b / 4.8e9 * r
        return t
    tb, ta = region_ms(before), region_ms(per_kernel(args.after))
    print(f"\nclass-calibrated ms per region (AttnRes kernels at x{KERNEL} of 4.8 TB/s)")
    for reg in sorted(set(tb) | set(ta), key=lambda r: -tb.get(r, 0)):
        print(f"{reg[:30]:30s} {tb.get(reg,0):8.1f} -> {ta.get(reg,0):8.1f}   {ta.get(reg,0)-tb.get(reg,0):+7.1f}")
    print(f"{'total':30s} {sum(tb.values()):8.1f} -> {sum(ta.values()):8.1f}   {sum(ta.values())-sum(tb.values()):+7.1f}")


if __name__ == "__main__":
    main()
