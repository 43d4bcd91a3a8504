"""Attention logits of one query group per KV head over its paged keys, read where they lie.

``paged_scores(q, k_pages, block_table, lengths)``: ``q[N, G, D]`` (the ``G`` query heads of each of ``N`` (row, KV
head) pairs), ``k_pages[P, page_size, D]``, ``block_table[N, M]`` and ``lengths[N]`` give the logits
``scale * q . k`` over each pair's first ``lengths`` tokens, ``[N, G, M * page_size]`` float32, ``MASK_VALUE`` past
the length. The recall methods' leaders score their held tokens with it every decode step (softmax, pooling and
the top-k follow in XLA, on the logits only).

Why a kernel: in XLA the pages are first gathered (``k_pages[block_table]``). On a TPU the compiler then keeps the
whole pool in on-chip memory for the gather, and the step's append writes every pool back (measured on the
compiled v5e-8 step); the kernel DMAs only each pair's pages below its length, in blocks, into a double-buffered
scratch, as the paged-attention kernel does.

* TPU (Mosaic): grid (pair, block of pages); the lengths and block table are scalar-prefetched into SMEM (split over
  several calls when they exceed the budget, as the paged-attention kernel).
* GPU: none. XLA fuses the page gather into the leaders' multiply-reduce there (each key read once).

``implementation="xla"`` is the reference (:func:`paged_scores_reference`); ``"pallas_interpret"`` runs the TPU form
on a CPU with Pallas' discharge interpreter (``interpret=True``), not ``pltpu.InterpretParams`` as the other kernels:
the recall methods call it inside decode steps whose outputs live in host memory, and that interpreter's ordered
effects break the lowering of such a program (jax 0.10.2).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax.pallas_kernels.backend import MASK_VALUE, check_call, resolve_backend
from kvjax.pallas_kernels.paged_attention import (_TPU_SMEM_PREFETCH_BYTES, PageBlocks, _check_tpu_page_size,
                                            _tpu_heads_per_call)

# Tokens per block: the output block's last dim, a multiple of the 128 lanes.
_BLOCK_TOKENS = 512
_HIGHEST = jax.lax.Precision.HIGHEST


def paged_scores_reference(q, k_pages, block_table, lengths, *, scale=None):
    """The logits in XLA: gather the pages, multiply in float32 (``q`` rounded to the pages' dtype first)."""
    N, G, D = q.shape
    _, ps, _ = k_pages.shape
    M = block_table.shape[-1]
    scale = D**-0.5 if scale is None else scale
    k = k_pages[jnp.clip(block_table, 0, k_pages.shape[0] - 1)].reshape(N, M * ps, D)
    s = jnp.einsum("ngd,nsd->ngs", q.astype(k_pages.dtype), k, precision=_HIGHEST,
                   preferred_element_type=jnp.float32) * scale
    seen = jnp.arange(M * ps)[None, None, :] < lengths[:, None, None]
    return jnp.where(seen, s, MASK_VALUE)


def check_scores_call(q, k_pages, block_table, lengths) -> None:
    """``ValueError`` unless the shapes agree (module docstring)."""
    if q.ndim != 3 or k_pages.ndim != 3 or block_table.ndim != 2 or lengths.ndim != 1:
        raise ValueError(f"need q[N, G, D], k_pages[P, page_size, D], block_table[N, M], lengths[N]; got "
                         f"{q.shape}, {k_pages.shape}, {block_table.shape}, {lengths.shape}")
    N, _, D = q.shape
    if k_pages.shape[-1] != D or block_table.shape[0] != N or lengths.shape[0] != N:
        raise ValueError(f"q {q.shape}, k_pages {k_pages.shape}, block_table {block_table.shape} and lengths "
                         f"{lengths.shape} disagree on N or D")


def _pages_per_block(page_size: int, max_pages: int) -> int:
    """Pages per block: about :data:`_BLOCK_TOKENS` tokens, a multiple of 128 tokens (the output's lanes), and no
    more than the table holds (rounded up to that multiple)."""
    unit = 128 // math.gcd(128, page_size)  # pages in the smallest lane-aligned block
    want = max(unit, (_BLOCK_TOKENS // page_size) // unit * unit)
    return min(want, pl.cdiv(max_pages, unit) * unit)


def _tpu_kernel(lengths_ref, bt_ref,  # scalar prefetch (SMEM)
                q_ref, k_hbm,  # inputs
                o_ref,  # output
                k_buf, sems,  # scratch
                *, scale, pages_per_block, page_size, pages_padded):
    n, i = pl.program_id(0), pl.program_id(1)  # (row, KV head) pair of this call, block
    length = lengths_ref[n]
    block_tokens = pages_per_block * page_size
    pages_used = jax.lax.div(length + page_size - 1, page_size)  # lax.div: see the paged-attention kernel
    blocks_used = jax.lax.div(length + block_tokens - 1, block_tokens)

    blocks = PageBlocks(bt_ref, n * pages_padded, pages_per_block, pages_used,
                        [(k_hbm, k_buf, lambda slot: sems.at[slot])])

    @pl.when((i == 0) & (blocks_used > 0))
    def _first():
        blocks.start(0, 0)

    @pl.when(i < blocks_used)
    def _score():
        slot = blocks.advance(i, blocks_used)
        k = k_buf[slot].astype(jnp.float32).reshape(block_tokens, k_buf.shape[-1])
        q = q_ref[...].astype(k_buf.dtype).astype(jnp.float32)  # [G, D], rounded as the reference
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                preferred_element_type=jnp.float32) * scale  # [G, block_tokens]
        pos = i * block_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        o_ref[...] = jnp.where(pos < length, s, MASK_VALUE)

    @pl.when(i >= blocks_used)
    def _past():
        o_ref[...] = jnp.full(o_ref.shape, MASK_VALUE, jnp.float32)


def _scores_tpu(q, k_pages, block_table, lengths, *, scale, interpret, prefetch_budget):
    N, G, D = q.shape
    num_pages, page_size, _ = k_pages.shape
    max_pages = block_table.shape[-1]
    if not interpret:
        _check_tpu_page_size(page_size, k_pages.dtype)
    bp = _pages_per_block(page_size, max_pages)
    num_blocks = pl.cdiv(max_pages, bp)
    pages_padded = num_blocks * bp
    bt = jnp.pad(jnp.clip(block_table, 0, num_pages - 1).astype(jnp.int32), ((0, 0), (0, pages_padded - max_pages)))
    kernel = functools.partial(_tpu_kernel, scale=scale, pages_per_block=bp, page_size=page_size,
                               pages_padded=pages_padded)

    def call(ln, table, q_c):
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2,
                grid=(q_c.shape[0], num_blocks),
                in_specs=[pl.BlockSpec((None, G, D), lambda n, i, *_: (n, 0, 0)), pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec((None, G, bp * page_size), lambda n, i, *_: (n, 0, i)),
                scratch_shapes=[pltpu.VMEM((2, bp, page_size, D), k_pages.dtype), pltpu.SemaphoreType.DMA((2,))],
            ),
            out_shape=jax.ShapeDtypeStruct((q_c.shape[0], G, pages_padded * page_size), jnp.float32),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
            interpret=interpret,
            name="paged_scores_tpu",
        )(ln, table.reshape(-1), q_c, k_pages)

    lengths = jnp.minimum(lengths.astype(jnp.int32), max_pages * page_size)
    per_call = _tpu_heads_per_call(N, pages_padded, prefetch_budget)
    outs = [call(lengths[s:s + per_call], bt[s:s + per_call], q[s:s + per_call]) for s in range(0, N, per_call)]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out[:, :, :max_pages * page_size]


@functools.partial(jax.jit, static_argnames=("scale", "implementation", "backend"))
def paged_scores(q, k_pages, block_table, lengths, *, scale=None, implementation: str = "xla",
                 backend: str | None = None):
    """Logits ``[N, G, M * page_size]`` float32 of ``q[N, G, D]`` over each pair's paged keys (module docstring).
    ``implementation``: ``"xla"``, ``"pallas"`` (the TPU form; a GPU has none) or ``"pallas_interpret"``."""
    check_scores_call(q, k_pages, block_table, lengths)
    check_call(implementation, backend, q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if implementation == "xla":
        return paged_scores_reference(q, k_pages, block_table, lengths, scale=scale)
    interpret = implementation == "pallas_interpret"
    if not interpret and resolve_backend(implementation, backend) != "tpu":
        raise NotImplementedError("paged_scores has a TPU form only: on a GPU XLA fuses the page gather into the "
                                  "scores; use implementation='xla' there")
    return _scores_tpu(q, k_pages, block_table, lengths, scale=scale, interpret=interpret,
                       prefetch_budget=_TPU_SMEM_PREFETCH_BYTES)
