"""The ladder's rungs and sizes.

A rung is one of configs/ladder/*.yaml: the ~290 M decoder of configs/ladder/base.yaml with
only its mixer changed (and, for softmax_conv, the attention's short convolution). Those files stay the one source of truth for what a rung *is* (its
mixer sequence, the dense FFN, plain residuals, head layout); a size shrinks every rung the
same way with overrides on top of them:

* the width, vocabulary and head sizes (`Size.model`), identical for every rung;
* the depth: the rung's repeating unit (one layer, or the hybrid's kda,kda,kda,mla) repeated
  to `Size.depth` layers, so the hybrid keeps its 3:1 ratio (depth must be a multiple of 4);
* the FFN width of every rung but the reference (kda), chosen so the total parameter count
  matches the reference's (`match_ffn`): the mixers differ in size (softmax has no output
  gate or short convs, KDA has its gate projections), the FFN absorbs the difference.

Every rung of a size trains with the same data, steps, batch, sequence length and optimizer,
once per seed (`Size.seeds`, or --seeds): train.seed and data.seed both take it. A size may
also train each rung at several widths (`Size.widths`, each matched on its own) and sweep the
learning rate (`Size.lrs`): Zoology's MQAR protocol, where each rung is reported at its best
learning rate per width (train/ladder/runs.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from k3jax.config import ConfigError, load_config

RUNGS = ("softmax", "softmax_conv", "linear", "deltanet", "gated_deltanet", "kda", "hybrid", "mla")
RUNG_ABOUT = {
    "softmax": "plain causal softmax attention with RoPE, no short conv",
    "softmax_conv": "the same attention with the linear rungs' short conv on q, k, v (Zoology's attention)",
    "linear": "linear attention (additive state, ELU+1 features)",
    "deltanet": "DeltaNet (delta rule, no decay)",
    "gated_deltanet": "gated DeltaNet (delta rule, one decay per head)",
    "kda": "KDA (delta rule, one decay per channel)",
    "hybrid": "K3's hybrid, 3 KDA : 1 gated MLA",
    "mla": "gated MLA in every layer (NoPE, K3's MLA; Kimi Linear's full-attention baseline)",
}
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
    # train on overwrite examples too (the mqar_overwrite task); False: plain MQAR only (Zoology's)
    overwrite: bool = True
    # grain worker processes for the training data (data.num_workers; how, not what: it never
    # orphans rows). MQAR examples cost ~1-4 ms each in Python (generation, packing), so 64 a step
    # would hold a small model's GPU step back several times over
    num_workers: int = 0
    # train on these MQAR sources, (pairs, example length, token weight) each, instead of
    # train_pairs at train_length (rows stay train_length tokens: shorter examples are packed
    # several to a row as separate documents); () = train_pairs
    train_mix: tuple[tuple[int, int, float], ...] = ()


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
class Width:
    """One model width of a size that trains several: overrides on top of `Size.model`."""

    d_model: int
    model: tuple[str, ...]


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
    seeds: tuple[int, ...] = (0, 1, 2)  # what it runs unless --seeds says
    widths: tuple[Width, ...] = ()  # () = one model per rung, at `model`'s width
    lrs: tuple[float, ...] = ()  # a learning-rate sweep (recall only); () = the optimizer's lr
    # with lrs: the sweep runs at the first `sweep_seeds` seeds, the other seeds at each rung and
    # width's best learning rate from it; 0 = the sweep at every seed
    sweep_seeds: int = 0

    def plan(self, task: str):
        return self.lm if task == "lm" else self.recall

    def width_list(self) -> tuple[Width | None, ...]:
        return self.widths or (None,)

    def runs_per_width(self, kind: str, seeds) -> int:
        """Runs one rung trains at one width for one kind of task ("recall" | "lm") and `seeds`:
        with a learning-rate sweep, every rate at the first `sweep_seeds` seeds and the best rate at
        the others (every rate at every seed when sweep_seeds is 0); else one per seed."""
        n = len(seeds)
        if not (self.lrs and kind == "recall"):
            return n
        if not self.sweep_seeds:
            return len(self.lrs) * n
        return len(self.lrs) * min(self.sweep_seeds, n) + max(n - self.sweep_seeds, 0)


def _heads(heads: int, head_dim: int, *, q_rank: int, kv_rank: int, rope: int) -> tuple[str, ...]:
    """The same head count and width for every mixer (MLA's nope and value dims = head_dim)."""
    return (f"model.kda.num_heads={heads}", f"model.kda.head_dim={head_dim}", f"model.attention.num_heads={heads}",
            f"model.attention.head_dim={head_dim}", f"model.mla.num_heads={heads}", f"model.mla.q_lora_rank={q_rank}",
            f"model.mla.kv_lora_rank={kv_rank}", f"model.mla.qk_nope_head_dim={head_dim}",
            f"model.mla.qk_rope_head_dim={rope}", f"model.mla.v_head_dim={head_dim}")


# float32 on a CPU (bf16 is emulated there), short chunks for short sequences, no loss chunking
_CPU = ("model.compute_dtype=float32", "model.kda.chunk_size=16", "train.loss_chunk=0")

def _zoology_width(d: int) -> Width:
    """Zoology's MQAR widths: two heads of d/2 in every mixer (Zoology: one for attention, two
    for the delta-rule mixers), the FFN at 2 d (Zoology has none; every rung here has the same one)."""
    return Width(d, (f"model.d_model={d}", f"model.ffn_hidden={2 * d}",
                     *_heads(2, d // 2, q_rank=d, kv_rank=d // 2, rope=16)))


SIZES = {
    "smoke": Size(
        name="smoke", about="CI: every rung and task for a handful of steps, a toy model",
        depth=4, model=("model.vocab_size=320", "model.d_model=32", "model.ffn_hidden=64",
                        *_heads(1, 32, q_rank=0, kv_rank=16, rope=8), *_CPU),
        optimizer=("optimizer.lr=3e-3", "optimizer.warmup_steps=1"),
        recall=RecallPlan(train_pairs=(2, 4), train_length=32, eval_pairs=(4,), eval_lengths=(32,),
                          steps=4, batch_size=4, eval_examples=4),
        lm=LMPlan(seq_len=32, batch_size=4, steps=4, evals=2, eval_batches=1, shuffle_window=0),
        ffn_multiple=8, tasks=TASKS, seeds=(0, 1)),
    "cpu": Size(
        name="cpu", about="recall and overwrite on a 2-core CPU, minutes per rung and seed",
        depth=4, model=("model.vocab_size=128", "model.d_model=64", "model.ffn_hidden=128",
                        *_heads(2, 32, q_rank=32, kv_rank=32, rope=16), *_CPU),
        optimizer=("optimizer.lr=3e-3", "optimizer.warmup_steps=50"),
        recall=RecallPlan(train_pairs=(2, 4, 8), train_length=32, eval_pairs=(2, 4, 8, 16),
                          eval_lengths=(32, 64, 128), steps=2400, batch_size=16, eval_examples=128),
        lm=LMPlan(seq_len=256, batch_size=16, steps=300, evals=3, eval_batches=4),
        ffn_multiple=8, tasks=("mqar", "mqar_overwrite", "cost")),
    "h200": Size(
        # 1,600 steps x 16 x 2,048 = 52.4 M tokens (51 M target tokens) per rung and seed: 4x the
        # first GPU table's 400 steps. The standard library is ~11 M training tokens, so this is
        # ~4.5 passes over it (held-out files are never trained on)
        name="h200", about="language modelling on one H200, a few minutes per rung and seed",
        depth=8, model=("model.vocab_size=512", "model.d_model=512", "model.ffn_hidden=1536",
                        *_heads(4, 128, q_rank=256, kv_rank=256, rope=64)),
        optimizer=("optimizer.lr=2e-3", "optimizer.warmup_steps=100"),
        recall=None,
        lm=LMPlan(seq_len=2048, batch_size=16, steps=1600, evals=8, eval_batches=4),
        ffn_multiple=64, tasks=("lm", "cost")),
    "zoology": Size(
        # Zoology's MQAR setting (Arora et al. 2023, its original_mqar_configs): sequences of 256,
        # 16-64 key-value pairs, vocabulary 8,192, widths 128 and 256, the best of a learning-rate
        # sweep per model. Divergences: 4 layers with an FFN (Zoology: 2 layers, no MLP; the hybrid's
        # 3:1 unit needs 4), fresh examples every step (Zoology: 32 epochs over 180 k examples), far
        # fewer steps (2,000 x 64 examples), three of its four learning rates (not 3.2e-2)
        name="zoology", about="MQAR at Zoology's setting on one GPU: two widths, a learning-rate sweep",
        depth=4, model=("model.vocab_size=8192",),
        optimizer=("optimizer.lr=1e-3", "optimizer.warmup_steps=100"),
        recall=RecallPlan(train_pairs=(16, 32, 64), train_length=256, eval_pairs=(16, 32, 64, 128),
                          eval_lengths=(256, 512), steps=2000, batch_size=64, eval_examples=1024,
                          overwrite=False, num_workers=8),
        lm=None, ffn_multiple=32, tasks=("mqar",), seeds=(0, 1),
        widths=(_zoology_width(128), _zoology_width(256)), lrs=(1e-3, 3.2e-3, 1e-2), sweep_seeds=1),
}


# The zoology size with Zoology's training mixture (its original_mqar_configs: 100 k examples of 4
# pairs in 64 tokens, 20 k each of 8 in 128 and of 16, 32, 64 in 256: token shares 6.4 : 2.56 :
# 5.12 : 5.12 : 5.12) and 4x the steps, two learning rates (1e-2 never won at 2,000 steps).
# Zoology's budget is still ~11x this (32 epochs over 180 k examples, batch 256)
SIZES["zoology-mix"] = dataclasses.replace(
    SIZES["zoology"], name="zoology-mix",
    about="MQAR with Zoology's easy-to-hard training mixture, 8,000 steps, two widths",
    recall=dataclasses.replace(SIZES["zoology"].recall, steps=8000, train_mix=(
        (4, 64, 2.5), (8, 128, 1.0), (16, 256, 2.0), (32, 256, 2.0), (64, 256, 2.0))),
    lrs=(1e-3, 3.2e-3))


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
                   ffn_hidden: int | None = None, width: Width | None = None) -> list[str]:
    """Overrides that turn configs/ladder/<rung>.yaml into this size's rung (at `width`)."""
    base = load_config(rung_file(rung, configs_dir))
    out = [*size.model, *(width.model if width else ()),
           f"model.layer_pattern={rung_pattern(base.model.mixers, size.depth, rung)}",
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


def rung_config(size: Size, rung: str, configs_dir: Path, task_overrides=(), extra=(), *, ffn_hidden=None,
                width: Width | None = None):
    return load_config(rung_file(rung, configs_dir),
                       rung_overrides(size, rung, configs_dir, (*task_overrides, *extra), ffn_hidden=ffn_hidden,
                                      width=width))


@functools.lru_cache(maxsize=None)  # configs are frozen: every launch in one process counts each model once
def total_params(model_cfg) -> int:
    from k3jax.model_sizes import abstract_model, param_counts

    return sum(param_counts(abstract_model(model_cfg)).values())


def match_ffn(size: Size, configs_dir: Path, extra=(), rungs=RUNGS,
              width: Width | None = None) -> dict[str, tuple[int, int]]:
    """rung -> (ffn_hidden, total params): the reference rung at the size's (or `width`'s) FFN
    width, every other rung at the FFN width (a multiple of size.ffn_multiple) whose total is
    closest to it."""
    config = lambda rung, ffn=None: rung_config(size, rung, configs_dir, extra=extra, ffn_hidden=ffn,  # noqa: E731
                                                width=width).model
    ref = config(REFERENCE_RUNG)
    target = total_params(ref)
    out = {}
    for rung in rungs:
        if rung == REFERENCE_RUNG:
            out[rung] = (ref.ffn_hidden, target)
            continue
        m = size.ffn_multiple
        lo, hi = ref.ffn_hidden, ref.ffn_hidden + m
        p_lo, p_hi = total_params(config(rung, lo)), total_params(config(rung, hi))
        per_unit = (p_hi - p_lo) / m  # parameters are affine in ffn_hidden
        best = max(m, int(round((lo + (target - p_lo) / per_unit) / m)) * m)
        out[rung] = (best, total_params(config(rung, best)))
    return out


def configs_dir_from(arg: str | None) -> Path:
    path = Path(arg) if arg else default_configs_dir()
    if not path.is_dir():
        raise ConfigError("no such directory; pass --configs with the folder holding the rung configs "
                          f"({', '.join(r + '.yaml' for r in RUNGS)})", os.fspath(path))
    return path
