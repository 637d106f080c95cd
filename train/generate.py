"""k3jax-generate: see what a run learned.

    k3jax-generate RUN_DIR [--prompt TEXT] [--max-new-tokens 200] [--temperature 0.8]
                   [--top-p 0.95] [--seed 0] [--batch 1] [--step N] [key.sub=value ...]

RUN_DIR is a k3jax-train run directory (its newest checkpoint, or --step N) or one that
k3jax-import wrote (imported Hugging Face weights). The prompt goes through the run's tokenizer
(`data.tokenizer`: UTF-8 bytes by default); an empty prompt starts from the end-of-document token,
as a new document would. The text goes to stdout as it is decoded (row 0 token by token; the
other rows of --batch after it); the loading, compile and speed lines go to stderr, so stdout
holds only the text. --temperature 0 is greedy; otherwise nucleus sampling (k3jax.decode's
`sample_logits`) drawn from --seed: the same seed gives the same sample.

The weights are restored onto one device unless `mesh.*` overrides say otherwise. Decoding is
k3jax.decode's: the prompt prefilled in chunks, then one compiled decode step per token, the
next step dispatched before the previous token is printed, so printing does not stall the device.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import decode
from k3jax.config import ConfigError
from k3jax.local_platform import cpu_unless_accelerator
from train.compile_cache import resolve_cache_dir
from train.kernel_tuning import KernelTuner, quiet_tokamax, untuned_line

# k3jax-generate's sampling defaults, which an export's generation_config.json repeats
SAMPLING_DEFAULTS = {"max_new_tokens": 200, "temperature": 0.8, "top_p": 0.95}
ONE_DEVICE = ["mesh.num_devices=1", "mesh.data=-1", "mesh.fsdp=1", "mesh.expert=1", "mesh.context=1", "mesh.tensor=1"]
PREFILL_CHUNK = 8192


class GenerateError(ValueError):
    """A run directory or request this program cannot sample from (printed, exit 2)."""


def sample(model, prompt, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
           on_tokens=None, timings: dict | None = None) -> np.ndarray:
    """prompt [B,T] int -> the new tokens [B, max_new_tokens] (int32).

    on_tokens(tokens [B]) is called with each position's tokens as they are decoded. The i-th
    new token is drawn with jax.random.fold_in(PRNGKey(seed), i). timings, when given, gets
    "compile_s", "prefill_s" (the prompt and the first new token) and "decode_s" (the rest)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    B, T = prompt.shape
    graphdef, state = nnx.split(model)
    key = jax.random.PRNGKey(seed)
    pick = functools.partial(decode.sample_logits, temperature=temperature, top_p=top_p)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def prefill(state, tokens, cache):
        logits, cache = decode.prefill(nnx.merge(graphdef, state), tokens, cache, last_only=True)
        return logits[:, -1], cache

    @jax.jit
    def first(logits, key):
        return pick(logits, jax.random.fold_in(key, 0))

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(state, token, cache, key, i):
        logits, cache = decode.decode_step(nnx.merge(graphdef, state), token, cache)
        return pick(logits, jax.random.fold_in(key, i)), cache

    t0 = time.perf_counter()
    cache = model.init_cache(B, T + max_new_tokens)
    chunks = [prompt[:, s:s + PREFILL_CHUNK] for s in range(0, T, PREFILL_CHUNK)]
    compiled = {c.shape[1]: prefill.lower(state, c, cache).compile() for c in chunks}
    logits_like = jax.ShapeDtypeStruct((B, model.cfg.vocab_size), jnp.float32)
    first_c = first.lower(logits_like, key).compile()
    token_like = jax.ShapeDtypeStruct((B,), jnp.int32)
    step_c = step.lower(state, token_like, cache, key, jnp.int32(1)).compile() if max_new_tokens > 1 else None
    t1 = time.perf_counter()
    for c in chunks:
        logits, cache = compiled[c.shape[1]](state, c, cache)
    token = first_c(logits, key)
    out = [np.asarray(token)]  # waits for the prompt
    t2 = time.perf_counter()
    if on_tokens is not None:
        on_tokens(out[-1])
    for i in range(1, max_new_tokens):
        nxt, cache = step_c(state, token, cache, key, jnp.int32(i))  # queued before token i-1 is printed
        if i > 1:
            out.append(np.asarray(token))
            if on_tokens is not None:
                on_tokens(out[-1])
        token = nxt
    if max_new_tokens > 1:
        out.append(np.asarray(token))
        if on_tokens is not None:
            on_tokens(out[-1])
    t3 = time.perf_counter()
    if timings is not None:
        timings.update(compile_s=t1 - t0, prefill_s=t2 - t1, decode_s=t3 - t2)
    return np.stack(out, axis=1).astype(np.int32)


class TextStream:
    """Writes a token sequence's text as it grows: the tokenizer decodes the whole sequence each
    time and the new suffix is written, held back while it ends in an unfinished character (a
    UTF-8 byte sequence cut between tokens). The end-of-document token shows as `<|eos|>`."""

    EOS_MARK = "<|eos|>"

    def __init__(self, tokenizer, out=None):
        self.tok, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.shown = ""

    def add(self, token: int) -> None:
        if token == self.tok.eos_id:
            self.flush()
            self.out.write(self.EOS_MARK)
            self.ids, self.shown = [], ""
        else:
            self.ids.append(int(token))
            self._write(self.tok.decode(self.ids).rstrip("\ufffd"))
        self.out.flush()

    def flush(self) -> None:
        self._write(self.tok.decode(self.ids))
        self.out.flush()

    def _write(self, text: str) -> None:
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.out.write(text[len(self.shown):])
            self.shown = text


def _steps(run_dir: Path) -> list[int]:
    """The finished checkpoints' steps (Orbax's step directories; a save under way is not one)."""
    ckpts = run_dir / "checkpoints"
    return sorted(int(p.name) for p in ckpts.iterdir() if p.is_dir() and p.name.isdigit()) if ckpts.is_dir() else []


def load(run_dir, step: int | None, overrides):
    """(the run's config, its model, its tokenizer), or GenerateError / ConfigError."""
    from k3jax.interchange.errors import InterchangeError
    from train.interchange.rundir import IMPORTED, load_model, run_config
    from train.data.tokenizers import load_tokenizer
    from train.resume import root_cause

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise GenerateError(f"{run_dir}: no such run directory")
    cfg = run_config(run_dir, ONE_DEVICE + list(overrides))  # its config.yaml, or InterchangeError
    if not _steps(run_dir) and not (run_dir / IMPORTED).is_dir():
        raise GenerateError(f"{run_dir} holds no checkpoint yet: train it first (k3jax-train), or wait for its "
                            f"first save (every checkpoint.every={cfg.checkpoint.every} steps)")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids, the model {cfg.model.vocab_size} "
                          f"(model.vocab_size)", "data.tokenizer")
    try:
        model = load_model(run_dir, step, ONE_DEVICE + list(overrides))
    except (ConfigError, InterchangeError):
        raise
    except Exception as e:  # a damaged checkpoint, weights of another shape, ...
        at = f" at step {step}" if step is not None else ""
        raise GenerateError(f"cannot load the model of {run_dir}{at}: {root_cause(e)}"
                            + (" (another step: --step N)" if len(_steps(run_dir)) > 1 else "")) from None
    return cfg, model, tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="k3jax-generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a k3jax-train run directory, or one k3jax-import wrote")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=SAMPLING_DEFAULTS["max_new_tokens"])
    p.add_argument("--temperature", type=float, default=SAMPLING_DEFAULTS["temperature"], help="0: greedy")
    p.add_argument("--top-p", type=float, default=SAMPLING_DEFAULTS["top_p"],
                   help="nucleus sampling: the smallest set of tokens "
                   "holding this much probability (1: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=1, help="rows sampled at once (the same prompt)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint to load (default: the newest)")
    p.add_argument("overrides", nargs="*", help="key.sub=value over the run's config.yaml, e.g. mesh.num_devices=2")
    a = p.parse_intermixed_args(argv)  # key=value overrides may follow the options
    for flag, ok in (("--max-new-tokens", a.max_new_tokens >= 1), ("--batch", a.batch >= 1),
                     ("--temperature", a.temperature >= 0), ("--top-p", 0 < a.top_p <= 1)):
        if not ok:
            p.error(f"{flag} is out of range")
    cpu_unless_accelerator()
    from k3jax.interchange.errors import InterchangeError

    try:
        t0 = time.perf_counter()
        cfg, model, tok = load(a.run_dir, a.step, a.overrides)
        print(f"k3jax-generate: loaded {a.run_dir} ({jax.devices()[0].platform}) in {time.perf_counter() - t0:.1f} s; "
              f"compiling ...", file=sys.stderr, flush=True)
    except (ConfigError, InterchangeError, GenerateError) as e:
        print(f"k3jax-generate: {e}", file=sys.stderr)
        return 2
    ids = tok.encode(a.prompt) or [tok.eos_id]
    prompt = np.tile(np.asarray(ids, np.int32), (a.batch, 1))
    stream = TextStream(tok)
    sys.stdout.write(a.prompt)
    timings: dict = {}
    # tokamax's kernels (a GPU with the [gpu] extra) log a ~1,000-character absl warning for each
    # decode shape without a tuned config, which a terminal shows amid the text: they are counted
    # and said in one line, as k3jax-train does, and configs k3jax-train tuned on this GPU kind
    # (train.autotune_budget_s) are loaded first
    tuner = KernelTuner.for_run(resolve_cache_dir(cfg.train.compile_cache_dir), processes=1,
                                say=lambda m: print(f"k3jax-generate: {m}", file=sys.stderr, flush=True))
    with quiet_tokamax(tuner.log_filter):
        tuner.load()
        new = sample(model, prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                     seed=a.seed, on_tokens=lambda t: stream.add(int(t[0])), timings=timings)
    stream.flush()
    for row in range(1, a.batch):
        sys.stdout.write(f"\n--- sample {row + 1} of {a.batch} ---\n{a.prompt}")
        rest = TextStream(tok)
        for t in new[row]:
            rest.add(int(t))
        rest.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    n, B = a.max_new_tokens, a.batch
    speed = (f"{B * (n - 1) / timings['decode_s']:,.1f} tokens/s ({n - 1} decode steps x {B} rows in "
             f"{timings['decode_s']:.2f} s)" if n > 1 else "no decode steps")
    print(f"k3jax-generate: {speed}; the {prompt.shape[1]}-token prompt and the first token in "
          f"{timings['prefill_s']:.2f} s; compiled in {timings['compile_s']:.1f} s", file=sys.stderr)
    untuned = untuned_line(tuner.log_filter, tuner.device_kind)
    if untuned:
        print(f"k3jax-generate: {untuned}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
