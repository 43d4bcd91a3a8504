"""Row writes into several pools in place, in one kernel.

``write_rows(pools, rows, slots, sizes)``: the rows ``rows[M, D]`` come in segments, ``sizes[i]`` rows for
``pools[i][N_i, D]`` in pool order; row ``r`` goes to row ``slots[r]`` of its pool, and a slot outside ``[0, N_i)``
drops it. The pools are the kernel's outputs in place (``input_output_aliases``): nothing but the written rows moves.

Why a kernel: XLA writes each pool with a scatter of its own, one launch per pool (two per layer for keys and
values), so a decode step that moves a few rows into every layer's pools pays a launch per pool. The rows arrive in
one block (a host gather for every layer at once): taking them as one operand, the kernel needs no per-pool slice of
it either.

* GPU (Triton): one program per row of the block, writing it into its pool.
* TPU: none. A Mosaic DMA into a ``[slots, D]`` pool must start at a multiple of the sublane tile (8 rows), so a
  single row cannot be written in place by DMA; the pool would need the slot as an untiled leading dimension (as
  tpu-inference's KV-cache update kernel's ``[slots, heads, D]``).

``implementation="xla"`` is the scatters (:func:`write_rows_reference`), ``"pallas_interpret"`` the GPU form on a
CPU. Slots must be distinct within a pool (a duplicated slot's winner is unspecified, as for a scatter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvjax.pallas_kernels.backend import IMPLEMENTATIONS, resolve_backend


def write_rows_reference(pools, rows, slots, sizes):
    """The writes as XLA scatters, one per pool."""
    out, at = [], 0
    for pool, size in zip(pools, sizes):
        slot = slots[at:at + size]
        slot = jnp.where(slot < 0, pool.shape[0], slot)  # a negative index would count from the end
        out.append(pool.at[slot].set(rows[at:at + size].astype(pool.dtype), mode="drop"))
        at += size
    return tuple(out)


def check_rows(pools, rows, slots, sizes) -> None:
    """``ValueError`` unless ``pools`` are ``[N_i, D]``, ``rows`` is ``[sum(sizes), D]`` and ``slots`` int
    ``[sum(sizes)]``, one size per pool."""
    if not pools or len(sizes) != len(pools):
        raise ValueError(f"one size per pool: {len(pools)} pools, {len(sizes)} sizes")
    if any(not isinstance(s, (int, np.integer)) or s < 0 for s in sizes):
        raise ValueError(f"sizes must be row counts >= 0, got {sizes}")
    D = rows.shape[-1] if rows.ndim == 2 else None
    if rows.ndim != 2 or rows.shape[0] != sum(sizes):
        raise ValueError(f"rows must be [sum(sizes)={sum(sizes)}, D]; got {rows.shape}")
    if slots.shape != (rows.shape[0],) or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots must be int [{rows.shape[0]}]; got {slots.dtype} {slots.shape}")
    bad = [i for i, p in enumerate(pools) if p.ndim != 2 or p.shape[1] != D]
    if bad:
        raise ValueError(f"pools {bad} are not [N, D={D}]: {[pools[i].shape for i in bad]}")


def _gpu_kernel(slots_ref, rows_ref, *refs, sizes: tuple):
    out_refs = refs[len(sizes):]
    r = pl.program_id(0)
    slot = slots_ref[r]
    start = 0
    for size, out_ref in zip(sizes, out_refs):
        if size:

            @pl.when((r >= start) & (r < start + size) & (slot >= 0) & (slot < out_ref.shape[0]))
            def _(out_ref=out_ref):
                out_ref[pl.ds(slot, 1), :] = rows_ref[pl.ds(r, 1), :].astype(out_ref.dtype)

        start += size


def _rows_gpu(pools, rows, slots, sizes, *, interpret: bool):
    if not rows.shape[0]:  # nothing to write (and no program to read a slot)
        return pools
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton  # GPU-only module, import lazily

        compiler_params = pltriton.CompilerParams(num_warps=1, num_stages=1)
    n = len(pools)
    return tuple(pl.pallas_call(
        functools.partial(_gpu_kernel, sizes=tuple(int(s) for s in sizes)),
        grid=(rows.shape[0],),
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools],
        input_output_aliases={2 + i: i for i in range(n)},
        compiler_params=compiler_params,
        interpret=interpret,
        name="write_rows_gpu",
    )(slots, rows, *pools))


def write_rows(pools, rows, slots, sizes, *, implementation: str = "xla", backend: str | None = None) -> tuple:
    """``pools`` with ``rows[M, D]`` written at ``slots[M]``: the first ``sizes[0]`` rows into ``pools[0]``, the
    next ``sizes[1]`` into ``pools[1]``... (module docstring). ``implementation``: ``"xla"`` (a scatter per pool),
    ``"pallas"`` (one kernel; the running platform's form, or ``backend``'s) or ``"pallas_interpret"`` (the GPU form on
    a CPU). Under ``jit`` with the pools donated, they are updated in place."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; allowed: {IMPLEMENTATIONS}")
    pools, sizes = tuple(pools), tuple(sizes)
    check_rows(pools, rows, slots, sizes)
    if implementation == "pallas" and resolve_backend(implementation, backend) == "tpu":
        raise NotImplementedError("write_rows has no TPU form: Mosaic DMAs only tile-aligned rows of a pool laid out "
                                  "[slots, D]; use implementation='xla' on a TPU")
    slots = jnp.asarray(slots, jnp.int32)
    if implementation == "xla":
        return write_rows_reference(pools, rows, slots, sizes)
    return _rows_gpu(pools, rows, slots, sizes, interpret=implementation == "pallas_interpret")
