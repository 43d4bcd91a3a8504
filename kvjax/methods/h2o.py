"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus recent tokens.

Two decode-time policies (``H2O.evict_during_decode``):

* off (default): the prompt is compressed once after prefill and decoded tokens are appended to
  pre-allocated room, as in the static prompt-compression setting most KV-compression papers
  evaluate. Decode attention is the paged kernel (:func:`kvjax.paged.paged_attention`).
* on: H2O's own decode-time policy. Each KV head holds exactly ``capacity`` tokens for the whole
  generation; every step the new token attends to the kept tokens and itself, the step's attention
  is added to the accumulated scores, and the new token then replaces the kept token with the
  lowest accumulated score outside the recent window (see :func:`h2o_decode_step`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from kvjax.attention import MASK_VALUE
from kvjax.methods.base import PagedAppend, PromptCompression
from kvjax.paged import PagedKV, build_paged, paged_device_bytes, paged_partition
from kvjax.selection import AccumulatedAttentionScores, RecentAndTop, UniformCapacity, gqa_aggregate


@struct.dataclass
class H2OKV:
    """One layer's H2O cache with decode-time eviction.

    ``paged``: page pools holding exactly ``capacities[h]`` slots per (row, KV head) (no decode
    room); logical slot ``j`` of a head lives at page ``block_table[b, h, j // page_size]``,
    offset ``j % page_size``. ``paged.lengths`` counts the slots holding a token.
    ``acc[B, Hkv, C]`` (f32): accumulated attention of the token in each logical slot (prefill
    accumulation, then every decode step), aggregated over the GQA group; 0 for empty slots.
    ``pos[B, Hkv, C]`` (int32): cache slot of the token held (its position plus the row's left
    padding), -1 for an empty slot. ``C = max(capacities)``; slots ``j >= capacities[h]`` are unused.
    ``recent``: recent-window size of each KV head, ``int(capacity * recent_ratio)`` (static).
    """

    paged: PagedKV
    acc: jax.Array
    pos: jax.Array
    recent: tuple = struct.field(pytree_node=False, default=())


def h2o_decode_step(st: H2OKV, q, k_new, v_new, slot, gqa: str):
    """One decode step with eviction: attention output ``[B, Hq, D]`` (f32) and the updated state.

    ``q[B, Hq, D]``, ``k_new, v_new[B, Hkv, D]`` (post-RoPE), ``slot``: int32 cache slot of the new
    token. Plain jnp (XLA): the attention probabilities are needed for the scores, and the paged
    Pallas kernel does not return them.

    1. attend over the head's held tokens plus the new token (softmax in f32);
    2. add the step's probabilities, aggregated over the GQA group (``gqa``: mean | max, as in
       selection), to the held tokens' accumulated scores;
    3. place the new token: into an empty slot if the head has one (capacity not reached), else over
       the held token with the lowest accumulated score among those outside the recent window (the
       last ``recent`` tokens by position, the new token included; ties: lowest slot index). The
       new token's score starts at its own attention weight of this step.
    """
    paged = st.paged
    B, Hkv, C = st.acc.shape
    Hq, D = q.shape[1], q.shape[2]
    ps = paged.page_size
    j = jnp.arange(C, dtype=jnp.int32)
    caps = jnp.asarray(paged.capacities, jnp.int32)
    in_range = (j[None, :] < caps[:, None])[None]  # [1, Hkv, C]
    flat = jnp.take_along_axis(paged.block_table, jnp.broadcast_to(j // ps, (B, Hkv, C)), axis=2) * ps + j % ps
    k_pool = paged.k_pages.reshape(-1, D)
    v_pool = paged.v_pages.reshape(-1, D)
    k_new = k_new.astype(k_pool.dtype)  # attended as stored, like the append path
    v_new = v_new.astype(v_pool.dtype)
    keys = jnp.concatenate([k_pool[flat], k_new[:, :, None]], axis=2).astype(jnp.float32)  # [B, Hkv, C+1, D]
    vals = jnp.concatenate([v_pool[flat], v_new[:, :, None]], axis=2).astype(jnp.float32)
    held = st.pos >= 0
    visible = jnp.concatenate([held, jnp.ones((B, Hkv, 1), bool)], axis=2)

    qg = q.astype(jnp.float32).reshape(B, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, keys, precision=lax.Precision.HIGHEST) * D**-0.5
    p = jax.nn.softmax(jnp.where(visible[:, :, None], s, MASK_VALUE), axis=-1)
    p = jnp.where(visible[:, :, None], p, 0.0)
    out = jnp.einsum("bhgt,bhtd->bhgd", p, vals, precision=lax.Precision.HIGHEST).reshape(B, Hq, D)

    probs = gqa_aggregate(p.reshape(B, Hq, C + 1), Hkv, gqa)  # [B, Hkv, C+1]
    acc = jnp.where(held, st.acc + probs[..., :C], 0.0)
    recent = jnp.asarray(st.recent, jnp.int32)[None, :, None]
    in_window = st.pos > slot - recent  # the held part of the last ``recent`` positions (new token = slot)
    empty = ~held & in_range
    evictable = held & ~in_window
    choice = jnp.where(empty, -jnp.inf, jnp.where(evictable, acc, jnp.inf))
    target = jnp.argmin(choice, axis=-1).astype(jnp.int32)  # [B, Hkv]; first empty slot, else the lightest
    hit = j[None, None, :] == target[..., None]

    dst = jnp.take_along_axis(flat, target[..., None], axis=2).reshape(-1)
    k_pages = k_pool.at[dst].set(k_new.reshape(-1, D)).reshape(paged.k_pages.shape)
    v_pages = v_pool.at[dst].set(v_new.reshape(-1, D)).reshape(paged.v_pages.shape)
    lengths = paged.lengths + jnp.any(empty, axis=-1).astype(jnp.int32)
    state = st.replace(
        paged=paged.replace(k_pages=k_pages, v_pages=v_pages, lengths=lengths),
        acc=jnp.where(hit, probs[..., C:], acc),
        pos=jnp.where(hit, jnp.asarray(slot, jnp.int32), st.pos),
    )
    return out, state


@dataclasses.dataclass(frozen=True)
class H2OEviction:
    """Layout of H2O's decode-time policy: pools of exactly ``capacity`` slots, scores and positions."""

    recent_ratio: float = 0.5
    page_size: int = 16
    gqa: str = "mean"

    def build(self, st, idx, lengths, head_caps, scores, spec):
        """Pools without room; held tokens keep their accumulated prefill scores."""
        paged = build_paged(st.k, st.v, idx, lengths, head_caps, 0, self.page_size, spec.mesh)
        C = idx.shape[-1]
        held = jnp.arange(C)[None, None, :] < paged.lengths[..., None]
        kept_scores = jnp.take_along_axis(scores, idx, axis=2)
        return H2OKV(paged, acc=jnp.where(held, kept_scores, 0.0).astype(jnp.float32),
                     pos=jnp.where(held, idx, -1).astype(jnp.int32),
                     recent=tuple(int(c * self.recent_ratio) for c in head_caps))

    def decode_attend(self, state: H2OKV, q, k, v, ctx):
        """:func:`h2o_decode_step` for each new token in turn (a question is fed token by token)."""
        def step(st, xs):
            qt, kt, vt, t = xs
            out, st = h2o_decode_step(st, qt, kt, vt, ctx.start + t, self.gqa)
            return st, out

        T = q.shape[1]
        state, outs = lax.scan(step, state, (q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1), jnp.arange(T)))
        return outs.swapaxes(0, 1).astype(q.dtype), state

    def partition(self, state: H2OKV) -> H2OKV:
        """Pools and tables as any paged layer; scores and positions by (row, head)."""
        from kvjax.sharding import ROWS_HEADS

        return state.replace(paged=paged_partition(state.paged), acc=ROWS_HEADS, pos=ROWS_HEADS)

    def stats(self, states) -> dict:
        """Fixed budget during decoding: pools hold the capacity only."""
        return {
            "kept_tokens_per_head": [list(st.paged.capacities) for st in states],
            "page_pool_bytes": sum(paged_device_bytes(st.paged) for st in states),
            "score_state_bytes": sum(int(x.size) * x.dtype.itemsize for st in states for x in (st.acc, st.pos)),
            "evicts_during_decode": True,
            "decode_attention": "xla (eviction needs the attention probabilities)",
        }

    def read_bytes(self, states) -> int:
        """Every held token plus the scores and positions."""
        total = 0
        for st in states:
            p = st.paged
            total += 2 * int(jnp.sum(p.lengths)) * p.k_pages.shape[-1] * p.k_pages.dtype.itemsize
            total += int(st.acc.size) * 4 + int(st.pos.size) * 4
        return total


@dataclasses.dataclass(frozen=True)
class H2O(PromptCompression):
    """Keep the most recent ``recent_ratio`` of the budget and the rest by accumulated attention.

    Scores: attention of every prompt query (causal mask, f32 softmax) summed over queries,
    accumulated chunk by chunk during prefill, then aggregated over the GQA group.

    Args:
      recent_ratio: share of the budget given to the recent window (default 0.5, the paper's split).
      evict_during_decode: False (default): later tokens are appended to the compressed prompt, as
        in the static setting most KV-compression papers evaluate. True: H2O's decode-time eviction
        -- the budget stays fixed at ``capacity`` tokens per KV head; every step adds the new
        token's attention probabilities to the accumulated scores and the new token replaces the
        held token with the lowest score outside the recent window (the last
        ``int(capacity * recent_ratio)`` tokens, new token included); its own score starts at its
        attention weight of that step. Pages are allocated for ``capacity`` slots only.

    Deviations: scores are aggregated over each KV head's query group (``gqa``: mean | max) since
    a KV head's tokens are shared by its query heads (the paper has one score per attention head).
    With eviction on, decode attention runs the jnp/XLA path (whatever ``implementation`` says),
    because the paged Pallas kernel does not return the attention probabilities the scores need.
    """

    recent_ratio: float = 0.5
    evict_during_decode: bool = False
    name = "h2o"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")
        if self.evict_during_decode and self.recent_ratio >= 1.0:
            raise ValueError("H2O with evict_during_decode=True needs recent_ratio < 1: a recent window as large "
                             "as the budget leaves no heavy-hitter slot to evict")

    def check_capacity(self, cap):
        """With eviction on, the recent window must leave at least one evictable (heavy-hitter) slot."""
        recent = int(cap * self.recent_ratio)
        if self.evict_during_decode and recent >= cap:
            raise ValueError(f"H2O with evict_during_decode=True: the recent window of {recent} tokens "
                             f"(recent_ratio {self.recent_ratio}) fills the budget of {cap} tokens per KV head, "
                             "leaving no slot to evict; lower recent_ratio")

    def components(self):
        """Accumulated scores + uniform + recent-and-top + pages (or H2O's evicting pool)."""
        layout = (H2OEviction(self.recent_ratio, self.page_size, self.gqa) if self.evict_during_decode
                  else PagedAppend(self.page_size, self.implementation))
        return AccumulatedAttentionScores(self.gqa), UniformCapacity(), RecentAndTop(self.recent_ratio), layout
