"""SnapKV (Li et al., 2024): observation-window attention picks prompt tokens per KV head."""

from __future__ import annotations

import dataclasses

from kvjax.methods.compressed import StaticMethod, gqa_aggregate, keep_top, pool1d, slot_masks, window_attention


def snapkv_scores(st, pad, *, window: int, kernel: int, pooling: str, gqa: str):
    """Pooled window-attention scores per KV head ``[B, Hkv, S]`` (f32), pooled over the prefix only.

    Queries of the last ``window`` prompt tokens attend causally to all keys (f32 softmax), summed
    over the window; pooled per query head (avg | max, stride 1, ``kernel``), then aggregated over
    the GQA group (mean | max). kvjax selects per KV head instead of repeating K/V per query head
    as the original code does, so memory keeps the GQA saving.
    """
    sums = window_attention(st.q_window, st.k, pad, st.prompt_len)
    _, prefix = slot_masks(pad, sums.shape[-1], st.prompt_len, window)
    pooled = pool1d(sums, prefix[:, None, :], kernel, pooling)
    return gqa_aggregate(pooled, st.k.shape[1], gqa)


@dataclasses.dataclass(frozen=True)
class SnapKV(StaticMethod):
    """Keep the observation window plus the top ``capacity - window`` prefix tokens per KV head.

    Args:
      window: observation window (default 32), always kept.
      kernel, pooling: score pooling (default 7, max — the paper's LongBench setting; the original
        code used 5, avg).
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    name = "snapkv"

    def select(self, layer, st, pad, cap):
        """Window slots forced, top prefix slots by pooled score."""
        scores = snapkv_scores(st, pad, window=self.window, kernel=self.kernel, pooling=self.pooling, gqa=self.gqa)
        real, prefix = slot_masks(pad, scores.shape[-1], st.prompt_len, self.window)
        forced = (real & ~prefix)[:, None, :]
        return keep_top(scores, forced, prefix[:, None, :], cap)
