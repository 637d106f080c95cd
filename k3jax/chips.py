"""Every accelerator k3jax knows, in one table: its name as JAX's devices report it, its dense
bf16 peak (MFU's denominator), its memory and links, and, for the chips k3jax-plan compiles for,
how to describe it to its compiler without having one.

    chip_for_device_kind(jax.devices()[0].device_kind)       # the chip this process runs on, or None
    peak_bf16_tflops("TPU v5")                                # 459.0: what the CLI's MFU divides by
    chip = CHIPS["h200"]                                      # the planner's chips, by --chip name
    chip.hbm_gb, chip.peak_bf16_tflops, chip.hbm_tbps        # the planner's defaults
    chip.gpu_target_config()                                  # GpuTargetConfigProto text (GPUs)
    chip.tpu_topology(2048)                                   # "v5p:8x16x16" (TPUs)

`device_kinds` are the exact strings `jax.Device.device_kind` returns: the CUDA device name on
NVIDIA GPUs ("NVIDIA H100 80GB HBM3" for the SXM part, "NVIDIA H100 PCIe", "NVIDIA H200"); on
TPUs libtpu's name, which is not the product's ("TPU v5 lite" is v5e, "TPU v5" is v5p, "TPU v6
lite" is v6e: jax/_src/tpu_info.py and mesh_utils.py match the same strings, and accept the
product spellings "TPU v5e", "TPU v5p", "TPU v6e" too). A device kind is looked up exactly: the
parts of one GPU generation differ in peak (H100: SXM 989, NVL 835, PCIe 756 TFLOP/s), so a
name not listed gets no peak rather than a sibling's (`logging.peak_tflops` sets one).

Figures are the vendors' published specifications (dense, no sparsity); what XLA needs beyond
them (an SM's shared memory and registers, the warp size) is the architecture's (Hopper:
sm_90). `hbm_gb` is the capacity a plan is judged against, in 1e9 bytes, as the vendors quote
it; `device_memory_bytes` is what the device reports to CUDA (XLA's schedulers size their
memory limit from it). Links are recorded for the chips the planner compiles for (0: not
recorded).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30


@dataclass(frozen=True)
class Chip:
    name: str                 # the --chip value
    platform: str             # "gpu" | "tpu"
    # what JAX's devices call it, exactly; the first is the one a compile-only device reports
    # (Pallas picks its GPU generation by it)
    device_kinds: tuple[str, ...]
    peak_bf16_tflops: float   # dense bf16 matmul peak (MFU's denominator)
    hbm_gb: float             # capacity, 1e9 bytes
    hbm_tbps: float           # HBM bandwidth, 1e12 bytes/s
    # links, GB/s per device per direction: inside a node (NVLink; on TPU the ICI), and between
    # nodes (the network; on TPU the data-center network between slices)
    intra_node_gbs: float = 0.0
    inter_node_gbs: float = 0.0
    devices_per_node: int = 0     # GPUs per NVLink domain; TPU chips per host
    # GPU only: what XLA:GPU's target description needs
    sms: int = 0
    compute_capability: tuple[int, int] = (0, 0)
    l2_bytes: int = 0
    clock_ghz: float = 0.0
    device_memory_bytes: int = 0
    # TPU only: the topology name's prefix and the chips one host drives
    tpu_generation: str = ""
    chips_per_host_bounds: tuple[int, int, int] = (2, 2, 1)
    tpu_dims: int = 3         # v5p: a 3-D torus (AxBxC); v6e: 2-D (AxB)
    max_slice_chips: int = 0  # the largest slice (one pod's ICI domain)
    # what a large bf16 matmul reached on it (BENCHMARKS.md), 0 where not measured: a ratio to
    # it may stand beside MFU, labelled as such, never in its place
    measured_bf16_matmul_tflops: float = 0.0

    @property
    def device_kind(self) -> str:
        return self.device_kinds[0]

    @property
    def plannable(self) -> bool:
        """Whether k3jax-plan can compile for it: a Hopper GPU (the target description below
        carries sm_90's per-SM limits) or a TPU whose slices are described."""
        if self.platform == "gpu":
            return self.compute_capability == (9, 0) and self.sms > 0 and self.devices_per_node > 0
        return bool(self.tpu_generation) and self.max_slice_chips > 0

    def gpu_target_config(self) -> str:
        """The GpuTargetConfigProto (text format) that lets XLA:GPU compile for this GPU
        without one attached (`jax.experimental.topologies.get_topology_desc(platform="cuda",
        target_config=...)`). Hopper's per-SM limits: 228 KiB shared memory (227 KiB to one
        block), 64 Ki registers, 2,048 threads; 128 FP32 lanes per SM."""
        if self.platform != "gpu":
            raise ValueError(f"{self.name} is not a GPU")
        major, minor = self.compute_capability
        fields = {
            "threads_per_block_limit": 1024, "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024, "shared_memory_per_core": 228 * 1024,
            "shared_memory_per_block_optin": 227 * 1024,
            "threads_per_core_limit": 2048, "core_count": self.sms, "fpus_per_core": 128,
            "block_dim_limit_x": 2 ** 31 - 1, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
            "memory_bandwidth": int(self.hbm_tbps * 1e12), "l2_cache_size": self.l2_bytes,
            "clock_rate_ghz": self.clock_ghz, "device_memory_size": self.device_memory_bytes,
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
        }
        body = "\n".join(f"  {k}: {v}" for k, v in fields.items())
        return (f"gpu_device_info {{\n{body}\n"
                f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
                f'platform_name: "CUDA"\n'
                f"dnn_version_info {{ major: 9 minor: 10 patch: 0 }}\n"
                f'device_description_str: "{self.device_kind}"\n')

    def gpu_topology(self, devices: int) -> str:
        """XLA:GPU's topology string, slices x hosts x devices per host, for `devices` GPUs in
        nodes of `devices_per_node`."""
        per = min(devices, self.devices_per_node)
        if devices % per:
            raise ValueError(f"{devices} GPUs do not fill nodes of {self.devices_per_node}")
        return f"1x{devices // per}x{per}"

    def tpu_dims_for(self, devices: int) -> tuple[int, ...]:
        """The slice shape of `devices` chips: each side a power of two, the sides as equal as
        they can be, longest first ("v5p:16x16x8" for 2,048 chips)."""
        if self.platform != "tpu":
            raise ValueError(f"{self.name} is not a TPU")
        if devices < 1 or devices & (devices - 1):
            raise ValueError(f"a {self.name} slice has a power-of-two number of chips, not {devices}")
        if devices > self.max_slice_chips:
            raise ValueError(f"a {self.name} slice has at most {self.max_slice_chips} chips, not {devices}")
        dims = [1] * self.tpu_dims
        n = devices
        while n > 1:  # double the shortest side
            i = min(range(self.tpu_dims), key=lambda j: (dims[j], j))
            dims[i] *= 2
            n //= 2
        return tuple(sorted(dims, reverse=True))

    def tpu_topology(self, devices: int) -> str:
        """The slice as libtpu names it: "v5p:16x16x8"."""
        return f"{self.tpu_generation}:" + "x".join(map(str, self.tpu_dims_for(devices)))

    def tpu_host_bounds(self, devices: int) -> tuple[int, int, int]:
        """The chips one host drives, cut down to a slice smaller than one host."""
        dims = self.tpu_dims_for(devices) + (1,) * (3 - self.tpu_dims)
        return tuple(min(b, d) for b, d in zip(self.chips_per_host_bounds, dims))

    def tpu_slice_name(self, devices: int) -> str:
        """How Cloud TPU names the slice: v5p counts TensorCores (2 per chip), v6e chips."""
        per_chip = 2 if self.tpu_generation == "v5p" else 1
        return f"{self.tpu_generation}-{devices * per_chip}"


CATALOG: tuple[Chip, ...] = (
    # NVIDIA H100 SXM5 80 GB: 132 SMs, HBM3 3.35 TB/s, 50 MiB L2, NVLink 4 (900 GB/s both ways)
    Chip("h100", "gpu", ("NVIDIA H100 80GB HBM3",), peak_bf16_tflops=989.0, hbm_gb=80.0, hbm_tbps=3.35,
         intra_node_gbs=450.0, inter_node_gbs=50.0, devices_per_node=8, sms=132, compute_capability=(9, 0),
         l2_bytes=50 * 2 ** 20, clock_ghz=1.98, device_memory_bytes=80 * GIB),
    # NVIDIA H100 NVL 94 GB (PCIe card, NVLink bridge in pairs) and H100 PCIe 80 GB: lower clocks
    Chip("h100-nvl", "gpu", ("NVIDIA H100 NVL",), peak_bf16_tflops=835.0, hbm_gb=94.0, hbm_tbps=3.9),
    Chip("h100-pcie", "gpu", ("NVIDIA H100 PCIe",), peak_bf16_tflops=756.0, hbm_gb=80.0, hbm_tbps=2.0),
    # NVIDIA H200 SXM 141 GB: the H100's die with HBM3e, 4.8 TB/s
    Chip("h200", "gpu", ("NVIDIA H200",), peak_bf16_tflops=989.0, hbm_gb=141.0, hbm_tbps=4.8,
         intra_node_gbs=450.0, inter_node_gbs=50.0, devices_per_node=8, sms=132, compute_capability=(9, 0),
         l2_bytes=50 * 2 ** 20, clock_ghz=1.98, device_memory_bytes=141 * GIB,
         measured_bf16_matmul_tflops=816.0),
    Chip("h200-nvl", "gpu", ("NVIDIA H200 NVL",), peak_bf16_tflops=835.0, hbm_gb=141.0, hbm_tbps=4.8),
    # NVIDIA A100: 312 TFLOP/s bf16 in every form; memory by part
    Chip("a100-80gb", "gpu", ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), peak_bf16_tflops=312.0,
         hbm_gb=80.0, hbm_tbps=2.039),
    Chip("a100-40gb", "gpu", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), peak_bf16_tflops=312.0,
         hbm_gb=40.0, hbm_tbps=1.555),
    # NVIDIA B200 (HGX): 2.25 PFLOP/s dense bf16, 180 GB HBM3e at 8 TB/s
    Chip("b200", "gpu", ("NVIDIA B200",), peak_bf16_tflops=2250.0, hbm_gb=180.0, hbm_tbps=8.0),
    # TPU v4: 32 GB HBM2 at 1.2 TB/s, 275 TFLOP/s bf16 (one JAX device per chip)
    Chip("v4", "tpu", ("TPU v4",), peak_bf16_tflops=275.0, hbm_gb=32.0, hbm_tbps=1.2),
    # TPU v5e: 16 GB HBM2 at 0.82 TB/s, 197 TFLOP/s bf16
    Chip("v5e", "tpu", ("TPU v5 lite", "TPU v5e"), peak_bf16_tflops=197.0, hbm_gb=16.0, hbm_tbps=0.819),
    # TPU v5p: 95 GB HBM2e at 2.76 TB/s, 459 TFLOP/s bf16, 3-D torus ICI (4,800 Gb/s per chip)
    Chip("v5p", "tpu", ("TPU v5", "TPU v5p"), peak_bf16_tflops=459.0, hbm_gb=95.0, hbm_tbps=2.76,
         intra_node_gbs=600.0, inter_node_gbs=25.0, devices_per_node=4, tpu_generation="v5p",
         chips_per_host_bounds=(2, 2, 1), tpu_dims=3, max_slice_chips=8960),
    # TPU v6e (Trillium): 32 GB HBM at 1.64 TB/s, 918 TFLOP/s bf16, 2-D torus ICI (3,584 Gb/s per chip)
    Chip("v6e", "tpu", ("TPU v6 lite", "TPU v6e"), peak_bf16_tflops=918.0, hbm_gb=32.0, hbm_tbps=1.64,
         intra_node_gbs=448.0, inter_node_gbs=25.0, devices_per_node=4, tpu_generation="v6e",
         chips_per_host_bounds=(2, 2, 1), tpu_dims=2, max_slice_chips=256),
)

# the chips k3jax-plan compiles for (--chip), by name
CHIPS: dict[str, Chip] = {c.name: c for c in CATALOG if c.plannable}

DEFAULT_CHIP = {"gpu": "h200", "tpu": "v5p"}

_BY_DEVICE_KIND = {kind: c for c in CATALOG for kind in c.device_kinds}


def chip_for_device_kind(device_kind: str) -> Chip | None:
    """The chip whose JAX device kind this is (an exact match), None for one not listed (a CPU)."""
    return _BY_DEVICE_KIND.get(device_kind.strip())


def peak_bf16_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak per device of this device kind, TFLOP/s; None where unknown."""
    chip = chip_for_device_kind(device_kind)
    return chip.peak_bf16_tflops if chip is not None else None
