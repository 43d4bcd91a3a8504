"""Host tier: full KV of chosen (row, KV head) pairs in ``pinned_host`` memory, recalled inside jit.

Methods that keep only part of a head on the device (HeteroCache, SyncKV, HCAttention) park the
head's full KV here and bring selected tokens back to device memory inside one jitted decode loop
(``lax.while_loop``), with no host synchronisation.

Layout
------
:class:`HostKV` holds ``k, v[n_heads, S_pad, D]`` in ``pinned_host`` memory, one row per token,
``S_pad`` = prompt length rounded up to ``page_size`` (padding rows are zero). Head ``i`` is the
(row, KV head) pair ``heads[i]``. A page ``p`` is rows ``p*page_size .. (p+1)*page_size - 1``, so the
same buffer serves token-granular (:func:`recall`) and page-granular (:func:`recall_pages`) recall.

Recall mechanism (default ``mechanism="host_gather"``)
------------------------------------------------------
One ``compute_on("device_host")`` region per call gathers the selected rows of every stored head
(K and V stacked) out of the host arrays into one ``[2, n_heads, R, D]`` block whose memory space is
declared ``Device``: the host computation writes the block and the runtime moves it to the device as
**one** transfer. The index array (a few KB) is the region's only device input; rows past ``count``
are masked to zero on the device afterwards. In HLO this is one ``call`` with
``_xla_compute_type="host"`` followed by one ``annotate_device_placement`` to ``"device"``; no gather
or arithmetic touches a host array outside the host region.

Why this mechanism (CPU: observed; GPU: read from XLA's source and jax's tests). On an H200 with
jax 0.11.2 this module's tests pass compiled, but the recall of HeteroCache and SyncKV did not
overlap decoding there (docs/RESULTS.md, "On a GPU"): a decode step with recall cost 5.5–8.5 ms more
than one without, about what the host gather itself costs. Those programs were compiled with XLA's
default schedule, which overlaps nothing (below).

* XLA:GPU runs a host region as ``HostExecuteStartThunk``/``HostExecuteDoneThunk``
  (``xla/backends/gpu/runtime/host_execute_thunk.cc``): the start thunk copies device arguments (our
  indices) to host and schedules the XLA:CPU-compiled gather on a host thread pool, reading the
  ``pinned_host`` K/V in place. When it finishes, the result is copied with one ``Memcpy`` on the
  host-to-device stream. Compute waits for that copy only at the done thunk, just before the first
  use, so device work between issue and use overlaps the gather and the copy. jax's own
  ``tests/memories_test.py::ComputeOffload`` runs these regions on GPU (``test_offload_take_host``:
  ``jnp.take`` inside ``compute_on``; ``test_compute_on_host_shared_sharding``: a host array plus a
  device array ``device_put`` to host inside the region, the pattern used here; ``test_scan_offload``:
  inside a loop). That test class skips CPU, but this module's tests pass on CPU with jax 0.10.2
  (``compute_on2``) and jax 0.11.2 (``compute_on``).
* Only with XLA:GPU's latency-hiding scheduler, which is **off by default** (jax 0.10.2 and 0.11.2,
  found by compiling for an H100 without one: ``python -m kvjax.evals.gpu_schedule``), does XLA place the
  start early and the done late; without it the two are scheduled back to back and nothing overlaps,
  whatever the program's order. kvjax's decode programs turn it on for a GPU
  (:data:`kvjax.decoding.GPU_DECODE_COMPILER_OPTIONS`); a program of your own needs
  ``jax.jit(..., compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True})`` at top level or
  ``XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true``.
* Caveat (same source): the done thunk blocks the thread that launches GPU work until the host
  gather has run. The gather starts only after the device work enqueued before ``issue`` is done.
  The copy is hidden only when the device work between ``issue`` and first use takes longer than
  the gather plus the copy. So issue as early as the indices are known (the prefetch pattern).
* Observed on CPU (same RAM, so this measures overhead only): 8 heads x 256 rows, D=128, bf16.
  The old per-row ``fori_loop`` of ``device_put``s took 41.7 ms per call (1.05 s to compile).
  ``host_gather`` took 0.26 ms (0.17 s). ``slices`` over 16 pages per head took 1.1 ms, and 4.1 s
  to compile.
* The API differs by version: jax <= 0.10 has ``compute_on2(f, *, compute_type,
  out_memory_spaces)`` and a context-manager ``compute_on(str)``; jax 0.11+ renamed the functional
  form to ``compute_on``. :func:`_device_host` picks whichever has ``out_memory_spaces``.

Alternatives tried (jax 0.10.2 CPU) and why they were not chosen:

* A gather on the host array (``x[idx]``, ``jnp.take``, ``vmap(dynamic_slice)``, which batches to a
  gather) with device indices fails at trace time: "memory_space of all inputs passed to `gather`
  must be the same".
* The same gather with the indices first ``device_put`` to host, outside any ``compute_on``: runs on
  CPU (it is the same RAM). On GPU, XLA's host offloader either rejects device compute on
  host-memory operands or turns it into slow implicit host compute with a warning, and it can fail
  a CHECK (openxla/xla#34565, scatter). Not relied on.
* ``dynamic_slice`` of the host array then ``device_put`` to device (the ``DESIGN.md`` pattern, and
  the old ``kvjax.paged.recall_rows``): correct and supported by XLA's host offloader on GPU, but
  each slice is its own transfer. Arbitrary rows or pages of several heads cannot be one
  rectangular slice. That is ``n_heads * R`` transfers (unrolled, or a sequential ``fori_loop`` in
  the old code) where one is possible. Kept as ``mechanism="slices"``, a fallback for a
  jaxlib whose GPU plugin cannot run ``device_host`` regions; use it with pages and small ``R``
  (each slice is an HLO op: compile time grows with ``n_heads * R``).
* Concatenating those slices on the host before one ``device_put`` is host compute outside a
  ``compute_on`` region, which has the same problem as above.

Prefetch pattern
----------------
The value of step ``t+1``'s recall does not depend on step ``t+1``. Issue it in step ``t`` and
carry it in the loop state::

    def body(carry):
        t, pf, ... = carry
        k_rec, v_rec = take(pf)                    # recalled in the previous iteration
        ...  # attention etc. of step t using k_rec, v_rec; choose idx/count for step t+1
        pf = issue(host, idx_next, count_next)     # as early as idx_next is known
        ...  # rest of step t overlaps the host gather + copy
        return t + 1, pf, ...

    carry0 = (0, issue(host, idx_0, count_0), ...)   # or empty_prefetch(host, R) for step 0

:class:`Prefetch` is a pytree. With the latency-hiding scheduler (above), XLA may start the host computation
as soon as its indices are ready and wait for it (the done thunk, the only wait) only before the loop-carried
output is needed; without it, it waits at once.

Paged pools
-----------
:func:`write_recalled` scatters recalled rows into the device page pools of ``kvjax.paged``
(``k_pages, v_pages[num_pages, page_size, D]``, ``block_table[B, Hkv, max_pages]``).

These functions see one device's arrays: on a mesh, callers run them per device under ``shard_map``
(:mod:`kvjax.methods.recall`), or on arrays split by the compiler's annotations (HCAttention's values),
whose batch axis is each device's own host heads. On CPU ``pinned_host`` and ``device`` are the same
RAM: the tests here show correctness and the transfer structure, not speed.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device
MECHANISMS = ("host_gather", "slices")


@struct.dataclass
class HostKV:
    """Full KV of chosen (row, KV head) pairs in ``pinned_host`` memory (see module docstring).

    ``k, v[n_heads, S_pad, D]``: head ``i`` holds (row, KV head) ``heads[i]``. ``length`` is the number
    of stored tokens ``S``; rows ``S .. S_pad-1`` are zero padding up to a multiple of ``page_size``.
    ``k_scales, v_scales[n_heads, S_pad]`` (float32, ``pinned_host``): the rows are stored quantized (int8,
    float8_e4m3fn; :mod:`kvjax.kv_quantization`) with these per-token scales; None for rows stored as they are.
    """

    k: jax.Array
    v: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None
    heads: tuple = struct.field(pytree_node=False, default=())
    length: int = struct.field(pytree_node=False, default=0)
    page_size: int = struct.field(pytree_node=False, default=16)

    @property
    def n_heads(self) -> int:
        """Heads held (the leading axis of ``k`` and ``v``)."""
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        """Whole pages of ``page_size`` rows per head."""
        return self.k.shape[1] // self.page_size

    @property
    def quantized(self) -> bool:
        """Whether the rows are stored quantized with per-token scales."""
        return self.k_scales is not None

    def arrays(self) -> tuple:
        """The host arrays: ``(k, v)``, then ``(k_scales, v_scales)`` when quantized."""
        return (self.k, self.v) + ((self.k_scales, self.v_scales) if self.quantized else ())

    def with_arrays(self, *arrays) -> "HostKV":
        """This tier with :meth:`arrays` replaced (e.g. one device's shards under ``shard_map``)."""
        names = ("k", "v", "k_scales", "v_scales")[:len(self.arrays())]
        return self.replace(**dict(zip(names, arrays, strict=True)))


class RecalledRows(NamedTuple):
    """Rows recalled to device memory: ``k, v[n_heads, R, D]`` (zero past each head's count) and, from a quantized
    tier, their scales ``k_scales, v_scales[n_heads, R]`` (None from a float tier)."""

    k: jax.Array
    v: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None


@struct.dataclass
class Prefetch:
    """A recall issued ahead of use: device ``k, v[n_heads, R', D]`` plus the ``idx``/``count`` it was issued for;
    ``k_scales, v_scales[n_heads, R']`` the rows' scales when the host tier is quantized (else None)."""

    k: jax.Array
    v: jax.Array
    idx: jax.Array
    count: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None


def offload(k, v, heads: Sequence[tuple[int, int]], *, page_size: int = 16) -> HostKV:
    """Copy ``k, v[B, Hkv, S, D]`` of ``heads`` [(row, kv_head), ...] to ``pinned_host`` memory.

    Works eagerly and inside jit (``device_put`` to the host memory space; inside jit the result
    carries the host memory kind when returned). ``heads`` and ``page_size`` are static.
    """
    if k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"offload: k, v must both be [B, Hkv, S, D]; got {k.shape} and {v.shape}")
    B, Hkv, S, _ = k.shape
    heads = tuple((int(b), int(h)) for b, h in heads)
    if not heads:
        raise ValueError("offload: heads is empty")
    bad = [(b, h) for b, h in heads if not (0 <= b < B and 0 <= h < Hkv)]
    if bad:
        raise ValueError(f"offload: heads {bad} outside rows [0, {B}) x KV heads [0, {Hkv})")
    if len(set(heads)) != len(heads):
        raise ValueError(f"offload: duplicate (row, kv_head) pairs in {heads}")
    if int(page_size) < 1:
        raise ValueError(f"offload: page_size must be >= 1, got {page_size}")
    page_size = int(page_size)
    rows = np.asarray([b for b, _ in heads], np.int32)
    hs = np.asarray([h for _, h in heads], np.int32)
    pad = (-S) % page_size

    def stage(x):
        x = x[rows, hs]  # [n_heads, S, D], still in device memory
        if pad:
            x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
        return jax.device_put(x, HOST)

    return HostKV(k=stage(k), v=stage(v), heads=heads, length=S, page_size=page_size)


def _device_host(fn):
    """``fn`` as a ``device_host`` computation whose outputs are in device memory (jax 0.10 and 0.11+)."""
    from jax.experimental import compute_on as co

    for name in ("compute_on", "compute_on2"):  # 0.11+: compute_on; <= 0.10: compute_on2
        api = getattr(co, name, None)
        if api is not None and "out_memory_spaces" in inspect.signature(api).parameters:
            return api(fn, compute_type="device_host", out_memory_spaces=DEVICE)
    raise NotImplementedError(
        "this jax has no functional compute_on(..., out_memory_spaces=...); use mechanism='slices'"
    )


def _check_request(host: HostKV, idx, count, pages: bool):
    """Validate a recall request; returns ``(idx, count, limit)``, limit = exclusive bound of ``idx``."""
    if not isinstance(host, HostKV):
        raise TypeError(f"expected a HostKV, got {type(host).__name__}")
    idx = idx if hasattr(idx, "shape") else np.asarray(idx)
    count = count if hasattr(count, "shape") else np.asarray(count)
    limit, what = (host.num_pages, "pages") if pages else (host.length, "idx")
    n = host.n_heads
    if getattr(idx, "ndim", None) != 2 or idx.shape[0] != n:
        raise ValueError(f"{what} must be int [n_heads={n}, R]; got shape {getattr(idx, 'shape', None)}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"{what} must be an integer array, got {idx.dtype}")
    if getattr(count, "shape", None) != (n,):
        raise ValueError(f"count must be int [n_heads={n}]; got shape {getattr(count, 'shape', None)}")
    if not jnp.issubdtype(count.dtype, jnp.integer):
        raise ValueError(f"count must be an integer array, got {count.dtype}")
    # Static checks where the values are known (not traced).
    if not isinstance(idx, jax.core.Tracer) and not isinstance(count, jax.core.Tracer):
        idx_np, count_np = np.asarray(idx), np.asarray(count)
        R = idx_np.shape[1]
        if ((count_np < 0) | (count_np > R)).any():
            raise ValueError(f"count must be in [0, R={R}]; got {count_np.tolist()}")
        live = np.arange(R)[None, :] < count_np[:, None]
        out = live & ((idx_np < 0) | (idx_np >= limit))
        if out.any():
            h, r = map(int, np.argwhere(out)[0])
            raise ValueError(
                f"{what}[{h}, {r}] = {int(idx_np[h, r])} is outside [0, {limit}) "
                f"(stored {'pages' if pages else 'tokens'} of head {host.heads[h]})"
            )
    return idx, count, limit


def _recall(host: HostKV, idx, count, *, block: int, limit: int, mechanism: str):
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
    n, R = idx.shape
    D = host.k.shape[-1]
    # Entries past count may be garbage: point them at block 0 (their rows are zeroed below).
    safe, live = _live_ids(idx, count, limit)

    if host.quantized:
        if mechanism != "host_gather":
            raise ValueError("a quantized host tier is recalled by mechanism='host_gather' only")

        def gather_packed(k, v, ks, vs, ids):
            ids = jax.device_put(ids, HOST)
            return jnp.stack([pack_rows(take_blocks(x, ids, block), take_blocks(s[..., None], ids, block)[..., 0])
                              for x, s in ((k, ks), (v, vs))])

        kv = _device_host(gather_packed)(*host.arrays(), safe)  # ONE transfer: [2, n, R*block, D + 4] bytes
        (k_out, k_s), (v_out, v_s) = (unpack_rows(kv[i], host.k.dtype) for i in range(2))
        keep = jnp.repeat(live, block, axis=1)  # [n, R*block]
        return RecalledRows(jnp.where(keep[..., None], k_out, 0), jnp.where(keep[..., None], v_out, 0),
                            jnp.where(keep, k_s, 0), jnp.where(keep, v_s, 0))

    if mechanism == "host_gather":

        def gather(k, v, ids):
            ids = jax.device_put(ids, HOST)  # same memory space as k, v for the gather
            return jnp.stack([take_blocks(k, ids, block), take_blocks(v, ids, block)])

        kv = _device_host(gather)(host.k, host.v, safe)  # ONE transfer: [2, n, R*block, D]
        k_out, v_out = kv[0], kv[1]
    else:  # "slices": one dynamic_slice + device_put per (head, block); n * R transfers per array
        def fetch(x):
            parts = [
                jax.device_put(lax.dynamic_slice(x, (h, safe[h, r] * block, 0), (1, block, D)), DEVICE)
                for h in range(n)
                for r in range(R)
            ]
            return jnp.concatenate(parts, axis=1).reshape(n, R * block, D)

        k_out, v_out = fetch(host.k), fetch(host.v)

    keep = jnp.repeat(live, block, axis=1)[..., None]  # [n, R*block, 1]
    return RecalledRows(jnp.where(keep, k_out, 0), jnp.where(keep, v_out, 0))


def pack_rows(rows, scales):
    """Quantized ``rows[..., D]`` (one-byte dtype) and their float32 ``scales[...]`` as one byte array
    ``[..., D + 4]`` (bit casts, no arithmetic): one block, one transfer, for rows and scales of one recall."""
    return jnp.concatenate([lax.bitcast_convert_type(rows, jnp.uint8),
                            lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)], axis=-1)


def unpack_rows(packed, dtype):
    """:func:`pack_rows`' inverse: ``(rows[..., D] in dtype, scales[...] float32)`` of ``packed[..., D + 4]``."""
    return (lax.bitcast_convert_type(packed[..., :-4], dtype),
            lax.bitcast_convert_type(packed[..., -4:], jnp.float32))


def take_blocks(x, ids, block: int = 1):
    """Blocks ``ids[n, R]`` of ``block`` rows of each head of ``x[n, S_pad, D]`` -> ``[n, R * block, D]`` (a gather;
    call it inside a ``device_host`` region when ``x`` lives in host memory)."""
    n, _, D = x.shape
    R = ids.shape[1]
    blocks = x.reshape(n, -1, block, D)
    return jax.vmap(lambda a, i: a[i])(blocks, ids).reshape(n, R * block, D)


def to_host(x) -> jax.Array:
    """``x`` in ``pinned_host`` memory (eagerly or inside jit, where the result keeps the host memory kind)."""
    return jax.device_put(x, HOST)


def _live_ids(idx, count, limit: int):
    """``idx`` with entries at positions ``>= count`` (and out-of-range values) replaced by valid row 0, and the live mask."""
    R = idx.shape[1]
    live = jnp.arange(R, dtype=jnp.int32)[None, :] < jnp.asarray(count, jnp.int32)[:, None]
    return jnp.where(live, jnp.clip(jnp.asarray(idx, jnp.int32), 0, limit - 1), 0), live


def gather_rows(x_host, idx, count):
    """Rows ``idx[n, R]`` of a host array ``x_host[n, S, D]`` brought to the device in **one** transfer.

    The gather runs in a ``device_host`` region (as :func:`recall`); rows at positions ``>= count[i]`` are
    zero. Returns ``[n, R, D]`` in device memory.
    """
    safe, live = _live_ids(idx, count, x_host.shape[1])
    rows = _device_host(lambda x, ids: take_blocks(x, jax.device_put(ids, HOST)))(x_host, safe)
    return jnp.where(live[..., None], rows, 0)


def float_rows(x, ids=None, scales=None):
    """Rows ``ids[n, R]`` of ``x[n, S, D]`` (every row when None) in float32, times their ``scales[n, S, 1]`` when
    the rows are stored quantized (:mod:`kvjax.kv_quantization`); inside a host region the rows never leave it."""
    rows = x if ids is None else take_blocks(x, ids)
    rows = rows.astype(jnp.float32)
    if scales is not None:
        rows = rows * (scales if ids is None else take_blocks(scales, ids))
    return rows


def weighted_rows_on_host(x_host, idx, weights, scales=None):
    """``out[i, q] = sum_r weights[i, q, r] * x_host[i, idx[i, r]]`` computed **where the rows live** (host).

    Only ``idx[n, R]`` and ``weights[n, Q, R]`` go to the host and ``out[n, Q, D]`` (float32) comes back:
    the rows themselves never move. Entries with zero weight contribute nothing (their ``idx`` may be
    any valid row). ``scales[n, S, 1]`` (host): the rows are stored quantized, dequantized on the host.
    """
    S = x_host.shape[1]

    def weighted(x, ids, w, *scales):
        ids, w = jax.device_put(ids, HOST), jax.device_put(w, HOST)
        rows = float_rows(x, jnp.clip(ids, 0, S - 1), *scales)
        return jnp.einsum("nqr,nrd->nqd", w.astype(jnp.float32), rows)

    extra = () if scales is None else (scales,)
    return _device_host(weighted)(x_host, jnp.asarray(idx, jnp.int32), weights, *extra)


def weighted_union_on_host(x_host, weights, sizes: tuple[int, ...], which, scales=None):
    """``out[i, q] = sum_s weights[i, q, s] * x_host[i, s]`` computed **where the rows live** (host), over only
    ``R = sizes[which]`` rows per head: each head's rows of nonzero weight, then rows of zero weight up to ``R``.

    Exact when no head has more than ``R`` rows of nonzero weight. ``weights[n, Q, S]`` and the int scalar ``which``
    go to the host and ``out[n, Q, D]`` (float32) comes back: the rows never move. The size is a conditional of the
    host computation, so the device never waits to learn it (a conditional of the device program would be a host
    synchronisation on a GPU). libtpu's host compiler rejects a conditional in a host computation: on a TPU choose
    the size in the device program (a TPU runs conditionals without the host) and call :func:`weighted_rows_on_host`.
    ``scales[n, S, 1]`` (host): the rows are stored quantized, dequantized on the host.
    """
    S = x_host.shape[1]
    if not sizes or any(not 1 <= R <= S for R in sizes):
        raise ValueError(f"sizes must be row counts in [1, {S}], got {sizes}")

    def weighted(x, w, which, *scales):
        w = jax.device_put(w, HOST).astype(jnp.float32)

        def over(R: int):
            def summed():
                if R == S:
                    return jnp.einsum("nqs,nsd->nqd", w, float_rows(x, None, *scales))
                ids = lax.top_k((w != 0).any(1).astype(jnp.float32), R)[1]  # [n, R]: the nonzero rows first
                rows = float_rows(x, ids, *scales)
                return jnp.einsum("nqr,nrd->nqd", jax.vmap(lambda a, i: a[:, i])(w, ids), rows)
            return summed

        if len(sizes) == 1:
            return over(sizes[0])()
        return lax.switch(jax.device_put(which, HOST), [over(R) for R in sizes])

    extra = () if scales is None else (scales,)
    return _device_host(weighted)(x_host, weights, jnp.asarray(which, jnp.int32), *extra)


def recall(host: HostKV, idx, count, *, mechanism: str = "host_gather"):
    """Bring token rows of every stored head to device memory (inside or outside jit).

    Args:
      host: the host tier.
      idx: int ``[n_heads, R]`` row (token slot) ids per head; entries at positions ``>= count[h]``
        are ignored. Live entries must lie in ``[0, host.length)``. This is checked when ``idx`` is
        concrete; traced values are clipped.
      count: int ``[n_heads]`` live entries per head, ``0 <= count <= R``.
      mechanism: ``"host_gather"`` (one transfer per call) or ``"slices"`` (fallback, see module doc).

    Returns:
      :class:`RecalledRows`: ``k, v[n_heads, R, D]`` in device memory, rows ``>= count[h]`` zero; from a quantized
      tier (``host.quantized``) ``k, v`` in its stored dtype and their scales ``k_scales, v_scales[n_heads, R]``,
      the four from one transfer (:func:`pack_rows`).
    """
    idx, count, limit = _check_request(host, idx, count, pages=False)
    return _recall(host, idx, count, block=1, limit=limit, mechanism=mechanism)


def recall_many(hosts: Sequence[HostKV], idxs: Sequence, counts: Sequence) -> list[RecalledRows]:
    """:func:`recall` of several host tiers (e.g. every layer's) in **one** host computation and one transfer: one
    host call where one per tier would each wait for the device work enqueued before it, the masking of rows past
    ``count`` done on the host, and every tier's rows in one block the device slices. Returns a
    :class:`RecalledRows` per tier (``[n_heads, R, D]`` in device memory, zero past ``count``)."""
    rows, out, at = recall_block(hosts, idxs, counts), [], 0
    for h, i in zip(hosts, idxs):
        size = i.shape[0] * i.shape[1]
        kv = [rows[at + x * size:at + (x + 1) * size].reshape(*i.shape, rows.shape[-1]) for x in range(2)]
        if h.quantized:
            (k, ks), (v, vs) = (unpack_rows(x, h.k.dtype) for x in kv)
            out.append(RecalledRows(k, v, ks, vs))
        else:
            out.append(RecalledRows(*kv))
        at += 2 * size
    return out


def recall_block(hosts: Sequence[HostKV], idxs: Sequence, counts: Sequence) -> jax.Array:
    """:func:`recall_many`'s one block in device memory, unsliced: ``[sum over tiers of 2 * n_heads * R, D]``, each
    tier's keys then its values, row by row of its ``idx`` (zero past ``count``). Quantized tiers: each row with its
    scale, ``[..., D + 4]`` bytes (:func:`pack_rows`; :func:`unpack_rows` splits them)."""
    if not (len(hosts) == len(idxs) == len(counts)) or not hosts:
        raise ValueError(f"one idx and count per host tier: {len(hosts)} tiers, {len(idxs)} idx, {len(counts)} count")
    if len({(h.k.dtype, h.k.shape[-1], h.quantized) for h in hosts}) != 1:
        raise ValueError("every host tier of one recall must have the same dtype and head dimension")
    checked = [_check_request(h, i, c, pages=False) for h, i, c in zip(hosts, idxs, counts)]
    n, D = len(hosts), hosts[0].k.shape[-1]
    # every tier's ids and counts in one block: one device-to-host copy (one kernel writes it) instead of two per tier
    request = jnp.concatenate([jnp.asarray(x, jnp.int32).reshape(-1) for i, c, _ in checked for x in (i, c)])

    per = len(hosts[0].arrays())  # host arrays per tier: k, v (and their scales)

    def gather(*args):
        out, at = [], 0
        request = jax.device_put(args[per * n], HOST)
        for j, (i, c, limit) in enumerate(checked):
            arrays = [args[x * n + j] for x in range(per)]
            ids = request[at:at + i.size].reshape(i.shape)
            count = request[at + i.size:at + i.size + c.size]
            at += i.size + c.size
            live = jax.device_put(jnp.arange(ids.shape[1], dtype=jnp.int32), HOST)[None, :] < count[:, None]
            safe = jnp.clip(ids, 0, limit - 1) * live.astype(ids.dtype)  # products: no constant in device memory
            if per == 2:
                out += [(take_blocks(x, safe) * live[..., None].astype(x.dtype)).reshape(-1, D) for x in arrays]
                continue
            # quantized: each row with its scale, as bytes (zeros past count, as the rows)
            rows = [pack_rows(take_blocks(x, safe), take_blocks(sc[..., None], safe)[..., 0])
                    for x, sc in zip(arrays[:2], arrays[2:])]
            out += [(r * live[..., None].astype(r.dtype)).reshape(-1, r.shape[-1]) for r in rows]
        return jnp.concatenate(out)

    return _device_host(gather)(*[a for x in range(per) for a in (h.arrays()[x] for h in hosts)], request)


def recall_pages(host: HostKV, pages, count, *, mechanism: str = "host_gather"):
    """Page-granular :func:`recall`: whole pages of ``host.page_size`` tokens.

    ``pages[n_heads, P]`` are page ids in ``[0, host.num_pages)`` (``count`` counts pages). Returns
    :class:`RecalledRows` with ``k, v[n_heads, P * page_size, D]``: page ``j`` of head ``h`` occupies rows
    ``j*page_size .. (j+1)*page_size - 1``. Pages ``>= count[h]`` and the padding past
    ``host.length`` in the last page are zero.
    """
    pages, count, limit = _check_request(host, pages, count, pages=True)
    return _recall(host, pages, count, block=host.page_size, limit=limit, mechanism=mechanism)


def issue(host: HostKV, idx, count, *, pages: bool = False, mechanism: str = "host_gather") -> Prefetch:
    """Start a recall now and return it as a :class:`Prefetch` to carry in the loop state.

    Use it for step ``t+1`` while step ``t`` computes (see the module docstring). ``pages`` selects
    :func:`recall_pages` instead of :func:`recall`.
    """
    fn = recall_pages if pages else recall
    rows = fn(host, idx, count, mechanism=mechanism)
    return Prefetch(rows.k, rows.v, jnp.asarray(idx, jnp.int32), jnp.asarray(count, jnp.int32), rows.k_scales,
                    rows.v_scales)


def take(prefetch: Prefetch):
    """Recalled ``(k, v)`` of a :class:`Prefetch` issued in an earlier step."""
    return prefetch.k, prefetch.v


def empty_prefetch(host: HostKV, r: int, *, pages: bool = False) -> Prefetch:
    """An all-zero :class:`Prefetch` with ``count = 0``, an initial loop state of the right shape."""
    n, D = host.n_heads, host.k.shape[-1]
    rows = r * (host.page_size if pages else 1)
    z = jnp.zeros((n, rows, D), host.k.dtype)
    scales = (jnp.zeros((n, rows), jnp.float32),) * 2 if host.quantized else ()
    return Prefetch(z, z, jnp.zeros((n, r), jnp.int32), jnp.zeros((n,), jnp.int32), *scales)


def write_recalled(k_pages, v_pages, block_table, recalled_k, recalled_v, heads, dst_start, count):
    """Scatter recalled rows into device page pools; returns the new ``(k_pages, v_pages)``.

    Row ``r`` of recalled head ``i`` goes to logical slot ``dst_start[i] + r`` of the (row, KV head)
    pair ``heads[i]``, i.e. page ``block_table[row, kv_head, slot // page_size]`` at offset
    ``slot % page_size``. Rows with ``r >= count[i]``, or slots past the head's block table, are
    dropped.

    Args:
      k_pages, v_pages: ``[num_pages, page_size, D]`` pools.
      block_table: int ``[B, Hkv, max_pages]``.
      recalled_k, recalled_v: ``[n_heads, R, D]`` (e.g. from :func:`recall` or :func:`take`).
      heads: static ``[(row, kv_head), ...]`` of length ``n_heads`` (usually ``host.heads``).
      dst_start: int scalar or ``[n_heads]``, first destination slot per head.
      count: int ``[n_heads]`` rows to write per head.
    """
    if k_pages.ndim != 3 or v_pages.shape != k_pages.shape:
        raise ValueError(f"pools must both be [num_pages, page_size, D]; got {k_pages.shape}, {v_pages.shape}")
    if block_table.ndim != 3:
        raise ValueError(f"block_table must be [B, Hkv, max_pages]; got {block_table.shape}")
    num_pages, ps, D = k_pages.shape
    B, Hkv, max_pages = block_table.shape
    heads = tuple((int(b), int(h)) for b, h in heads)
    n = len(heads)
    if recalled_k.ndim != 3 or recalled_v.shape != recalled_k.shape or recalled_k.shape[0] != n:
        raise ValueError(
            f"recalled k, v must both be [n_heads={n}, R, D]; got {recalled_k.shape}, {recalled_v.shape}"
        )
    if recalled_k.shape[2] != D:
        raise ValueError(f"recalled head dim {recalled_k.shape[2]} != pool head dim {D}")
    bad = [(b, h) for b, h in heads if not (0 <= b < B and 0 <= h < Hkv)]
    if bad:
        raise ValueError(f"heads {bad} outside the block table's rows [0, {B}) x KV heads [0, {Hkv})")
    if getattr(count, "shape", None) != (n,):
        raise ValueError(f"count must be int [n_heads={n}]; got shape {getattr(count, 'shape', None)}")
    rows = jnp.asarray([b for b, _ in heads], jnp.int32)
    hs = jnp.asarray([h for _, h in heads], jnp.int32)
    return scatter_recalled(k_pages, v_pages, block_table, recalled_k, recalled_v, rows, hs, dst_start, count)


def scatter_recalled(k_pages, v_pages, block_table, recalled_k, recalled_v, rows, hs, dst_start, count):
    """:func:`write_recalled` without its checks, the (row, KV head) pairs given as int arrays ``rows, hs[n_heads]``
    (traced values allowed: a device's local pairs under ``shard_map``)."""
    n, R = recalled_k.shape[:2]
    start = jnp.broadcast_to(jnp.asarray(dst_start, jnp.int32), (n,))
    slots = start[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]  # [n, R] logical slots
    return scatter_to_slots(k_pages, v_pages, block_table, recalled_k, recalled_v, rows, hs, slots, count)


def pool_rows(num_pages: int, page_size: int, block_table, rows, hs, slots, count=None):
    """Where recalled rows go in a pool flattened to ``[num_pages * page_size, D]``: row ``r`` of recalled head ``i``
    (the (row, KV head) pair ``rows[i], hs[i]``) at logical slot ``slots[i, r]``; ``[n_heads * R]`` int32, with
    ``num_pages * page_size`` (outside the pool: dropped) for rows past ``count[i]`` (if given) or slots outside
    the table."""
    ps, max_pages = page_size, block_table.shape[-1]
    j = jnp.asarray(slots, jnp.int32)
    ok = (j >= 0) & (j < max_pages * ps)
    if count is not None:
        ok &= jnp.arange(j.shape[1])[None, :] < jnp.asarray(count, jnp.int32)[:, None]
    page = block_table[rows[:, None], hs[:, None], jnp.clip(j // ps, 0, max_pages - 1)]  # [n, R]
    return jnp.where(ok, page * ps + j % ps, num_pages * ps).reshape(-1)


def scatter_to_slots(k_pages, v_pages, block_table, recalled_k, recalled_v, rows, hs, slots, count, *, scales=()):
    """As :func:`scatter_recalled`, row ``r`` of recalled head ``i`` going to any logical slot ``slots[i, r]``
    (int ``[n_heads, R]``; distinct within a head) instead of consecutive ones. ``scales``: quantized pools'
    ``(k_scales, v_scales[num_pages, page_size], recalled k_scales, v_scales[n_heads, R])``, written at the same
    slots; then returns ``(k_pages, v_pages, k_scales, v_scales)``."""
    num_pages, ps, D = k_pages.shape
    n, R = recalled_k.shape[:2]
    n_slots = num_pages * ps
    flat = pool_rows(num_pages, ps, block_table, rows, hs, slots, count)

    def write(pool, x):
        upd = x.reshape(n * R, -1).astype(pool.dtype)
        return pool.reshape(n_slots, -1).at[flat].set(upd, mode="drop").reshape(pool.shape)

    out = (write(k_pages, recalled_k), write(v_pages, recalled_v))
    if scales:
        k_scales, v_scales, recalled_ks, recalled_vs = scales
        out += (write(k_scales, recalled_ks), write(v_scales, recalled_vs))
    return out
