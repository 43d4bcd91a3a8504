"""A bounded prefill working buffer: methods that evict *during* chunked prefill (Locret) keep at most
``capacity + chunk`` tokens per KV head instead of the whole prompt.

A :class:`WorkingKV` holds, per (row, KV head), up to ``C = capacity + chunk`` stored tokens:
``k, v[B, Hkv, C, D]`` (post-RoPE, at their original positions), the slot each entry holds
(``slots[B, Hkv, C]``, -1 = empty) and the method's retention score of each entry
(``scores[B, Hkv, C]``, f32). Because entries are compacted after eviction, an entry's index is not
its slot: attention masks come from the stored slots (:func:`kvjax.attention.attention_by_slots`).

Life of a chunk (:func:`buffer_chunk`): its tokens are written after the first ``capacity``
entries (where eviction left the survivors), the chunk attends over buffer + itself (causal by
stored slots, padding never stored; an online softmax over key blocks,
:func:`kvjax.attention.blocked_attention_by_slots`), then :func:`evict_to` keeps the ``capacity`` highest-priority
entries, compacted in slot order. After the prompt, :func:`kept_indices` gives the survivors for a
paged layout (:func:`kvjax.paged.build_paged`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention import blocked_attention_by_slots
from kvjax.cache import AttendContext, CacheSpec
from kvjax.selection import rank_desc


@struct.dataclass
class WorkingKV:
    """One layer's bounded working buffer (see module docstring); ``capacity`` and ``chunk`` are static."""

    k: jax.Array
    v: jax.Array
    slots: jax.Array
    scores: jax.Array
    capacity: int = struct.field(pytree_node=False, default=0)
    chunk: int = struct.field(pytree_node=False, default=0)


def init_working(spec: CacheSpec, capacity: int, chunk: int) -> tuple[WorkingKV, ...]:
    """Empty buffers of ``capacity + chunk`` entries per (row, KV head) for every layer."""
    if capacity <= 0 or chunk <= 0:
        raise ValueError(f"need capacity > 0 and chunk > 0, got {capacity}, {chunk}")
    C = capacity + chunk
    dtype = jnp.dtype(spec.dtype)
    shape = (spec.batch, spec.num_kv_heads, C, spec.head_dim)
    return tuple(
        WorkingKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                  jnp.full(shape[:3], -1, jnp.int32), jnp.zeros(shape[:3], jnp.float32), capacity=capacity, chunk=chunk)
        for _ in range(spec.num_layers)
    )


def buffer_chunk(state: WorkingKV, q, k, v, ctx: AttendContext, chunk_scores, *, attend: bool = True):
    """Store a chunk (``k, v[B, T, Hkv, D]``, T <= chunk) with its scores ``chunk_scores[B, T, Hkv]`` and attend.

    The chunk goes to entries ``capacity .. capacity + T``; its padding slots (``< pad``) are not
    stored. Returns (output [B, T, Hq, D], or None when ``attend`` is False, state); call
    :func:`evict_to` (or :func:`compact`) next.
    """
    B, T, Hkv, _ = k.shape
    if T > state.chunk:
        raise ValueError(f"a prefill chunk of {T} tokens does not fit the working buffer's chunk of {state.chunk}")
    q_slots = ctx.start + jnp.arange(T, dtype=jnp.int32)
    stored = jnp.where(q_slots[None, :] >= ctx.pad[:, None], q_slots[None, :], -1)  # [B, T]
    at = state.capacity

    def put(buf, x):
        return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), at, axis=2)

    new = state.replace(
        k=put(state.k, k.transpose(0, 2, 1, 3)), v=put(state.v, v.transpose(0, 2, 1, 3)),
        slots=put(state.slots, jnp.broadcast_to(stored[:, None, :], (B, Hkv, T))),
        scores=put(state.scores, chunk_scores.transpose(0, 2, 1)),
    )
    if not attend:
        return None, new
    out = blocked_attention_by_slots(q, q_slots, new.k, new.v, new.slots, ctx.pad, scale=q.shape[-1] ** -0.5)
    return out, new


def evict_to(state: WorkingKV, priority) -> WorkingKV:
    """Keep the ``capacity`` stored entries of highest ``priority[B, Hkv, C]``, compacted in slot order.

    Entries past the survivors are emptied (slot -1, score 0).
    """
    held = state.slots >= 0
    return compact(state, held & (rank_desc(priority, held) < state.capacity))


def compact(state: WorkingKV, keep) -> WorkingKV:
    """Keep the entries where ``keep[B, Hkv, C]`` (at most ``capacity`` per head), compacted in slot order.

    Entries past the survivors are emptied (slot -1, score 0).
    """
    keep = keep & (state.slots >= 0)
    order_key = jnp.where(keep, state.slots, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(order_key, axis=-1, stable=True)  # survivors first, by slot
    kept = jnp.take_along_axis(keep, order, axis=-1)

    def take(x):
        return jnp.take_along_axis(x, order[..., None] if x.ndim == 4 else order, axis=2)

    return state.replace(
        k=take(state.k), v=take(state.v),
        slots=jnp.where(kept, take(state.slots), -1), scores=jnp.where(kept, take(state.scores), 0.0),
    )


def kept_indices(state: WorkingKV):
    """(entry indices ``[B, Hkv, capacity]`` in slot order, count ``[B, Hkv]``) of the stored tokens."""
    held = state.slots[..., : state.capacity] >= 0
    idx = jnp.broadcast_to(jnp.arange(state.capacity, dtype=jnp.int32), held.shape)
    return idx, held.sum(axis=-1).astype(jnp.int32)
