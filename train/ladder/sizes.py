"""The ladder's rungs and sizes.

A rung is one of configs/ladder/*.yaml: the ~290 M decoder of configs/ladder/base.yaml with
only its mixer changed. Those files stay the one source of truth for what a rung *is* (its
mixer sequence, the dense FFN, plain residuals, head layout); a size shrinks every rung the
same way with overrides on top of them:

* the width, vocabulary and head sizes (`Size.model`), identical for every rung;
* the depth: the rung's repeating unit (one layer, or the hybrid's kda,kda,kda,mla) repeated
  to `Size.depth` layers, so the hybrid keeps its 3:1 ratio (depth must be a multiple of 4);
* the FFN width of every rung but the reference (kda), chosen so the total parameter count
  matches the reference's (`match_ffn`): the mixers differ in size (softmax has no output
  gate or short convs, KDA has its gate projections), the FFN absorbs the difference.

Every rung of a size trains with the same data, steps, batch, sequence length, optimizer and
seed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from k3jax.config import ConfigError, load_config

RUNGS = ("softmax", "linear", "deltanet", "gated_deltanet", "kda", "hybrid")
TASKS = ("mqar", "mqar_overwrite", "lm", "cost")
REFERENCE_RUNG = "kda"  # the parameter budget every other rung is matched to
COST_CONTEXTS = (4096, 131072)  # decode-state bytes per sequence at these contexts


def default_configs_dir() -> Path:
    """configs/ladder of this checkout (k3jax is installed editable from it)."""
    return Path(__file__).resolve().parents[2] / "configs" / "ladder"


@dataclass(frozen=True)
class RecallPlan:
    """MQAR and MQAR-overwrite: train on a mixture, evaluate on a grid of (pairs, length)."""

    train_pairs: tuple[int, ...]  # one MQAR source per entry, equal token shares
    train_length: int  # tokens per example (and per row) in training
    eval_pairs: tuple[int, ...]
    eval_lengths: tuple[int, ...]  # include lengths longer than train_length
    steps: int
    batch_size: int
    eval_examples: int  # per cell


@dataclass(frozen=True)
class LMPlan:
    seq_len: int
    batch_size: int
    steps: int
    evals: int  # held-out loss this many times over the run (the loss-vs-tokens curve)
    eval_batches: int
    # data.shuffle_window for the LM task; None = the config's (1 M tokens). A run of a handful
    # of steps reads a few rows: filling a million-token window first only costs start-up time
    shuffle_window: int | None = None


@dataclass(frozen=True)
class Size:
    name: str
    about: str
    depth: int
    model: tuple[str, ...]  # overrides of the rung configs' model section, every rung alike
    optimizer: tuple[str, ...]
    recall: RecallPlan | None
    lm: LMPlan | None
    ffn_multiple: int  # the matched FFN widths are rounded to this
    tasks: tuple[str, ...]  # what `k3jax-ladder --size NAME` runs unless told

    def plan(self, task: str):
        return self.lm if task == "lm" else self.recall


def _heads(heads: int, head_dim: int, *, q_rank: int, kv_rank: int, rope: int) -> tuple[str, ...]:
    """The same head count and width for every mixer (MLA's nope and value dims = head_dim)."""
    return (f"model.kda.num_heads={heads}", f"model.kda.head_dim={head_dim}", f"model.attention.num_heads={heads}",
            f"model.attention.head_dim={head_dim}", f"model.mla.num_heads={heads}", f"model.mla.q_lora_rank={q_rank}",
            f"model.mla.kv_lora_rank={kv_rank}", f"model.mla.qk_nope_head_dim={head_dim}",
            f"model.mla.qk_rope_head_dim={rope}", f"model.mla.v_head_dim={head_dim}")


# float32 on a CPU (bf16 is emulated there), short chunks for short sequences, no loss chunking
_CPU = ("model.compute_dtype=float32", "model.kda.chunk_size=16", "train.loss_chunk=0")

SIZES = {
    "smoke": Size(
        name="smoke", about="CI: every rung and task for a handful of steps, a toy model",
        depth=4, model=("model.vocab_size=320", "model.d_model=32", "model.ffn_hidden=64",
                        *_heads(1, 32, q_rank=0, kv_rank=16, rope=8), *_CPU),
        optimizer=("optimizer.lr=3e-3", "optimizer.warmup_steps=1"),
        recall=RecallPlan(train_pairs=(2, 4), train_length=32, eval_pairs=(4,), eval_lengths=(32,),
                          steps=4, batch_size=4, eval_examples=4),
        lm=LMPlan(seq_len=32, batch_size=4, steps=4, evals=2, eval_batches=1, shuffle_window=0),
        ffn_multiple=8, tasks=TASKS),
    "cpu": Size(
        name="cpu", about="recall and overwrite on a 2-core CPU, minutes per rung",
        depth=4, model=("model.vocab_size=128", "model.d_model=64", "model.ffn_hidden=128",
                        *_heads(2, 32, q_rank=32, kv_rank=32, rope=16), *_CPU),
        optimizer=("optimizer.lr=3e-3", "optimizer.warmup_steps=50"),
        recall=RecallPlan(train_pairs=(2, 4, 8), train_length=32, eval_pairs=(2, 4, 8, 16),
                          eval_lengths=(32, 64, 128), steps=2400, batch_size=16, eval_examples=128),
        lm=LMPlan(seq_len=256, batch_size=16, steps=300, evals=3, eval_batches=4),
        ffn_multiple=8, tasks=("mqar", "mqar_overwrite", "cost")),
    "h200": Size(
        name="h200", about="language modelling on one H200, a few minutes per rung",
        depth=8, model=("model.vocab_size=512", "model.d_model=512", "model.ffn_hidden=1536",
                        *_heads(4, 128, q_rank=256, kv_rank=256, rope=64)),
        optimizer=("optimizer.lr=2e-3", "optimizer.warmup_steps=100"),
        recall=None,
        lm=LMPlan(seq_len=2048, batch_size=16, steps=400, evals=4, eval_batches=4),
        ffn_multiple=64, tasks=("lm", "cost")),
}


def periodic_unit(mixers: tuple[str, ...]) -> tuple[str, ...]:
    """The shortest unit whose repetition is `mixers` (("kda",) for 16*kda)."""
    n = len(mixers)
    for p in range(1, n + 1):
        if n % p == 0 and mixers == mixers[:p] * (n // p):
            return mixers[:p]
    return mixers


def rung_pattern(rung_mixers: tuple[str, ...], depth: int, rung: str) -> str:
    unit = periodic_unit(rung_mixers)
    if depth % len(unit):
        raise ConfigError(f"the {rung} rung repeats a unit of {len(unit)} layers ({','.join(unit)}); "
                          f"a depth of {depth} is not a multiple of it", "size depth")
    return f"{depth // len(unit)}*({','.join(unit)})"


def rung_overrides(size: Size, rung: str, configs_dir: Path, extra: tuple[str, ...] = (), *,
                   ffn_hidden: int | None = None) -> list[str]:
    """Overrides that turn configs/ladder/<rung>.yaml into this size's rung."""
    base = load_config(rung_file(rung, configs_dir))
    out = [*size.model, f"model.layer_pattern={rung_pattern(base.model.mixers, size.depth, rung)}",
           *size.optimizer, "mesh.num_devices=1", "logging.progress=false", "logging.tensorboard=false", *extra]
    if ffn_hidden is not None:
        out.append(f"model.ffn_hidden={ffn_hidden}")
    return out


def rung_file(rung: str, configs_dir: Path) -> Path:
    path = Path(configs_dir) / f"{rung}.yaml"
    if not path.is_file():
        raise ConfigError(f"no config for the {rung} rung (expected one file per rung: "
                          f"{', '.join(r + '.yaml' for r in RUNGS)}); pass --configs DIR", str(path))
    return path


def rung_config(size: Size, rung: str, configs_dir: Path, task_overrides=(), extra=(), *, ffn_hidden=None):
    return load_config(rung_file(rung, configs_dir),
                       rung_overrides(size, rung, configs_dir, (*task_overrides, *extra), ffn_hidden=ffn_hidden))


def total_params(model_cfg) -> int:
    from k3jax.model_sizes import abstract_model, param_counts

    return sum(param_counts(abstract_model(model_cfg)).values())


def match_ffn(size: Size, configs_dir: Path, extra=(), rungs=RUNGS) -> dict[str, tuple[int, int]]:
    """rung -> (ffn_hidden, total params): the reference rung at the size's width, every other
    rung at the FFN width (a multiple of size.ffn_multiple) whose total is closest to it."""
    ref = rung_config(size, REFERENCE_RUNG, configs_dir, extra=extra).model
    target = total_params(ref)
    out = {}
    for rung in rungs:
        if rung == REFERENCE_RUNG:
            out[rung] = (ref.ffn_hidden, target)
            continue
        m = size.ffn_multiple
        lo, hi = ref.ffn_hidden, ref.ffn_hidden + m
        p_lo = total_params(rung_config(size, rung, configs_dir, extra=extra, ffn_hidden=lo).model)
        p_hi = total_params(rung_config(size, rung, configs_dir, extra=extra, ffn_hidden=hi).model)
        per_unit = (p_hi - p_lo) / m  # parameters are affine in ffn_hidden
        best = max(m, int(round((lo + (target - p_lo) / per_unit) / m)) * m)
        out[rung] = (best, total_params(rung_config(size, rung, configs_dir, extra=extra, ffn_hidden=best).model))
    return out


def configs_dir_from(arg: str | None) -> Path:
    path = Path(arg) if arg else default_configs_dir()
    if not path.is_dir():
        raise ConfigError("no such directory; pass --configs with the folder holding the rung configs "
                          f"({', '.join(r + '.yaml' for r in RUNGS)})", os.fspath(path))
    return path
