"""Checkpoint names of kernel outputs that `model.remat=save_dots` keeps for the backward pass.

`jax.checkpoint_policies.dots_with_no_batch_dims_saveable` sees only dot_general primitives.
The products of k3jax's fast paths hide theirs inside custom VJPs and kernel calls (Pallas
KDA, tokamax flash attention and grouped GEMM), so under that policy alone the backward pass
re-ran each of those forward kernels just to rebuild its output: in the 2026-12-01 k3-small
profile (benchmarks/results/k3-small-2026-12-01/README.md) the fused-KDA forward kernels ran once
more per layer (their backward recomputes what it needs anyway), flash attention's forward and two
of the three expert GEMMs too. Each of these outputs is named where it is made, and the save_dots
policy (k3jax.model.REMAT_POLICIES) saves these names besides the plain dots.

What each costs to keep, per layer, at k3-small's 8 x 4096 tokens: KDA's output and MLA's
attention output one [B,T,H,V] bf16 tensor (~100 MB); the experts' gate and up products two
[B*T*k, hidden] bf16 tensors (~540 MB), and the GLU of them (~270 MB). The experts' fp32
down-projection output (~800 MB) and its routing-weighted sum per token (~100 MB): the
combine's weight gradient reads the first and the norm after it the second, so without them
the backward ran the down projection's grouped GEMM and the combine's gathers again (12.9 and
13.7 GB of traffic a step, XLA:GPU's program for an H200, 2026-12-04). Each AttnRes site's output, one [B,T,d] bf16 tensor (~100 MB; two sites a
layer): without it the backward pass re-ran every site's forward (two reads of all its
sources) only to rebuild the norm's input, and XLA:GPU fused those re-runs into multi-output
kernels that wrote fp32 copies of the outputs (benchmarks/tools/glue_regions.py --micro, 2026-12-01).
The fused KDA kernels' residuals (`model.kda.kernel_residuals: intermediates`): their
intermediates (~0.7 GB a layer) and their inputs (q, k, v, the cumulative gate, beta: ~0.5
GB), named inside the operator's forward rule, so that the backward reads them rather than
re-running the forward kernels, and the conv, norm and gate that made their inputs (11.8 and
3.6 GB of traffic a step), under the layer's remat.
"""

MATMUL_F32_OUT = "matmul_f32_out"   # k3jax.ops.matmul_f32 (gates, logits)
KDA_OUT = "kda_out"                 # the delta-rule mixers' chunked operator output
ATTENTION_OUT = "attention_out"     # softmax attention output (flash kernel or XLA)
EXPERT_HIDDEN = "expert_hidden"     # the grouped GEMMs' gate and up products, before the GLU
ATTNRES_OUT = "attnres_out"         # an AttnRes site's output (the next norm's input)
KDA_INTERMEDIATES = "kda_intermediates"  # the fused KDA kernels' residuals (intermediates and inputs), when kept
EXPERT_OUT = "expert_out"           # the experts' fp32 down-projection output per pair, and its weighted sum

SAVED_BY_SAVE_DOTS = (MATMUL_F32_OUT, KDA_OUT, ATTENTION_OUT, EXPERT_HIDDEN, ATTNRES_OUT, KDA_INTERMEDIATES,
                      EXPERT_OUT)
