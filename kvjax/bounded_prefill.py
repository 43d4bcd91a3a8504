"""Eviction during chunked prefill to a fixed budget: the shared schedule of Locret and the bounded baselines.

Locret's Algorithm 1 with the scorer left open. Per layer, a bounded working buffer
(:mod:`kvjax.working_buffer`) holds at most ``b + n_loc + B`` tokens per (row, KV head):

1. the prompt is prefilled in pieces of ``chunk`` (B) tokens: each piece is stored, attends over
   the buffer and itself (causal by stored slots; an online softmax over key blocks, or the dense
   probabilities when the scorer needs them), and the scorer gives every held token its
   priority (Locret: the score its retaining head gave it when first seen; SnapKV: the piece's
   last queries' attention; H2O: accumulated attention; StreamingLLM: recency);
2. after each piece each (row, KV head) keeps every token of the local window (the last ``n_loc``
   prompt slots, never evicted), the ``sinks`` first tokens of the row, and its ``b_r`` highest
   priority other tokens, the last ``n_s`` ("stabilizers") forced among them unless no evictable
   token follows the piece; survivors stay in slot order;
3. local-window queries of the piece that ends the evictable part attend to the evicted cache
   (Algorithm 1 prefills the last ``n_loc`` tokens after the last eviction).

Positions (``positions``): ``"original"`` leaves every key RoPE'd at its own position (gaps where
tokens were evicted). ``"contiguous"`` is the reference code's: after every eviction the survivors'
keys are moved (:func:`kvjax.rope.shift_rope`) to consecutive positions ending just before the next
token, so later tokens, at their own positions, see the compacted cache as one gap-free context.
Attention depends only on relative positions, so this equals the reference's re-application of
RoPE at positions ``0 .. n-1`` of a pre-RoPE cache with the next chunk at ``n ..``.

Each prefill call is split into pieces of ``chunk`` tokens from its start, so one call or calls of
any multiple of ``chunk`` tokens give the same cache; calls shorter than ``chunk`` evict after each
call. A row keeps ``b_r = row budget - n_loc`` tokens outside its local window (its own length
decides a fractional budget, :func:`kvjax.selection.row_capacities`).
"""

from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp
from flax import struct
from jax import lax

from kvjax.attention import attention_probs_by_slots, blocked_attention_by_slots, weighted_values
from kvjax.budgets import tokens_per_head
from kvjax.cache import AttendContext, Cache, CacheSpec
from kvjax.paged import PagedKV, build_paged, paged_device_bytes, paged_partition, paged_read_bytes
from kvjax.rope import shift_rope
from kvjax.selection import keep_top, row_capacities
from kvjax.working_buffer import WorkingKV, buffer_chunk, compact, init_working, kept_indices


@struct.dataclass
class BoundedPrefill:
    """One layer during prefill: the working buffer and the static sizes its evictions use.

    ``buffer`` holds at most ``b + local + chunk`` tokens per (row, KV head); ``spec`` is the
    cache's spec; ``b``, ``n_s``, ``local``, ``sinks`` the sizes of :func:`bounded_sizes`; ``budget``
    the method's budget (row capacities of a ragged batch); ``positions`` ``"original"`` or
    ``"contiguous"`` (module docstring).
    """

    buffer: WorkingKV
    spec: CacheSpec = struct.field(pytree_node=False, default=None)
    budget: int | float = struct.field(pytree_node=False, default=0)
    b: int = struct.field(pytree_node=False, default=0)
    n_s: int = struct.field(pytree_node=False, default=0)
    local: int = struct.field(pytree_node=False, default=0)
    sinks: int = struct.field(pytree_node=False, default=0)
    positions: str = struct.field(pytree_node=False, default="original")


POSITIONS = ("original", "contiguous")


def bounded_sizes(name: str, budget, local: int, stabilizers, spec: CacheSpec) -> tuple[int, int]:
    """``(b, n_s)`` for the longest row: ``b = budget tokens - local``; ``stabilizers`` an int or a fraction of ``b``."""
    if spec.longest_row <= local:
        raise ValueError(f"{name}: the prompt ({spec.longest_row} tokens) must be longer than the local window "
                         f"local={local} (n_loc): nothing would be evicted; lower local or use the full cache")
    cap = tokens_per_head(budget, spec.longest_row)
    b = cap - local
    if b <= 0:
        raise ValueError(f"{name}: a budget of {cap} tokens per KV head leaves no room beyond the local window of "
                         f"{local} tokens (b = budget - local = {b}); raise the budget or lower local")
    n_s = stabilizers if isinstance(stabilizers, int) else int(stabilizers * b)
    if n_s >= b:
        raise ValueError(f"{name}: stabilizers n_s={n_s} must be smaller than b={b} (budget {cap} - local {local}): "
                         "the stabilizers would fill the whole budget")
    return b, n_s


def chunk_tokens(chunk, b: int) -> int:
    """``B`` in tokens: ``chunk`` itself (an int), or ``ceil(chunk * b)`` (a float, a fraction of ``b``), at least 1."""
    return chunk if isinstance(chunk, int) else max(1, math.ceil(chunk * b))


def check_schedule(name: str, chunk, local, stabilizers, positions: str = "original") -> None:
    """Validate the schedule's hyper-parameters (clear errors)."""
    if positions not in POSITIONS:
        raise ValueError(f"{name}: positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
    if (isinstance(chunk, bool) or not isinstance(chunk, (int, float)) or (isinstance(chunk, int) and chunk < 1)
            or (isinstance(chunk, float) and not 0.0 < chunk <= 4.0)):
        raise ValueError(f"{name}: chunk (B) must be an int >= 1 (tokens) or a fraction of b in (0, 4], got {chunk!r}")
    if isinstance(local, bool) or not isinstance(local, int) or local < 0:
        raise ValueError(f"{name}: local (n_loc) must be an int >= 0, got {local!r}")
    s = stabilizers
    if isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0 or (isinstance(s, float) and s >= 1.0):
        raise ValueError(f"{name}: stabilizers (n_s) must be an int >= 0 or a fraction of b in [0, 1), got {s!r}")


def init_bounded(spec: CacheSpec, name: str, budget, chunk, local: int, stabilizers, sinks: int = 0,
                 positions: str = "original"):
    """Empty bounded buffers of ``b + local + B`` tokens per KV head for every layer (``B``: :func:`chunk_tokens`)."""
    b, n_s = bounded_sizes(name, budget, local, stabilizers, spec)
    return tuple(BoundedPrefill(buf, spec=spec, budget=budget, b=b, n_s=n_s, local=local, sinks=sinks, positions=positions)
                 for buf in init_working(spec, b + local, chunk_tokens(chunk, b)))


def pack_positions(buf: WorkingKV, keep, start, end, inv_freq) -> WorkingKV:
    """Move the keys that ``keep`` (held entries only) keeps to consecutive positions ending at slot ``end - 1``
    (before compaction).

    Entries ``< capacity`` are the previous survivors, already packed to end at ``start - 1``; later
    entries are the tokens stored by this call, at their own slots. Held entries are in slot order, so
    the ``j``-th kept of ``n`` goes to ``end - n + j``. Padding offsets cancel (only differences count).
    """
    held = buf.slots >= 0
    idx = jnp.arange(buf.slots.shape[-1], dtype=jnp.int32)
    old = idx < buf.capacity
    n_prev = (held & old).sum(axis=-1, keepdims=True)
    current = jnp.where(old, start - n_prev + idx, buf.slots)
    n = keep.sum(axis=-1, keepdims=True)
    target = end - n + jnp.cumsum(keep, axis=-1) - 1
    delta = jnp.where(keep, target - current, 0)
    return buf.replace(k=shift_rope(buf.k, delta, inv_freq))


# rescore(buffer after storing the piece, probabilities [B, Hkv, G, P, C] or None, piece start) -> priority [B, Hkv, C]
Rescore = Callable


def prefill_in_pieces(state: BoundedPrefill, q, k, v, ctx: AttendContext, token_scores, rescore: Rescore | None = None,
                      needs_probs: bool = False):
    """One prefill call (``q[B, T, Hq, D]``, ``k, v[B, T, Hkv, D]``) as pieces of ``chunk`` tokens; (output, state).

    ``token_scores[B, T, Hkv]``: each token's stored score (Locret's head; zeros for scorers that
    rescore). ``rescore``: the held tokens' priorities after each piece is stored (None: the stored
    scores); ``needs_probs``: pass it the piece's attention probabilities over the buffer.
    """
    P = state.buffer.chunk
    T = q.shape[1]
    n_full, rem = divmod(T, P)
    outs = []
    if n_full:
        def split(x):
            return x[:, : n_full * P].reshape(x.shape[0], n_full, P, *x.shape[2:]).swapaxes(0, 1)

        def body(st, xs):
            i, qi, ki, vi, si = xs
            out, st = evict_piece(st, qi, ki, vi, si, ctx.start + i * P, ctx, rescore, needs_probs)
            return st, out

        state, out = lax.scan(body, state, (jnp.arange(n_full), split(q), split(k), split(v), split(token_scores)))
        outs.append(out.swapaxes(0, 1).reshape(q.shape[0], n_full * P, *q.shape[2:]))
    if rem:
        s = n_full * P
        out, state = evict_piece(state, q[:, s:], k[:, s:], v[:, s:], token_scores[:, s:], ctx.start + s, ctx, rescore,
                                 needs_probs)
        outs.append(out)
    return (jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]), state


def evict_piece(state: BoundedPrefill, q, k, v, token_scores, start, ctx: AttendContext, rescore=None,
                needs_probs: bool = False):
    """One piece of at most ``chunk`` tokens at slot ``start``: store and attend, score, evict (module docstring)."""
    spec = state.spec
    P = q.shape[1]
    scale = q.shape[-1] ** -0.5
    local_start = spec.prompt_slots - state.local  # first slot of the local window (rows end together)
    if needs_probs:
        _, buf = buffer_chunk(state.buffer, q, k, v, ctx.replace(start=start), token_scores, attend=False)
        q_slots = start + jnp.arange(P, dtype=jnp.int32)
        probs = attention_probs_by_slots(q, q_slots, buf.k, buf.slots, ctx.pad, scale=scale)
        out_all = weighted_values(probs, buf.v, q.dtype)
    else:
        out_all, buf = buffer_chunk(state.buffer, q, k, v, ctx.replace(start=start), token_scores)
        probs = None
    if rescore is not None:
        buf = buf.replace(scores=jnp.where(buf.slots >= 0, rescore(buf, probs, start), 0.0))
    held = buf.slots >= 0
    local = buf.slots >= local_start
    sink = held & (buf.slots - ctx.pad[:, None, None] < state.sinks)
    evictable = held & ~local & ~sink
    end = start + P
    forced = evictable & (buf.slots >= end - state.n_s) & (end < local_start)
    caps = row_capacities((state.b + state.local,), state.budget, spec, ctx.pad)  # [B, 1]
    b_rows = jnp.maximum(caps - state.local - jnp.minimum(state.sinks, caps), 0)
    keep = held & (local | sink | keep_top(buf.scores, forced, evictable, b_rows))
    if state.positions == "contiguous":
        buf = pack_positions(buf, keep, start, end, ctx.rope_inv_freq)
    evicted = compact(buf, keep)

    def local_queries_see_the_evicted_cache():
        q_slots = start + jnp.arange(P, dtype=jnp.int32)
        out_local = blocked_attention_by_slots(q, q_slots, evicted.k, evicted.v, evicted.slots, ctx.pad, scale=scale)
        return jnp.where((q_slots >= local_start)[None, :, None, None], out_local, out_all)

    straddles = (start < local_start) & (end > local_start)
    out = lax.cond(straddles, local_queries_see_the_evicted_cache, lambda: out_all)
    return out, state.replace(buffer=evicted)


def evict_decoding(state: BoundedPrefill, q, k, v, ctx: AttendContext, token_scores):
    """Later tokens (``T <= chunk``: a question or one decoded token) with eviction: the budget stays fixed.

    The tokens are stored (with ``token_scores[B, T, Hkv]``) and attend over the buffer; then each
    (row, KV head) keeps the last ``local`` slots (a window that slides with decoding), its sinks
    and its ``b_r`` best-scored other tokens. Returns (output, state).
    """
    out, buf = buffer_chunk(state.buffer, q, k, v, ctx, token_scores)
    end = ctx.start + q.shape[1]
    held = buf.slots >= 0
    local = buf.slots >= end - state.local
    sink = held & (buf.slots - ctx.pad[:, None, None] < state.sinks)
    evictable = held & ~local & ~sink
    caps = row_capacities((state.b + state.local,), state.budget, state.spec, ctx.pad)
    b_rows = jnp.maximum(caps - state.local - jnp.minimum(state.sinks, caps), 0)
    none = jnp.zeros_like(held)
    keep = held & (local | sink | keep_top(buf.scores, none, evictable, b_rows))
    if state.positions == "contiguous":
        buf = pack_positions(buf, keep, ctx.start, end, ctx.rope_inv_freq)
    return out, state.replace(buffer=compact(buf, keep))


def bounded_partition(state):
    """Partition specs of a bounded-prefill layer (either stage): the working buffer's arrays by (row, KV head),
    the compressed pages as any paged layer (:func:`kvjax.paged.paged_partition`)."""
    from kvjax.sharding import ROWS_HEADS

    if isinstance(state, BoundedPrefill):
        buffer = state.buffer.replace(k=ROWS_HEADS, v=ROWS_HEADS, slots=ROWS_HEADS, scores=ROWS_HEADS)
        return state.replace(buffer=buffer)
    return paged_partition(state)


def buffer_read_bytes(cache: Cache) -> int:
    """K/V bytes a decode step reads from bounded buffers: every entry (held or empty) of every layer."""
    return sum(2 * int(st.buffer.k.size) * st.buffer.k.dtype.itemsize for st in cache.layers)


def to_pages(state: BoundedPrefill, room: int, page_size: int) -> PagedKV:
    """After the prompt: the survivors (``<= budget`` per head, slot order) into page pools with ``room`` for later tokens."""
    buf = state.buffer
    idx, count = kept_indices(buf)
    return build_paged(buf.k, buf.v, idx, count, (buf.capacity,) * buf.k.shape[1], room, page_size, state.spec.mesh,
                       state.spec.kv_dtype)


def paged_facts(cache: Cache) -> dict:
    """Kept tokens per head and the page pools' bytes of a compressed cache (empty before compression)."""
    if cache.stage != "compressed":
        return {}
    return {"kept_tokens_per_head": [list(st.capacities) for st in cache.layers],
            "page_pool_bytes": sum(paged_device_bytes(st) for st in cache.layers)}


def paged_cache_read_bytes(cache: Cache) -> int:
    """Every held token of every head, each decode step (0 before compression)."""
    return sum(paged_read_bytes(st) for st in cache.layers) if cache.stage == "compressed" else 0


__all__ = ["POSITIONS", "pack_positions", "evict_decoding", "buffer_read_bytes", "to_pages", "paged_facts", "paged_cache_read_bytes", "BoundedPrefill", "bounded_sizes", "check_schedule", "init_bounded", "prefill_in_pieces", "evict_piece"]
