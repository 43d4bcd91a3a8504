"""Attention over KV caches: the XLA reference path and the dispatch point for Pallas kernels.

Conventions: queries ``q[B, T, Hq, D]``; cached keys/values ``k, v[B, Hkv, S, D]`` (post-RoPE, one
row per slot). GQA puts ``Hq // Hkv`` query heads on each KV head. Scores and softmax are f32;
masked scores use ``0.7 * finfo(f32).min`` (never -inf, so fully masked rows stay finite).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

MASK_VALUE = 0.7 * float(jnp.finfo(jnp.float32).min)
IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret")


def resolve_implementation(implementation: str) -> str:
    """Map "auto" to "pallas" on TPU/GPU and "xla" on CPU; validate the name."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; allowed: {', '.join(IMPLEMENTATIONS)}")
    if implementation == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    return implementation


def _visible(q_slots, k_slots, pad):
    """Bool [B, len(q_slots), len(k_slots)]: key slot visible to query slot (causal, at or after the row's padding)."""
    return (k_slots[None, None, :] <= q_slots[None, :, None]) & (k_slots[None, None, :] >= pad[:, None, None])


def _slot_mask(q_start, num_queries: int, kv_start, num_keys: int, pad):
    """Bool [B, T, S]: :func:`_visible` for contiguous query slots ``q_start..`` and key slots ``kv_start..``."""
    q_slots = q_start + jnp.arange(num_queries, dtype=jnp.int32)
    k_slots = kv_start + jnp.arange(num_keys, dtype=jnp.int32)
    return _visible(q_slots, k_slots, pad)


def query_block_rows(q, q_block: int, num_kv_heads: int):
    """Regroup queries ``[B, T, Hq, D]`` for block-wise attention over a KV-head cache.

    Returns ``(rows [nq, B, Hkv, G * qb, D], qb, row_offsets [G * qb])``: query block ``j`` holds, per
    KV head, its ``G`` query heads' ``qb`` queries as the rows of one matrix (row ``r`` is query
    ``j * qb + row_offsets[r]``). ``T`` is zero-padded to a multiple of ``qb = min(T, q_block)``.
    """
    if q_block <= 0:
        raise ValueError(f"q_block must be positive, got {q_block}")
    B, T, Hq, D = q.shape
    G = Hq // num_kv_heads
    qb = min(T, q_block)
    nq = -(-T // qb)
    qp = jnp.pad(q, ((0, 0), (0, nq * qb - T), (0, 0), (0, 0)))
    qp = qp.reshape(B, nq, qb, num_kv_heads, G, D).transpose(1, 0, 3, 4, 2, 5).reshape(nq, B, num_kv_heads, G * qb, D)
    return qp, qb, jnp.tile(jnp.arange(qb, dtype=jnp.int32), G)


def visible_key_blocks(q_start, j, qb: int, block: int, num_slots: int):
    """Number of key blocks query block ``j`` (slots ``q_start + j*qb ..``) can see: up to its last query."""
    return jnp.minimum((q_start + (j + 1) * qb + block - 1) // block, num_slots // block)


def masked_block_scores(qj, kb, kv_start, q_slots, pad, scale: float, precision=None):
    """Scores ``[B, Hkv, rows, block]`` (f32) of query rows ``qj`` against key block ``kb`` (slots
    ``kv_start..``); pairs the query may not see are ``MASK_VALUE``."""
    s = lax.dot_general(qj, kb, (((3,), (3,)), ((0, 1), (0, 1))), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    mask = _visible(q_slots, kv_start + jnp.arange(kb.shape[2], dtype=jnp.int32), pad)
    return jnp.where(mask[:, None], s, MASK_VALUE)


def dense_causal_attention(q, k, v, *, q_start, pad, scale: float):
    """Causal GQA attention of ``q`` (slots ``q_start..``) over every cache slot, one softmax.

    Cost and memory are O(T * S); used for decode (T = 1) and short prompts. For one query (decode)
    both products read the cache in its stored layout (no transposed copy of the values): the keys
    are the left operand of the score product ``[S, D] x [D, G]`` and the softmax runs over its rows,
    the forms XLA:CPU ran fastest.
    """
    attend = functools.partial(_dense_attention, scale=scale)
    if q.shape[0] == 1:
        # XLA:CPU only: XLA drops the cache's size-1 batch dim with a reshape; fused with the caller's
        # in-place cache write (dynamic_update_slice) that reshape becomes a copy of the whole cache,
        # plus more copies to order the in-place write. Inside a conditional branch the cache is a plain
        # operand and nothing is copied. Not on GPU: XLA:GPU reads a conditional's predicate on the host
        # and waits for the stream (ConditionalThunk), one synchronisation per layer and decode step.
        # `platform_dependent` lowers only the branch of the platform compiled for.
        def on_cpu(q, k, v, q_start, pad):
            return lax.cond(jnp.asarray(q_start) >= 0, attend, attend, q, k, v, q_start, pad)

        return lax.platform_dependent(q, k, v, q_start, pad, cpu=on_cpu, default=attend)
    return attend(q, k, v, q_start, pad)


def _dense_attention(q, k, v, q_start, pad, *, scale: float):
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    mask = _slot_mask(q_start, T, 0, S, pad)  # [B, T, S]
    if T == 1:
        qt = q.reshape(B, Hkv, G, D).transpose(0, 1, 3, 2)  # [B, Hkv, D, G]
        s = lax.dot_general(k, qt, (((3,), (2,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32) * scale
        s = jnp.where(mask[:, None, 0, :, None], s, MASK_VALUE)  # [B, Hkv, S, G]
        p = jax.nn.softmax(s, axis=2)
        o = lax.dot_general(p.astype(v.dtype), v, (((2,), (2,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
        return o.reshape(B, 1, Hq, D).astype(q.dtype)  # [B, Hkv, G, D] -> [B, 1, Hq, D]
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgts,bhsd->bthgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, Hq, D).astype(q.dtype)


def blocked_causal_attention(q, k, v, *, q_start, pad, scale: float, block: int, q_block: int = 512):
    """Causal GQA attention with an online softmax over key blocks (flash-attention style, in XLA).

    Queries go in blocks of ``q_block`` rows; each query block visits only the key blocks up to its
    own last slot, so a prompt chunk costs about O(T * (start + T / 2)) and holds
    O(G * q_block * block) scores per KV head. Inside a block the ``G`` query heads of a KV head and
    the block's queries form the rows of one matrix product with the key block (``[G * q_block, D] x
    [D, block]``); this layout ran ~3x faster on XLA:CPU than a per-head einsum over the whole chunk
    (docs/results/foundation_bench.md). ``S`` must be a multiple of ``block``.
    """
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if S % block:
        raise ValueError(f"cache slots {S} must be a multiple of the attention block {block}")
    qp, qb, row_offsets = query_block_rows(q, q_block, Hkv)
    nq, rows = qp.shape[0], qp.shape[3]

    def query_block(j, out):
        qj = qp[j]
        q_slots = q_start + j * qb + row_offsets

        def key_block(i, carry):
            m, l, acc = carry
            kb = lax.dynamic_slice_in_dim(k, i * block, block, axis=2)
            vb = lax.dynamic_slice_in_dim(v, i * block, block, axis=2)
            s = masked_block_scores(qj, kb, i * block, q_slots, pad, scale)  # [B, Hkv, rows, block]
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            l_new = l * corr + p.sum(axis=-1)
            pv = lax.dot_general(p.astype(vb.dtype), vb, (((3,), (2,)), ((0, 1), (0, 1))),
                                 preferred_element_type=jnp.float32)
            return m_new, l_new, acc * corr[..., None] + pv

        m0 = jnp.full((B, Hkv, rows), MASK_VALUE, jnp.float32)
        l0 = jnp.zeros((B, Hkv, rows), jnp.float32)
        a0 = jnp.zeros((B, Hkv, rows, D), jnp.float32)
        _, l, acc = lax.fori_loop(0, visible_key_blocks(q_start, j, qb, block, S), key_block, (m0, l0, a0))
        return out.at[j].set((acc / l[..., None]).astype(q.dtype))

    out = lax.fori_loop(0, nq, query_block, jnp.zeros((nq, B, Hkv, rows, D), q.dtype))
    o = out.reshape(nq, B, Hkv, G, qb, D).transpose(1, 0, 4, 2, 3, 5).reshape(B, nq * qb, Hq, D)
    return o[:, :T]


def causal_cache_attention(q, k, v, *, q_start, pad, scale: float, block: int, implementation: str = "auto"):
    """Attention of new queries over a contiguous (uncompressed) cache; dispatches on size and backend.

    Decode steps and prompts that fit in one block use :func:`dense_causal_attention`; longer prompt
    chunks use :func:`blocked_causal_attention`. ``implementation`` is validated here; this path is XLA's
    (a full cache's one-token step on an accelerator goes to :func:`contiguous_decode_attention` instead).
    """
    resolve_implementation(implementation)
    T, S = q.shape[1], k.shape[2]
    if T == 1 or S <= block or S % block:
        return dense_causal_attention(q, k, v, q_start=q_start, pad=pad, scale=scale)
    return blocked_causal_attention(q, k, v, q_start=q_start, pad=pad, scale=scale, block=block)


KERNEL_PAGE = 64  # tokens per page when a contiguous cache is read by the paged kernel


def kernel_reads_contiguous(slots: int, head_dim: int, implementation: str) -> bool:
    """Whether one-token decode over a contiguous ``[B, Hkv, slots, D]`` cache goes through the paged Pallas kernel:
    a Pallas implementation, whole pages, and a head dimension both kernel forms take (a power of two >= 16)."""
    return (resolve_implementation(implementation) != "xla" and slots % KERNEL_PAGE == 0 and head_dim >= 16
            and head_dim & (head_dim - 1) == 0)


def contiguous_decode_attention(q, k, v, *, length, pad, implementation: str, mesh=None, k_scales=None,
                                v_scales=None):
    """One query token per row ``q[B, Hq, D]`` over a contiguous cache ``k, v[B, Hkv, S, D]`` whose row ``b`` holds
    slots ``pad[b] .. length - 1``, with the paged decode kernel: the cache is read as pages of
    :data:`KERNEL_PAGE` tokens (a free reshape, an identity block table, ``starts = pad``), one fused pass over K and
    V with an online softmax. XLA's dense path writes the ``[S, G]`` f32 scores, reads them for the softmax and
    writes a padded bf16 copy of the probabilities for the value product: 1.45x the step's bytes floor for the
    default model's full cache at 30K tokens in the program compiled for an H100 (``kvjax.evals.plan``).
    ``k_scales, v_scales[B, Hkv, S]``: the per-token float32 scales of an int8 / fp8 cache
    (:mod:`kvjax.kv_quantization`), read as the pages' scales (each compiled form of the kernel dequantizes each
    block it reads); None for a float cache.
    On a multi-device ``mesh`` each device reads its own rows and KV heads under ``shard_map``."""
    from kvjax.pallas_kernels import paged_decode_attention

    from kvjax.sharding import ROWS_HEADS, is_split

    impl = resolve_implementation(implementation)
    scales = () if k_scales is None else (k_scales, v_scales)

    def local(q, k, v, length, pad, *scales):
        B, H, S, D = k.shape
        pages = S // KERNEL_PAGE
        table = (jnp.arange(B * H, dtype=jnp.int32)[:, None] * pages + jnp.arange(pages, dtype=jnp.int32))
        lengths = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (B, H))
        starts = jnp.broadcast_to(pad.astype(jnp.int32)[:, None], (B, H))
        page_scales = dict(zip(("k_scales", "v_scales"), (s.reshape(B * H * pages, KERNEL_PAGE) for s in scales)))
        return paged_decode_attention(q, k.reshape(B * H * pages, KERNEL_PAGE, D),
                                      v.reshape(B * H * pages, KERNEL_PAGE, D), table.reshape(B, H, pages), lengths,
                                      starts=starts, implementation=impl, **page_scales)

    if is_split(mesh):
        from jax.sharding import PartitionSpec as P

        from kvjax.sharding import DATA

        try:  # jax >= 0.7
            from jax import shard_map
        except ImportError:  # pragma: no cover - old jax
            from jax.experimental.shard_map import shard_map

        return shard_map(local, mesh=mesh, in_specs=(ROWS_HEADS, ROWS_HEADS, ROWS_HEADS, P(), P(DATA))
                         + (ROWS_HEADS,) * len(scales), out_specs=ROWS_HEADS, check_vma=False)(q, k, v, length, pad,
                                                                                                *scales)
    return local(q, k, v, length, pad, *scales)


def chunk_attention_sums(q, k, start, pad, block: int, q_block: int = 512):
    """Column sums of the causal softmax of a chunk's queries over all keys: [B, Hq, S] (f32).

    Queries at slots ``start..start+T-1`` (real queries only: left padding does not vote) attend to
    key slots ``pad .. own slot``. Computed by query blocks of ``q_block`` rows in the layout of
    :func:`blocked_causal_attention`: a first pass over the visible key blocks gives
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


def attention_probs_by_slots(q, q_slots, k, k_slots, pad, *, scale: float):
    """Softmax probabilities ``[B, Hkv, G, T, S]`` (f32) of :func:`attention_by_slots` (0 where not visible)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    visible = (k_slots[:, :, None, :] <= q_slots[None, None, :, None]) & (k_slots[:, :, None, :] >= pad[:, None, None, None])
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible[:, :, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.where(visible[:, :, None], p, 0.0)


def weighted_values(p, v, out_dtype):
    """``p[B, Hkv, G, T, S] @ v[B, Hkv, S, D]`` as ``[B, T, Hq, D]`` in ``out_dtype``."""
    B, Hkv, G, T, _ = p.shape
    o = jnp.einsum("bhgts,bhsd->bthgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, Hkv * G, v.shape[-1]).astype(out_dtype)


def blocked_attention_by_slots(q, q_slots, k, v, k_slots, pad, *, scale: float, block: int = 256, q_block: int = 512):
    """:func:`attention_by_slots` with an online softmax over key blocks: holds O(G * q_block * block) scores
    per KV head instead of O(T * S) (the buffers of eviction during prefill hold thousands of entries).

    Same masks and result (to float rounding); the buffer is padded with empty entries to a
    multiple of ``block``.
    """
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    block = min(block, S)
    extra = -S % block
    if extra:
        k = jnp.pad(k, ((0, 0), (0, 0), (0, extra), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, extra), (0, 0)))
        k_slots = jnp.pad(k_slots, ((0, 0), (0, 0), (0, extra)), constant_values=-1)
    n_blocks = (S + extra) // block
    qp, qb, row_offsets = query_block_rows(q, q_block, Hkv)
    nq, rows = qp.shape[0], qp.shape[3]
    q_slots_padded = jnp.pad(q_slots, (0, nq * qb - T), mode="edge")

    def query_block(j, out):
        qj = qp[j]
        rows_slots = lax.dynamic_slice_in_dim(q_slots_padded, j * qb, qb)[row_offsets]  # [rows]

        def key_block(i, carry):
            m, l, acc = carry
            kb = lax.dynamic_slice_in_dim(k, i * block, block, axis=2)
            vb = lax.dynamic_slice_in_dim(v, i * block, block, axis=2)
            sb = lax.dynamic_slice_in_dim(k_slots, i * block, block, axis=2)  # [B, Hkv, block]
            s = lax.dot_general(qj, kb, (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32) * scale
            vis = (sb[:, :, None, :] <= rows_slots[None, None, :, None]) & (sb[:, :, None, :] >= pad[:, None, None, None])
            s = jnp.where(vis, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            pv = lax.dot_general(p.astype(vb.dtype), vb, (((3,), (2,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv

        m0 = jnp.full((B, Hkv, rows), MASK_VALUE, jnp.float32)
        l0 = jnp.zeros((B, Hkv, rows), jnp.float32)
        a0 = jnp.zeros((B, Hkv, rows, D), jnp.float32)
        _, l, acc = lax.fori_loop(0, n_blocks, key_block, (m0, l0, a0))
        return out.at[j].set((acc / jnp.maximum(l, 1e-30)[..., None]).astype(q.dtype))  # a row seeing nothing: 0

    out = lax.fori_loop(0, nq, query_block, jnp.zeros((nq, B, Hkv, rows, D), q.dtype))
    o = out.reshape(nq, B, Hkv, G, qb, D).transpose(1, 0, 4, 2, 3, 5).reshape(B, nq * qb, Hq, D)
    return o[:, :T]


def attention_by_slots(q, q_slots, k, v, k_slots, pad, *, scale: float):
    """GQA attention where each stored key carries its own slot: masks come from stored positions.

    ``q[B, T, Hq, D]`` at slots ``q_slots[T]``; ``k, v[B, Hkv, S, D]`` with ``k_slots[B, Hkv, S]``
    (int32, -1 = empty). A key is visible to a query when ``pad[b] <= k_slot <= q_slot``. Used by
    caches whose buffers are compacted (evicting during chunked prefill), where a buffer index is
    no longer a slot. Dense: O(T * S) scores.
    """
    return weighted_values(attention_probs_by_slots(q, q_slots, k, k_slots, pad, scale=scale), v, q.dtype)
