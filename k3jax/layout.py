"""How the decoder's layers are grouped into scanned stages.

A stage is a unit of consecutive layers repeated `repeat` times and run with one
`lax.scan`, so compile time depends on the unit, not the depth: the unit length is the one
that leaves the fewest layer bodies to compile. Units start at multiples of their length.

Block AttnRes closes a block at every layer l with l % block_size == 0. When the unit length
is a multiple of the block size (or the stage runs once), that happens at the same place in
every repetition and is decided when tracing (`Stage.static_pushes`); otherwise each
repetition decides it from its first layer's index, inside the scan (`DecoderLayer`'s
dynamic push). K3 (93 layers, block 12): [layers 0-3, layer 0 dense] | 22 x [kda, kda, kda,
mla with MoE] | layer 92: 9 layer bodies to compile, not the 33 that 12-layer units leave
(layers 0-11 | 6 x 12 | 84-92), which is what makes its plan compile in minutes.
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

    def static_pushes(self, block_size: int) -> tuple[bool, ...] | None:
        """Which unit layers close an AttnRes block, when that is the same in every
        repetition (a tuple, one flag per unit layer); None when it changes from one
        repetition to the next (the scan then decides it per repetition)."""
        u = len(self.unit)
        if not block_size:
            return (False,) * u
        first = tuple((self.start + j) % block_size == 0 for j in range(u))
        if self.repeat == 1 or u % block_size == 0:
            return first
        return None


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

    def best_of(units):
        """The plan with the fewest layer bodies (ties: the shorter unit) -> (cost, stages);
        cost counts each stage once more, for its own loop."""
        plans = [(sum(len(s.unit) for s in st), U, st) for U in units for st in [_stages_for_unit(specs, U)]]
        bodies, _, st = min(plans, key=lambda p: p[:2])
        return bodies + len(st), st

    cost, best = best_of(range(align, L + align, align))
    if align > 1:  # units that cut AttnRes blocks (dynamic pushes): only for a large saving
        cost_any, any_unit = best_of([U for U in range(1, L + 1) if U % align])
        if 2 * cost_any <= cost:
            best = any_unit
    return tuple(best)


def num_attn_res_blocks(model_cfg) -> int:
    """Buffer slots: one block is closed at every layer l with l % block_size == 0."""
    bs = model_cfg.attn_res_block_size
    return 0 if not bs else -(-model_cfg.num_layers // bs)
