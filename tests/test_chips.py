"""The one chip table (k3jax/chips.py) against the device kinds JAX really reports, checked
against JAX's own matchers (jax/_src/tpu_info.py for TPUs, Pallas's gpu_info.py for NVIDIA GPUs),
and the CLI's MFU peak read from it."""

from types import SimpleNamespace

import pytest
from jax._src import tpu_info
from jax._src.pallas.triton import gpu_info

from k3jax.chips import CATALOG, CHIPS, chip_for_device_kind, peak_bf16_tflops
from train.metrics import guess_peak_tflops

# jax.Device.device_kind as the runtimes return it: the CUDA device name on NVIDIA GPUs; libtpu's
# name on TPUs, which is not the product's (v5e reports "TPU v5 lite", v5p "TPU v5", v6e "TPU v6
# lite"). The peak: the vendor's dense bf16 figure (NVIDIA quotes it with sparsity: half of that).
REPORTED = [
    ("NVIDIA H100 80GB HBM3", "h100", 1979 / 2),
    ("NVIDIA H100 NVL", "h100-nvl", 1671 / 2),
    ("NVIDIA H100 PCIe", "h100-pcie", 1513 / 2),
    ("NVIDIA H200", "h200", 1979 / 2),
    ("NVIDIA H200 NVL", "h200-nvl", 1671 / 2),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb", 624 / 2),
    ("NVIDIA A100 80GB PCIe", "a100-80gb", 624 / 2),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb", 624 / 2),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb", 624 / 2),
    ("NVIDIA B200", "b200", 4500 / 2),
    ("TPU v4", "v4", 275),
    ("TPU v5 lite", "v5e", 197),
    ("TPU v5", "v5p", 459),
    ("TPU v6 lite", "v6e", 918),
]


@pytest.mark.parametrize("kind,name,peak", REPORTED)
def test_reported_device_kinds_find_their_chip_and_peak(kind, name, peak):
    chip = chip_for_device_kind(kind)
    assert chip is not None and chip.name == name
    assert peak_bf16_tflops(kind) == pytest.approx(peak, abs=0.6)  # the table rounds 989.5 to 989
    assert guess_peak_tflops(SimpleNamespace(device_kind=kind)) == chip.peak_bf16_tflops  # the CLI's MFU


@pytest.mark.parametrize("kind,name", [(k, n) for k, n, _ in REPORTED])
def test_the_table_agrees_with_jax_on_each_generation(kind, name):
    """JAX's own readers of device_kind name the same generation (TPU_V5P for "TPU v5", H100
    for "NVIDIA H100 PCIe"): an independent check of the strings and of the TPU names' trap."""
    chip = chip_for_device_kind(kind)
    if chip.platform == "tpu":
        assert tpu_info.chip_version_from_device_kind(kind).name == "TPU_" + name.upper()
    else:
        assert gpu_info.gpu_version_from_device_kind(kind).name == name.split("-")[0].upper()


def test_unknown_or_partial_names_get_no_peak():
    """A name not in the table gets no peak rather than a sibling's (an H100 of unknown form may
    be 756, 835 or 989); the CPU gets none."""
    for kind in ("cpu", "NVIDIA H100", "TPU v5e lite", "NVIDIA GeForce RTX 4090", ""):
        assert chip_for_device_kind(kind) is None and peak_bf16_tflops(kind) is None
    assert guess_peak_tflops(SimpleNamespace(platform="cpu")) is None  # a device without device_kind


def test_one_table():
    """Each device kind belongs to one chip; the planner's chips are the table's plannable ones,
    and a GPU's compile-only device reports the table's first name for it."""
    kinds = [k for c in CATALOG for k in c.device_kinds]
    assert len(kinds) == len(set(kinds))
    assert sorted(CHIPS) == ["h100", "h200", "v5p", "v6e"]
    assert all(CHIPS[c.name] is c for c in CATALOG if c.plannable)
    for chip in (CHIPS["h100"], CHIPS["h200"]):
        assert f'device_description_str: "{chip.device_kinds[0]}"' in chip.gpu_target_config()
