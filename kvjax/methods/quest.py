"""Quest (Tang et al., 2024): query-aware page selection over a full cache.

Every token stays on the device (Quest saves bandwidth, not memory). Each page of ``page_size``
(default 16) tokens keeps the element-wise min and max of its keys; at every decode step the page
score is the upper bound ``sum_i max(q_i * max_i, q_i * min_i)`` (aggregated over the GQA group),
and attention reads only the top pages plus the page holding the newest tokens. The first
``dense_layers`` (default 2) layers attend densely.

Tokens prefilled onto the compressed cache in one call (a question, T > 1) attend to every held
token (exact attention; page selection is a per-decode-step policy) and update the page bounds.

With a quantized ``kv_dtype`` (int8, float8_e4m3fn; :mod:`kvjax.kv_quantization`) the pages are the
shared paged pools stored with per-token scales (:func:`kvjax.paged.build_paged`,
:func:`kvjax.paged.append`), read by the paged decode attention with their scales; the page bounds
are the min / max of the dequantized stored keys (float32), so the selection bounds exactly the keys
attention reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from kvjax.budgets import budget_facts, check_budget, tokens_per_head
from kvjax.cache import Cache, CacheSpec
from kvjax.kv_quantization import dequantize, stored_vector_bytes
from kvjax.methods.base import LayerLocal, StagedPrefill, check_common
from kvjax.paged import (
    PagedKV, append, build_paged, paged_attention, paged_chunk_attention, paged_device_bytes, paged_partition,
)
from kvjax.selection import gqa_aggregate
from kvjax.staging import Recording, StagedKV, staged_partition


@struct.dataclass
class QuestKV:
    """A full paged layer plus per-page key bounds ``kmin, kmax[num_pages, D]`` (f32; +-inf when empty).

    The bounds are float32 whatever ``kv_dtype``: they are taken over the dequantized stored keys (``q * s`` in
    float32, each token with its own scale), which no per-token quantized dtype can hold for a whole page, and in
    float32 they are the exact extremes of what attention reads, so a page's score stays an upper bound of its
    dequantized keys' logits."""

    paged: PagedKV
    kmin: jax.Array
    kmax: jax.Array
    pages_per_step: int = struct.field(pytree_node=False, default=1)
    dense: bool = struct.field(pytree_node=False, default=False)


def page_bounds(state: PagedKV):
    """Element-wise min / max of the valid keys of every page (f32), over the keys as stored and dequantized (pages
    times their per-token scales when quantized): the keys attention reads."""
    P, ps, D = state.k_pages.shape
    B, H, M = state.block_table.shape
    j = jnp.arange(M * ps).reshape(M, ps)
    valid = j[None, None] < state.lengths[..., None, None]  # [B, H, M, ps]
    scales = None if state.k_scales is None else state.k_scales[state.block_table]
    k = dequantize(state.k_pages[state.block_table], scales, jnp.float32)  # [B, H, M, ps, D]
    kmin = jnp.where(valid[..., None], k, jnp.inf).min(axis=3)
    kmax = jnp.where(valid[..., None], k, -jnp.inf).max(axis=3)
    init_min = jnp.full((P, D), jnp.inf, jnp.float32)
    init_max = jnp.full((P, D), -jnp.inf, jnp.float32)
    return init_min.at[state.block_table].min(kmin), init_max.at[state.block_table].max(kmax)


def stored_keys(state: PagedKV, flat):
    """The keys stored at pool slots ``flat[n]`` (page * page_size + offset), dequantized to float32: ``[n, D]``."""
    D = state.k_pages.shape[-1]
    scales = None if state.k_scales is None else state.k_scales.reshape(-1)[flat]
    return dequantize(state.k_pages.reshape(-1, D)[flat], scales, jnp.float32)


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
class Quest(StagedPrefill, LayerLocal):
    """Quest: full cache, per-step top pages by key bounds.

    Args:
      budget: tokens of the top pages read per KV head per step (``budget // page_size`` pages, for
        the longest row); the page holding the newest tokens is read in addition, as in the paper.
      page_size: tokens per page (default 16).
      dense_layers: first layers that attend densely (default 2).
      gqa: aggregation of the group's page scores, mean | max.
      block: key-block size of the prefill attention.
      implementation: decode attention implementation.
    """

    budget: int | float = 0.25
    page_size: int = 16
    dense_layers: int = 2
    gqa: str = "mean"
    block: int = 256
    implementation: str = "auto"
    name = "quest"

    def __post_init__(self):
        check_common(self.page_size, self.block, self.gqa, self.implementation)
        check_budget(self.budget)
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")

    def pages_per_step(self, spec: CacheSpec) -> int:
        """Top pages read per step plus the newest page."""
        cap = tokens_per_head(self.budget, spec.longest_row)
        if cap < self.page_size:
            raise ValueError(f"Quest budget of {cap} tokens is smaller than one page ({self.page_size} tokens)")
        return cap // self.page_size + 1

    def recording(self) -> Recording:
        """The plain staging."""
        return Recording(block=self.block)

    def check_spec(self, spec: CacheSpec) -> None:
        """The budget holds at least one page (``finish_prefill`` moves every real token into pages); any
        ``kv_dtype`` (the pages are the shared paged pools)."""
        self.pages_per_step(spec)

    def finish_prefill(self, state: StagedKV, ctx) -> QuestKV:
        """Every real prompt token into pages (room included, stored in ``kv_dtype``) and the page bounds of the stored
        keys."""
        spec = ctx.spec
        P = spec.prompt_slots
        B, H = state.k.shape[:2]
        idx = jnp.clip(ctx.pad[:, None, None] + jnp.arange(spec.longest_row)[None, None, :], 0, P - 1)
        idx = jnp.broadcast_to(idx, (B, H, spec.longest_row)).astype(jnp.int32)
        lengths = jnp.broadcast_to((P - ctx.pad)[:, None], (B, H)).astype(jnp.int32)
        paged = build_paged(state.k, state.v, idx, lengths, (spec.longest_row,) * H, spec.room, self.page_size, spec.mesh,
                            spec.kv_dtype)
        kmin, kmax = page_bounds(paged)
        return QuestKV(paged, kmin, kmax, pages_per_step=self.pages_per_step(spec), dense=ctx.layer < self.dense_layers)

    def decode_attend(self, state: QuestKV, q, k, v, ctx):
        """Append (updating the page bounds from the new keys as stored, dequantized) and attend over the selected
        pages (all pages for T > 1)."""
        paged = state.paged
        ps, T = paged.page_size, k.shape[1]
        j = paged.lengths[..., None] + jnp.arange(T, dtype=jnp.int32)  # [B, Hkv, T]
        page = jnp.take_along_axis(paged.block_table, j // ps, axis=2).reshape(-1)
        paged = append(paged, k, v)
        if paged.k_scales is None and paged.k_pages.dtype == k.dtype:  # stored as given: no read-back
            kn = k.transpose(0, 2, 1, 3).reshape(-1, k.shape[-1]).astype(jnp.float32)
        else:
            kn = stored_keys(paged, page * ps + (j % ps).reshape(-1))  # [B * Hkv * T, D], the order of ``page``
        state = state.replace(paged=paged, kmin=state.kmin.at[page].min(kn), kmax=state.kmax.at[page].max(kn))
        if T > 1:
            return paged_chunk_attention(q, state.paged), state
        if state.dense:
            out = paged_attention(q[:, 0], state.paged, implementation=self.implementation, mesh=ctx.mesh)
        else:
            table, lengths = select_pages(q[:, 0], state, self.gqa)
            out = paged_attention(q[:, 0], state.paged, block_table=table, lengths=lengths, implementation=self.implementation,
                                  mesh=ctx.mesh)
        return out[:, None].astype(q.dtype), state

    def state_partition(self, state, spec: CacheSpec):
        """The staging's specs, then pages as any paged layer with each page's bounds beside it."""
        if isinstance(state, StagedKV):
            return staged_partition(state)
        paged = paged_partition(state.paged)
        return state.replace(paged=paged, kmin=paged.k_pages, kmax=paged.k_pages)

    def stats(self, cache: Cache) -> dict:
        """Quest saves bandwidth, not memory: device bytes are the full cache's (in ``kv_dtype``, scales included)
        plus the page bounds."""
        if cache.stage != "compressed":
            return {}
        return {"saves": "bandwidth, not memory (every token stays on the device)",
                "page_pool_bytes": sum(paged_device_bytes(st.paged) for st in cache.layers),
                **budget_facts(self.budget, cache.spec.longest_row)}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Dense layers read every token; the others the selected pages plus the page bounds (tokens in their stored
        dtype with their scales)."""
        if cache.stage != "compressed":
            return 0
        read = 0
        for st in cache.layers:
            p = st.paged
            per_token = stored_vector_bytes(p.k_pages.shape[-1], p.k_pages.dtype)
            tokens = int(jnp.sum(p.lengths)) if st.dense else int(jnp.sum(jnp.minimum(p.lengths, st.pages_per_step * p.page_size)))
            read += 2 * tokens * per_token + (0 if st.dense else 2 * st.kmin.size * st.kmin.dtype.itemsize)
        return read
