"""k3jax-ladder: the linear-attention lineage (softmax -> linear -> DeltaNet -> gated DeltaNet ->
KDA -> the K3 hybrid) trained and measured on equal terms from one command.

sizes.py   the rungs (configs/ladder/*.yaml) and the sizes (smoke, cpu, h200) built on them
tasks.py   training one rung on one task with the training machinery, and its evaluation
claims.py  the literature's expectations, each checked against the measured rows
report.py  ladder.json (written as it goes), the Markdown table and the plots
cli.py     the command
"""
