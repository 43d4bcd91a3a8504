"""Product-quantised (PQ) attention scores, HCAttention-style.

Keys are product-quantised per KV head: the head dimension ``D`` is split into ``g`` groups of
``D // g`` dims, each with a codebook of ``c`` centroids::

    codebooks : [H_kv, g, c, D // g]   float
    codes     : [B, H_kv, S, g]        uint8 (c <= 256) or uint16 (256 < c <= 65536)
    q         : [B, H_q, D]            H_q = H_kv * G

For every query head ``h`` (KV head ``kv(h) = h // G``) the lookup table
``T[g, c] = q_g . C[kv(h), g, c]`` turns scoring into table lookups::

    z[b, h, j] = scale * sum_g T[g, codes[b, kv(h), j, g]]        scale = D ** -0.5

Positions ``j >= lengths[b, kv(h)]`` get the mask value ``0.7 * finfo(f32).min``.  With
``return_stats=True`` the op also returns the softmax statistics over the valid positions,
``m = max_j z`` and ``l = sum_j exp(z - m)`` (``m = mask value, l = 0`` for an empty head), which
is all top-p (cumulative attention mass, HCAttention Eq. 4) selection needs besides ``z``.

The table is computed once per call with an XLA einsum (``B * H_q * c * D`` flops, tiny) and
fed to the kernel; the kernel streams the codes (the only per-token traffic) and keeps the
table on chip.  Two kernel forms, because arbitrary-index gathers lower very differently:

* ``backend="tpu"`` (Mosaic): *one-hot matmul*.  Mosaic has no general vector gather from
  VMEM, but the MXU is idle in a memory-bound decode, so for each group the code column is
  compared against an iota to build a ``[block_s, c]`` one-hot (bf16, exact 0/1) and multiplied
  with the table: ``[2G, c] x [block_s, c]^T -> [2G, block_s]``.  The f32 table is split into
  ``hi = bf16(T)`` and ``lo = bf16(T - hi)`` stacked along rows, so one bf16 MXU pass with f32
  accumulation reproduces T to ~2^-17 relative error (a one-hot picks a single product, which
  is exact).  The table block ``[g, 2G, c]`` has a constant block index along the sequence grid
  axis, so it is DMA-ed to VMEM once per (row, KV head).  Cost: ``g * c`` compares and MACs per
  token and head group, so large ``c`` (4096) is compute-bound on TPU; ``c = 256`` is cheap.
  Compiled, ``block_s`` must be a multiple of 128 (the ``[G, block_s]`` score tile puts it on
  the 128-wide lane axis); other values raise ``ValueError`` (interpret mode accepts them).
* ``backend="gpu"`` (Triton): *gather*.  The table row of each query head (``g * c`` f32, at
  most 1 MiB) stays in L1/L2; each program takes up to ``ROWS_PER_PROGRAM`` (8) query rows of one
  KV head (a decode step's GQA group; more rows, e.g. a question's tokens prefilled onto the cache,
  take more programs rather than a longer unrolled loop), loads a ``[block_s, g]`` tile of codes, forms flat
  indices ``g_idx * c + code`` and gathers ``T`` with one vectorised load (``t_ref[h, flat]``:
  Triton lowering takes a single indexer per ref access), then reduces over ``g``.  Edge tiles
  use masked loads/stores (Triton does not bounds-check blocks).  ``block_s`` and ``g`` must be
  powers of two.  There is no matmul, hence no TF32 question.

Both forms write per-tile partial statistics that a ``jnp`` epilogue combines, so every grid
axis is parallel.  Both run on CPU in interpret mode (``implementation="pallas_interpret"``); there
the GPU form is the default, for the reason given in :mod:`kvjax.pallas_kernels.paged_attention` (the TPU
form's interpreter uses ordered host callbacks, which jax 0.10 cannot lower next to ``pinned_host``
results such as HCAttention's values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax.pallas_kernels.backend import (MASK_VALUE, check_call, check_group, check_lengths_shape, check_sizes,
                                    resolve_backend)

__all__ = ["MASK_VALUE", "pq_scores", "pq_scores_reference", "pq_lookup_table"]

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _validate(q, codebooks, codes, lengths, implementation, backend, block_s):
    check_call(implementation, backend, q)
    if codebooks.ndim != 4:
        raise ValueError(f"codebooks must be [H_kv, g, c, D // g], got shape {codebooks.shape}")
    if codes.ndim != 4:
        raise ValueError(f"codes must be [B, H_kv, S, g], got shape {codes.shape}")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, groups, num_centroids, sub_dim = codebooks.shape
    if groups < 1 or head_dim % groups or sub_dim != head_dim // groups:
        raise ValueError(
            f"codebooks shape {codebooks.shape} does not split D={head_dim} into g groups: "
            f"need [H_kv, g, c, D // g] with D % g == 0")
    check_group(num_q_heads, num_kv_heads, "codebooks")
    if (codes.shape[0], codes.shape[1], codes.shape[3]) != (batch, num_kv_heads, groups):
        raise ValueError(
            f"codes must be [B, H_kv, S, g] = [{batch}, {num_kv_heads}, S, {groups}], "
            f"got shape {codes.shape}")
    if jnp.dtype(q.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported; allowed: float32, bfloat16, float16")
    if jnp.dtype(codebooks.dtype) not in _FLOAT_DTYPES:
        raise ValueError(
            f"codebooks dtype {codebooks.dtype} not supported; allowed: float32, bfloat16, "
            "float16")
    if num_centroids > 65536 or num_centroids < 1:
        raise ValueError(f"c={num_centroids} centroids not supported; allowed: 1..65536")
    want = jnp.dtype(jnp.uint8) if num_centroids <= 256 else jnp.dtype(jnp.uint16)
    if jnp.dtype(codes.dtype) != want:
        raise ValueError(
            f"codes dtype {codes.dtype} does not match c={num_centroids}: use uint8 for "
            f"c <= 256 and uint16 for 256 < c <= 65536 (expected {want})")
    if lengths is not None:
        check_lengths_shape(lengths, batch, num_kv_heads)
        if not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"lengths dtype must be an integer type, got {lengths.dtype}")
    check_sizes(block_s=block_s)


def pq_lookup_table(q, codebooks, *, scale=None):
    """Scaled lookup tables ``T[b, h_kv, G, g, c] = scale * q_g . C[h_kv, g, c]`` in f32."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, groups, _, sub_dim = codebooks.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, groups, sub_dim)
    return jnp.einsum("bhGgd,hgcd->bhGgc", qg, codebooks.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * scale


def _stats(z, valid):
    m = jnp.max(jnp.where(valid, z, MASK_VALUE), axis=-1)
    l = jnp.sum(jnp.where(valid, jnp.exp(z - m[..., None]), 0.0), axis=-1)
    return m, l


@functools.partial(jax.jit, static_argnames=("return_stats",))
def pq_scores_reference(q, codebooks, codes, lengths=None, *, return_stats=False):
    """Plain-jnp PQ scores (table lookup with ``take_along_axis``); same contract as
    :func:`pq_scores`."""
    batch, num_q_heads, _ = q.shape
    num_kv_heads, groups, num_centroids, _ = codebooks.shape
    seq = codes.shape[2]
    group = num_q_heads // num_kv_heads
    table = pq_lookup_table(q, codebooks)  # [B, Hkv, G, g, c]
    idx = jnp.swapaxes(codes.astype(jnp.int32), 2, 3)[:, :, None]  # [B, Hkv, 1, g, S]
    z = jnp.take_along_axis(table, jnp.broadcast_to(idx, (batch, num_kv_heads, group, groups,
                                                          seq)), axis=-1)
    z = jnp.sum(z, axis=3)  # [B, Hkv, G, S]
    if lengths is None:
        valid = jnp.ones((batch, num_kv_heads, 1, seq), bool)
    else:
        valid = (jnp.arange(seq) < lengths[..., None])[:, :, None, :]
    z = jnp.where(valid, z, MASK_VALUE)
    out = z.reshape(batch, num_q_heads, seq)
    if not return_stats:
        return out
    m, l = _stats(z, valid)
    return out, m.reshape(batch, num_q_heads), l.reshape(batch, num_q_heads)


# --------------------------------------------------------------------------------------------
# TPU form: one-hot matmul
# --------------------------------------------------------------------------------------------


def _tpu_kernel(len_ref,  # scalar prefetch
                t_ref, codes_ref,  # inputs: [g, 2G, c] bf16, [bs, g] uint
                z_ref, m_ref, l_ref,  # outputs: [G, bs], [G, 1], [G, 1]
                *, group, num_centroids):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_s, groups = codes_ref.shape
    length = len_ref[b * pl.num_programs(1) + h]
    codes = codes_ref[...].astype(jnp.int32)
    cent = jax.lax.broadcasted_iota(jnp.int32, (block_s, num_centroids), 1)
    acc = jnp.zeros((2 * group, block_s), jnp.float32)
    for gi in range(groups):  # static unroll: g <= 64 small matmuls
        onehot = (codes[:, gi:gi + 1] == cent).astype(jnp.bfloat16)  # [bs, c]
        acc += jax.lax.dot_general(t_ref[gi], onehot, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # [2G, bs]
    z = acc[:group] + acc[group:]
    pos = s * block_s + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
    valid = pos < length
    z = jnp.where(valid, z, MASK_VALUE)
    z_ref[...] = z
    m = jnp.max(z, axis=1, keepdims=True)
    m_ref[...] = m
    l_ref[...] = jnp.sum(jnp.where(valid, jnp.exp(z - m), 0.0), axis=1, keepdims=True)


def _pq_tpu(table, codes, lengths, *, block_s, interpret):
    batch, num_kv_heads, group, groups, num_centroids = table.shape
    seq = codes.shape[2]
    if not interpret and block_s % 128:
        # z's [G, block_s] tile has block_s on the lane axis: Mosaic needs a multiple of 128.
        raise ValueError(
            f"TPU form needs block_s to be a multiple of 128 (z tiles put block_s on the "
            f"128-wide lane axis), got block_s={block_s}")
    num_blocks = pl.cdiv(seq, block_s)
    t = jnp.swapaxes(table, 2, 3)  # [B, Hkv, g, G, c]
    hi = t.astype(jnp.bfloat16)
    lo = (t - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    t2 = jnp.concatenate([hi, lo], axis=3)  # [B, Hkv, g, 2G, c]
    kernel = functools.partial(_tpu_kernel, group=group, num_centroids=num_centroids)
    table_bytes = 2 * groups * 2 * group * num_centroids * 2  # double-buffered bf16
    work_bytes = 4 * block_s * num_centroids * 2 + 4 * block_s * (groups + 4 * group)
    vmem_limit = None
    if table_bytes + work_bytes > 12 * 2**20:
        vmem_limit = min(int(1.5 * (table_bytes + work_bytes)) + 8 * 2**20, 100 * 2**20)
    z, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, num_kv_heads, num_blocks),
            in_specs=[
                pl.BlockSpec((None, None, groups, 2 * group, num_centroids),
                             lambda b, h, s, *_: (b, h, 0, 0, 0)),
                pl.BlockSpec((None, None, block_s, groups), lambda b, h, s, *_: (b, h, s, 0)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, group, block_s), lambda b, h, s, *_: (b, h, 0, s)),
                pl.BlockSpec((None, None, None, group, 1), lambda b, h, s, *_: (b, h, s, 0, 0)),
                pl.BlockSpec((None, None, None, group, 1), lambda b, h, s, *_: (b, h, s, 0, 0)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, group, seq), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_blocks, group, 1), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_blocks, group, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel"),
            vmem_limit_bytes=vmem_limit),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="pq_scores_tpu",
    )(lengths.reshape(-1), t2, codes)
    return z, m[..., 0], l[..., 0]  # [B,Hkv,G,S], [B,Hkv,nb,G] x2


# --------------------------------------------------------------------------------------------
# GPU form: gather from the table
# --------------------------------------------------------------------------------------------


ROWS_PER_PROGRAM = 8  # query rows one GPU program scores (a static unroll): a decode step's GQA group fits


def _gpu_kernel(t_ref, codes_ref, len_ref,  # inputs: [rows, g*c] f32, [S, g] uint, [1] int32
                z_ref, m_ref, l_ref,  # outputs: [rows, S], [rows], [rows]
                *, block_s, num_centroids):
    from jax.experimental.pallas import triton as pltriton

    s = pl.program_id(3)
    seq, groups = codes_ref.shape
    rows = t_ref.shape[0]
    length = len_ref[0]
    pos = s * block_s + jnp.arange(block_s)
    in_seq = pos < seq
    codes = pltriton.load(codes_ref.at[pl.ds(s * block_s, block_s), :],
                          mask=in_seq[:, None], other=0).astype(jnp.int32)
    flat = codes + (jnp.arange(groups) * num_centroids)[None, :]  # [bs, g]
    valid = pos < length
    for gq in range(rows):  # static unroll over this program's query rows (at most ROWS_PER_PROGRAM)
        # One indexer (row gq, gather columns flat): Triton lowers a single NDIndexer per ref
        # access only ("No support for multiple indexers yet" for t_ref.at[gq][flat]).
        z = jnp.sum(t_ref[gq, flat], axis=1)  # gather [bs, g] -> [bs]
        z = jnp.where(valid, z, MASK_VALUE)
        # (1, bs) / (1,) slices rather than integer indices: interpret mode's masked-store
        # discharge rule does not accept static integer indices.
        pltriton.store(z_ref.at[pl.ds(gq, 1), pl.ds(s * block_s, block_s)], z[None, :],
                       mask=in_seq[None, :])
        m = jnp.max(z, keepdims=True)
        m_ref[pl.ds(gq, 1)] = m
        l_ref[pl.ds(gq, 1)] = jnp.sum(jnp.where(valid, jnp.exp(z - m), 0.0), keepdims=True)


def _pq_gpu(table, codes, lengths, *, block_s, interpret):
    """The gather form: one program per (batch row, KV head, block of ``ROWS_PER_PROGRAM`` query rows, tile of
    ``block_s`` tokens). A decode step's query heads of a KV head (``G <= 8``) share one program and one load
    of the codes; more rows (a question prefilled onto the cache: ``G`` x its tokens) take more programs
    instead of a longer unrolled loop."""
    from jax.experimental.pallas import triton as pltriton

    batch, num_kv_heads, group, groups, num_centroids = table.shape
    seq = codes.shape[2]
    if block_s & (block_s - 1) or groups & (groups - 1):
        raise ValueError(
            f"GPU (Triton) form needs block_s and g to be powers of two, got block_s={block_s}, "
            f"g={groups}")
    num_blocks = pl.cdiv(seq, block_s)
    rows = min(group, ROWS_PER_PROGRAM)
    row_blocks = pl.cdiv(group, rows)
    padded = row_blocks * rows  # zero rows of the table past ``group``: their outputs are dropped
    t = table.reshape(batch, num_kv_heads, group, groups * num_centroids)
    t = jnp.pad(t, ((0, 0), (0, 0), (0, padded - group), (0, 0)))
    kernel = functools.partial(_gpu_kernel, block_s=block_s, num_centroids=num_centroids)
    z, m, l = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, row_blocks, num_blocks),
        in_specs=[
            pl.BlockSpec((None, None, rows, groups * num_centroids),
                         lambda b, h, r, s: (b, h, r, 0)),
            pl.BlockSpec((None, None, seq, groups), lambda b, h, r, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, 1), lambda b, h, r, s: (b, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, rows, seq), lambda b, h, r, s: (b, h, r, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, r, s: (b, h, s, r)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, r, s: (b, h, s, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, padded, seq), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_blocks, padded), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_blocks, padded), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="pq_scores_gpu",
    )(t, codes, lengths.reshape(batch, num_kv_heads, 1))
    return z[:, :, :group], m[..., :group], l[..., :group]


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("return_stats", "implementation", "backend",
                                             "block_s"))
def _pq_scores(q, codebooks, codes, lengths, *, return_stats, implementation, backend, block_s):
    if implementation == "xla":
        return pq_scores_reference(q, codebooks, codes, lengths, return_stats=return_stats)
    batch, num_q_heads, _ = q.shape
    seq = codes.shape[2]
    table = pq_lookup_table(q, codebooks)  # [B, Hkv, G, g, c] f32, scale applied
    if lengths is None:
        lengths = jnp.full(codes.shape[:2], seq, jnp.int32)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, seq)
    interpret = implementation == "pallas_interpret"
    if backend == "tpu":
        z, m_part, l_part = _pq_tpu(table, codes, lengths, block_s=block_s, interpret=interpret)
    else:
        z, m_part, l_part = _pq_gpu(table, codes, lengths, block_s=block_s, interpret=interpret)
    z = z.reshape(batch, num_q_heads, seq)
    if not return_stats:
        return z
    # Combine per-tile statistics: m = max_t m_t, l = sum_t l_t exp(m_t - m).
    m = jnp.max(m_part, axis=2)  # [B, Hkv, G]
    l = jnp.sum(l_part * jnp.exp(m_part - m[:, :, None]), axis=2)
    return z, m.reshape(batch, num_q_heads), l.reshape(batch, num_q_heads)


def _default_block_s(backend, seq, groups, num_centroids):
    if backend == "tpu":
        # keep the [block_s, c] one-hot around 512K elements; multiple of 128 lanes.
        bs = min(1024, max(128, (2**19 // num_centroids) // 128 * 128))
        return bs
    return max(16, min(256, 4096 // groups))


def pq_scores(q, codebooks, codes, lengths=None, *, return_stats=False,
              implementation="pallas", backend=None, block_s=None):
    """Approximate attention logits from product-quantised keys.

    Args:
      q: ``[B, H_q, D]`` float query (one decode token).
      codebooks: ``[H_kv, g, c, D // g]`` float centroids per KV head and group.
      codes: ``[B, H_kv, S, g]`` centroid indices, uint8 for ``c <= 256``, uint16 above.
      lengths: optional int ``[B, H_kv]``; positions ``j >= length`` get the mask value.
      return_stats: also return ``m, l`` ([B, H_q] f32): max and ``sum exp(z - m)`` over valid j.
      implementation: ``"pallas"`` | ``"pallas_interpret"`` | ``"xla"`` (the reference).
      backend: ``"tpu"`` (one-hot matmul) | ``"gpu"`` (table gather) | ``None`` (from
        ``jax.default_backend()``; the GPU form when interpreting on CPU).
      block_s: tokens per kernel tile (TPU: multiple of 128; GPU: power of two); ``None`` picks
        a default from ``c`` and ``g``.

    Returns ``z: [B, H_q, S]`` f32 scores scaled by ``D ** -0.5`` (or ``(z, m, l)``).
    """
    _validate(q, codebooks, codes, lengths, implementation, backend, block_s)
    seq = codes.shape[2]
    _, groups, num_centroids, _ = codebooks.shape
    if implementation != "xla":
        backend = resolve_backend(implementation, backend)
        if block_s is None:
            block_s = _default_block_s(backend, seq, groups, num_centroids)
    else:
        backend, block_s = None, None
    return _pq_scores(q, codebooks, codes, lengths, return_stats=return_stats,
                      implementation=implementation, backend=backend,
                      block_s=None if block_s is None else int(block_s))
