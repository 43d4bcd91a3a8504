"""Block-sparse / paged decode attention (one query token per sequence).

Cache layout (one layer)::

    k_pages, v_pages : [num_pages, page_size, D]   page pool shared by all rows and KV heads
    block_table      : int32 [B, H_kv, max_pages]  (row, kv head, i) -> page index in the pool
    lengths          : int32 [B, H_kv]             valid tokens of that head, stored in order in
                                                   pages block_table[b, h, 0], [b, h, 1], ...
    starts (optional): int32 [B, H_kv]             first valid token (default 0): tokens
                                                   starts .. lengths-1 are attended, so a
                                                   contiguous left-padded cache is read as pages

The last used page of a head may be partial; block-table entries past
``ceil(length / page_size)`` are ignored (they may hold any value; the kernels clip them into
``[0, num_pages)`` so that a stale entry can never cause an out-of-bounds copy).  Because every
head has its own block table and length, the same kernel serves per-head budgets (HeteroCache,
AdaKV), per-layer budgets (PyramidKV) and block-sparse selection (a selection *is* a block
table).

Query ``q: [B, H_q, D]`` with ``H_q = H_kv * G``; the ``G`` query heads of a GQA group share
one program so K/V are read once per group.  The softmax is computed online in f32; masked
positions get ``0.7 * finfo(f32).min`` (never ``-inf``, so ``exp(m_prev - m_next)`` stays finite),
and masked V rows are zeroed before the ``p @ V`` product so garbage in a partial page (even
NaN from an uninitialised pool) cannot leak into the output.  A head with length 0 returns zeros.

Three kernel forms:

* ``backend="tpu"`` (Mosaic TPU): grid ``(B * H_kv, page_blocks)`` over flattened (row, KV
  head) pairs; lengths, starts and the block table are scalar-prefetched into SMEM
  (``pltpu.PrefetchScalarGridSpec``); K/V stay in HBM (``memory_space=pl.ANY``) and the pages
  of a block are DMA-ed into a double-buffered VMEM scratch with ``pltpu.make_async_copy``:
  while block ``i`` is computed, block ``i+1`` of the same (row, head) is in flight.  Only the
  pages below ``ceil(length/page_size)`` are copied; grid steps past the head's length do
  nothing (block-sparse skip).  The page-block axis is sequential ("arbitrary"), the (row,
  head) axis "parallel" (megacore).  The prefetch stays within one (row, head): the first block
  of each head is not overlapped with the previous head's last block (jax's own TPU paged
  attention chains across heads at the cost of sequential row/head axes).
  SMEM is small (1 MiB per core on TPU v4-v7, 16 KiB on v2/v3, which are not supported): one
  ``pallas_call`` prefetches at most ``_TPU_SMEM_PREFETCH_BYTES`` (128 KiB) of lengths, starts and
  block table, and larger tables are split into several calls over the (row, head) pairs (e.g. B=8,
  H_kv=8, 32K tokens in 16-token pages: 512 KiB of table, 5 calls).  One head's table must fit
  on its own (up to 32766 pages), else ``ValueError``.  Compiled (``implementation="pallas"``)
  the form requires ``page_size`` to be a multiple of 8 (f32 K/V, and quantized K/V, converted to
  f32 first) / 16 (bf16 K/V), the sublane tiling, because a block of pages is reshaped to
  ``[tokens, D]``; other sizes raise ``ValueError`` (interpret mode accepts any page size).
* ``backend="gpu"`` (Triton): split-K ("flash decoding").  Grid ``(B, H_kv, num_splits)``; each
  program walks its share of the block table in blocks of ``pages_per_block`` pages, gathering
  pages with vector indices, and writes a partial ``(o, l, m)``; a final ``jnp`` combine
  rescales the partials.  Splits wholly past a head's length exit immediately.  GPU form
  constraints (Triton): ``page_size``, ``pages_per_block`` and ``D`` powers of two (and
  ``D >= 16``); the query group is zero-padded to ``max(16, next_pow2(G))`` rows for ``tl.dot``.
  Shared memory bounds the block: a ``[tokens, D]`` K block is at most 32 KiB (about 110 KiB of
  shared memory with two pipeline stages, measured on sm_90 TTIR); a larger explicit
  ``pages_per_block`` raises ``ValueError``, and a page larger than that (e.g. 256 tokens, f32,
  D=128) is viewed as consecutive sub-pages of the pool.
  Triton is requested explicitly (``pltriton.CompilerParams``): a plain ``pallas_call`` goes to
  Mosaic GPU by default on recent jax, whose programming model (warpgroups, TMA) this kernel
  does not use.
* ``backend="mosaic_gpu"`` (Mosaic GPU, H100 / H200): the same split-K algorithm with TMA page copies into
  double-buffered shared memory (:mod:`kvjax.pallas_kernels.paged_attention_mgpu`). jax deprecates its Triton backend;
  on a GPU the Triton form stays the default (``backend=None``) until the two are timed against each other
  (``research.bench_kernels``).

Numerics: every kernel matmul has ``precision=HIGHEST``, so f32 operands multiply in full f32
(Triton ``inputPrecision = ieee`` rather than its TF32 default; Mosaic
``contract_precision<fp32>``).  The TPU form upcasts K/V blocks to f32 (like jax's TPU paged
attention); the GPU form feeds the matmuls in the K/V dtype (bf16 ``q . k`` and bf16 ``p @ v``
with f32 accumulation, the usual flash-decoding choice), so with bf16 K/V it differs from the
f32 reference by bf16 rounding of q and p (~1e-2 relative).

Quantized pools (``k_scales, v_scales`` given: int8 / float8_e4m3fn pages with one float32 scale per
stored token, ``[num_pages, page_size]``; :mod:`kvjax.kv_quantization`), read as stored by the GPU and
TPU forms, so a decode step reads 1 byte per element plus 4 per token and head, not a float copy:

* GPU form: gathers the quantized pages and their scales and dequantizes the block in the kernel
  (f32 operands; the block is sized for f32).
* TPU form: each page is DMA-ed as stored (``[page_size, D]`` int8 / fp8) beside its scales, one
  ``[page_size]`` row of the float32 scale pool per page into a ``[2, pages_per_block, page_size]``
  VMEM buffer (double-buffered with the pages, its own DMA semaphores). The block is converted to
  f32 and reshaped to ``[tokens, D]``; the scales are not broadcast over ``D`` (a float-sized copy)
  but applied where tokens already lie on the lane axis: ``q . (k_t s_t) = (q . k_t) s_t`` scales
  the score columns, ``sum_t p_t (v_t s_t) = (p s_v) @ V`` the softmax weights' columns, each with
  the block's scales read as one ``[1, tokens]`` row. The value scales are masked like V (a stale
  scale past a head's length may be NaN). Compiled, ``page_size`` must be a multiple of 8 (f32's
  sublane tiling, as the block is reshaped in f32), not of int8's 32-row tiles: checked by compiling
  for a TPU v5e with int8 pages of 8 to 256 tokens and fp8 pages of 8 to 32 (Mosaic converts
  float8_e4m3fn on v5e, which has no fp8 unit). Not run on a TPU.
  Why a page's scales are one row of the 2-D pool: a DMA's source must start on a 128-lane word
  boundary, so a flat scale pool sliced at ``page * page_size`` is rejected by Mosaic unless pages
  hold a multiple of 128 tokens; a row of a row-major ``[num_pages, page_size]`` array is
  addressed by the page alone. The cost: XLA may hold the scale pool in another layout (it picks
  pages-minor ``{0,1}`` for a ``[num_pages, 16]`` f32 array, which avoids padding 16 lanes to 128)
  and then copies the scales to row-major before the kernel, every step: it reads 4 bytes per
  stored token and pool and writes them with lanes padded to 128 (into VMEM in the compiled v5e
  test program; against 2 * D bytes per token of int8 K/V).
* Mosaic GPU form: copies each page into shared memory as stored, widens the block in registers
  and applies the scales to the score and weight vectors as the TPU form; its scales come gathered
  through the block table, a contiguous row per (row, KV head)
  (:mod:`kvjax.pallas_kernels.paged_attention_mgpu`).
* The reference dequantizes the gathered pages.

Both run on CPU in interpret mode (``implementation="pallas_interpret"``): the TPU form under
``pltpu.InterpretParams()`` (which emulates DMAs, semaphores and uninitialised (NaN) VMEM), the
GPU form under ``interpret=True``. Interpreting on CPU picks the GPU form unless ``backend="tpu"``
is given: its interpreter discharges the kernel into ordinary jax ops, while the TPU form's
interpreter simulates through ordered host callbacks, and jax 0.10 cannot lower those in a
program that also returns ``pinned_host`` arrays (a decode loop with a host tier fails with
``safe_zip() argument 1 has length N+1 but argument 0 has length N``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax.pallas_kernels.backend import (MASK_VALUE, check_call, check_group, check_lengths_shape, check_sizes,
                                    resolve_backend)

__all__ = [
    "MASK_VALUE",
    "check_block_table",
    "paged_decode_attention",
    "paged_decode_attention_reference",
]

_KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # pools with per-token scales

# Target number of KV tokens per kernel block when pages_per_block is not given: large DMA
# blocks amortise the per-grid-step cost on TPU; on GPU the block lives in registers.
_TARGET_BLOCK_TOKENS = {"tpu": 512, "gpu": 128}
# GPU split-K: aim for this many programs in flight (about 2 waves on a 132-SM H100).
_GPU_TARGET_PROGRAMS = 256
# GPU form: most bytes of one [tokens, D] K block.  Triton stages K and V blocks in shared
# memory; with num_stages=2 a program uses about 3.3x the K block bytes (measured by compiling
# the kernel's TTIR for sm_90), so 32 KiB blocks need ~110 KiB: fits A100 (164 KiB) and
# H100/H200 (227 KiB).  E.g. D=128 gets 128-token blocks in bf16, 64-token blocks in f32.
_GPU_MAX_BLOCK_BYTES = 32 * 1024
# TPU form: bytes of SMEM one pallas_call may use for its scalar-prefetched lengths and block
# table.  TPU v4 / v5e / v5p / v6e / v7 have 1 MiB of SMEM per core (jax's tpu_info), shared
# with Mosaic's own scalars; an eighth of it is a conservative budget.  Larger tables are
# split over several calls (see _paged_tpu).
_TPU_SMEM_PREFETCH_BYTES = 128 * 1024
# Precision of every kernel matmul.  f32 operands: full f32 products (Triton input precision
# "ieee" instead of its TF32 default; Mosaic "fp32" contract precision), so compiled kernels
# match the f32 reference.  bf16 operands (GPU form with bf16 K/V): no effect, products of bf16
# values are exact and accumulate in f32.
_HIGHEST = jax.lax.Precision.HIGHEST


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_block_table(block_table, lengths, num_pages: int, page_size: int) -> None:
    """Host-side check of a paged-cache block table (eager; pulls both arrays to the host).

    Raises ``ValueError`` if a length is negative or exceeds ``max_pages * page_size``, or if a
    *used* entry ``block_table[b, h, i]`` (``i < ceil(lengths[b, h] / page_size)``) lies outside
    ``[0, num_pages)``.  Entries past a head's used pages are not checked.
    """
    bt = np.asarray(block_table)
    ln = np.asarray(lengths)
    if bt.ndim != 3:
        raise ValueError(f"block_table must be [B, H_kv, max_pages], got shape {bt.shape}")
    if ln.shape != bt.shape[:2]:
        raise ValueError(
            f"lengths must have shape [B, H_kv] = {bt.shape[:2]} matching block_table, "
            f"got {ln.shape}"
        )
    max_pages = bt.shape[2]
    capacity = max_pages * page_size
    if ln.size and ln.min() < 0:
        b, h = np.argwhere(ln < 0)[0]
        raise ValueError(f"lengths[{b}, {h}] = {ln[b, h]} is negative; lengths must be >= 0")
    if ln.size and ln.max() > capacity:
        b, h = np.argwhere(ln > capacity)[0]
        raise ValueError(
            f"lengths[{b}, {h}] = {ln[b, h]} exceeds the block table capacity "
            f"max_pages * page_size = {max_pages} * {page_size} = {capacity}"
        )
    used = np.arange(max_pages)[None, None, :] < (-(-ln // page_size))[..., None]
    bad = used & ((bt < 0) | (bt >= num_pages))
    if bad.any():
        b, h, i = np.argwhere(bad)[0]
        raise ValueError(
            f"block_table[{b}, {h}, {i}] = {bt[b, h, i]} is out of range: used entries must be "
            f"in [0, num_pages) = [0, {num_pages}) ({int(bad.sum())} bad entries in total)"
        )


def _validate(q, k_pages, v_pages, block_table, lengths, implementation, backend, pages_per_block,
              num_splits, k_scales=None, v_scales=None):
    check_call(implementation, backend, q)
    if k_pages.ndim != 3:
        raise ValueError(f"k_pages must be [num_pages, page_size, D], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(
            f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}"
        )
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, kv_dim = k_pages.shape
    if kv_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) != head_dim of k_pages ({kv_dim})")
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"k_pages must hold at least one page of >= 1 token, got {k_pages.shape}")
    if block_table.ndim != 3 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must be [B={batch}, H_kv, max_pages], got shape {block_table.shape}"
        )
    num_kv_heads = block_table.shape[1]
    check_group(num_q_heads, num_kv_heads, "block_table")
    if block_table.shape[2] < 1:
        raise ValueError(f"block_table needs max_pages >= 1, got shape {block_table.shape}")
    check_lengths_shape(lengths, batch, num_kv_heads)
    kv_dtype = jnp.dtype(k_pages.dtype)
    if jnp.dtype(v_pages.dtype) != kv_dtype:
        raise ValueError(f"v_pages dtype {v_pages.dtype} must equal k_pages dtype {kv_dtype}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("give both k_scales and v_scales, or neither")
    if k_scales is not None:
        if kv_dtype not in _QUANTIZED_DTYPES:
            raise ValueError(f"scales are for int8 / float8_e4m3fn pools, got {kv_dtype} pools")
        for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
            if x.shape != k_pages.shape[:2] or jnp.dtype(x.dtype) != jnp.float32:
                raise ValueError(f"{name} must be float32 [num_pages, page_size] = {k_pages.shape[:2]}, got "
                                 f"{x.dtype} {x.shape}")
        if jnp.dtype(q.dtype) not in _KV_DTYPES:
            raise ValueError(f"q dtype {q.dtype} not supported; allowed: bfloat16, float32")
    elif kv_dtype not in _KV_DTYPES:
        raise ValueError(f"k_pages dtype {kv_dtype} not supported; allowed: bfloat16, float32 "
                         "(int8, float8_e4m3fn with k_scales and v_scales)")
    elif jnp.dtype(q.dtype) not in (kv_dtype, jnp.dtype(jnp.float32)):
        raise ValueError(
            f"q dtype {q.dtype} not supported with {kv_dtype} K/V; allowed: {kv_dtype} or float32"
        )
    if jnp.dtype(block_table.dtype) != jnp.int32:
        raise ValueError(f"block_table dtype must be int32, got {block_table.dtype}")
    if jnp.dtype(lengths.dtype) != jnp.int32:
        raise ValueError(f"lengths dtype must be int32, got {lengths.dtype}")
    check_sizes(pages_per_block=pages_per_block, num_splits=num_splits)


def _gpu_max_block_tokens(head_dim: int, dtype) -> int:
    """Most tokens per GPU-form block whose K block fits ``_GPU_MAX_BLOCK_BYTES`` (a power of
    two, at least 16)."""
    return max(16, _prev_pow2(_GPU_MAX_BLOCK_BYTES // (head_dim * jnp.dtype(dtype).itemsize)))


def _prev_pow2(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def _dequantized(pages, scales, dtype):
    """``pages`` times their per-token ``scales`` (``pages.shape[:-1]``) in ``dtype``; None: ``pages`` as stored."""
    if scales is None:
        return pages
    return (pages.astype(jnp.float32) * scales[..., None]).astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_decode_attention_reference(q, k_pages, v_pages, block_table, lengths, *, scale=None, starts=None,
                                     k_scales=None, v_scales=None):
    """Plain-jnp paged decode attention: gather pages through the block table (dequantized with their scales when
    given), mask, softmax.

    Shapes as in :func:`paged_decode_attention`; scores and softmax in f32, output in q's dtype,
    zeros for heads with no token (``lengths <= starts``).
    """
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, _ = k_pages.shape
    _, num_kv_heads, max_pages = block_table.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    bt = jnp.clip(block_table, 0, num_pages - 1)
    k = _dequantized(k_pages[bt], None if k_scales is None else k_scales[bt], jnp.float32)
    v = _dequantized(v_pages[bt], None if v_scales is None else v_scales[bt], jnp.float32)
    k = k.reshape(batch, num_kv_heads, max_pages * page_size, head_dim)
    v = v.reshape(batch, num_kv_heads, max_pages * page_size, head_dim)
    starts = jnp.zeros_like(lengths) if starts is None else starts
    slot = jnp.arange(max_pages * page_size)[None, None, :]
    valid = (slot >= starts[..., None]) & (slot < lengths[..., None])  # [B,Hkv,T]
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(valid[:, :, None, :], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    v = jnp.where(valid[..., None], v.astype(jnp.float32), 0.0)
    o = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=jax.lax.Precision.HIGHEST)
    o = jnp.where((lengths > starts)[:, :, None, None], o, 0.0)
    return o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# TPU form
# --------------------------------------------------------------------------------------------


class PageBlocks:
    """A TPU kernel's double-buffered DMA of one (row, KV head) pair's pages, a block of ``pages_per_block`` pages at a
    time, into ``buf[slot, j]`` of each stream (shared by the paged kernels).

    ``table_ref``: the scalar-prefetched block table, this pair's pages from ``first``; ``pages_used``: pages below its
    length (the rest are not copied); ``streams``: ``(hbm, buf, sem(slot))`` per pool copied (keys, values).
    """

    def __init__(self, table_ref, first, pages_per_block: int, pages_used, streams):
        self.table_ref, self.first, self.pages_per_block = table_ref, first, pages_per_block
        self.pages_used, self.streams = pages_used, streams

    def _copies(self, block, slot):
        for j in range(self.pages_per_block):
            pos = block * self.pages_per_block + j
            page = self.table_ref[self.first + pos]
            yield pos < self.pages_used, [pltpu.make_async_copy(hbm.at[page], buf.at[slot, j], sem(slot))
                                          for hbm, buf, sem in self.streams]

    def start(self, block, slot):
        """Start copying ``block`` into ``slot``."""
        for used, copies in self._copies(block, slot):
            @pl.when(used)
            def _(copies=copies):  # pl.when calls this at once; the default binds this page
                for c in copies:
                    c.start()

    def wait(self, block, slot):
        """Wait for ``block``'s copies into ``slot``."""
        for used, copies in self._copies(block, slot):
            @pl.when(used)
            def _(copies=copies):
                for c in copies:
                    c.wait()

    def advance(self, block, blocks_used):
        """At ``block`` (its copies started by the previous step, or by ``start(0, 0)`` for the first): start the next
        block's copies into the other slot if it is used, wait for this one's; returns the slot that holds it."""
        slot = jax.lax.rem(block, 2)

        @pl.when(block + 1 < blocks_used)
        def _():
            self.start(block + 1, 1 - slot)

        self.wait(block, slot)
        return slot


def _tpu_kernel(lengths_ref, starts_ref, bt_ref,  # scalar prefetch (SMEM)
                q_ref, k_hbm, v_hbm, *refs,  # inputs (and the pools' scales when quantized), output, scratch
                scale, pages_per_block, page_size, pages_padded, num_blocks, quantized):
    if quantized:
        ks_hbm, vs_hbm, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems, m_ref, l_ref, acc_ref = refs
    else:
        o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
    n, i = pl.program_id(0), pl.program_id(1)  # flattened (row, KV head) of this call, block
    length = lengths_ref[n]
    start = starts_ref[n]
    block_tokens = pages_per_block * page_size
    # lax.div/rem, not // and %: the operands are >= 0, and jnp's floor semantics add a
    # lax.sign whose Mosaic lowering queries the TPU generation (fails when lowering on CPU).
    pages_used = jax.lax.div(length + page_size - 1, page_size)
    blocks_used = jax.lax.div(length + block_tokens - 1, block_tokens)

    streams = [(k_hbm, k_buf, lambda slot: sems.at[0, slot]), (v_hbm, v_buf, lambda slot: sems.at[1, slot])]
    if quantized:  # each page's scales, a [page_size] row, beside it
        streams += [(ks_hbm, ks_buf, lambda slot: sems.at[2, slot]), (vs_hbm, vs_buf, lambda slot: sems.at[3, slot])]
    blocks = PageBlocks(bt_ref, n * pages_padded, pages_per_block, pages_used, streams)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(blocks_used > 0)
        def _():
            blocks.start(0, 0)

    @pl.when(i < blocks_used)
    def _compute():
        slot = blocks.advance(i, blocks_used)
        head_dim = k_buf.shape[-1]
        k = k_buf[slot].astype(jnp.float32).reshape(block_tokens, head_dim)
        v = v_buf[slot].astype(jnp.float32).reshape(block_tokens, head_dim)
        q = q_ref[...].astype(jnp.float32)  # [G, D]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                preferred_element_type=jnp.float32) * scale  # [G, T]
        pos_row = i * block_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        valid_row = (pos_row >= start) & (pos_row < length)
        if quantized:  # q . (k_t s_t) = (q . k_t) s_t: the key scales multiply the score columns
            s = s * _token_row(ks_buf[slot])
        s = jnp.where(valid_row, s, MASK_VALUE)
        pos_col = i * block_tokens + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
        v = jnp.where((pos_col >= start) & (pos_col < length), v, 0.0)
        m_prev = m_ref[...]  # [G, 1]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        if quantized:  # sum_t p_t (v_t s_t) = (p s) @ v: the value scales multiply p's columns (masked: a stale
            p = p * jnp.where(valid_row, _token_row(vs_buf[slot]), 0.0)  # scale may be NaN)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, precision=_HIGHEST,
                                                      preferred_element_type=jnp.float32)
        m_ref[...] = m_next

    @pl.when(i == num_blocks - 1)
    def _finalize():
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def _token_row(scales):
    """A block's per-token scales ``[pages_per_block, page_size]`` (one DMA-ed row per page) as one ``[1, tokens]``
    row, the lane axis of the scores."""
    return scales.reshape(1, scales.shape[0] * scales.shape[1])


def _tpu_heads_per_call(num_heads: int, pages_padded: int, budget: int) -> int:
    """(row, KV head) pairs per ``pallas_call`` so that the scalar-prefetched lengths, starts and
    block table (``4 * (2 + pages_padded)`` bytes per pair) fit in ``budget`` bytes of SMEM; calls
    are balanced (their sizes differ by at most one pair)."""
    per_head = 4 * (2 + pages_padded)
    if per_head > budget:
        raise ValueError(
            f"TPU form: the block table of one KV head ({pages_padded} pages, {per_head} bytes "
            f"of int32 with its length and start) exceeds the {budget}-byte SMEM budget for scalar "
            f"prefetch; use a larger page_size (at most {budget // 4 - 2} pages per head)")
    n_calls = pl.cdiv(num_heads, budget // per_head)
    return pl.cdiv(num_heads, n_calls)


def _check_tpu_page_size(page_size: int, kv_dtype, quantized: bool = False) -> None:
    """ValueError unless ``page_size`` is a multiple of the sublane tiling of the block reshaped to ``[tokens, D]``:
    the K/V dtype's (8 for f32, 16 for bf16), or f32's for a quantized pool (its block is converted to f32 first)."""
    block_dtype = jnp.float32 if quantized else kv_dtype
    sublanes = 8 * 4 // jnp.dtype(block_dtype).itemsize  # 8 (f32), 16 (bf16)
    if page_size % sublanes:
        raise ValueError(
            f"TPU form needs page_size to be a multiple of {sublanes} for "
            f"{jnp.dtype(kv_dtype).name} K/V (a block of pages is reshaped to [tokens, D]"
            f"{' in float32' if quantized else ''} without relayout), got page_size={page_size}")


def _paged_tpu(q, k_pages, v_pages, block_table, lengths, starts, *, scale, pages_per_block, interpret,
               prefetch_budget, k_scales=None, v_scales=None):
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, _ = k_pages.shape
    _, num_kv_heads, max_pages = block_table.shape
    group = num_q_heads // num_kv_heads
    quantized = k_scales is not None
    if not interpret:
        _check_tpu_page_size(page_size, k_pages.dtype, quantized)
    num_blocks = pl.cdiv(max_pages, pages_per_block)
    pages_padded = num_blocks * pages_per_block
    num_heads = batch * num_kv_heads  # the kernel sees (row, KV head) pairs flattened
    bt = jnp.clip(block_table, 0, num_pages - 1)
    bt = jnp.pad(bt, ((0, 0), (0, 0), (0, pages_padded - max_pages)))
    bt = bt.reshape(num_heads, pages_padded)
    ln = lengths.reshape(num_heads)
    st = starts.reshape(num_heads)

    # As in jax's TPU paged attention: when G is not a multiple of 8, give q a unit
    # second-minor dim so XLA picks a <1x128> HBM layout matching the kernel's memref.
    if group % 8:
        q_in = q.astype(jnp.float32).reshape(num_heads, group, 1, head_dim)
        q_spec = pl.BlockSpec((None, group, None, head_dim), lambda n, i, *_: (n, 0, 0, 0))
    else:
        q_in = q.astype(jnp.float32).reshape(num_heads, group, head_dim)
        q_spec = pl.BlockSpec((None, group, head_dim), lambda n, i, *_: (n, 0, 0))

    kernel = functools.partial(
        _tpu_kernel, scale=scale, pages_per_block=pages_per_block, page_size=page_size,
        pages_padded=pages_padded, num_blocks=num_blocks, quantized=quantized)
    buf_shape = (2, pages_per_block, page_size, head_dim)
    scales = (k_scales, v_scales) if quantized else ()
    scale_bufs = [pltpu.VMEM((2, pages_per_block, page_size), jnp.float32)] * len(scales)

    def call(ln_c, st_c, bt_c, q_c):
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3,
                grid=(q_c.shape[0], num_blocks),
                in_specs=[q_spec] + [pl.BlockSpec(memory_space=pl.ANY)] * (2 + len(scales)),
                out_specs=q_spec,
                scratch_shapes=[
                    pltpu.VMEM(buf_shape, k_pages.dtype),
                    pltpu.VMEM(buf_shape, v_pages.dtype),
                    *scale_bufs,
                    pltpu.SemaphoreType.DMA((2 + len(scales), 2)),
                    pltpu.VMEM((group, 1), jnp.float32),
                    pltpu.VMEM((group, 1), jnp.float32),
                    pltpu.VMEM((group, head_dim), jnp.float32),
                ],
            ),
            out_shape=jax.ShapeDtypeStruct(q_c.shape, jnp.float32),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "arbitrary")),
            interpret=pltpu.InterpretParams() if interpret else False,
            name="paged_decode_attention_tpu",
        )(ln_c, st_c, bt_c.reshape(-1), q_c, k_pages, v_pages, *scales)

    # SMEM holds only the scalar-prefetch operands of one call: split the (row, head) pairs
    # into calls whose lengths + block table fit the budget (one call in the common case).
    per_call = _tpu_heads_per_call(num_heads, pages_padded, prefetch_budget)
    outs = [call(ln[s:s + per_call], st[s:s + per_call], bt[s:s + per_call], q_in[s:s + per_call])
            for s in range(0, num_heads, per_call)]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# GPU form (Triton, split-K)
# --------------------------------------------------------------------------------------------


def _gpu_kernel(*refs, scale, pages_per_block, pages_per_split, quantized):
    if quantized:  # inputs (with the pools' per-token scales), outputs (partials of this split)
        q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref, len_ref, start_ref, o_ref, m_ref, l_ref = refs
    else:
        q_ref, k_ref, v_ref, bt_ref, len_ref, start_ref, o_ref, m_ref, l_ref = refs
    split = pl.program_id(2)
    num_pages, page_size, head_dim = k_ref.shape
    block_tokens = pages_per_block * page_size
    rows = q_ref.shape[0]
    length = len_ref[0]
    start = start_ref[0]
    first_page = split * pages_per_split
    pages_used = (length + page_size - 1) // page_size
    n_pages = jnp.clip(pages_used - first_page, 0, pages_per_split)
    n_blocks = (n_pages + pages_per_block - 1) // pages_per_block
    q = q_ref[...]

    def body(t, carry):
        o, m, l = carry
        pages = bt_ref[pl.ds(t * pages_per_block, pages_per_block)]
        k = k_ref[pages].reshape(block_tokens, head_dim)
        v = v_ref[pages].reshape(block_tokens, head_dim)
        if quantized:  # dequantize the block: one scale per token
            k = k.astype(jnp.float32) * ks_ref[pages].reshape(block_tokens)[:, None]
            v = v.astype(jnp.float32) * vs_ref[pages].reshape(block_tokens)[:, None]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                preferred_element_type=jnp.float32) * scale
        pos = (first_page + t * pages_per_block) * page_size + jnp.arange(block_tokens)
        valid = (pos >= start) & (pos < length)
        s = jnp.where(valid[None, :], s, MASK_VALUE)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_next)
        p = jnp.exp(s - m_next[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        o = alpha[:, None] * o + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_HIGHEST,
            preferred_element_type=jnp.float32)
        return o, m_next, l

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def subpage_view(k_pages, v_pages, block_table, tokens: int):
    """``(k_pages, v_pages, block_table)`` with each page read as ``page_size // tokens`` consecutive sub-pages of
    ``tokens`` tokens (a free reshape of the pools) and the block table expanded to match (the GPU forms' way with
    pages larger than a block)."""
    num_pages, page_size, head_dim = k_pages.shape
    batch, num_kv_heads, max_pages = block_table.shape
    r = page_size // tokens
    table = (block_table[..., None] * r + jnp.arange(r, dtype=block_table.dtype)).reshape(
        batch, num_kv_heads, max_pages * r)
    return (k_pages.reshape(num_pages * r, tokens, head_dim), v_pages.reshape(num_pages * r, tokens, head_dim),
            table)


def split_pages(max_pages: int, pages_per_block: int, num_splits: int | None,
                rows_and_heads: int) -> tuple[int, int]:
    """Split-K of the GPU forms: ``(num_splits, pages_per_split)``, whole blocks per split; ``num_splits=None`` aims
    at about ``_GPU_TARGET_PROGRAMS`` programs over the ``rows_and_heads`` (row, KV head) pairs."""
    total_blocks = pl.cdiv(max_pages, pages_per_block)
    if num_splits is None:
        num_splits = pl.cdiv(_GPU_TARGET_PROGRAMS, rows_and_heads)
    num_splits = max(1, min(num_splits, total_blocks))
    pages_per_split = pl.cdiv(total_blocks, num_splits) * pages_per_block
    return pl.cdiv(max_pages, pages_per_split), pages_per_split


def combine_splits(o, m, l):
    """The flash-decoding reduction of the GPU forms: split partials ``o [B, H_kv, S, R, D]`` (unnormalised), running
    maxima and sums ``m, l [B, H_kv, S, R]`` -> ``[B, H_kv, R, D]``; zeros where nothing was attended."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)  # [B, Hkv, S, R]
    l_all = jnp.sum(l * w, axis=2)
    o_all = jnp.sum(o * w[..., None], axis=2)
    return o_all / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]


def _paged_gpu(q, k_pages, v_pages, block_table, lengths, starts, *, scale, pages_per_block, num_splits,
               interpret, k_scales=None, v_scales=None):
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, _ = k_pages.shape
    _, num_kv_heads, max_pages = block_table.shape
    group = num_q_heads // num_kv_heads
    for name, val in (("page_size", page_size), ("head_dim", head_dim),
                      ("pages_per_block", pages_per_block)):
        if val & (val - 1):
            raise ValueError(f"GPU (Triton) form needs {name} to be a power of two, got {val}")
    if head_dim < 16:
        raise ValueError(f"GPU (Triton) form needs head_dim >= 16, got {head_dim}")
    if pages_per_block * page_size < 16:
        raise ValueError(
            f"GPU (Triton) form needs pages_per_block * page_size >= 16, got "
            f"{pages_per_block} * {page_size}")
    quantized = k_scales is not None
    block_dtype = jnp.float32 if quantized else k_pages.dtype  # a quantized block is dequantized to f32
    max_tokens = _gpu_max_block_tokens(head_dim, block_dtype)
    if pages_per_block > 1 and pages_per_block * page_size > max_tokens:
        raise ValueError(
            f"GPU (Triton) form: pages_per_block * page_size = {pages_per_block} * {page_size} "
            f"tokens exceeds {max_tokens}, the most whose [tokens, D={head_dim}] "
            f"{jnp.dtype(block_dtype).name} K block fits {_GPU_MAX_BLOCK_BYTES} bytes (Triton "
            f"shared memory); use pages_per_block <= {max(1, max_tokens // page_size)}")
    bt = jnp.clip(block_table, 0, num_pages - 1)
    if page_size > max_tokens:
        # one page is too big a block: read it as consecutive sub-pages
        r = page_size // max_tokens
        k_pages, v_pages, bt = subpage_view(k_pages, v_pages, bt, max_tokens)
        if quantized:
            k_scales, v_scales = (x.reshape(num_pages * r, max_tokens) for x in (k_scales, v_scales))
        (num_pages, page_size, _), max_pages = k_pages.shape, bt.shape[2]
    num_splits, pages_per_split = split_pages(max_pages, pages_per_block, num_splits, batch * num_kv_heads)
    pages_padded = num_splits * pages_per_split

    rows = max(16, _next_pow2(group))
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(block_dtype)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    bt = jnp.pad(bt, ((0, 0), (0, 0), (0, pages_padded - max_pages)))
    bt = bt.reshape(batch, num_kv_heads, num_splits, pages_per_split)

    from jax.experimental.pallas import triton as pltriton  # GPU-only module, import lazily

    kernel = functools.partial(_gpu_kernel, scale=scale, pages_per_block=pages_per_block,
                               pages_per_split=pages_per_split, quantized=quantized)
    part_shape = (batch, num_kv_heads, num_splits, rows)
    pool = pl.BlockSpec((num_pages, page_size, head_dim), lambda b, h, s: (0, 0, 0))
    scales = [pl.BlockSpec((num_pages, page_size), lambda b, h, s: (0, 0))] * 2 if quantized else []
    o, m, l = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pool, pool, *scales,
            pl.BlockSpec((None, None, None, pages_per_split), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, 1), lambda b, h, s: (b, h, 0)),
            pl.BlockSpec((None, None, 1), lambda b, h, s: (b, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(part_shape + (head_dim,), jnp.float32),
            jax.ShapeDtypeStruct(part_shape, jnp.float32),
            jax.ShapeDtypeStruct(part_shape, jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_decode_attention_gpu",
    )(qg, k_pages, v_pages, *((k_scales, v_scales) if quantized else ()), bt, lengths.reshape(batch, num_kv_heads, 1),
      starts.reshape(batch, num_kv_heads, 1))

    o_all = combine_splits(o, m, l)
    return o_all[:, :, :group].reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "implementation", "backend",
                                             "pages_per_block", "num_splits", "prefetch_budget"))
def _paged_decode_attention(q, k_pages, v_pages, block_table, lengths, starts, k_scales, v_scales, *, scale,
                            implementation, backend, pages_per_block, num_splits, prefetch_budget):
    if implementation == "xla":
        return paged_decode_attention_reference(q, k_pages, v_pages, block_table, lengths,
                                                scale=scale, starts=starts, k_scales=k_scales, v_scales=v_scales)
    interpret = implementation == "pallas_interpret"
    if backend == "gpu":
        return _paged_gpu(q, k_pages, v_pages, block_table, lengths, starts, scale=scale,
                          pages_per_block=pages_per_block, num_splits=num_splits,
                          interpret=interpret, k_scales=k_scales, v_scales=v_scales)
    if backend == "mosaic_gpu":
        from kvjax.pallas_kernels.paged_attention_mgpu import paged_mgpu

        return paged_mgpu(q, k_pages, v_pages, block_table, lengths, starts, scale=scale,
                          pages_per_block=pages_per_block, num_splits=num_splits, interpret=interpret,
                          k_scales=k_scales, v_scales=v_scales)
    return _paged_tpu(q, k_pages, v_pages, block_table, lengths, starts, scale=scale,
                      pages_per_block=pages_per_block, interpret=interpret,
                      prefetch_budget=prefetch_budget, k_scales=k_scales, v_scales=v_scales)


def paged_decode_attention(q, k_pages, v_pages, block_table, lengths, *, scale=None,
                           implementation="pallas", backend=None, pages_per_block=None,
                           num_splits=None, starts=None, k_scales=None, v_scales=None):
    """Decode attention of one query token over a paged (block-table) KV cache.

    Args:
      q: ``[B, H_q, D]`` query (bf16 or f32; same dtype as K/V or f32).
      k_pages, v_pages: ``[num_pages, page_size, D]`` page pools (bf16 or f32; int8 or float8_e4m3fn with scales).
      block_table: int32 ``[B, H_kv, max_pages]``; ``H_q`` must be a multiple of ``H_kv``.
      lengths: int32 ``[B, H_kv]`` valid tokens per (row, KV head); 0 gives a zero output.
      starts: int32 ``[B, H_kv]`` or None (zeros): the first valid token of each head; tokens
        ``starts .. lengths - 1`` are attended (a contiguous cache read as pages: a left-padded
        row's padding is never attended); ``lengths <= starts`` gives a zero output.
      k_scales, v_scales: float32 ``[num_pages, page_size]`` per-token scales of quantized pools, or None
        (module docstring: every compiled form dequantizes in the kernel).
      scale: logit scale, default ``D ** -0.5``.
      implementation: ``"pallas"`` (compiled), ``"pallas_interpret"`` (CPU emulation) or
        ``"xla"`` (:func:`paged_decode_attention_reference`).
      backend: kernel form, ``"tpu"``, ``"gpu"`` (Triton) or ``"mosaic_gpu"``
        (:mod:`kvjax.pallas_kernels.paged_attention_mgpu`, H100 / H200); ``None`` follows ``jax.default_backend()``
        (Triton on a GPU; the GPU form when interpreting on CPU; module docstring).
      pages_per_block: pages per kernel block; ``None`` picks about 512 (TPU) / 128 (GPU)
        tokens per block (a power of two for the GPU form, whose K block is also kept within
        32 KiB; pages larger than that are processed in sub-pages).
      num_splits: GPU form only, number of split-K partitions; ``None`` targets ~256 programs.

    Returns ``[B, H_q, D]`` in q's dtype.  With concrete (non-traced) inputs the block table is
    checked on the host first (:func:`check_block_table`); under ``jit`` the caller is
    responsible (entries are clipped into range, so bad tables give wrong values, not crashes).
    """
    _validate(q, k_pages, v_pages, block_table, lengths, implementation, backend,
              pages_per_block, num_splits, k_scales, v_scales)
    num_pages, page_size, head_dim = k_pages.shape
    max_pages = block_table.shape[2]
    if not (_is_tracer(block_table) or _is_tracer(lengths)):
        check_block_table(block_table, lengths, num_pages, page_size)
    if implementation != "xla":
        backend = resolve_backend(implementation, backend)
    else:
        backend = None
    if pages_per_block is None and backend != "mosaic_gpu":  # the Mosaic GPU form picks its own
        target = _TARGET_BLOCK_TOKENS.get(backend, 512)
        if backend == "gpu":
            block_dtype = k_pages.dtype if k_scales is None else jnp.float32  # quantized: dequantized in f32
            target = min(target, _gpu_max_block_tokens(head_dim, block_dtype))
        pages_per_block = max(1, min(max_pages, target // page_size))
        if backend == "gpu":
            pages_per_block = _prev_pow2(pages_per_block)
            while pages_per_block * page_size < 16:
                pages_per_block *= 2
    scale = float(head_dim**-0.5 if scale is None else scale)
    if starts is None:
        starts = jnp.zeros_like(lengths)
    elif starts.shape != lengths.shape or jnp.dtype(starts.dtype) != jnp.int32:
        raise ValueError(f"starts must be int32 of the lengths' shape {lengths.shape}, got {starts.dtype} "
                         f"{starts.shape}")
    return _paged_decode_attention(
        q, k_pages, v_pages, block_table, lengths, starts, k_scales, v_scales, scale=scale, implementation=implementation,
        backend=backend, pages_per_block=None if pages_per_block is None else int(pages_per_block),
        num_splits=None if num_splits is None else int(num_splits),
        prefetch_budget=_TPU_SMEM_PREFETCH_BYTES)
