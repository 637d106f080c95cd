"""The small k3-tiny run that test_train_run.py and test_watching.py both launch: one set of
programs, so the shared compilation cache serves both files."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "k3-tiny.yaml")
SMALL = ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2", "model.d_model=64", "model.moe.latent_dim=32",
         "data.seq_len=32", "train.batch_size=4", "train.steps=16", "checkpoint.every=4", "checkpoint.keep_last=3",
         "logging.every=1", "logging.eval_every=8", "logging.eval_batches=1", "logging.progress=false",
         "optimizer.warmup_steps=2", "mesh.num_devices=1"]
