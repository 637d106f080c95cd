"""k3jax-export: a run's weights as a Hugging Face checkpoint in the K3 release's layout.

    k3jax-export RUN_DIR [--step N] --out DIR [--mxfp4] [--dtype bfloat16|float32|auto]
                 [--layout k3|fla_kda|kimi_linear] [--shard-size-gb 5] [key=value ...]
                 (key=value: overrides of the run's config, e.g. the mesh: mesh.fsdp=8)

The run's weights (its newest checkpoint, --step's, or its imported weights) are read sharded
as the run trains them (`train.interchange.rundir`) and streamed out by
`k3jax.interchange.hf_writer` (the files written, the dtypes, --mxfp4: its docstring). The
run's tokenizer (data.tokenizer) goes beside them with tokenizer_config.json and
generation_config.json, its EOS/pad ids into config.json (`train.interchange.tokenizer_files`).
"""

from __future__ import annotations

import sys
import time

import jax

from k3jax.interchange.foreign import LAYOUTS
from k3jax.interchange.hf_writer import export_weights
from train.generate import SAMPLING_DEFAULTS
from train.interchange.rundir import command_parser, load_run_weights, run_command, run_config
from train.interchange.tokenizer_files import config_entries, export_tokenizer, write_tokenizer


def main(argv=None) -> int:
    p = command_parser("k3jax-export", __doc__)
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--mxfp4", action="store_true", help="routed experts as compressed-tensors MXFP4")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "auto"), default="bfloat16")
    p.add_argument("--shard-size-gb", type=float, default=5.0)
    p.add_argument("--layout", choices=LAYOUTS, default="k3",
                   help="k3 (the release's names), or a relative's: fla_kda (KDAForCausalLM), kimi_linear")
    p.add_argument("overrides", nargs="*", help="key=value applied to the run's config (e.g. the mesh)")
    a = p.parse_intermixed_args(argv)  # key=value may follow the options, as the usage shows

    def export() -> str:
        t0 = time.perf_counter()
        tok, why_none = export_tokenizer(run_config(a.run_dir, a.overrides))  # a missing file stops us here
        cfg, params, rest = load_run_weights(a.run_dir, a.step, a.overrides)
        stats = export_weights(cfg, params, rest, a.out, mxfp4=a.mxfp4, dtype=a.dtype,
                               shard_bytes=int(a.shard_size_gb * (1 << 30)), layout=a.layout,
                               config_extra=config_entries(tok) if tok else None)
        if tok is not None and jax.process_index() == 0:
            files = write_tokenizer(tok, a.out, **SAMPLING_DEFAULTS)
            said = f"its tokenizer ({tok.spec}, EOS {tok.eos_id}) as {', '.join(files)}"
        else:
            said = why_none or "its tokenizer"
        return (f"wrote {stats['tensors']} tensors ({stats['bytes'] / 1e9:.2f} GB) in {stats['files']} "
                f"files to {a.out} in {time.perf_counter() - t0:.1f} s; {said}")
    return run_command("k3jax-export", export)


if __name__ == "__main__":
    sys.exit(main())
