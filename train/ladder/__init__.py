"""k3jax-ladder: the linear-attention lineage (softmax -> linear -> DeltaNet -> gated DeltaNet ->
KDA -> the K3 hybrid) and the papers' baselines (softmax attention with a short conv, full gated
MLA) trained and measured on equal terms from one command, over several seeds.

sizes.py        the rungs (configs/ladder/*.yaml) and the sizes (smoke, cpu, h200, zoology) built on them
tasks.py        training one rung on one task with the training machinery, and its evaluation
runs.py         runs and their keys in ladder.json, statistics over seeds, the best learning rate of a sweep
fingerprint.py  what a rung's rows measured, and when a resumed launch may keep them
claims.py       the literature's expectations, each judged on every seed
report.py       ladder.json (written as it goes), the Markdown tables and the plots
cli.py          the command
recipe.py       K3's training recipe at k3-small scale (bf16, MXFP4 QAT, the full recipe), one command each
"""
