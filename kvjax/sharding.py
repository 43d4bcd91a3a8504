"""Device meshes and sharding rules: data parallel over batch rows, tensor parallel over attention heads.

A kvjax mesh has two named axes (either may have size 1):

* ``data``: batch rows. Every cache array with a batch axis is split by row.
* ``model``: attention heads and the MLP's hidden dimension (tensor parallelism). Weights are split
  as Megatron does (column-parallel q/k/v and gate/up projections, row-parallel o and down
  projections; see ``kvjax.models.sharding``), and caches by KV head, so each device attends over its
  own KV heads and their query heads.

Computation runs under plain sharding annotations (GSPMD): the model's parameters and the cache are
placed with :class:`jax.sharding.NamedSharding`, and every jitted call of ``kvjax.decoding``
constrains the cache it returns to the same layout (:func:`constrain_cache`), so the layout holds
across prefill, compression and every decode step. The XLA compiler inserts the collectives (the
all-reduce after the row-parallel projections, the gather of logits for sampling).

Each method states how its per-layer state splits (``method.state_partition``, part of the method
protocol): the partition spec of every array. A state that cannot be split that way raises a clear
error naming the method instead of being silently replicated (today only calibration and Locret's
label recording). Host-memory arrays (:class:`OnHost`) keep their memory kind, split like the device
arrays. The Pallas paged and PQ kernels and the host recall of HeteroCache/SyncKV run per device under
``shard_map`` (:func:`device_block` gives a device its block inside one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (a missing axis has size 1)."""
    shape = {DATA: 1, MODEL: 1}
    seen = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"mesh entries are name=size, got {part!r} in {text!r}")
        if name not in AXES:
            raise ValueError(f"unknown mesh axis {name!r} in {text!r}; axes: {', '.join(AXES)}")
        if name in seen:
            raise ValueError(f"mesh axis {name!r} given twice in {text!r}")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {name!r} needs an integer size, got {value!r}") from None
        if size < 1:
            raise ValueError(f"mesh axis {name!r} needs a size >= 1, got {size}")
        shape[name] = size
        seen.add(name)
    return shape


def make_mesh(shape: str | Mapping[str, int] | Mesh, devices=None) -> Mesh:
    """A ``(data, model)`` mesh from ``"data=2,model=4"``, ``{"data": 2, "model": 4}`` or a ready :class:`Mesh`.

    Uses the first ``data * model`` of ``devices`` (default ``jax.devices()``: every process's devices
    in a multi-process job). A given ``Mesh`` must have exactly the axes ``data`` and ``model``.
    """
    if isinstance(shape, Mesh):
        if tuple(shape.axis_names) != AXES:
            raise ValueError(f"a kvjax mesh has the axes {AXES}, got {tuple(shape.axis_names)}")
        return shape
    if isinstance(shape, str):
        shape = parse_mesh(shape)
    unknown = set(shape) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; axes: {', '.join(AXES)}")
    sizes = tuple(int(shape.get(a, 1)) for a in AXES)
    if min(sizes) < 1:
        raise ValueError(f"mesh axis sizes must be >= 1, got {dict(zip(AXES, sizes))}")
    devices = list(jax.devices() if devices is None else devices)
    needed = math.prod(sizes)
    if needed > len(devices):
        raise ValueError(
            f"a mesh of data={sizes[0]} x model={sizes[1]} needs {needed} devices; {len(devices)} available "
            f"({devices[0].platform}). On CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "(set before jax starts)"
        )
    return Mesh(np.array(devices[:needed], dtype=object).reshape(sizes), AXES)


def axis_size(mesh: Mesh | None, name: str) -> int:
    """Size of mesh axis ``name`` (1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape[name])


def check_mesh(mesh: Mesh, *, num_heads: int, num_kv_heads: int, intermediate_size: int | None = None,
               batch: int | None = None) -> None:
    """Raise ValueError when the mesh cannot split the model's heads (or the batch) evenly."""
    model, data = axis_size(mesh, MODEL), axis_size(mesh, DATA)
    if num_kv_heads % model or num_heads % model:
        raise ValueError(f"the mesh's model axis ({model}) must divide the KV heads ({num_kv_heads}) and the query "
                         f"heads ({num_heads}): each device attends over whole KV heads")
    if intermediate_size is not None and intermediate_size % model:
        raise ValueError(f"the mesh's model axis ({model}) must divide the MLP's hidden size ({intermediate_size})")
    if batch is not None and batch % data:
        raise ValueError(f"the mesh's data axis ({data}) must divide the batch ({batch} rows); pad the batch or "
                         "use a smaller data axis")


def named(mesh: Mesh, spec: P, memory_kind: str | None = None) -> NamedSharding:
    """``NamedSharding(mesh, spec)`` (in ``memory_kind`` when given)."""
    if memory_kind is None:
        return NamedSharding(mesh, spec)
    return NamedSharding(mesh, spec, memory_kind=memory_kind)


REPLICATED = P()
ROWS_HEADS = P(DATA, MODEL)  # [B, H, ...]: rows on data, heads on model
BY_DEVICE = P((DATA, MODEL))  # leading axis in (data, model) blocks: one block per device


@dataclasses.dataclass(frozen=True)
class OnHost:
    """The partition of an array kept in ``pinned_host`` memory (each device's shard in its host's memory)."""

    spec: P


def head_blocks(mesh: Mesh | None) -> tuple[int, int]:
    """``(data, model)`` blocks of (row, KV head) pairs on ``mesh``; (1, 1) without one."""
    return (axis_size(mesh, DATA), axis_size(mesh, MODEL)) if is_split(mesh) else (1, 1)


def flatten_heads(x, mesh: Mesh | None):
    """``x[B, H, ...]`` -> ``[B * H, ...]`` with each device's (rows, heads) contiguous, in (data, model)
    block order (so :data:`BY_DEVICE` splits it by device); row by row, head by head without a mesh."""
    d, m = head_blocks(mesh)
    B, H, *rest = x.shape
    x = x.reshape(d, B // d, m, H // m, *rest).swapaxes(1, 2)
    return x.reshape(B * H, *rest)


def unflatten_heads(y, batch: int, heads: int, mesh: Mesh | None):
    """Inverse of :func:`flatten_heads`: ``[B * H, ...]`` -> ``[B, H, ...]``."""
    d, m = head_blocks(mesh)
    rest = y.shape[1:]
    y = y.reshape(d, m, batch // d, heads // m, *rest).swapaxes(1, 2)
    return y.reshape(batch, heads, *rest)


def device_block(mesh: Mesh | None, rows: int, heads: int):
    """Inside ``shard_map`` over ``mesh``: the calling device's (data, model) block index, first batch row and first
    KV head, for local blocks of ``rows`` x ``heads``; ``(0, 0, 0)`` without a multi-device mesh."""
    if not is_split(mesh):
        return 0, 0, 0
    d, m = jax.lax.axis_index(DATA), jax.lax.axis_index(MODEL)
    return d * axis_size(mesh, MODEL) + m, d * rows, m * heads


def cache_shardings(cache):
    """A pytree like ``cache`` whose array leaves are the :class:`NamedSharding` each must have.

    Raises ValueError when the cache's method keeps state that cannot be split over the mesh.
    """
    mesh = cache.spec.mesh
    layers = tuple(cache.method.state_partition(state, cache.spec) for state in cache.layers)
    artifact = jax.tree_util.tree_map(lambda _: REPLICATED, cache.artifact)
    specs = cache.replace(layers=layers, length=REPLICATED, pad=P(DATA), artifact=artifact)

    def to_sharding(spec):
        if isinstance(spec, OnHost):
            return named(mesh, spec.spec, "pinned_host")
        return named(mesh, spec)

    return jax.tree_util.tree_map(to_sharding, specs, is_leaf=lambda x: isinstance(x, (P, OnHost)))


def is_split(mesh: Mesh | None) -> bool:
    """Whether ``mesh`` has more than one device (a one-device mesh is the same as no mesh)."""
    return mesh is not None and mesh.size > 1


def constrain_cache(cache):
    """Inside jit: constrain every array of ``cache`` to its layout on the cache's mesh (no-op without one)."""
    if cache.spec is None or not is_split(cache.spec.mesh):
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache))


def place_cache(cache):
    """Outside jit: put every array of ``cache`` on the cache's mesh with its layout (no-op without one)."""
    if cache.spec is None or not is_split(cache.spec.mesh):
        return cache
    return jax.device_put(cache, cache_shardings(cache))


def place_rows(x, mesh: Mesh | None):
    """Put ``x[B, ...]`` (tokens, padding) on ``mesh`` split by row (as it is without a mesh)."""
    if not is_split(mesh):
        return x
    return jax.device_put(x, named(mesh, P(DATA)))


def shard_shapes(x: jax.Array) -> list[tuple[int, ...]]:
    """Shapes of ``x``'s per-device shards, in device order."""
    return [tuple(s.data.shape) for s in x.addressable_shards]


def not_shardable(method_name: str, reason: str):
    """The ValueError a method raises when its state cannot be split over a mesh."""
    return ValueError(f"{method_name} cannot run on a multi-device mesh yet: {reason}. Use a mesh of one device "
                      "(data=1,model=1) for it")
