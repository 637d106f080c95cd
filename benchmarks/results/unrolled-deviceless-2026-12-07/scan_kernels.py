import sys, collections
from benchmarks.tools.glue_regions import kernels
text = open(sys.argv[1]).read()
pat = sys.argv[2] if len(sys.argv) > 2 else "k3jax/model.py:156"
rows = collections.Counter(); cnt = collections.Counter(); ex = {}
for k in kernels(text):
    if k.kind not in ("glue",) or not (k.source or "").startswith(pat):
        continue
    # kernel "type": opcode-ish from name
    base = k.name.split(".")[0]
    key = (base, k.phase, k.rtype[:60])
    rows[key] += (k.read + k.written) * k.runs
    cnt[key] += k.runs
tot = sum(rows.values())
print(f"total {tot/1e9:.1f} GB")
for key, b in rows.most_common(40):
    print(f"{b/1e9:8.2f} GB {cnt[key]:5d}  {key}")
