"""The Mosaic GPU form (``backend="mosaic_gpu"``) of :func:`kvjax.pallas_kernels.paged_attention.paged_decode_attention`.

jax's Pallas Triton backend is deprecated; this is the same split-K ("flash decoding") kernel written for Mosaic GPU
(``jax.experimental.pallas.mosaic_gpu``, H100 / H200, sm_90), with the semantics of
:func:`~kvjax.pallas_kernels.paged_attention.paged_decode_attention_reference`.

* ``plgpu.kernel`` over the grid ``(B, H_kv, num_splits)``, one warpgroup (128 threads) per block, Lane lowering
  semantics (pinned: jax 0.11 made Warpgroup the default; this kernel sets register layouts itself).
* The ``G`` query rows of the (row, KV head) are copied to shared memory once (f32, one TMA copy).
* A split walks its pages in blocks of ``pages_per_block`` pages, ``T = pages_per_block * page_size`` tokens
  (``T`` a multiple of 64): each page index is a scalar read of the block table, each page one TMA copy
  (``plgpu.copy_gmem_to_smem``) into a double-buffered ``[2, T, D]`` K and V buffer (tiled and 128-byte swizzled, as
  jax's own kernels): block ``t + 1`` is in flight while block ``t`` is computed, one barrier per buffer. A split's
  last block copies whole blocks (stale, clipped entries included); masking makes them harmless.
* No tensor cores: ``G <= 8`` query rows are far below wgmma's 64 rows, and f32 wgmma is TF32. K and V are upcast
  to f32 in registers (the WGMMA register layout ``[T, D]``); per query row: ``q . K`` by broadcast and reduction,
  mask, online softmax, ``p @ V``. bf16 K/V are therefore multiplied in f32 (the Triton form feeds bf16 to its dots).
* Pages above 64 tokens that are multiples of 64 are read as 64-token sub-pages. A ``ValueError`` when the
  double-buffered blocks would exceed 227 KiB of shared memory (f32, D = 128, 128-token blocks).
* Each split writes ``[G, 3, D]`` f32 (unnormalised output, running max, running sum); a jnp combine rescales the
  splits, as the Triton form's.
* Quantized pools (int8 / float8_e4m3fn pages with per-token float32 scales) are copied as stored. A block loads in
  the register layout made for upcasting 8-bit tiles (``WGMMA_UPCAST_2X``), widens exactly to f16 (every int8 and
  e4m3 value is an f16 value; the H100 converts e4m3 to f16, not to bf16, in hardware), moves to the WGMMA layout (a
  16-bit relayout) and widens to f32. The scales multiply the ``[T]`` score and weight vectors
  (``q . (k_t s_t) = (q . k_t) s_t``, ``sum_t p_t (v_t s_t)``), masked like V. They come gathered through the block
  table, ``[B, H_kv, tokens]``, so a block's scales are one copy: a TMA copy moves a multiple of 128 bytes, a 16-token
  page's scales are 64 (the gather reads and writes 4 bytes per token and pool per call beside the 2 D bytes of K/V).

``interpret=True`` runs it on the CPU under Mosaic GPU's interpreter (simulated shared memory, TMA, barriers; its
race detector checks the barriers), which jax 0.10 and 0.11 expose only as
``jax._src.pallas.mosaic_gpu.interpret``. The interpreter cannot run ``plgpu.layout_cast``; the casts are skipped
when interpreting.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas_kernels.backend import MASK_VALUE
from kvjax.pallas_kernels.paged_attention import combine_splits, split_pages, subpage_view

_BLOCK_ROWS = 64  # rows of the WGMMA register layout
_SMEM_BYTES = 227 * 1024  # H100/H200 opt-in shared memory per block (Mosaic GPU's AOT default)
_SMEM_OVERHEAD = 4096  # Pallas reduction scratch, barriers, alignment (measured ~2 KiB)


def interpret_params(**options):
    """Mosaic GPU's interpreter parameters (``InterpretGPUParams(**options)``, e.g. ``detect_races=True``): jax
    exports them under no public name, so a jax without them is a clear error."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        raise ValueError(f"jax {jax.__version__} has no Mosaic GPU interpreter; run the mosaic_gpu form compiled "
                         "on a GPU or use backend='gpu'") from e
    return InterpretGPUParams(**options)


def _kernel(*refs, scale, group, page_size, pages_per_block, pages_per_split, quantized, interpret):
    if quantized:  # GMEM inputs (with the pools' per-token scales), GMEM output [B, H_kv, S, G, 3, D], scratch
        (q_ref, k_hbm, v_hbm, ks_hbm, vs_hbm, bt_ref, len_ref, start_ref, out_ref,
         q_smem, k_smem, v_smem, ks_smem, vs_smem, out_smem, q_bar, kv_bar) = refs
    else:
        (q_ref, k_hbm, v_hbm, bt_ref, len_ref, start_ref, out_ref,
         q_smem, k_smem, v_smem, out_smem, q_bar, kv_bar) = refs
    head_dim = q_smem.shape[-1]
    block_tokens = pages_per_block * page_size

    def cast(x, layout):
        return x if interpret else plgpu.layout_cast(x, layout)

    def load_block(smem):
        """One K or V block ``[T, D]`` in f32, in the WGMMA register layout."""
        if not quantized:
            return cast(smem[...], wgmma).astype(jnp.float32)
        if interpret:
            return smem[...].astype(jnp.float32)
        # 8-bit tiles load in the layout built to upcast them (32-bit shared-memory reads), widen exactly to float16
        # (|int8| <= 127 and every float8_e4m3fn value are float16 values; the H100 converts e4m3 to f16 in one
        # instruction), move to the WGMMA layout (a 16-bit relayout), then widen to f32
        x = plgpu.load(smem, (), layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
        return plgpu.layout_cast(x, wgmma).astype(jnp.float32)

    def load_row(smem):
        """One block's per-token scales ``[T]``, one per K/V row of the register layout."""
        return smem[...] if interpret else plgpu.load(smem, (), layout=row)

    wgmma = plgpu.Layout.WGMMA
    row = plgpu.Layout.WGMMA.reduce(1)  # [T] vectors (one value per K/V row)
    col = plgpu.Layout.WGMMA.reduce(0)  # [D] vectors (one value per head-dim column)

    b = lax.axis_index("b")
    h = lax.axis_index("h")
    split = lax.axis_index("s")
    length = len_ref[b, h]
    start = start_ref[b, h]
    first_page = split * pages_per_split
    pages_used = (length + page_size - 1) // page_size
    n_pages = jnp.clip(pages_used - first_page, 0, pages_per_split)
    n_blocks = (n_pages + pages_per_block - 1) // pages_per_block

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)

    def issue(t, slot):
        for j in range(pages_per_block):
            page = bt_ref[b, h, first_page + t * pages_per_block + j]
            dst = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_hbm.at[page], k_smem.at[slot, dst], kv_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_hbm.at[page], v_smem.at[slot, dst], kv_bar.at[slot])
        if quantized:  # the block's scales, contiguous in the head's gathered row, one copy each on the same barrier
            tokens = pl.ds((first_page + t * pages_per_block) * page_size, block_tokens)
            plgpu.copy_gmem_to_smem(ks_hbm.at[b, h, tokens], ks_smem.at[slot], kv_bar.at[slot])
            plgpu.copy_gmem_to_smem(vs_hbm.at[b, h, tokens], vs_smem.at[slot], kv_bar.at[slot])

    @pl.when(n_blocks > 0)
    def _():
        issue(0, 0)

    plgpu.barrier_wait(q_bar)
    qs = [cast(q_smem[g], col) for g in range(group)]

    def body(t, carry):
        os, ms, ls = carry
        slot = lax.rem(t, 2)

        @pl.when(t + 1 < n_blocks)
        def _():
            issue(t + 1, 1 - slot)

        plgpu.barrier_wait(kv_bar.at[slot])
        k = load_block(k_smem.at[slot])
        v = load_block(v_smem.at[slot])
        iota = (plgpu.broadcasted_iota(jnp.int32, (block_tokens,), 0, layout=row)
                if not interpret else lax.broadcasted_iota(jnp.int32, (block_tokens,), 0))
        pos = (first_page + t * pages_per_block) * page_size + iota
        valid = (pos >= start) & (pos < length)
        v = jnp.where(lax.broadcast_in_dim(valid, v.shape, [0]), v, 0.0)
        if quantized:
            # q . (k_t s_t) = (q . k_t) s_t and sum_t p_t (v_t s_t) = sum_t (p_t s_t) v_t: the scales multiply the
            # [T] score and weight vectors, never a [T, D] block; a stale scale past the length may be NaN: masked
            k_row = jnp.where(valid, load_row(ks_smem.at[slot]), 0.0) * scale
            v_row = jnp.where(valid, load_row(vs_smem.at[slot]), 0.0)
        new_o, new_m, new_l = [], [], []
        for g in range(group):
            s = jnp.sum(k * lax.broadcast_in_dim(qs[g], k.shape, [1]), axis=1)
            s = s * k_row if quantized else s * scale
            s = jnp.where(valid, s, MASK_VALUE)
            m_next = jnp.maximum(ms[g], jnp.max(s))
            alpha = jnp.exp(ms[g] - m_next)
            p = jnp.exp(s - m_next)
            new_l.append(alpha * ls[g] + jnp.sum(p))
            new_m.append(m_next)
            w = p * v_row if quantized else p
            pv = jnp.sum(v * lax.broadcast_in_dim(w, v.shape, [0]), axis=0)
            new_o.append(alpha * os[g] + pv)
        return tuple(new_o), tuple(new_m), tuple(new_l)

    init = (tuple(cast(jnp.zeros((head_dim,), jnp.float32), col) for _ in range(group)),
            tuple(jnp.float32(MASK_VALUE) for _ in range(group)),
            tuple(jnp.float32(0.0) for _ in range(group)))
    os, ms, ls = lax.fori_loop(0, n_blocks, body, init)
    for g in range(group):
        out_smem[g, 0] = os[g]
        out_smem[g, 1] = cast(jnp.full((head_dim,), ms[g], jnp.float32), col)
        out_smem[g, 2] = cast(jnp.full((head_dim,), ls[g], jnp.float32), col)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[b, h, split])
    plgpu.wait_smem_to_gmem(0)


def paged_mgpu(q, k_pages, v_pages, block_table, lengths, starts, *, scale, pages_per_block=None, num_splits=None,
               interpret=False, k_scales=None, v_scales=None):
    """The kernel and its combine (arguments as :func:`kvjax.pallas_kernels.paged_attention.paged_decode_attention`, already
    validated there; ``k_scales, v_scales``: the per-token scales of int8 / float8_e4m3fn pools). ``interpret``: False,
    True (the interpreter's defaults) or interpreter parameters (:func:`interpret_params`)."""
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, _ = k_pages.shape
    _, num_kv_heads, max_pages = block_table.shape
    group = num_q_heads // num_kv_heads
    scale = float(scale)
    if page_size % 8:
        raise ValueError(f"page_size must be a multiple of 8 (SMEM tile rows), got {page_size}")
    quantized = k_scales is not None
    itemsize = jnp.dtype(k_pages.dtype).itemsize
    swizzle = min(128, head_dim * itemsize)
    if swizzle < 32 or (head_dim * itemsize) % swizzle or swizzle & (swizzle - 1):
        raise ValueError(f"head_dim * itemsize = {head_dim * itemsize} bytes must be 32, 64 or a "
                         f"multiple of 128 (SMEM swizzle)")
    bt = jnp.clip(block_table.astype(jnp.int32), 0, num_pages - 1)
    if page_size > _BLOCK_ROWS and page_size % _BLOCK_ROWS == 0 and pages_per_block is None:
        # a big page is read as consecutive 64-token sub-pages
        r = page_size // _BLOCK_ROWS
        k_pages, v_pages, bt = subpage_view(k_pages, v_pages, bt, _BLOCK_ROWS)
        if quantized:
            k_scales, v_scales = (x.reshape(num_pages * r, _BLOCK_ROWS) for x in (k_scales, v_scales))
        (num_pages, page_size, _), max_pages = k_pages.shape, bt.shape[2]
    if pages_per_block is None:
        pages_per_block = math.lcm(page_size, _BLOCK_ROWS) // page_size
    block_tokens = pages_per_block * page_size
    if block_tokens % _BLOCK_ROWS:
        raise ValueError(f"pages_per_block * page_size = {block_tokens} must be a multiple of "
                         f"{_BLOCK_ROWS} (WGMMA register layout rows)")
    smem = 4 * block_tokens * (head_dim * itemsize + 4 * quantized) + 4 * group * head_dim * 4 + _SMEM_OVERHEAD
    if smem > _SMEM_BYTES:
        raise ValueError(f"K/V blocks of {block_tokens} tokens x D={head_dim} "
                         f"({jnp.dtype(k_pages.dtype).name}, double-buffered) need ~{smem} bytes of "
                         f"shared memory > {_SMEM_BYTES}; use a smaller pages_per_block")
    num_splits, pages_per_split = split_pages(max_pages, pages_per_block, num_splits, batch * num_kv_heads)
    pages_padded = num_splits * pages_per_split

    bt = jnp.pad(bt, ((0, 0), (0, 0), (0, pages_padded - max_pages)))
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
    kv_dtype = k_pages.dtype
    # Swizzled [8, swizzle bytes] tiles: the TMA writes them, and the WGMMA-layout load from SMEM
    # into registers is bank-conflict free (an untiled buffer fails Mosaic's transfer planner).
    kv_transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

    kernel = plgpu.kernel(
        functools.partial(_kernel, scale=scale, group=group, page_size=page_size,
                          pages_per_block=pages_per_block, pages_per_split=pages_per_split, quantized=quantized,
                          interpret=bool(interpret)),
        out_type=jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group, 3, head_dim),
                                      jnp.float32),
        scratch_types=[
            plgpu.SMEM((group, head_dim), jnp.float32),
            plgpu.SMEM((2, block_tokens, head_dim), kv_dtype, transforms=kv_transforms),
            plgpu.SMEM((2, block_tokens, head_dim), kv_dtype, transforms=kv_transforms),
            *([plgpu.SMEM((2, block_tokens), jnp.float32)] * (2 * quantized)),
            plgpu.SMEM((group, 3, head_dim), jnp.float32),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=2 * pages_per_block + 2 * quantized, num_barriers=2),
        ],
        grid=(batch, num_kv_heads, num_splits),
        grid_names=("b", "h", "s"),
        # Lane semantics pinned: the default became Warpgroup in jax 0.11 (this kernel sets layouts by hand).
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=(interpret if not isinstance(interpret, bool) else interpret_params()) if interpret else None,
    )
    # the scales gathered through the block table, [B, H_kv, tokens] (4 bytes read and written per token beside
    # the 2 D bytes of its K and V): a page's 16 scales (64 bytes) are below a TMA copy's 128-byte granule, a
    # block's are not
    scales = tuple(x[bt].reshape(batch, num_kv_heads, pages_padded * page_size).astype(jnp.float32)
                   for x in (k_scales, v_scales)) if quantized else ()
    out = kernel(qg, k_pages, v_pages, *scales, bt, lengths.astype(jnp.int32), starts.astype(jnp.int32))
    o, m, l = out[..., 0, :], out[..., 1, 0], out[..., 2, 0]  # [B,Hkv,S,G,D], [B,Hkv,S,G] x2
    return combine_splits(o, m, l).reshape(batch, num_q_heads, head_dim).astype(q.dtype)


__all__ = ["interpret_params", "paged_mgpu"]
