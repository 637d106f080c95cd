"""How the decoder's layers are grouped into scanned stages.

A stage is a unit of consecutive layers repeated `repeat` times and run with one
`lax.scan`, so compile time depends on the unit, not the depth. Units start at
multiples of their length, which is a multiple of the AttnRes block size: a block
is then always closed at a fixed position inside the unit, and the block buffer is
saved once per unit, not once per layer, by the backward pass.

K3 (93 layers, block 12): layers 0-11 (layer 0 is dense) | 6 x [12 MoE layers] | 84-92.
"""

from __future__ import annotations

from dataclasses import dataclass

LayerSpec = tuple[str, str]  # (mixer, ffn kind)


@dataclass(frozen=True)
class Stage:
    start: int                       # absolute index of the stage's first layer
    unit: tuple[LayerSpec, ...]      # the repeated unit
    repeat: int

    @property
    def num_layers(self) -> int:
        return len(self.unit) * self.repeat

    def layer_index(self, rep: int, j: int) -> int:
        return self.start + rep * len(self.unit) + j


def layer_specs(model_cfg) -> tuple[LayerSpec, ...]:
    return tuple((m, model_cfg.ffn_kind(i)) for i, m in enumerate(model_cfg.mixers))


def _stages_for_unit(specs, U: int) -> list[Stage]:
    stages: list[Stage] = []
    for start in range(0, len(specs), U):
        chunk = specs[start:start + U]
        last = stages[-1] if stages else None
        if last is not None and last.unit == chunk:
            stages[-1] = Stage(last.start, last.unit, last.repeat + 1)
        else:
            stages.append(Stage(start, chunk, 1))
    return stages


def plan_stages(model_cfg) -> tuple[Stage, ...]:
    """Choose the unit length that compiles the fewest layer bodies (ties: the shorter unit).

    scan_layers=False gives one stage holding every layer, i.e. a fully unrolled model.
    """
    specs = layer_specs(model_cfg)
    L = len(specs)
    if not model_cfg.scan_layers:
        return (Stage(0, specs, 1),)
    align = model_cfg.attn_res_block_size or 1
    best: list[Stage] | None = None
    best_cost = None
    for U in range(align, L + align, align):
        stages = _stages_for_unit(specs, U)
        cost = sum(len(s.unit) for s in stages)
        if best_cost is None or cost < best_cost:
            best, best_cost = stages, cost
    return tuple(best)


def num_attn_res_blocks(model_cfg) -> int:
    """Buffer slots: one block is closed at every layer l with l % block_size == 0."""
    bs = model_cfg.attn_res_block_size
    return 0 if not bs else -(-model_cfg.num_layers // bs)
