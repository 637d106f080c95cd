"""Where XLA put the optimizer's all-to-alls (train/muon_mesh.py) in its schedule of the compiled
train step: which run asynchronously with Newton-Schulz fusions between their start and done.

    python benchmarks/results/k3-plan-2026-12-03b/optimizer_schedule.py DUMP_DIR

DUMP_DIR: `k3jax-plan ... --dump-dir DUMP_DIR` (the optimized HLO of the step; scheduled, so its
entry computation lists the instructions in the order they run)."""
import collections
import glob
import math
import os
import re
import sys

from train.plan.breakdown import FrameResolver, instruction_sites

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SIZE = {"bf16": 2, "f32": 4, "f16": 2, "s32": 4, "u8": 1}


def main(dump: str) -> None:
    hlo = max(glob.glob(os.path.join(dump, "*jit_step*after_optimizations.txt")), key=os.path.getsize)
    text = open(hlo).read()
    resolver, sites = FrameResolver(text, (ROOT,)), instruction_sites(text)
    entry = text[text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}\n")]
    seq = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not m:
            continue
        s = sites.get(m.group(1))
        seq.append((m.group(1), s.op if s else "?", (resolver.project_site(s.frame) if s and s.frame else None) or "", line))
    ns = lambda x: x[1] == "fusion" and ("newton_schulz" in x[2] or "_gram" in x[2])  # noqa: E731
    starts, pairs, sync = {}, [], 0
    for i, (name, op, where, line) in enumerate(seq):
        if "muon_mesh" in where and op in ("async-start", "all-to-all-start"):
            starts[name] = i
        elif "muon_mesh" in where and op == "all-to-all":
            sync += 1
        m = re.search(r"(?:async|all-to-all)-done\([^%]*%([\w.\-]+)", line)
        if m and m.group(1) in starts:
            j = starts[m.group(1)]
            shape = re.search(r"= \(+(\w+)\[([\d,]*)\]", seq[j][3])
            nbytes = SIZE.get(shape.group(1), 4) * math.prod(int(d) for d in shape.group(2).split(",") if d)
            pairs.append((sum(1 for x in seq[j + 1:i] if ns(x)), nbytes))
    under = [b for n, b in pairs if n]
    bare = [b for n, b in pairs if not n]
    print(f"{hlo}")
    print(f"optimizer all-to-alls: {len(pairs)} asynchronous, {sync} synchronous; "
          f"{len(under)} with Newton-Schulz fusions between start and done ({sum(under) / 1e9:.2f} GB of operands), "
          f"{len(bare)} with none ({sum(bare) / 1e9:.2f} GB)")
    kinds = collections.Counter(x[1] for x in seq if "muon" in x[2])
    print("the optimizer's instructions by opcode:", dict(kinds.most_common(8)))


if __name__ == "__main__":
    main(sys.argv[1])
