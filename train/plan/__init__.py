"""k3jax-plan: will a config train on a mesh? (cli.py; its docstring says what each module holds).

The planner compiles the real train step (train.setup), so it is a program over the trainer
and sits beside it, as MaxText's train_compile sits beside its trainer.
"""
