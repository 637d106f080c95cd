"""benchmarks/ops/kda_op.py runs each shape in its own process, so each row's allocator peak is its
own shape's (JAX cannot reset the peak), and every row carries its settings and lease."""

import json

from benchmarks.ops import kda_op


def test_each_shape_in_its_own_process(tmp_path):
    out = tmp_path / "rows.json"
    kda_op.main(["--shapes", "1x64x1x16,1x32x1x16", "--impl", "xla", "--passes", "fwd", "--iters", "1",
                 "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["settings"]["shape"] for r in rows] == [[1, 64, 1, 16], [1, 32, 1, 16]]
    assert len({r["process"] for r in rows}) == 2 and all(r["lease"] for r in rows)
