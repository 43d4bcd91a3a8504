"""The immutable KV-cache pytree passed into and returned from every jitted model call.

A :class:`Cache` holds one state per layer (whatever pytree its compression method defines), the
number of cache *slots* written so far and each row's left padding. Slots are the sequence
positions of the padded batch: row ``b`` holds real tokens from slot ``pad[b]`` on, and its token
at slot ``s`` has position ``s - pad[b]``. All rows share the slot counter, so a batch decodes in
lock step. Static facts (the method and its hyper-parameters, capacities) are not pytree leaves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class AttendContext:
    """What a method's ``attend`` may need besides q, k, v (all arrays except ``layer`` and ``phase``).

    Attributes:
      layer: layer index (static).
      phase: "prefill" (a prompt chunk, T >= 1) or "decode" (one generated token); static.
      last_chunk: the prefill call that ends the prompt (static); compressing methods act on it.
      start: int32 scalar, slot of the first query token of this call.
      pad: int32 [B], left-padding slots per row (never attended).
      positions: int32 [B, T], RoPE positions of the query tokens.
      q_pre_rope, k_pre_rope: [B, T, H, D] projections before RoPE (used by Locret; dead code otherwise).
    """

    start: jax.Array
    pad: jax.Array
    positions: jax.Array
    q_pre_rope: jax.Array | None = None
    k_pre_rope: jax.Array | None = None
    layer: int = struct.field(pytree_node=False, default=0)
    phase: str = struct.field(pytree_node=False, default="prefill")
    last_chunk: bool = struct.field(pytree_node=False, default=True)


@struct.dataclass
class Cache:
    """Per-layer method states plus the shared slot counter and per-row left padding."""

    layers: tuple
    length: jax.Array  # int32 [] slots written so far
    pad: jax.Array  # int32 [B] left-padding slots per row
    method: Any = struct.field(pytree_node=False)
    capacity: int = struct.field(pytree_node=False, default=0)  # slots that fit without compression

    @property
    def batch_size(self) -> int:
        """Rows in the batch."""
        return int(self.pad.shape[0])

    def device_bytes(self) -> int:
        """Bytes of all device-memory arrays held by the cache (from the arrays' sizes)."""
        return _bytes_by_kind(self)[0]

    def host_bytes(self) -> int:
        """Bytes of all host-memory (``pinned_host`` / ``unpinned_host``) arrays held by the cache."""
        return _bytes_by_kind(self)[1]

    def stats(self) -> dict:
        """Cache statistics: device and host bytes actually held, slots used, the method's own facts."""
        device, host = _bytes_by_kind(self)
        out = {
            "method": getattr(self.method, "name", type(self.method).__name__),
            "device_bytes": device,
            "host_bytes": host,
            "length": int(self.length),
            "capacity": self.capacity,
        }
        extra = getattr(self.method, "cache_stats", None)
        if extra is not None:
            out.update(extra(self))
        return out


def _memory_kind(x: jax.Array) -> str:
    sharding = getattr(x, "sharding", None)
    kind = getattr(sharding, "memory_kind", None)
    return kind or "device"


def _bytes_by_kind(tree) -> tuple[int, int]:
    device = host = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if not hasattr(leaf, "dtype"):
            continue
        nbytes = int(leaf.size) * jnp.dtype(leaf.dtype).itemsize
        if "host" in _memory_kind(leaf):
            host += nbytes
        else:
            device += nbytes
    return device, host


def cache_fields(cache: Cache) -> dict[str, Any]:
    """The dataclass fields of a cache, for debugging and tests."""
    return {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}
