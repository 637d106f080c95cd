"""k3jax-import: a Hugging Face checkpoint (K3 release layout, Kimi Linear, or fla's
KDAForCausalLM) into a k3jax run directory that k3jax-train starts from (step 0, fresh
optimizer state) and `train.interchange.load_model` + `k3jax.decode` generate from.

    k3jax-import HF_DIR --config CONFIG --out RUN_DIR [key=value ...]

CONFIG is the run's config (data, optimizer, mesh, dtypes, kernels). For the K3 layout its
model section must describe the checkpoint; for Kimi Linear and fla the architecture is read
from HF_DIR/config.json and only execution settings (dtypes, chunk sizes, ...) come from
CONFIG (`k3jax.interchange.foreign`). The checks and the sharded read:
`k3jax.interchange.hf_reader`. A tokenizer in HF_DIR (as k3jax-export writes it) becomes the
run's data.tokenizer ("bytes", or a copy of the file in RUN_DIR); CONFIG's data.tokenizer must
be the same vocabulary or the import stops naming both (`train.interchange.tokenizer_files`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax

from k3jax.config import load_config
from k3jax.config.schema import replace
from k3jax.interchange.errors import InterchangeError
from k3jax.interchange.foreign import LAYOUTS
from k3jax.interchange.hf_reader import import_checkpoint, resolve_config
from train.interchange.rundir import command_parser, run_command, save_imported
from train.interchange.tokenizer_files import copy_tokenizer, imported_tokenizer
from train.setup import prepare


def main(argv=None) -> int:
    p = command_parser("k3jax-import", __doc__)
    p.add_argument("hf_dir")
    p.add_argument("--config", required=True, help="the run's YAML config")
    p.add_argument("--out", required=True, help="the new run directory")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="the checkpoint's layout (default: from config.json's model_type; k3 for a K3 release "
                        "whose model_type k3jax does not know)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    a = p.parse_intermixed_args(argv)  # key=value may follow the options, as the usage shows

    def import_() -> str:
        t0 = time.perf_counter()
        cfg = replace(load_config(a.config, a.overrides), run_dir=a.out)
        if any((Path(a.out) / d).exists() for d in ("imported", "checkpoints")):
            raise InterchangeError(f"{a.out} already holds weights (imported/ or checkpoints/); "
                                   f"import into a new run directory")
        ckpt_cfg, _, config_json = resolve_config(cfg, a.hf_dir, a.layout)
        tokenizer, tokenizer_file = imported_tokenizer(cfg, a.hf_dir, config_json, a.out)
        cfg = replace(cfg, **{"data.tokenizer": tokenizer})
        setup = prepare(ckpt_cfg)
        shardings = {"params": setup.shardings["params"], "rest": setup.shardings["rest"]}
        with jax.set_mesh(setup.mesh):
            cfg, arrays = import_checkpoint(a.hf_dir, cfg, shardings=shardings, layout=a.layout)
            save_imported(a.out, cfg, arrays["params"], arrays["rest"])
        if jax.process_index() == 0:
            copy_tokenizer(tokenizer_file, tokenizer)
        return (f"{a.hf_dir} -> {a.out} in {time.perf_counter() - t0:.1f} s; data.tokenizer={tokenizer}; "
                f"train with: k3jax-train --config {Path(a.out) / 'config.yaml'}")
    return run_command("k3jax-import", import_)


if __name__ == "__main__":
    sys.exit(main())
