"""PyramidKV (Cai et al., 2024): SnapKV scores with budgets decreasing linearly over layers."""

from __future__ import annotations

import dataclasses

from kvjax.methods.base import PagedAppend, PromptCompression
from kvjax.selection import PyramidCapacity, TopTokens, WindowAttentionScores


@dataclasses.dataclass(frozen=True)
class PyramidKV(PromptCompression):
    """SnapKV scores and selection with per-layer capacities ``window +`` linear from max to min = (C - w) / beta.

    The mean over layers is the requested budget (see :func:`kvjax.selection.pyramid_capacities`).
    A row of a ragged batch keeps its proportional share of each layer's capacity (float budgets)
    or ``min(capacity, row length)`` (int budgets); padding is never kept.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    beta: float = 20.0
    name = "pyramidkv"

    def __post_init__(self):
        super().__post_init__()
        if self.window <= 0 or self.beta <= 0:
            raise ValueError(f"window and beta must be > 0, got {self.window}, {self.beta}")

    def components(self):
        """Window scores + pyramid capacities + top tokens (window forced) + pages."""
        return (WindowAttentionScores(self.window, self.kernel, self.pooling, self.gqa),
                PyramidCapacity(self.window, self.beta), TopTokens(protect=self.window),
                PagedAppend(self.page_size, self.implementation))
