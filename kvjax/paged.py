"""Compressed cache layout: per-layer page pools with a block table and per-(row, KV head) lengths.

``PagedKV`` is what attention reads after compression:

* ``k_pages, v_pages[num_pages, page_size, D]``: the layer's pool. Each (row, KV head) owns
  ``ceil((capacity_h + room) / page_size)`` pages, so device memory is the sum of the heads'
  capacities (up to page rounding), not ``heads x longest``;
* ``block_table[B, Hkv, max_pages]`` (int32): page ids of each head, in order;
* ``lengths[B, Hkv]`` (int32): tokens held by each head (prompt survivors, then decoded tokens).

Keys stay post-RoPE at their original positions; decoding appends the new token at
``lengths[b, h]`` into pre-allocated room. Allocation is static (capacities are known when the
cache is built), so a full head is impossible by construction: ``room`` covers ``max_new_tokens``.

The host tier (:class:`HostKV`) keeps a ``pinned_host`` copy of chosen heads' full KV; :func:`recall`
moves chosen rows from it into a head's device slots inside jit (``dynamic_slice`` on the host
array, then a transfer to device memory), for the methods that refresh heads from host memory.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from kvjax.attention import resolve_implementation


@struct.dataclass
class PagedKV:
    """One layer's compressed cache (see module docstring)."""

    k_pages: jax.Array
    v_pages: jax.Array
    block_table: jax.Array
    lengths: jax.Array
    page_size: int = struct.field(pytree_node=False, default=16)
    capacities: tuple = struct.field(pytree_node=False, default=())  # prompt tokens kept per KV head


def page_layout(batch: int, slots_per_head: Sequence[int], page_size: int) -> tuple[np.ndarray, int]:
    """Static contiguous page allocation: (block_table [B, Hkv, max_pages] int32, num_pages)."""
    pages = [max(1, -(-int(n) // page_size)) for n in slots_per_head]
    max_pages = max(pages)
    table = np.zeros((batch, len(pages), max_pages), np.int32)
    next_page = 0
    for b in range(batch):
        for h, n in enumerate(pages):
            ids = np.arange(next_page, next_page + n)
            table[b, h, :n] = ids
            table[b, h, n:] = ids[-1]  # unused entries stay in range
            next_page += n
    return table, next_page


def build_paged(k, v, keep_idx, capacities: Sequence[int], room: int, page_size: int) -> PagedKV:
    """Gather kept tokens into a fresh page pool.

    Args:
      k, v: [B, Hkv, S, D] staged prompt keys/values (slot order).
      keep_idx: int32 [B, Hkv, max(capacities)] kept slots per head, ascending; entries past a head's
        capacity are ignored.
      capacities: prompt tokens kept per KV head (static, same for every row).
      room: extra slots per head for decoded tokens.
    """
    B, Hkv, _, D = k.shape
    capacities = tuple(int(c) for c in capacities)
    table_np, num_pages = page_layout(B, [c + room for c in capacities], page_size)
    table = jnp.asarray(table_np)
    cap_max = keep_idx.shape[-1]
    j = jnp.arange(cap_max, dtype=jnp.int32)
    valid = j[None, :] < jnp.asarray(capacities, jnp.int32)[:, None]  # [Hkv, cap_max]
    page = jnp.take_along_axis(table, jnp.broadcast_to(j // page_size, (B, Hkv, cap_max)), axis=2)
    flat = jnp.where(valid[None], page * page_size + j % page_size, num_pages * page_size)  # out of range: dropped
    def scatter(src):
        sel = jnp.take_along_axis(src, keep_idx[..., None], axis=2)  # [B, Hkv, cap_max, D]
        pool = jnp.zeros((num_pages * page_size, D), src.dtype)
        pool = pool.at[flat.reshape(-1)].set(sel.reshape(-1, D), mode="drop")
        return pool.reshape(num_pages, page_size, D)

    lengths = jnp.broadcast_to(jnp.asarray(capacities, jnp.int32), (B, Hkv))
    return PagedKV(scatter(k), scatter(v), table, lengths, page_size=page_size, capacities=capacities)


def append(state: PagedKV, k_new, v_new) -> PagedKV:
    """Write one decoded token ``k_new, v_new[B, Hkv, D]`` at each head's ``lengths`` slot."""
    B, Hkv, D = k_new.shape
    ps = state.page_size
    page = jnp.take_along_axis(state.block_table, (state.lengths // ps)[..., None], axis=2)[..., 0]
    flat = (page * ps + state.lengths % ps).reshape(-1)

    def write(pool, x):
        n = pool.shape[0]
        return pool.reshape(n * ps, D).at[flat].set(x.reshape(-1, D).astype(pool.dtype)).reshape(n, ps, D)

    return state.replace(
        k_pages=write(state.k_pages, k_new), v_pages=write(state.v_pages, v_new), lengths=state.lengths + 1
    )


def paged_attention(q, state: PagedKV, *, block_table=None, lengths=None, implementation: str = "auto"):
    """Decode attention ``q[B, Hq, D]`` over a paged layer (optionally a per-step selected block table)."""
    from pallas_kernels import paged_decode_attention

    impl = resolve_implementation(implementation)
    return paged_decode_attention(
        q, state.k_pages, state.v_pages,
        state.block_table if block_table is None else block_table,
        state.lengths if lengths is None else lengths,
        implementation=impl,
    )


def paged_device_bytes(state: PagedKV) -> int:
    """Bytes of the layer's page pools (K and V) from the arrays' sizes."""
    return sum(int(x.size) * x.dtype.itemsize for x in (state.k_pages, state.v_pages))


# ------------------------------------------------------------------ host tier
@struct.dataclass
class HostKV:
    """Full prompt KV of chosen KV heads in ``pinned_host`` memory: ``k, v[n_heads, S, D]``.

    ``heads`` lists the (row, KV head) pairs stored, in order (static).
    """

    k: jax.Array
    v: jax.Array
    heads: tuple = struct.field(pytree_node=False, default=())


def host_memory_sharding(kind: str = "pinned_host"):
    """Single-device sharding of the default device in memory ``kind`` ("device" | "pinned_host")."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def offload(k, v, heads: Sequence[tuple[int, int]]) -> HostKV:
    """Copy the staged ``k, v[B, Hkv, S, D]`` of ``heads`` [(row, kv_head), ...] to pinned host memory."""
    rows = np.asarray([b for b, _ in heads], np.int32)
    hs = np.asarray([h for _, h in heads], np.int32)
    host = host_memory_sharding("pinned_host")
    return HostKV(
        k=jax.device_put(k[rows, hs], host), v=jax.device_put(v[rows, hs], host), heads=tuple(map(tuple, heads))
    )


def recall_rows(host: HostKV, head: int, rows: jax.Array, count: jax.Array):
    """Inside jit: rows ``rows[:count]`` of host head ``head`` moved to device memory, ``[R, D]`` each for k, v.

    Each row is a ``dynamic_slice`` of the host array followed by a transfer to device memory (no
    gather or arithmetic runs on the host array). Rows past ``count`` are zero.
    """
    device = host_memory_sharding("device")
    R = rows.shape[0]
    D = host.k.shape[-1]

    def body(i, acc):
        kk, vv = acc
        r = rows[i]
        k_row = jax.device_put(lax.dynamic_slice(host.k, (head, r, 0), (1, 1, D)), device)[0, 0]
        v_row = jax.device_put(lax.dynamic_slice(host.v, (head, r, 0), (1, 1, D)), device)[0, 0]
        keep = i < count
        return kk.at[i].set(jnp.where(keep, k_row, 0)), vv.at[i].set(jnp.where(keep, v_row, 0))

    zeros = jnp.zeros((R, D), host.k.dtype)
    return lax.fori_loop(0, R, body, (zeros, zeros))


def recall_into(state: PagedKV, host: HostKV, host_head: int, row: int, kv_head: int, rows, count, dst_start: int = 0) -> PagedKV:
    """Overwrite slots ``dst_start..dst_start+count`` of device head (row, kv_head) with recalled host rows."""
    k_rows, v_rows = recall_rows(host, host_head, rows, count)
    ps = state.page_size
    R = rows.shape[0]
    j = dst_start + jnp.arange(R, dtype=jnp.int32)
    page = state.block_table[row, kv_head, j // ps]
    n_slots = state.k_pages.shape[0] * ps
    flat = jnp.where(jnp.arange(R) < count, page * ps + j % ps, n_slots)

    def write(pool, x):
        D = pool.shape[-1]
        return pool.reshape(n_slots, D).at[flat].set(x.astype(pool.dtype), mode="drop").reshape(pool.shape)

    return state.replace(k_pages=write(state.k_pages, k_rows), v_pages=write(state.v_pages, v_rows))
