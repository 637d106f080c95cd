"""Shared pieces of the fused delta-rule kernels (Pallas, Triton lowering on GPU).

Layout. Every kernel reads and writes the operator's own [B,T,H,*] layout: a BlockSpec
squeezes B and H and the grid walks (chunk, batch x head) or (batch x head, value block),
so there is no transpose around the kernels. T is padded to a multiple of the chunk.

Precision. `Numerics` holds the dtype of the matmul operands (`cd`: bf16 when q, k, v are
16-bit, like fla; fp32 otherwise) and three precisions:
  mm     operands in cd: DEFAULT for bf16, HIGHEST (exact fp32, "ieee") for fp32 inputs;
  f32    fp32 x fp32 products of derived matrices (the UT inverse's block merges): TF32 for
         bf16 inputs (the inverse is then rounded to bf16), exact for fp32 inputs;
  exact  the diagonal score blocks of the backward, where bf16 rounding would not cancel:
         HIGHEST, or bf16x3 on GPU for bf16 inputs (fla's choice there).
Accumulation is fp32 everywhere; the recurrent state is fp32. In the interpreter (CPU tests)
every product is exact.

Limits of the Pallas-Triton lowering that shape the code (jax 0.11): no slicing of values
(16-row sub-blocks are loaded from refs at dynamic or static offsets and stored the same
way), dots are 2-D with both sides >= 16, every loaded or stored block has a power-of-two
size, and there is no scratch memory (kernel 1 writes rows to a discarded output and reads
them back whole after a CTA barrier). Loops (`fori_loop`) rather than unrolled sub-blocks
keep each kernel small: Triton's layout passes grow fast with the kernel's size (one
unrolled kernel took 40 s to compile, its loop form 5 s).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

def kernel_jit(fn):
    """`fn` (a kernel launcher: arrays positional, settings keyword-only) under jax.jit with
    every keyword argument static. The model calls each kernel with the same shapes and
    settings in every KDA layer (and again in the backward's recompute), and identical calls
    of a jitted function share one traced jaxpr, so JAX lowers its pallas_call to Triton once
    per module instead of once per call site: k3-small's step lowered 42 pallas_calls for 7
    distinct kernels, about 1.7 s of Python each."""
    import inspect

    static = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    return jax.jit(fn, static_argnames=static)


SUB = 16  # rows of one sub-block: the smallest tensor-core dot
SAFE_SPAN = 80.0  # exp(80) ~ 5.5e34: largest growing factor allowed (as k3jax.ops.delta_rule)
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Numerics:
    cd: object  # dtype of the matmul operands
    mm: object
    f32: object
    exact: object

    @staticmethod
    def for_inputs(low_precision: bool, interpret: bool) -> "Numerics":
        hi = jax.lax.Precision.HIGHEST
        if not low_precision or interpret:  # the interpreter (CPU) computes every product exactly
            cd = jnp.bfloat16 if low_precision else jnp.float32
            lo = jax.lax.Precision.DEFAULT if low_precision else hi
            return Numerics(cd, lo, lo, hi)
        # bf16x3: three tensor-core products, ~fp32 accurate (fp32 "ieee" dots run on CUDA
        # cores through register-hungry layouts)
        return Numerics(jnp.bfloat16, jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT,
                        jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch parameters (no autotuner in Pallas-Triton: pinned from measurements on an H200)."""
    state_block_v: Optional[int] = None  # value columns per state-pass program; None = by grid size
    # warps, measured at K = V = 128 on the H200: the intra kernel's reductions cross warps (4 beat
    # 8: fwd 2.9 vs 4.5 ms); the WY-gradient kernel spilled registers at 4 (ptxas -v, sm_90a)
    warps_intra: int = 4
    warps_state: int = 4
    warps_grad: int = 8
    warps_score: int = 4
    stages_state: int = 2
    # kernel 1's K (and V) columns per slice (its registers against its loop trips) and pipeline
    # stages; 64 and 1 measured fastest (kda_kernels/intra.py)
    intra_block_k: int = 64
    stages_intra: int = 1
    # kernel 1's UT inverse: 0 = merging diagonal blocks over the whole C x C chunk matrix (the
    # measured default), 1 = forward substitution over 16 x 16 blocks in the scratch (every
    # temporary 16 x 16: fewer registers and ~80x fewer FLOPs at C = 64; slower on an H100,
    # 2026-12-07), 2 = the same with the blocks held in registers (no barrier between row blocks)
    intra_inverse: int = 0
    # kernel 1 as one program per chunk (0) or split as fla splits it (1): the rows of Aqk and L,
    # qg and kg with one program per 16-row block, then the inverse, w, u and gamma per chunk.
    # intra_split, intra_inverse=2 and cumsum_kernel are off until a GPU times them against the
    # defaults (benchmarks/results/kda-split-2026-12-07/: the lease that would, queued)
    intra_split: int = 0
    warps_scores: int = 0  # warps of the split form's first kernel (0: warps_intra)
    # the in-chunk cumsum of the log-decay (and its transpose in the backward): 0 = XLA's
    # jnp.cumsum, 1 = a Pallas kernel (kda_kernels/cumsum.py)
    cumsum_kernel: int = 0
    # forward output o = qg h + Aqk v_new: 1 = inside the state pass, 0 = a chunk-parallel kernel
    # after it (writes h and v_new), -1 = by shape (fused while the pass has few chunks per program)
    fuse_output: int = -1
    warps_output: int = 4
    grad_block_k: int = 64  # K columns per step of the WY-gradient kernel (measured: 64 beats 32)
    score_split_k: int = 1  # programs per 16-row block of the score-gradient kernel, each K / this channels
    # what the forward keeps for the backward (model.kda.kernel_residuals): 1 = kernel 1's and the
    # state pass's outputs (w, kg, qg, Aqk, Ainv, gamma, the chunk states h and v_new: about
    # 2 (3K + 2C + V) + 2 K V / C bytes per token and head in bf16, ~0.7 GB per k3-small layer),
    # so the backward runs neither again; 0 = only the inputs, as fla keeps, and the backward
    # recomputes both kernels. Results are identical either way (the same kernels on the same inputs)
    keep_intermediates: int = 1

    @staticmethod
    def parse(text: str) -> "Tuning":
        """'state_block_v=32,warps_grad=4' -> Tuning (benchmark sweeps)."""
        kw = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if key not in Tuning.__dataclass_fields__:
                raise ValueError(f"unknown kernel tuning key {key!r}; expected one of {list(Tuning.__dataclass_fields__)}")
            kw[key] = int(value)
        return Tuning(**kw)

    @staticmethod
    def parse_list(text: str) -> tuple["Tuning", ...]:
        """';state_block_v=32' -> (Tuning(), Tuning(state_block_v=32)): a benchmark's --tune list,
        each entry parsed (an empty entry is the defaults). A bad entry raises ValueError naming it,
        so a sweep refuses a typo before it times anything."""
        out = []
        for entry in text.split(";"):
            try:
                out.append(Tuning.parse(entry))
            except (ValueError, TypeError) as e:
                raise ValueError(f"--tune entry {entry!r}: {e}") from None
        return tuple(out)


def dot(a, b, precision, *, ta: bool = False, tb: bool = False):
    """a @ b (a^T if ta, b^T if tb) with fp32 accumulation; 2-D operands of one dtype."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def iota2(n: int, m: int):
    """Row and column index grids [n, m] (int32)."""
    return (jax.lax.broadcasted_iota(jnp.int32, (n, m), 0), jax.lax.broadcasted_iota(jnp.int32, (n, m), 1))


class Specs:
    """BlockSpecs on [B,T,H,*] arrays for a kernel of H heads; `t` is the chunk index."""

    def __init__(self, H: int, C: int):
        self.H, self.C = H, C

    def chunk(self, width: int):
        """One chunk of one (batch, head): ref [C, width]; grid (t, bh)."""
        H = self.H
        return pl.BlockSpec((None, self.C, None, width), lambda t, bh: (bh // H, t, bh % H, 0))

    def chunk_vec(self):
        """[B,T,H] -> ref [C]; grid (t, bh)."""
        H = self.H
        return pl.BlockSpec((None, self.C, None), lambda t, bh: (bh // H, t, bh % H))

    def chunk_rows(self):
        """[B,T] -> ref [C]; grid (t, bh)."""
        H = self.H
        return pl.BlockSpec((None, self.C), lambda t, bh: (bh // H, t))

    def chunk_state(self, K: int, V: int):
        """[B,NT,H,K,V] -> ref [K, V] of chunk t; grid (t, bh)."""
        H = self.H
        return pl.BlockSpec((None, None, None, K, V), lambda t, bh: (bh // H, t, bh % H, 0, 0))

    def chunk_gate(self, K: int):
        """[B,NT,H,K] -> ref [K]; grid (t, bh)."""
        H = self.H
        return pl.BlockSpec((None, None, None, K), lambda t, bh: (bh // H, t, bh % H, 0))

    # ---- grid (t, sub-block x, bh): one 16-row sub-block of a chunk per program

    def sub_chunk(self, width: int):
        """The whole chunk t: ref [C, width]."""
        H = self.H
        return pl.BlockSpec((None, self.C, None, width), lambda t, x, bh: (bh // H, t, bh % H, 0))

    def sub_chunk_vec(self):
        H = self.H
        return pl.BlockSpec((None, self.C, None), lambda t, x, bh: (bh // H, t, bh % H))

    def sub_chunk_rows(self):
        """[B,T] -> ref [C] of chunk t."""
        H = self.H
        return pl.BlockSpec((None, self.C), lambda t, x, bh: (bh // H, t))

    def sub_rows(self, width: int):
        """Sub-block x of chunk t: ref [16, width]."""
        H, nb = self.H, self.C // SUB
        return pl.BlockSpec((None, SUB, None, width), lambda t, x, bh: (bh // H, t * nb + x, bh % H, 0))

    def sub_rows_vec(self):
        H, nb = self.H, self.C // SUB
        return pl.BlockSpec((None, SUB, None), lambda t, x, bh: (bh // H, t * nb + x, bh % H))

    # ---- the state passes: grid (bh, value block), the whole sequence of one (batch, head)

    def seq(self, T: int, width: int, block: Optional[int] = None):
        """[B,T,H,width] -> ref [T, block or width]; with `block`, value block vb of it."""
        H = self.H
        if block is None:
            return pl.BlockSpec((None, T, None, width), lambda bh, vb: (bh // H, 0, bh % H, 0))
        return pl.BlockSpec((None, T, None, block), lambda bh, vb: (bh // H, 0, bh % H, vb))

    def seq_gate(self, NT: int, K: int):
        """[B,NT,H,K] -> ref [NT, K]."""
        H = self.H
        return pl.BlockSpec((None, NT, None, K), lambda bh, vb: (bh // H, 0, bh % H, 0))

    def seq_states(self, NT: int, K: int, BV: int):
        """[B,NT,H,K,V] -> ref [NT, K, BV]."""
        H = self.H
        return pl.BlockSpec((None, NT, None, K, BV), lambda bh, vb: (bh // H, 0, bh % H, 0, vb))

    def state(self, K: int, BV: int):
        """[B,H,K,V] -> ref [K, BV]."""
        H = self.H
        return pl.BlockSpec((None, None, K, BV), lambda bh, vb: (bh // H, bh % H, 0, vb))
