"""Is the per-step max_violation of the run here driven by how much each batch's content differs
from the one before (QB routes batch t with the bias set from batch t-1)? Reads k3-small's
training batches on the CPU from the same loader, seed and config as the GPU run, and writes
batch_content.json: per step, the total-variation distance between its byte distribution and
the previous batch's; the share of its bytes on lines of the codecs' character tables
(`0x.. -> NAME`, ~100 near-identical files in encodings/, where every token is alike); and the
first bytes of each piece in steps 189-194.

    python benchmarks/results/qb-steps-2026-12-06/batch_content.py   (from the repository root)
"""
import json
from pathlib import Path

import re

import numpy as np

from k3jax.config import load_config
from train.data.sharded import ShardedData

HERE = Path(__file__).parent
TABLE_LINE = re.compile(rb"[^\n]*0x[0-9A-Fa-f]{2,4}[^\n]*->[^\n]*(\n|$)")
cfg = load_config("configs/k3-small.yaml", ["train.micro_batches=4"])
data = ShardedData(cfg, split="train", process_index=0, process_count=1)
prev, rows, pieces = None, [], {}
for step in range(1, 301):
    batch = next(data)
    tok, seg = batch["tokens"], batch["segment_ids"]
    valid = tok[seg > 0] if (seg > 0).any() else tok.ravel()
    hist = np.bincount(valid.ravel(), minlength=cfg.model.vocab_size)[:256].astype(np.float64)
    hist /= hist.sum()
    tv = None if prev is None else 0.5 * float(np.abs(hist - prev).sum())
    text = b"".join(bytes(tok[r][seg[r] > 0].astype(np.uint8)) for r in range(tok.shape[0]))
    table = sum(len(m.group(0)) for m in TABLE_LINE.finditer(text)) / max(len(text), 1)
    rows.append({"step": step, "tv_vs_previous": tv, "codec_table_share": table, "space_share": float(hist[32]),
                 "newline_share": float(hist[10]), "non_ascii_share": float(hist[128:].sum())})
    if 189 <= step <= 194:
        heads = []
        for r in range(tok.shape[0]):
            starts = np.flatnonzero(np.diff(np.concatenate([[-1], seg[r]])) != 0)
            for s0 in starts:
                heads.append(bytes(int(t) for t in tok[r, s0:s0 + 60] if t < 256).decode("latin-1"))
        pieces[step] = heads
    prev = hist
json.dump({"rows": rows, "piece_heads": pieces}, open(HERE / "batch_content.json", "w"), indent=1)
print("wrote", HERE / "batch_content.json")
