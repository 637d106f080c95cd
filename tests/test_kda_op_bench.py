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
    # a CPU is no chip k3jax.chips knows: no roofline, rather than one against a GPU's spec
    assert all("roofline_fraction" not in r for r in rows)


def test_roofline_against_hand_counts():
    """kda_roofline on a toy chip (1 TFLOP/s, 1 TB/s), counted by hand: B=1, T=2, H=1, K=V=4, C=2.
    FLOPs per token and head: 4CK + 2C(K+V) + 2CV + 6KV + C^2/3 = 32 + 32 + 16 + 96 + 4/3.
    Bytes per token: q, k, v 8 each (bf16), g 16 (fp32), beta 2 = 42; o 8 (bf16)."""
    from k3jax.chips import Chip

    toy = Chip(name="toy", platform="gpu", device_kinds=("toy",), peak_bf16_tflops=1.0, hbm_gb=1.0, hbm_tbps=1.0)
    fwd = kda_op.kda_roofline(1, 2, 1, 4, 4, 2, "fwd", toy)
    flops = 2 * (32 + 32 + 16 + 96 + 4 / 3)
    assert abs(fwd["model_tflop"] - flops / 1e12) < 1e-20
    assert abs(fwd["min_gb"] - 2 * (42 + 8) / 1e9) < 1e-18
    assert fwd["bound"] == "compute" and abs(fwd["roofline_ms"] - flops / 1e12 * 1e3) < 1e-15
    both = kda_op.kda_roofline(1, 2, 1, 4, 4, 2, "fwd+bwd", toy)
    assert abs(both["model_tflop"] - 3 * flops / 1e12) < 1e-20
    assert abs(both["min_gb"] - 2 * (42 + 42) / 1e9) < 1e-18  # inputs read, their gradients written


def test_roofline_of_the_benchmark_shape_on_an_h200():
    """8 x 4096 x 16 heads x 128 on an H200 (989 TFLOP/s, 4.8 TB/s) is memory-bound: 0.806 GB
    (524,288 token-heads x (1,282 + 256) bytes) take 0.168 ms, its 0.0952 TFLOP 0.096 ms."""
    from k3jax.chips import CHIPS

    r = kda_op.kda_roofline(8, 4096, 16, 128, 128, 64, "fwd", CHIPS["h200"])
    assert r["bound"] == "memory"
    assert abs(r["min_gb"] - 524288 * 1538 / 1e9) < 1e-9
    assert abs(r["roofline_ms"] - 524288 * 1538 / 4.8e12 * 1e3) < 1e-9


def test_a_bad_tuning_is_refused_by_name_before_anything_runs(tmp_path, capsys):
    """kda_op and kda_check parse every --tune entry first (Tuning.parse_list): a typo in the
    third entry exits 2 naming that entry and the key, and no row is written."""
    import pytest

    from benchmarks.checks import kda_check
    from k3jax.ops.kda_kernels import Tuning

    assert Tuning.parse_list(";intra_split=1,warps_grad=4") == (Tuning(), Tuning(intra_split=1, warps_grad=4))
    out = tmp_path / "rows.json"
    for main, extra in ((kda_op.main, ["--shapes", "1x32x1x16", "--impl", "pallas", "--json", str(out)]),
                        (kda_check.main, ["--quick", "--json", str(out)])):
        with pytest.raises(SystemExit) as e:
            main(extra + ["--tune", ";intra_split=1;intra_splt=1"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "'intra_splt=1'" in err and "unknown kernel tuning key 'intra_splt'" in err, err
        assert not out.exists()
