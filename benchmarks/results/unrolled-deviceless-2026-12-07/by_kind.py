import sys, collections
from benchmarks.tools.glue_regions import kernels
text = open(sys.argv[1]).read()
kind = sys.argv[2]
rows = collections.Counter(); cnt = collections.Counter()
for k in kernels(text):
    if k.kind != "glue" or not k.name.startswith(kind):
        continue
    key = (" < ".join((k.source or "-").split(" < ")[:2]), k.phase, k.rtype[:50])
    rows[key] += (k.read + k.written) * k.runs
    cnt[key] += k.runs
print(f"total {sum(rows.values())/1e9:.1f} GB, {sum(cnt.values())} launches")
for key, b in rows.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 30):
    print(f"{b/1e9:7.2f} GB {cnt[key]:5d}  {key}")
