"""HBW-KV (hierarchical block-wise KV compression, the seed paper ``papers/hbw_kv.md``).

SnapKV scoring (observation-window attention, pooled, f32), but the prefix is kept in whole
*blocks* of ``T`` tokens (block score = mean of its token scores, Eq. 5) and selection is
*hierarchical*: round ``r`` of the group schedule ``M`` splits the prefix into ``M[r]`` equal
groups, each choosing its best blocks among those not chosen in earlier rounds. The observation
window is kept verbatim.

Choices where the paper is silent (documented deviations):
* the prefix capacity ``C = capacity - window`` is split equally over the rounds, and each round's
  share equally over its groups; a group keeps ``floor(share / T)`` whole blocks;
* blocks are aligned to the first real token of each row; a block belongs to the group holding its
  first token; the last block of the prefix may be partial (its score is the mean of its tokens);
* capacity left over by rounding (or by groups with too few blocks) is filled with the best
  remaining single tokens, so every head keeps exactly ``capacity`` tokens.
With ``T = 1`` and ``M = (1,)`` this is exactly SnapKV (the paper's degenerate case).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.methods.compressed import keep_top, slot_masks, topk_mask
from kvjax.methods.snapkv import SnapKV, snapkv_scores


def hierarchical_block_keep(scores, pad, prompt_len: int, window: int, cap: int, block: int, groups: tuple[int, ...]):
    """Keep mask ``[B, Hkv, S]`` of HBW-KV from per-token scores ``[B, Hkv, S]`` (see module docstring)."""
    B, H, S = scores.shape
    real, prefix = slot_masks(pad, S, prompt_len, window)
    prefix_len = prompt_len - window - pad  # [B]
    nb = -(-(prompt_len - window) // block)
    P = nb * block
    # shift each row to position space: pos p <-> slot p + pad[b]
    pos = jnp.arange(P)
    src = jnp.clip(pos[None, :] + pad[:, None], 0, S - 1)  # [B, P]
    pos_valid = pos[None, :] < prefix_len[:, None]  # [B, P]
    pos_scores = jnp.take_along_axis(scores, jnp.broadcast_to(src[:, None, :], (B, H, P)), axis=2)
    pos_scores = jnp.where(pos_valid[:, None, :], pos_scores, 0.0).reshape(B, H, nb, block)
    counts = pos_valid.reshape(B, nb, block).sum(-1)  # [B, nb]
    block_valid = counts > 0
    block_score = jnp.where(block_valid[:, None, :], pos_scores.sum(-1) / jnp.maximum(counts, 1)[:, None, :], -jnp.inf)

    chosen = jnp.zeros((B, H, nb), bool)
    per_round = (cap - window) // len(groups)
    block_start = jnp.arange(nb) * block
    for m in groups:
        per_group_blocks = (per_round // m) // block
        group_of = (block_start[None, :] * m) // jnp.maximum(prefix_len[:, None], 1)  # [B, nb]
        for g in range(m):
            cand = (group_of == g)[:, None, :] & block_valid[:, None, :] & ~chosen
            pick = topk_mask(jnp.where(cand, block_score, -jnp.inf), min(per_group_blocks, nb)) & cand
            chosen = chosen | pick
    token_chosen_pos = jnp.repeat(chosen, block, axis=2) & pos_valid[:, None, :]  # [B, H, P]
    # back to slot space
    slots = jnp.arange(S)
    p_of_slot = slots[None, :] - pad[:, None]  # [B, S]
    in_range = (p_of_slot >= 0) & (p_of_slot < P)
    gathered = jnp.take_along_axis(
        token_chosen_pos, jnp.broadcast_to(jnp.clip(p_of_slot, 0, P - 1)[:, None, :], (B, H, S)), axis=2
    )
    token_chosen = gathered & in_range[:, None, :] & prefix[:, None, :]
    forced = token_chosen | (real & ~prefix)[:, None, :]
    return keep_top(scores, forced, prefix[:, None, :], cap)


@dataclasses.dataclass(frozen=True)
class HBW(SnapKV):
    """HBW-KV: SnapKV scores, block-wise, hierarchical selection (module docstring has the details).

    Args:
      block_size: tokens per block ``T``; None = ``max(1, capacity // 32)`` (the paper's rule).
      groups: the group schedule ``M`` (default ``(1, 8)``).
      window, kernel, pooling: SnapKV scoring (defaults 32, 7, max).
    """

    block_size: int | None = None
    groups: tuple = (1, 8)
    name = "hbw"

    def __post_init__(self):
        super().__post_init__()
        if not self.groups or any(int(m) <= 0 for m in self.groups):
            raise ValueError(f"groups must be a non-empty sequence of positive ints, got {self.groups!r}")
        object.__setattr__(self, "groups", tuple(int(m) for m in self.groups))
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def block_for(self, cap: int) -> int:
        """Block size used at capacity ``cap``."""
        return self.block_size if self.block_size is not None else max(1, cap // 32)

    def check_capacity(self, cap):
        """Window and block must fit in the capacity."""
        super().check_capacity(cap)
        if self.block_for(cap) > cap:
            raise ValueError(f"block size {self.block_for(cap)} is larger than the capacity of {cap} tokens per KV head")

    def select(self, layer, st, pad, cap):
        """Hierarchical block-wise keep mask."""
        scores = snapkv_scores(st, pad, window=self.window, kernel=self.kernel, pooling=self.pooling, gqa=self.gqa)
        return hierarchical_block_keep(scores, pad, st.prompt_len, self.window, cap, self.block_for(cap), self.groups)
