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
from kvjax.cache import Cache
from kvjax.methods.compressed import StagedKV, StaticMethod, gqa_aggregate, keep_top, mask_to_indices, slot_masks
from kvjax.paged import PagedKV, build_paged, paged_device_bytes


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
class H2O(StaticMethod):
    """Keep the ``recent`` last prompt tokens and the rest of the budget by accumulated attention.

    Scores: attention of every prompt query (causal mask, f32 softmax) summed over queries,
    accumulated chunk by chunk during prefill, then aggregated over the GQA group.

    Args:
      recent_ratio: share of the budget given to the recent window (default 0.5, the paper's split).
      evict_during_decode: False (default): decoded tokens are appended to the compressed prompt, as
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
    accumulate: bool = True
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
        super().check_capacity(cap)
        recent = int(cap * self.recent_ratio)
        if self.evict_during_decode and recent >= cap:
            raise ValueError(f"H2O with evict_during_decode=True: the recent window of {recent} tokens "
                             f"(recent_ratio {self.recent_ratio}) fills the budget of {cap} tokens per KV head, "
                             "leaving no slot to evict; lower recent_ratio")

    def select(self, layer, st, pad, cap):
        """Recent slots forced, heavy hitters by accumulated attention among the rest."""
        recent = int(cap * self.recent_ratio)
        scores = gqa_aggregate(st.acc, st.k.shape[1], self.gqa)
        real, prefix = slot_masks(pad, scores.shape[-1], st.prompt_len, recent)
        return keep_top(scores, (real & ~prefix)[:, None, :], prefix[:, None, :], cap)

    def compress(self, cache: Cache) -> Cache:
        """Default: the static compression. Eviction on: pools of ``capacity`` slots plus scores and positions."""
        if not self.evict_during_decode:
            return super().compress(cache)
        layers = []
        for i, st in enumerate(cache.layers):
            if not isinstance(st, StagedKV):
                raise ValueError(f"{self.name}: cache layer {i} is already compressed")
            for c in sorted(set(st.capacities)):
                self.check_capacity(c)
            cap = max(st.capacities)
            keep = self.select(i, st, cache.pad, cap)
            idx = mask_to_indices(keep, cap)  # [B, Hkv, cap]
            paged = build_paged(st.k, st.v, idx, st.capacities, 0, self.page_size)
            Hkv = st.k.shape[1]
            in_range = jnp.arange(cap)[None, :] < jnp.asarray(st.capacities)[:, None]
            # a row shorter than the budget keeps fewer tokens: the rest of its slots start empty
            held = jnp.take_along_axis(keep, idx, axis=2) & in_range[None]
            scores = jnp.take_along_axis(gqa_aggregate(st.acc, Hkv, self.gqa), idx, axis=2)
            layers.append(H2OKV(
                paged.replace(lengths=held.sum(axis=-1).astype(jnp.int32)),
                acc=jnp.where(held, scores, 0.0).astype(jnp.float32),
                pos=jnp.where(held, idx, -1).astype(jnp.int32),
                recent=tuple(int(c * self.recent_ratio) for c in st.capacities),
            ))
        return cache.replace(layers=tuple(layers))

    def attend(self, state, q, k, v, ctx):
        """Eviction on and compressed: :func:`h2o_decode_step`; otherwise the static path."""
        if not isinstance(state, H2OKV):
            return super().attend(state, q, k, v, ctx)
        if q.shape[1] != 1:
            raise ValueError(f"{self.name}: a compressed cache decodes one token per step, got {q.shape[1]}")
        out, state = h2o_decode_step(state, q[:, 0], k[:, 0], v[:, 0], ctx.start, self.gqa)
        return out[:, None].astype(q.dtype), state

    def cache_stats(self, cache: Cache) -> dict:
        """Static stats; with eviction on the budget stays fixed during decoding (pools hold capacity only)."""
        layers = [st for st in cache.layers if isinstance(st, H2OKV)]
        if not layers:
            return super().cache_stats(cache)
        return {
            "kept_tokens_per_head": [list(st.paged.capacities) for st in layers],
            "page_pool_bytes": sum(paged_device_bytes(st.paged) for st in layers),
            "score_state_bytes": sum(int(x.size) * x.dtype.itemsize for st in layers for x in (st.acc, st.pos)),
            "evicts_during_decode": True,
            "decode_attention": "xla (eviction needs the attention probabilities)",
        }
