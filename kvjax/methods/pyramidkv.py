"""PyramidKV (Cai et al., 2024): SnapKV scores with budgets decreasing linearly over layers."""

from __future__ import annotations

import dataclasses

from kvjax.budgets import tokens_per_head
from kvjax.methods.snapkv import SnapKV


def pyramid_capacities(num_layers: int, average: int, window: int, beta: float, limit: int | None = None) -> tuple[int, ...]:
    """Per-layer capacities: ``window +`` a budget linear from max (layer 0) to min = (C - w) / beta.

    max = 2 (C - w) - min, so the mean over layers is C; integer rounding is corrected so the total
    equals ``num_layers * average`` exactly. Capacities above ``limit`` (the prompt length) are
    clipped and the excess is given to the other layers, largest first (so a budget equal to the
    prompt keeps everything in every layer).
    """
    c = average - window
    lo = c / beta
    hi = 2 * c - lo
    if num_layers == 1:
        raw = [float(c)]
    else:
        raw = [hi - (hi - lo) * i / (num_layers - 1) for i in range(num_layers)]
    caps = [int(x) for x in raw]
    short = num_layers * c - sum(caps)
    order = sorted(range(num_layers), key=lambda i: raw[i] - caps[i], reverse=True)
    for i in order[:short]:
        caps[i] += 1
    caps = [window + x for x in caps]
    if limit is not None:
        excess = sum(max(0, c - limit) for c in caps)
        caps = [min(c, limit) for c in caps]
        while excess > 0:
            room = [i for i in range(num_layers) if caps[i] < limit]
            if not room:
                break
            for i in room[:excess]:
                caps[i] += 1
            excess -= min(excess, len(room))
    return tuple(caps)


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV selection with per-layer budgets (``beta`` = 20); the total matches the requested budget."""

    beta: float = 20.0
    name = "pyramidkv"

    def layer_capacities(self, num_layers, prompt_len):
        """Pyramid of capacities whose mean is the requested tokens per head."""
        avg = tokens_per_head(self.budget, prompt_len)
        self.check_capacity(avg)
        return pyramid_capacities(num_layers, avg, self.window, self.beta, limit=prompt_len)
