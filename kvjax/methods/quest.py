"""Quest (Tang et al., 2024): query-aware page selection over a full cache.

Every token stays on the device (Quest saves bandwidth, not memory). Each page of ``page_size``
(default 16) tokens keeps the element-wise min and max of its keys; at every decode step the page
score is the upper bound ``sum_i max(q_i * max_i, q_i * min_i)`` (aggregated over the GQA group),
and attention reads only the top pages plus the page holding the newest tokens. The first
``dense_layers`` (default 2) layers attend densely.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from kvjax.budgets import tokens_per_head
from kvjax.cache import Cache
from kvjax.methods.compressed import StaticMethod, gqa_aggregate
from kvjax.paged import PagedKV, append, build_paged, paged_attention, paged_device_bytes


@struct.dataclass
class QuestKV:
    """A full paged layer plus per-page key bounds ``kmin, kmax[num_pages, D]`` (f32; +-inf when empty)."""

    paged: PagedKV
    kmin: jax.Array
    kmax: jax.Array
    pages_per_step: int = struct.field(pytree_node=False, default=1)
    dense: bool = struct.field(pytree_node=False, default=False)


def page_bounds(state: PagedKV):
    """Element-wise min / max of the valid keys of every page (f32)."""
    P, ps, D = state.k_pages.shape
    B, H, M = state.block_table.shape
    j = jnp.arange(M * ps).reshape(M, ps)
    valid = j[None, None] < state.lengths[..., None, None]  # [B, H, M, ps]
    k = state.k_pages[state.block_table].astype(jnp.float32)  # [B, H, M, ps, D]
    kmin = jnp.where(valid[..., None], k, jnp.inf).min(axis=3)
    kmax = jnp.where(valid[..., None], k, -jnp.inf).max(axis=3)
    init_min = jnp.full((P, D), jnp.inf, jnp.float32)
    init_max = jnp.full((P, D), -jnp.inf, jnp.float32)
    return init_min.at[state.block_table].min(kmin), init_max.at[state.block_table].max(kmax)


def select_pages(q, st: QuestKV, gqa: str):
    """Per (row, KV head): the top ``pages_per_step - 1`` full pages by Quest's bound, then the last page.

    Returns (block table [B, Hkv, n], lengths [B, Hkv]) for the kernel.
    """
    paged = st.paged
    ps, n = paged.page_size, st.pages_per_step
    B, Hkv, M = paged.block_table.shape
    used = (paged.lengths + ps - 1) // ps  # pages holding tokens
    kmin, kmax = st.kmin[paged.block_table], st.kmax[paged.block_table]  # [B, Hkv, M, D]
    qg = q.reshape(B, Hkv, -1, q.shape[-1]).astype(jnp.float32)  # [B, Hkv, G, D]
    bound = jnp.maximum(qg[:, :, :, None, :] * kmax[:, :, None], qg[:, :, :, None, :] * kmin[:, :, None]).sum(-1)
    scores = gqa_aggregate(bound.reshape(B, -1, M), Hkv, gqa)  # [B, Hkv, M]
    page_ids = jnp.arange(M)
    candidate = page_ids[None, None, :] < (used - 1)[..., None]  # full pages before the last one
    _, top = lax.top_k(jnp.where(candidate, scores, -jnp.inf), n - 1)
    top = jnp.sort(top, axis=-1)
    logical = jnp.concatenate([top, (used - 1)[..., None]], axis=-1)  # [B, Hkv, n]
    small = (used <= n)[..., None]  # everything fits: the first n pages in order
    logical = jnp.where(small, jnp.minimum(page_ids[:n], M - 1)[None, None, :], logical)
    table = jnp.take_along_axis(paged.block_table, logical, axis=2)
    tail = paged.lengths - (used - 1) * ps
    lengths = jnp.where(used <= n, paged.lengths, (n - 1) * ps + tail)
    return table, lengths


@dataclasses.dataclass(frozen=True)
class Quest(StaticMethod):
    """Quest: full cache, per-step top pages by key bounds.

    ``budget`` = tokens of the top pages read per KV head per step (``budget // page_size`` pages);
    the page holding the newest tokens is read in addition, as in the paper.
    """

    dense_layers: int = 2
    name = "quest"

    def layer_capacities(self, num_layers, prompt_len):
        """Quest keeps the whole prompt; the budget sets the pages read per step."""
        cap = tokens_per_head(self.budget, prompt_len)
        if cap < self.page_size:
            raise ValueError(f"Quest budget of {cap} tokens is smaller than one page ({self.page_size} tokens)")
        return (prompt_len,) * num_layers

    def check_prompt_lengths(self, lengths):
        """Quest evicts nothing: any row length works (a head shorter than the budget is read whole)."""

    def compress(self, cache: Cache) -> Cache:
        """Move every real prompt token into pages and compute the page bounds."""
        layers = []
        for i, st in enumerate(cache.layers):
            L = st.prompt_len
            idx = jnp.clip(cache.pad[:, None, None] + jnp.arange(L)[None, None, :], 0, L - 1)
            idx = jnp.broadcast_to(idx, (st.k.shape[0], st.k.shape[1], L)).astype(jnp.int32)
            paged = build_paged(st.k, st.v, idx, st.capacities, st.room, self.page_size)
            paged = paged.replace(lengths=jnp.broadcast_to((L - cache.pad)[:, None], paged.lengths.shape).astype(jnp.int32))
            kmin, kmax = page_bounds(paged)
            n = tokens_per_head(self.budget, L) // self.page_size + 1  # top pages + the newest page
            layers.append(QuestKV(paged, kmin, kmax, pages_per_step=n, dense=i < self.dense_layers))
        return cache.replace(layers=tuple(layers))

    def attend(self, state, q, k, v, ctx):
        """Decode: append (updating the page bounds) and attend over the selected pages."""
        if not isinstance(state, QuestKV):
            return super().attend(state, q, k, v, ctx)
        paged = state.paged
        ps = paged.page_size
        page = jnp.take_along_axis(paged.block_table, (paged.lengths // ps)[..., None], axis=2)[..., 0].reshape(-1)
        kn = k[:, 0].reshape(-1, k.shape[-1]).astype(jnp.float32)
        state = state.replace(
            paged=append(paged, k[:, 0], v[:, 0]),
            kmin=state.kmin.at[page].min(kn), kmax=state.kmax.at[page].max(kn),
        )
        if state.dense:
            out = paged_attention(q[:, 0], state.paged, implementation=self.implementation)
        else:
            table, lengths = select_pages(q[:, 0], state, self.gqa)
            out = paged_attention(q[:, 0], state.paged, block_table=table, lengths=lengths, implementation=self.implementation)
        return out[:, None].astype(q.dtype), state

    def select(self, layer, st, pad, cap):  # pragma: no cover - Quest does not evict
        raise NotImplementedError("Quest keeps every token")

    def cache_stats(self, cache: Cache) -> dict:
        """Quest saves bandwidth, not memory: device bytes are the full cache's; reads per step are reduced."""
        layers = [st for st in cache.layers if isinstance(st, QuestKV)]
        read = 0
        for st in layers:
            p = st.paged
            itemsize = p.k_pages.dtype.itemsize
            tokens = int(jnp.sum(p.lengths)) if st.dense else int(jnp.sum(jnp.minimum(p.lengths, st.pages_per_step * p.page_size)))
            read += 2 * tokens * p.k_pages.shape[-1] * itemsize + (0 if st.dense else 2 * st.kmin.size * 4)
        return {
            "saves": "bandwidth, not memory (every token stays on the device)",
            "page_pool_bytes": sum(paged_device_bytes(st.paged) for st in layers),
            "kv_bytes_read_per_step": read,
        }
