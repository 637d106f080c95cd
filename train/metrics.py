"""Watching a run: a progress bar, TensorBoard scalars and metrics.jsonl.

metrics.jsonl gets one JSON object per logged step ({"step", "loss", ...}; eval lines
carry "eval_loss", and each launch first logs its compile time, {"step", "compile_s"}), so a
run can be plotted (`k3jax-plot`) or parsed without TensorBoard.
Only process 0 writes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

# per-device bf16 dense peaks (TFLOP/s) when logging.peak_tflops is 0
_PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v5p": 459.0, "TPU v5 lite": 197.0, "TPU v4": 275.0}


def guess_peak_tflops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, peak in _PEAKS.items():
        if name.lower() in kind.lower():
            return peak
    return None


class RunLogger:
    def __init__(self, run_dir, log_cfg, *, total_steps: int, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self.dir = Path(run_dir)
        self.bar = None
        self.tb = None
        if not enabled:
            return
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        if log_cfg.tensorboard:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        if log_cfg.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            smoothing=0.1)
        self._t = time.perf_counter()

    def scalars(self, step: int, values: dict, *, prefix: str = "") -> None:
        """values: floats, or 1-D arrays (per layer) logged as name/layer_i."""
        if not self.enabled:
            return
        line = {"step": step}
        for k, v in values.items():
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

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.refresh()

    def message(self, text: str) -> None:
        if not self.enabled:
            return
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
