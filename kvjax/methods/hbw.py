"""HBW-KV (hierarchical block-wise KV compression, the seed paper ``papers/hbw_kv.md``).

SnapKV scoring (observation-window attention, pooled, f32), but the prefix is kept in whole
*blocks* of ``T`` tokens (block score = mean of its token scores, Eq. 5) and selection is
*hierarchical*: round ``r`` of the group schedule ``M`` splits the prefix into ``M[r]`` equal
groups, each choosing its best blocks among those not chosen in earlier rounds. The observation
window is kept verbatim.

Allocation, in blocks (the paper gives each group ``C / M`` of the capacity; it is silent on rounding):
* the prefix capacity ``C - window`` holds ``N = (C - window) // T`` whole blocks; rounds share
  them equally (earlier rounds take the remainder first);
* in a round with ``m`` groups each group takes ``floor(share / m)`` blocks; the round's leftover
  blocks go to the groups with the best remaining block, at most one more per group (so with
  C = 1024, T = 32, M = (1, 8): 16 blocks in round 1, then 15 = 8 + 7 in round 2, and 31 blocks
  = 992 tokens in all, where the previous token-share rounding kept only 23 blocks + 256 single
  tokens);
* blocks a group cannot supply (too few blocks) are filled with the best remaining blocks of the
  whole prefix, and the last ``C - window - N * T < T`` tokens with the best single tokens.

Other choices where the paper is silent (documented deviations):
* blocks are aligned to the first real token of each row; a block belongs to the group holding its
  first token; the last block of the prefix may be partial (its score is the mean of its tokens);
* token scores are SnapKV's: the softmax runs over prefix and window keys (the paper's Eq. 3
  normalises over the prefix only; the window keys only add a per-query constant to the
  denominator, which changes the sum over window queries slightly), and pooling (kernel 7, max)
  is applied to token scores before block averaging.
With ``T = 1`` and ``M = (1,)`` this is exactly SnapKV (the paper's degenerate case).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.methods.base import PagedAppend, PromptCompression
from kvjax.selection import UniformCapacity, WindowAttentionScores, keep_top, rank_desc, slot_masks


@dataclasses.dataclass(frozen=True)
class HierarchicalBlocks:
    """HBW-KV's selector: window forced, whole blocks by hierarchical rounds, then single tokens."""

    window: int
    block_size: int | None
    groups: tuple

    def block_for(self, cap: int) -> int:
        """Block size used at capacity ``cap`` (the paper's ``capacity / 32`` unless given)."""
        return self.block_size if self.block_size is not None else max(1, cap // 32)

    def __call__(self, scores, pad, prompt_slots: int, row_caps, head_caps):
        """Keep mask ``[B, Hkv, S]`` (see module docstring)."""
        return hierarchical_block_keep(scores, pad, prompt_slots, self.window, row_caps,
                                       self.block_for(max(head_caps)), self.groups)


def hierarchical_block_keep(scores, pad, prompt_slots: int, window: int, row_caps, block: int, groups: tuple[int, ...]):
    """Keep mask ``[B, Hkv, S]`` of HBW-KV from per-token scores; ``row_caps[B, Hkv]`` (see module docstring)."""
    B, H, S = scores.shape
    real, prefix = slot_masks(pad, S, prompt_slots, window)
    prefix_len = jnp.maximum(prompt_slots - window - pad, 0)  # [B]
    nb = max(1, -(-(prompt_slots - window) // block))
    P = nb * block
    pos = jnp.arange(P)
    src = jnp.clip(pos[None, :] + pad[:, None], 0, S - 1)  # position p of row b <-> slot p + pad[b]
    pos_valid = pos[None, :] < prefix_len[:, None]  # [B, P]
    pos_scores = jnp.take_along_axis(scores, jnp.broadcast_to(src[:, None, :], (B, H, P)), axis=2)
    pos_scores = jnp.where(pos_valid[:, None, :], pos_scores, 0.0).reshape(B, H, nb, block)
    counts = pos_valid.reshape(B, nb, block).sum(-1)  # [B, nb]
    block_valid = jnp.broadcast_to((counts > 0)[:, None, :], (B, H, nb))
    block_score = jnp.where(block_valid, pos_scores.sum(-1) / jnp.maximum(counts, 1)[:, None, :], -jnp.inf)

    n_window = jnp.minimum(window, prompt_slots - pad)[:, None]  # [B, 1] window tokens of each row
    total = jnp.maximum(row_caps - n_window, 0) // block  # [B, H] whole blocks of the prefix capacity
    R = len(groups)
    chosen = jnp.zeros((B, H, nb), bool)
    block_start = jnp.arange(nb) * block
    for r, m in enumerate(groups):
        share = total // R + (r < total % R)  # [B, H]
        per_group = share // m
        leftover = share - per_group * m
        group_of = (block_start[None, :] * m) // jnp.maximum(prefix_len[:, None], 1)  # [B, nb]
        best_left = jnp.zeros((B, H, nb), bool)
        for g in range(m):
            cand = (group_of == g)[:, None, :] & block_valid & ~chosen
            rank = rank_desc(block_score, cand)
            chosen = chosen | (cand & (rank < per_group[..., None]))
            best_left = best_left | (cand & (rank == per_group[..., None]))  # the group's next-best block
        chosen = chosen | (best_left & (rank_desc(block_score, best_left) < leftover[..., None]))
    remaining = total - chosen.sum(-1)  # blocks the groups could not supply
    cand = block_valid & ~chosen
    chosen = chosen | (cand & (rank_desc(block_score, cand) < remaining[..., None]))

    token_chosen_pos = jnp.repeat(chosen, block, axis=2) & pos_valid[:, None, :]  # [B, H, P]
    p_of_slot = jnp.arange(S)[None, :] - pad[:, None]  # [B, S]
    in_range = (p_of_slot >= 0) & (p_of_slot < P)
    gathered = jnp.take_along_axis(
        token_chosen_pos, jnp.broadcast_to(jnp.clip(p_of_slot, 0, P - 1)[:, None, :], (B, H, S)), axis=2
    )
    forced = (gathered & in_range[:, None, :] & prefix[:, None, :]) | (real & ~prefix)[:, None, :]
    return keep_top(scores, forced, prefix[:, None, :], row_caps)


@dataclasses.dataclass(frozen=True)
class HBW(PromptCompression):
    """HBW-KV: SnapKV scores, block-wise, hierarchical selection (module docstring has the details).

    Args:
      block_size: tokens per block ``T``; None = ``max(1, capacity // 32)`` (the paper's rule).
      groups: the group schedule ``M`` (default ``(1, 8)``).
      window, kernel, pooling: SnapKV scoring (defaults 32, 7, max).
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
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
        if self.window <= 0:
            raise ValueError(f"window must be > 0, got {self.window}")

    def selector(self) -> HierarchicalBlocks:
        """The hierarchical block selector."""
        return HierarchicalBlocks(self.window, self.block_size, self.groups)

    def check_capacity(self, cap):
        """Window and block must fit in the capacity."""
        if self.window > cap:
            raise ValueError(f"window {self.window} is larger than the budget of {cap} tokens per KV head")
        if self.selector().block_for(cap) > cap:
            raise ValueError(f"block size {self.selector().block_for(cap)} is larger than the capacity of {cap} tokens per KV head")

    def components(self):
        """Window scores + uniform + hierarchical blocks + pages."""
        return (WindowAttentionScores(self.window, self.kernel, self.pooling, self.gqa), UniformCapacity(),
                self.selector(), PagedAppend(self.page_size, self.implementation))
