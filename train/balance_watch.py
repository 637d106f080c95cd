"""Watching expert balance: one warning line when a MoE layer collapses, one when it recovers.

A layer has collapsed at a step when one expert took more than half of its valid tokens
(`hot_share` > 0.5): with top-k routing over E experts a balanced layer gives each expert k/E of
them (k3-small: 1/8), so half is 4x its share and far past anything Quantile Balancing leaves
behind. The train step logs `collapsed` per MoE layer, 1.0 at such a step; averaged over a
logging window it is the share of the window's steps that collapsed.

The watch sees windows, not steps: a streak counts the steps of consecutive windows in which
every step collapsed, and a window with any balanced step ends it. It warns once when a layer's
streak reaches `steps`, and says so once the layer is balanced for a whole window again.
"""

from __future__ import annotations

import numpy as np


class CollapseWatch:
    def __init__(self, steps: int, moe_layers: list[int]):
        """steps: how long (in steps) a collapse lasts before the warning; moe_layers: the model
        layer of each MoE layer (for the message)."""
        self.steps = steps
        self.moe_layers = moe_layers
        self.streak = np.zeros(len(moe_layers), np.int64)
        self.warned = np.zeros(len(moe_layers), bool)

    def update(self, step: int, window_steps: int, metrics: dict) -> list[str]:
        """The lines to log after a logging line at `step` whose window averaged `window_steps`
        steps; metrics holds `collapsed`, `hot_share` and `max_violation` per MoE layer."""
        if "collapsed" not in metrics or self.steps <= 0:
            return []
        collapsed = np.asarray(metrics["collapsed"], np.float64)
        every_step = collapsed >= 1.0 - 1e-6
        none = collapsed <= 1e-6
        self.streak = np.where(every_step, self.streak + window_steps, 0)
        lines = []
        for i in np.nonzero((self.streak >= self.steps) & ~self.warned)[0]:
            share = float(np.asarray(metrics["hot_share"])[i])
            viol = float(np.asarray(metrics["max_violation"])[i])
            lines.append(f"warning: MoE layer {i} (layer {self.moe_layers[i]}) has collapsed: one expert took more than "
                         f"half of its tokens at every step of the last {int(self.streak[i])} (at step {step}: "
                         f"{share:.0%} of them, max_violation {viol:.2f}); Quantile Balancing is not holding it "
                         f"(README, 'Expert balance')")
            self.warned[i] = True
        for i in np.nonzero(self.warned & none)[0]:
            lines.append(f"MoE layer {i} (layer {self.moe_layers[i]}) is balanced again at step {step} "
                         f"(max_violation {float(np.asarray(metrics['max_violation'])[i]):.2f})")
            self.warned[i] = False
        return lines
