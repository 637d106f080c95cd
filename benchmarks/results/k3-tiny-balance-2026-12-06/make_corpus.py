"""One-off: the corpus the README's "Your data" recipe was followed on (2026-12-06): the Python
standard library's email/, json/ and logging/ modules as corpus/part0.jsonl and part1.jsonl (one
document per file, every other file), and its xml/ package as books.parquet. Run from the checkout."""
import glob
import json
import os
import sysconfig

import pyarrow as pa
import pyarrow.parquet as pq

lib = sysconfig.get_paths()["stdlib"]
files = sorted(glob.glob(os.path.join(lib, "email", "*.py")) + glob.glob(os.path.join(lib, "json", "*.py"))
               + glob.glob(os.path.join(lib, "logging", "*.py")))
os.makedirs("corpus", exist_ok=True)
for i, part in enumerate((files[::2], files[1::2])):
    with open(f"corpus/part{i}.jsonl", "w") as f:
        for p in part:
            f.write(json.dumps({"text": open(p).read()}) + "\n")
books = sorted(glob.glob(os.path.join(lib, "xml", "**", "*.py"), recursive=True))
pq.write_table(pa.table({"text": [open(p).read() for p in books]}), "books.parquet")
