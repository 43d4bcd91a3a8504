"""Compressed cache layout: per-layer page pools with a block table and per-(row, KV head) lengths.

``PagedKV`` is what attention reads after compression:

* ``k_pages, v_pages[num_pages, page_size, D]``: the layer's pool. Each (row, KV head) owns
  ``ceil((capacity_h + room) / page_size)`` pages, so device memory is the sum of the heads'
  capacities (up to page rounding), not ``heads x longest``;
* ``block_table[B, Hkv, max_pages]`` (int32): page ids of each head, in order;
* ``lengths[B, Hkv]`` (int32): tokens held by each head (prompt survivors, then appended tokens).
  A row may hold fewer prompt tokens than its head's capacity (a short row of a ragged batch, a
  budget above the row's length): padding is never stored or attended;
* ``k_scales, v_scales[num_pages, page_size]`` (float32): with a quantized ``kv_dtype`` (int8,
  float8_e4m3fn) the pools hold quantized values and these their per-token scales
  (:mod:`kvjax.kv_quantization`); None otherwise. Attention dequantizes (pages x scales) before
  its math: the XLA paths the gathered pages, the Pallas kernel's compiled forms each block they read
  (:func:`kvjax.pallas_kernels.paged_decode_attention`).

Keys stay post-RoPE at their original positions; later tokens (a question, decoded tokens) are
appended at ``lengths[b, h]`` into pre-allocated room (``room`` slots per head, the cache spec's
``room``). Allocation is static; ``kvjax.decoding`` refuses to write past the room.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.attention import MASK_VALUE, resolve_implementation
from kvjax.kv_quantization import dequantize, quantize, stored_vector_bytes

try:  # jax >= 0.7 (0.10, 0.11 here); older releases kept it in jax.experimental
    from jax import shard_map
except ImportError:  # pragma: no cover - old jax
    from jax.experimental.shard_map import shard_map


@struct.dataclass
class PagedKV:
    """One layer's compressed cache (see module docstring); ``capacities`` are prompt tokens per KV head."""

    @property
    def quantized(self) -> bool:
        """Whether the pools hold quantized values with per-token scales."""
        return self.k_scales is not None

    k_pages: jax.Array
    v_pages: jax.Array
    block_table: jax.Array
    lengths: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None
    page_size: int = struct.field(pytree_node=False, default=16)
    capacities: tuple = struct.field(pytree_node=False, default=())


def page_layout(batch: int, slots_per_head: Sequence[int], page_size: int,
                blocks: tuple[int, int] = (1, 1)) -> tuple[np.ndarray, int]:
    """Static contiguous page allocation: (block_table [B, Hkv, max_pages] int32, num_pages).

    ``blocks = (data, model)``: the rows are cut into ``data`` and the heads into ``model`` equal
    blocks, and each (row block, head block)'s pages are contiguous, row block-major (inside a block:
    row by row, head by head). Split evenly by page, the pool then gives each device of a
    ``(data, model)`` mesh exactly its rows' and heads' pages (:mod:`kvjax.sharding`). When the heads
    hold different capacities, head blocks may need different page counts: every block is padded with
    unused pages to the largest, so the blocks stay equal (the padding is counted in the pool's bytes).
    ``(1, 1)``: row by row, head by head, no padding.
    """
    pages = [max(1, -(-int(n) // page_size)) for n in slots_per_head]
    row_blocks, head_blocks = blocks
    if batch % row_blocks or len(pages) % head_blocks:
        raise ValueError(f"page blocks {blocks} must divide the rows ({batch}) and KV heads ({len(pages)})")
    rows, heads = batch // row_blocks, len(pages) // head_blocks
    block_pages = rows * max(sum(pages[hb * heads:(hb + 1) * heads]) for hb in range(head_blocks))
    max_pages = max(pages)
    table = np.zeros((batch, len(pages), max_pages), np.int32)
    for rb in range(row_blocks):
        for hb in range(head_blocks):
            next_page = (rb * head_blocks + hb) * block_pages
            for b in range(rb * rows, (rb + 1) * rows):
                for h in range(hb * heads, (hb + 1) * heads):
                    n = pages[h]
                    ids = np.arange(next_page, next_page + n)
                    table[b, h, :n] = ids
                    table[b, h, n:] = ids[-1]  # unused entries stay in range
                    next_page += n
    return table, row_blocks * head_blocks * block_pages


def build_paged(k, v, keep_idx, lengths, capacities: Sequence[int], room: int, page_size: int, mesh=None,
                kv_dtype: str | None = None) -> PagedKV:
    """Gather kept tokens into a fresh page pool (laid out for ``mesh`` when given: :func:`page_layout`).

    Args:
      k, v: [B, Hkv, S, D] staged keys/values (slot order).
      keep_idx: int32 [B, Hkv, C] kept slots per head (C >= max capacity); the first ``lengths[b, h]``
        entries are stored in order, the rest are ignored.
      lengths: int32 [B, Hkv] tokens kept per (row, head), at most ``capacities[h]``.
      capacities: prompt tokens each KV head may keep (static, the allocation).
      room: extra slots per head for later tokens.
      page_size: tokens per page.
      mesh: the cache's device mesh (None: one device).
      kv_dtype: the pools' dtype (None: ``k``'s); int8 / float8_e4m3fn are quantized with per-token scales.
    """
    from kvjax.sharding import head_blocks

    B, Hkv, _, D = k.shape
    capacities = tuple(int(c) for c in capacities)
    if len(capacities) != Hkv:
        raise ValueError(f"need one capacity per KV head ({Hkv}), got {capacities}")
    table_np, num_pages = page_layout(B, [c + room for c in capacities], page_size, head_blocks(mesh))
    table = jnp.asarray(table_np)
    C = max(capacities)
    keep_idx = keep_idx[..., :C]
    j = jnp.arange(C, dtype=jnp.int32)
    lengths = jnp.minimum(lengths.astype(jnp.int32), jnp.asarray(capacities, jnp.int32)[None, :])
    valid = j[None, None, :] < lengths[..., None]  # [B, Hkv, C]
    page = jnp.take_along_axis(table, jnp.broadcast_to(j // page_size, (B, Hkv, C)), axis=2)
    flat = jnp.where(valid, page * page_size + j % page_size, num_pages * page_size)  # out of range: dropped

    kv_dtype = k.dtype.name if kv_dtype is None else kv_dtype

    def scatter(src):
        sel, scales = quantize(jnp.take_along_axis(src, keep_idx[..., None], axis=2), kv_dtype)  # [B, Hkv, C, D]
        pool = jnp.zeros((num_pages * page_size, D), sel.dtype)
        pool = pool.at[flat.reshape(-1)].set(sel.reshape(-1, D), mode="drop").reshape(num_pages, page_size, D)
        if scales is None:
            return pool, None
        pool_scales = jnp.zeros((num_pages * page_size,), jnp.float32)
        return pool, pool_scales.at[flat.reshape(-1)].set(scales.reshape(-1), mode="drop").reshape(num_pages, page_size)

    (k_pages, k_scales), (v_pages, v_scales) = scatter(k), scatter(v)
    return PagedKV(k_pages, v_pages, table, lengths, k_scales, v_scales, page_size=page_size, capacities=capacities)


def append(state: PagedKV, k_new, v_new) -> PagedKV:
    """Append ``k_new, v_new[B, T, Hkv, D]`` to every head after its ``lengths`` tokens (quantized like the pool)."""
    B, T, Hkv, D = k_new.shape
    ps = state.page_size
    j = state.lengths[..., None] + jnp.arange(T, dtype=jnp.int32)  # [B, Hkv, T]
    page = jnp.take_along_axis(state.block_table, j // ps, axis=2)
    flat = (page * ps + j % ps).reshape(-1)

    def write(pool, scales, x):
        n = pool.shape[0]
        x, s = quantize(x.transpose(0, 2, 1, 3).reshape(-1, D), pool.dtype.name)
        pool = pool.reshape(n * ps, D).at[flat].set(x).reshape(n, ps, D)
        return pool, None if scales is None else scales.reshape(n * ps).at[flat].set(s).reshape(n, ps)

    (k_pages, k_scales), (v_pages, v_scales) = write(state.k_pages, state.k_scales, k_new), write(state.v_pages, state.v_scales, v_new)
    return state.replace(k_pages=k_pages, v_pages=v_pages, k_scales=k_scales, v_scales=v_scales,
                         lengths=state.lengths + T)


def paged_attention(q, state: PagedKV, *, block_table=None, lengths=None, implementation: str = "auto", mesh=None):
    """Decode attention ``q[B, Hq, D]`` over a paged layer (optionally a per-step selected block table).

    On a multi-device ``mesh`` the Pallas kernel runs under ``shard_map``: each device attends its own
    rows' and KV heads' pages in its shard of the pool (:func:`sharded_paged_attention`); the XLA path
    runs under the sharding annotations.
    """
    from kvjax.pallas_kernels import paged_decode_attention

    from kvjax.sharding import is_split

    impl = resolve_implementation(implementation)
    table = state.block_table if block_table is None else block_table
    lengths = state.lengths if lengths is None else lengths
    if impl != "xla" and is_split(mesh):
        return sharded_paged_attention(q, state, table, lengths, mesh, impl)
    return paged_decode_attention(q, state.k_pages, state.v_pages, table, lengths, implementation=impl,
                                  k_scales=state.k_scales, v_scales=state.v_scales)


def local_block_table(table, pool_pages: int, mesh):
    """Inside ``shard_map`` over ``mesh``: a device's block-table entries as page ids into its own block of the pool
    (``pool_pages`` pages). The pool is split by page into (data, model) blocks that hold exactly one device's rows and
    KV heads (:func:`page_layout`), so the entries point into that block: made local by subtracting its first page."""
    from kvjax.sharding import device_block

    block, _, _ = device_block(mesh, *table.shape[:2])  # the device's (data, model) block
    return table - (block * pool_pages).astype(table.dtype)


def sharded_paged_attention(q, state: PagedKV, block_table, lengths, mesh, implementation: str):
    """The paged-attention kernel per device under ``shard_map`` (``pallas_call`` needs ``check_vma=False``), each
    device over its block of the pool (:func:`local_block_table`)."""
    from kvjax.sharding import BY_DEVICE, ROWS_HEADS
    from kvjax.pallas_kernels import paged_decode_attention

    def local(q, k_pages, v_pages, table, lengths, *scales):
        table = local_block_table(table, k_pages.shape[0], mesh)
        return paged_decode_attention(q, k_pages, v_pages, table, lengths, implementation=implementation,
                                      **dict(zip(("k_scales", "v_scales"), scales)))

    scales = (state.k_scales, state.v_scales) if state.quantized else ()
    return shard_map(local, mesh=mesh, in_specs=(ROWS_HEADS, BY_DEVICE, BY_DEVICE, ROWS_HEADS, ROWS_HEADS)
                     + (BY_DEVICE,) * len(scales), out_specs=ROWS_HEADS,
                     check_vma=False)(q, state.k_pages, state.v_pages, block_table, lengths, *scales)


def paged_chunk_attention(q, state: PagedKV):
    """Attention of ``T`` new queries ``q[B, T, Hq, D]`` whose tokens were just appended (causal among them).

    Query ``t`` sees each head's first ``lengths - T + t + 1`` tokens. XLA path (pages gathered to a
    dense view): used for prefilling a question onto a compressed cache, where T > 1.
    """
    B, T, Hq, D = q.shape
    ps = state.page_size
    _, Hkv, M = state.block_table.shape
    G = Hq // Hkv
    k = dequantize(state.k_pages[state.block_table], None if state.k_scales is None else state.k_scales[state.block_table],
                   q.dtype).reshape(B, Hkv, M * ps, D)
    v = dequantize(state.v_pages[state.block_table], None if state.v_scales is None else state.v_scales[state.block_table],
                   q.dtype).reshape(B, Hkv, M * ps, D)
    limit = state.lengths[..., None] - T + jnp.arange(T, dtype=jnp.int32) + 1  # [B, Hkv, T]
    visible = jnp.arange(M * ps)[None, None, None, :] < limit[..., None]  # [B, Hkv, T, S]
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) * D**-0.5
    s = jnp.where(visible[:, :, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgts,bhsd->bthgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, Hq, D).astype(q.dtype)


def append_and_attend(state: PagedKV, q, k, v, implementation: str = "auto", mesh=None):
    """Append ``k, v[B, T, Hkv, D]`` and attend ``q[B, T, Hq, D]``: the kernel for T == 1 (per device on a
    ``mesh``), XLA otherwise."""
    state = append(state, k, v)
    if q.shape[1] == 1:
        out = paged_attention(q[:, 0], state, implementation=implementation, mesh=mesh)[:, None]
    else:
        out = paged_chunk_attention(q, state)
    return out.astype(q.dtype), state


def paged_partition(state: PagedKV) -> PagedKV:
    """Partition specs of a paged layer: tables by (row, head), pools by page in device blocks (:func:`page_layout`)."""
    from kvjax.sharding import BY_DEVICE, ROWS_HEADS

    scales = BY_DEVICE if state.quantized else None
    return state.replace(k_pages=BY_DEVICE, v_pages=BY_DEVICE, block_table=ROWS_HEADS, lengths=ROWS_HEADS,
                         k_scales=scales, v_scales=scales)


def paged_device_bytes(state: PagedKV) -> int:
    """Bytes of the layer's page pools (K and V, in their stored dtype) and their scales from the arrays' sizes."""
    pools = (state.k_pages, state.v_pages, state.k_scales, state.v_scales)
    return sum(int(x.size) * x.dtype.itemsize for x in pools if x is not None)


def paged_read_bytes(state: PagedKV) -> int:
    """K/V bytes one decode step reads from a paged layer: every held token of every head (concrete lengths), in the
    stored dtype with its scales, as the kernel's forms read them (the Mosaic GPU form's program also gathers the
    scales per head, and the TPU form's may relayout the whole scale pools, which this count leaves out)."""
    per_token = stored_vector_bytes(state.k_pages.shape[-1], state.k_pages.dtype)
    return 2 * int(jnp.sum(state.lengths)) * per_token
