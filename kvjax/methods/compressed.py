"""Shared machinery of the static (compress-after-prefill) methods: staging, scoring, selection, paging.

Life of a static method's cache:
1. ``init_cache`` allocates a dense *staging* cache (:class:`StagedKV`) of the prompt's slots.
2. Prefill chunks write their K/V there and attend causally (XLA blocked attention). The last
   chunk records the observation-window queries; H2O-style methods accumulate attention.
3. ``compress(cache)`` (jitted, called once after prefill) scores tokens, selects per KV head, and
   gathers the survivors into per-layer page pools (:class:`kvjax.paged.PagedKV`) with room for
   the decoded tokens. The staging buffer is then dropped: device memory holds only the pages.
4. Decode appends to the pages and attends through ``kvjax.paged.paged_attention`` (the Pallas
   block-sparse kernel on accelerators, its XLA reference on CPU).

Scores are float32. A method's ``select`` returns kept slots ``[B, Hkv, cap]`` sorted ascending.
Padding slots of left-padded rows are never kept.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from kvjax.attention import (
    MASK_VALUE, causal_cache_attention, masked_block_scores, query_block_rows, resolve_implementation,
    visible_key_blocks,
)
from kvjax.budgets import tokens_per_head
from kvjax.cache import AttendContext, Cache
from kvjax.methods.base import round_up
from kvjax.paged import PagedKV, append, build_paged, paged_attention, paged_device_bytes

GQA_AGGREGATIONS = ("mean", "max")
NEG_INF = -jnp.inf


@struct.dataclass
class StagedKV:
    """Dense prefill staging of one layer: ``k, v[B, Hkv, S, D]`` plus what scoring needs.

    ``q_window[B, W, Hq, D]``: post-RoPE queries of the last W prompt slots (recorded by the last
    chunk); ``acc[B, Hq, S]``: attention accumulated over all prompt queries (H2O), or None.
    ``capacities``: per-layer kept tokens per KV head (static); ``room``: decode slots per head.
    """

    k: jax.Array
    v: jax.Array
    q_window: jax.Array | None
    acc: jax.Array | None
    prompt_len: int = struct.field(pytree_node=False, default=0)
    capacities: tuple = struct.field(pytree_node=False, default=())
    room: int = struct.field(pytree_node=False, default=0)


def gqa_aggregate(scores, num_kv_heads: int, how: str):
    """``[B, Hq, S]`` -> ``[B, Hkv, S]`` by mean or max over each KV head's query group."""
    B, Hq, S = scores.shape
    g = scores.reshape(B, num_kv_heads, Hq // num_kv_heads, S)
    if how == "mean":
        return g.mean(axis=2)
    if how == "max":
        return g.max(axis=2)
    raise ValueError(f"unknown GQA aggregation {how!r}; allowed: {', '.join(GQA_AGGREGATIONS)}")


def pool1d(x, valid, kernel: int, how: str):
    """Stride-1 pooling over the last axis with padding ``kernel // 2``, restricted to ``valid`` entries.

    ``avg`` divides by ``kernel`` (zeros outside, PyTorch's ``count_include_pad=True``, as SnapKV);
    ``max`` ignores entries outside ``valid``. ``kernel=1`` returns ``x``.
    """
    if kernel == 1:
        return x
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd, got {kernel}")
    if how == "avg":
        z = jnp.where(valid, x, 0.0)
        out = lax.reduce_window(z, 0.0, lax.add, (1,) * (x.ndim - 1) + (kernel,), (1,) * x.ndim,
                                [(0, 0)] * (x.ndim - 1) + [(kernel // 2, kernel // 2)])
        return out / kernel
    if how == "max":
        z = jnp.where(valid, x, NEG_INF)
        return lax.reduce_window(z, NEG_INF, lax.max, (1,) * (x.ndim - 1) + (kernel,), (1,) * x.ndim,
                                 [(0, 0)] * (x.ndim - 1) + [(kernel // 2, kernel // 2)])
    raise ValueError(f"unknown pooling {how!r}; allowed: avg, max")


def window_attention(q_window, k, pad, prompt_len: int):
    """Softmax (f32) of the last W prompt queries over the prompt's keys, summed over the window: [B, Hq, S]."""
    B, W, Hq, D = q_window.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q_window.reshape(B, W, Hkv, Hq // Hkv, D).astype(jnp.float32)
    s = jnp.einsum("bwhgd,bhsd->bhgws", qg, k.astype(jnp.float32), precision=lax.Precision.HIGHEST) * D**-0.5
    q_slots = prompt_len - W + jnp.arange(W)
    slots = jnp.arange(S)
    mask = (slots[None, None, :] <= q_slots[None, :, None]) & (slots[None, None, :] >= pad[:, None, None])
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    return jax.nn.softmax(s, axis=-1).sum(axis=-2).reshape(B, Hq, S)


def slot_masks(pad, S: int, prompt_len: int, window: int):
    """(real [B, S], prefix [B, S]): real prompt slots, and those before the last ``window`` slots."""
    slots = jnp.arange(S)[None, :]
    real = (slots >= pad[:, None]) & (slots < prompt_len)
    return real, real & (slots < prompt_len - window)


def topk_mask(scores, k: int):
    """Bool mask of the ``k`` largest entries of the last axis (ties: lower index first)."""
    if k <= 0:
        return jnp.zeros(scores.shape, bool)
    _, idx = lax.top_k(scores, k)
    flat = scores.reshape(-1, scores.shape[-1])
    rows = jnp.arange(flat.shape[0])[:, None]
    return jnp.zeros(flat.shape, bool).at[rows, idx.reshape(flat.shape[0], k)].set(True).reshape(scores.shape)


def keep_top(scores, forced, candidates, cap: int):
    """Forced slots plus the best ``cap - #forced`` candidates: bool keep mask [..., S]."""
    n_forced = forced.sum(axis=-1, keepdims=True)
    s = jnp.where(candidates & ~forced, scores, NEG_INF)
    # rank candidates; keep those ranked below cap - n_forced (n_forced may differ per row)
    order = jnp.argsort(-s, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    chosen = (rank < cap - n_forced) & candidates & ~forced
    return forced | chosen


def mask_to_indices(keep, cap: int):
    """Kept slots ascending, ``[..., cap]`` (``keep`` must hold ``cap`` True entries per row)."""
    return jnp.argsort(~keep, axis=-1, stable=True)[..., :cap].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class StaticMethod:
    """Base of the compress-after-prefill methods; subclasses implement :meth:`select`.

    Common args: ``budget`` (see :mod:`kvjax.budgets`), ``page_size`` of the pools, ``gqa`` (mean | max
    aggregation of a KV head's query-group scores), ``block`` (prefill attention block),
    ``implementation`` of the decode attention.
    """

    budget: int | float = 0.25
    page_size: int = 16
    gqa: str = "mean"
    block: int = 256
    implementation: str = "auto"
    name = "static"

    # what the staging records
    window: int = 0  # observation window kept verbatim and used for scoring
    accumulate: bool = False  # H2O: accumulate attention of every prompt query

    def __post_init__(self):
        if self.gqa not in GQA_AGGREGATIONS:
            raise ValueError(f"unknown GQA aggregation {self.gqa!r}; allowed: {', '.join(GQA_AGGREGATIONS)}")
        if self.page_size <= 0 or self.block <= 0:
            raise ValueError(f"page_size and block must be positive, got {self.page_size}, {self.block}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        resolve_implementation(self.implementation)
        tokens_per_head(self.budget, 1 << 30) if isinstance(self.budget, float) else None
        if isinstance(self.budget, int) and not isinstance(self.budget, bool) and self.budget <= 0:
            raise ValueError(f"budget must be > 0 tokens per KV head, got {self.budget}")

    # ---- budgets
    def layer_capacities(self, num_layers: int, prompt_len: int) -> tuple[int, ...]:
        """Prompt tokens kept per KV head in each layer (uniform by default)."""
        cap = tokens_per_head(self.budget, prompt_len)
        self.check_capacity(cap)
        return (cap,) * num_layers

    def check_capacity(self, cap: int) -> None:
        """Reject capacities the method cannot fill (window larger than the budget, ...)."""
        if self.window > cap:
            raise ValueError(f"window {self.window} is larger than the budget of {cap} tokens per KV head")

    def check_prompt_lengths(self, lengths: Sequence[int]) -> None:
        """Every row of a left-padded batch must have at least ``max capacity`` real tokens."""
        shortest = min(lengths)
        cap = max(self.layer_capacities(1, max(lengths)))
        if isinstance(self.budget, int) and cap > shortest:
            raise ValueError(f"budget of {cap} tokens per KV head is larger than the shortest prompt ({shortest} tokens)")

    # ---- protocol
    def init_cache(self, config, batch: int, prompt_len: int, max_new_tokens: int, dtype) -> Cache:
        """Staging cache for the prompt; pages are allocated by :meth:`compress`."""
        caps = self.layer_capacities(config.num_layers, prompt_len)
        S = round_up(prompt_len, self.block)
        shape = (batch, config.num_kv_heads, S, config.head_dim)
        # one buffer per field and layer: aliased buffers cannot be donated
        layers = tuple(
            StagedKV(
                jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                jnp.zeros((batch, self.window, config.num_heads, config.head_dim), dtype) if self.window else None,
                jnp.zeros((batch, config.num_heads, S), jnp.float32) if self.accumulate else None,
                prompt_len=prompt_len, capacities=(caps[i],) * config.num_kv_heads, room=max_new_tokens,
            )
            for i in range(config.num_layers)
        )
        return Cache(layers=layers, length=jnp.zeros((), jnp.int32), pad=jnp.zeros((batch,), jnp.int32),
                     method=self, capacity=S)

    def attend(self, state, q, k, v, ctx: AttendContext):
        """Prefill: write staging, record window/accumulation, attend densely. Decode: append to pages."""
        if isinstance(state, PagedKV):
            state = append(state, k[:, 0], v[:, 0])
            out = paged_attention(q[:, 0], state, implementation=self.implementation)
            return out[:, None].astype(q.dtype), state
        if ctx.phase == "decode":
            raise ValueError(f"{self.name}: decoding on an uncompressed staging cache; call compress(cache) after prefill")
        k_all = lax.dynamic_update_slice_in_dim(state.k, k.transpose(0, 2, 1, 3).astype(state.k.dtype), ctx.start, axis=2)
        v_all = lax.dynamic_update_slice_in_dim(state.v, v.transpose(0, 2, 1, 3).astype(state.v.dtype), ctx.start, axis=2)
        out = causal_cache_attention(q, k_all, v_all, q_start=ctx.start, pad=ctx.pad, scale=q.shape[-1] ** -0.5,
                                     block=self.block)
        q_window, acc = state.q_window, state.acc
        if ctx.last_chunk and self.window:
            T = q.shape[1]
            if T < self.window:
                raise ValueError(f"{self.name}: the last prefill chunk has {T} tokens, fewer than the window {self.window}; "
                                 "use a larger chunk_size")
            q_window = q[:, T - self.window:].astype(state.k.dtype)
        if self.accumulate:
            acc = acc + chunk_attention_sums(q, k_all, ctx.start, ctx.pad, self.block)
        return out, state.replace(k=k_all, v=v_all, q_window=q_window, acc=acc)

    def compress(self, cache: Cache) -> Cache:
        """Select per KV head and move the survivors into page pools (jit this; see kvjax.generate.compress)."""
        layers = []
        for i, st in enumerate(cache.layers):
            if not isinstance(st, StagedKV):
                raise ValueError(f"{self.name}: cache layer {i} is already compressed")
            cap = max(st.capacities)
            keep = self.select(i, st, cache.pad, cap)
            layers.append(build_paged(st.k, st.v, mask_to_indices(keep, cap), st.capacities, st.room, self.page_size))
        return cache.replace(layers=tuple(layers))

    def select(self, layer: int, st: StagedKV, pad, cap: int):
        """Bool keep mask [B, Hkv, S] with ``cap`` True entries per head (implemented by each method)."""
        raise NotImplementedError

    def cache_stats(self, cache: Cache) -> dict:
        """Per-layer kept tokens per head and bytes of the page pools."""
        paged = [st for st in cache.layers if isinstance(st, PagedKV)]
        return {
            "kept_tokens_per_head": [list(st.capacities) for st in paged],
            "page_pool_bytes": sum(paged_device_bytes(st) for st in paged),
        }


def chunk_attention_sums(q, k, start, pad, block: int, q_block: int = 512):
    """Column sums of the causal softmax of a chunk's queries over all keys: [B, Hq, S] (f32).

    Queries at slots ``start..start+T-1`` (real queries only: left padding does not vote) attend to
    key slots ``pad .. own slot``. Computed by query blocks of ``q_block`` rows in the layout of
    :func:`kvjax.attention.blocked_causal_attention`: a first pass over the visible key blocks gives
    each row's log-sum-exp, a second adds ``exp(score - lse)`` into the column sums. Both passes stop
    at the block's causal frontier, so empty future slots of the staging buffer cost nothing.
    """
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if S % block:
        raise ValueError(f"cache slots {S} must be a multiple of the attention block {block}")
    scale = D**-0.5
    qp, qb, row_offsets = query_block_rows(q.astype(jnp.float32), q_block, Hkv)
    nq, rows = qp.shape[0], qp.shape[3]

    def query_block(j, acc):
        qj = qp[j]
        q_slots = start + j * qb + row_offsets
        real = ((j * qb + row_offsets)[None, :] < T) & (q_slots[None, :] >= pad[:, None])  # [B, rows]
        n_blocks = visible_key_blocks(start, j, qb, block, S)

        def scores(i):
            kb = lax.dynamic_slice_in_dim(k, i * block, block, axis=2).astype(jnp.float32)
            return masked_block_scores(qj, kb, i * block, q_slots, pad, scale, precision=lax.Precision.HIGHEST)

        def normalizer(i, carry):
            m, l = carry
            s = scores(i)
            m_new = jnp.maximum(m, s.max(axis=-1))
            return m_new, l * jnp.exp(m - m_new) + jnp.exp(s - m_new[..., None]).sum(axis=-1)

        m0 = jnp.full((B, Hkv, rows), MASK_VALUE, jnp.float32)
        m, l = lax.fori_loop(0, n_blocks, normalizer, (m0, jnp.zeros((B, Hkv, rows), jnp.float32)))
        lse = jnp.where(real[:, None], m + jnp.log(l), jnp.inf)  # padding rows: exp(s - inf) = 0

        def column_sums(i, acc):
            p = jnp.exp(scores(i) - lse[..., None]).reshape(B, Hkv, G, qb, block).sum(axis=3)
            old = lax.dynamic_slice_in_dim(acc, i * block, block, axis=3)
            return lax.dynamic_update_slice_in_dim(acc, old + p, i * block, axis=3)

        return lax.fori_loop(0, n_blocks, column_sums, acc)

    acc = lax.fori_loop(0, nq, query_block, jnp.zeros((B, Hkv, G, S), jnp.float32))
    return acc.reshape(B, Hq, S)
