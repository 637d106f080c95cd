"""Watching a run: progress (a bar on a terminal, plain lines elsewhere), TensorBoard scalars
and metrics.jsonl.

metrics.jsonl gets one JSON object per logged step ({"step", "loss", ...}; eval lines carry
"eval_loss" and "eval_s", checkpoint saves "checkpoint_s", and each launch first logs its
compile time, {"step", "compile_s", "lower_s"}: XLA's compile of the train step and, before it,
its tracing and lowering, the launch's wait being their sum; on GPUs and TPUs each logged step also carries "peak_gib",
the most device memory in use on any of this process's devices since launch), so a run can be
plotted (`k3jax-plot`) or parsed without TensorBoard. tokens_per_s and mfu count training steps
only (train/timing.py). Only process 0 writes.

Fields that cannot be non-zero under the run's config and mesh are left out of both
(`constant_metrics`, decided once at launch): `z_loss` when train.z_loss is 0, and
`expert_drop_rate` where no pair can be dropped (no MoE layer, or one device: the dropless
grouped matmul; the sharded exchange drops pairs over its capacity, so a mesh of several devices
keeps it). The step still computes them; they are just not written.

Progress: with `logging.progress` on and both stdout and stderr terminals, a redrawn tqdm bar
(step, loss, the training tokens/s, ETA); otherwise (nohup, a scheduler, a pipe, a file, or
`logging.progress=false`) one plain line per logged step, so a log file holds no redraws.

Start lines: every message up to the first step, and the first step's plain line, begin with
the seconds since the process started ("[  12.3 s] compiling ..."), so a log shows where a
launch's first minutes went (imports, data, the state, tuning, compiles).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from k3jax.chips import peak_bf16_tflops
from train.timing import stamp

# tqdm's own rate is wall time (eval and checkpoints included): the bar shows ours instead
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def guess_peak_tflops(device) -> float | None:
    """The device's dense bf16 peak by the device kind JAX reports (k3jax/chips.py), None when
    unknown."""
    return peak_bf16_tflops(getattr(device, "device_kind", ""))


def peak_device_gib(devices) -> float | None:
    """The largest `peak_bytes_in_use` among `devices` (this process's), in GiB; None where the
    backend keeps no allocator statistics (XLA:CPU returns none)."""
    peaks = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # a backend without the call
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) / 2**30 if peaks else None


def draws_bar(progress: bool, streams=None) -> bool:
    """Whether to draw a redrawn progress bar: asked for, and every stream a terminal."""
    streams = (sys.stdout, sys.stderr) if streams is None else streams
    return progress and all(_is_terminal(s) for s in streams)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def progress_line(step: int, total: int, values: dict, eta_s: float | None = None) -> str:
    """One plain log line: 'step 20/300: loss 3.4521, 12,345 tokens/s, MFU 14.2%, peak 103.4 GiB,
    lr 3.00e-03, balance 0.42 (MoE layer 13), eta 1:23' (balance: `expert_balance`)."""
    parts = [f"step {step}/{total}: loss {float(values['loss']):.4f}"]
    if "tokens_per_s" in values:
        parts.append(f"{float(values['tokens_per_s']):,.0f} tokens/s")
    if "mfu" in values:
        parts.append(f"MFU {100 * float(values['mfu']):.1f}%")
    if "peak_gib" in values:
        parts.append(f"peak {float(values['peak_gib']):.1f} GiB")
    if "lr" in values:
        parts.append(f"lr {float(values['lr']):.2e}")
    balance = expert_balance(values)
    if balance:
        parts.append(balance)
    if eta_s is not None:
        parts.append(f"eta {_clock(eta_s)}")
    return parts[0] + (", " + ", ".join(parts[1:]) if len(parts) > 1 else "")


def expert_balance(values: dict) -> str | None:
    """'balance 0.42 (MoE layer 13)', plus ', 3 idle experts' when some MoE layer's experts got no
    token in the window: the worst layer's max_violation (0 = balanced). None without MoE layers."""
    if "max_violation" not in values:
        return None
    viol = np.asarray(values["max_violation"], np.float64).ravel()
    worst = int(np.argmax(viol))
    text = f"balance {viol[worst]:.2f} (MoE layer {worst})"
    idle = np.asarray(values.get("idle_experts", 0.0), np.float64)
    if np.any(idle > 0):  # averaged over the window: experts idle at every step of it count 1 each
        text += f", {float(np.sum(idle)):.0f} idle experts"
    return text


def constant_metrics(cfg, mesh_size: int) -> frozenset[str]:
    """The step metrics that are 0 on every step of this run (module docstring): not logged."""
    out = set()
    if cfg.train.z_loss == 0:
        out.add("z_loss")
    has_moe = any(cfg.model.ffn_kind(i) == "moe" for i in range(cfg.model.num_layers))
    if not has_moe or mesh_size == 1:
        out.add("expert_drop_rate")
    return frozenset(out)


class RunLogger:
    def __init__(self, run_dir, log_cfg, *, total_steps: int, start_step: int, enabled: bool = True,
                 streams=None, launched_at: float | None = None, now=time.perf_counter,
                 constant: frozenset[str] = frozenset()):
        """launched_at: the process's start on the `now` clock (train.timing.launch_time); given,
        the start lines carry the seconds since then. constant: metrics left out of every line
        (`constant_metrics`)."""
        self.enabled = enabled
        self.constant = constant
        self._launched_at, self._now = launched_at, now
        self.dir = Path(run_dir)
        self.bar = None
        self.tb = None
        self.total = total_steps
        self._first = None  # (time, step) of the first progress report, for the plain lines' ETA
        if not enabled:
            return
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        if log_cfg.tensorboard:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        if draws_bar(log_cfg.progress, streams):
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            smoothing=0.1, bar_format=_BAR_FORMAT)

    def scalars(self, step: int, values: dict, *, prefix: str = "") -> None:
        """values: floats, or 1-D arrays (per layer) logged as name/layer_i."""
        if not self.enabled:
            return
        line = {"step": step}
        for k, v in values.items():
            if not prefix and k in self.constant:
                continue
            arr = np.asarray(v)
            if arr.ndim == 0:
                line[prefix + k] = float(arr)
                if self.tb is not None:
                    self.tb.add_scalar(prefix + k, float(arr), step)
            else:
                line[prefix + k] = [float(x) for x in arr.ravel()]
                if self.tb is not None:
                    for i, x in enumerate(arr.ravel()):
                        self.tb.add_scalar(f"{prefix}{k}/layer_{i}", float(x), step)
        self.jsonl.write(json.dumps(line) + "\n")

    def progress(self, step: int, values: dict) -> None:
        """The bar's position and postfix (loss, training tokens/s, MFU), or one plain line."""
        if not self.enabled:
            return
        values = {k: v for k, v in values.items() if k not in self.constant}
        if self.bar is not None:
            post = {"loss": f"{float(values['loss']):.4f}", "tok_s": f"{float(values['tokens_per_s']):,.0f}"}
            if "mfu" in values:
                post["mfu"] = f"{100 * float(values['mfu']):.1f}%"
            if "max_violation" in values:  # the worst MoE layer's balance (expert_balance)
                post["bal"] = f"{float(np.max(values['max_violation'])):.2f}"
            self.bar.n = step
            self.bar.set_postfix(post, refresh=False)
            self.bar.refresh()
            self._launched_at = None  # the start lines are over
            return
        now = time.perf_counter()
        eta = None
        if self._first is None:
            self._first = (now, step)
        elif step > self._first[1]:
            eta = (now - self._first[0]) / (step - self._first[1]) * max(self.total - step, 0)
        print(self._stamped(progress_line(step, self.total, values, eta)), flush=True)
        self._launched_at = None  # the first step's line is the last one stamped

    def since_launch(self) -> float | None:
        """Seconds since the process started, while the start lines last (else None)."""
        return None if self._launched_at is None else self._now() - self._launched_at

    def _stamped(self, text: str) -> str:
        seconds = self.since_launch()
        return text if seconds is None else stamp(seconds) + text

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        text = self._stamped(text)
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.jsonl.close()
