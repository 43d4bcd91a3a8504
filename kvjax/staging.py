"""Dense prefill staging: the prefill state of the full cache and of every evict-after-prefill method.

A :class:`StagedKV` holds one layer's prompt (and room for what follows) in a dense buffer
``k, v[B, Hkv, S, D]`` with one row per slot, plus what scoring needs, as declared by a
:class:`Recording`:

* ``window``: post-RoPE queries of the last ``window`` prompt slots (``q_window[B, W, Hq, D]``),
  kept as a rolling window over the chunks, so a last chunk shorter than the window works;
* ``accumulate``: attention of every prompt query summed per key slot (``acc[B, Hq, S]``, H2O).

Recording does not change the prefill's outputs, so one staging that records the union of several
methods' needs serves them all (:mod:`kvjax.shared_prefill`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from kvjax.attention import causal_cache_attention, chunk_attention_sums
from kvjax.cache import AttendContext, CacheSpec


@dataclasses.dataclass(frozen=True)
class Recording:
    """What a staging prefill records: the observation window, accumulated attention, the attention block."""

    window: int = 0
    accumulate: bool = False
    block: int = 256

    def __post_init__(self):
        if self.window < 0 or self.block <= 0:
            raise ValueError(f"need window >= 0 and block > 0, got {self.window}, {self.block}")

    def covers(self, other: "Recording") -> bool:
        """True when this recording holds everything ``other`` needs (same block)."""
        return self.window >= other.window and (self.accumulate or not other.accumulate) and self.block == other.block

    @staticmethod
    def union(recordings) -> "Recording":
        """The smallest recording covering all of ``recordings`` (they must share one block)."""
        recordings = list(recordings)
        blocks = {r.block for r in recordings}
        if len(blocks) > 1:
            raise ValueError(f"methods with different attention blocks {sorted(blocks)} cannot share a prefill")
        return Recording(max(r.window for r in recordings), any(r.accumulate for r in recordings), blocks.pop())


@struct.dataclass
class StagedKV:
    """One layer's dense staging (see module docstring); ``recording`` is static."""

    k: jax.Array
    v: jax.Array
    q_window: jax.Array | None
    acc: jax.Array | None
    recording: Recording = struct.field(pytree_node=False, default=Recording())


def staging_slots(spec: CacheSpec, block: int) -> int:
    """Slots of a staging buffer: prompt plus room, rounded up to the attention block."""
    return -(-spec.total_slots // block) * block


def init_staging(spec: CacheSpec, recording: Recording) -> tuple[StagedKV, ...]:
    """Zero-filled staging for every layer (one buffer per field and layer: aliased buffers cannot be donated)."""
    S = staging_slots(spec, recording.block)
    dtype = jnp.dtype(spec.dtype)
    shape = (spec.batch, spec.num_kv_heads, S, spec.head_dim)
    return tuple(
        StagedKV(
            jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
            jnp.zeros((spec.batch, recording.window, spec.num_heads, spec.head_dim), dtype) if recording.window else None,
            jnp.zeros((spec.batch, spec.num_heads, S), jnp.float32) if recording.accumulate else None,
            recording=recording,
        )
        for _ in range(spec.num_layers)
    )


def staged_partition(state: StagedKV) -> StagedKV:
    """Partition specs of a staging layer: K/V and accumulated scores by (row, head), window queries by row and head."""
    from jax.sharding import PartitionSpec as P

    from kvjax.sharding import DATA, MODEL, ROWS_HEADS

    return state.replace(
        k=ROWS_HEADS, v=ROWS_HEADS,
        q_window=None if state.q_window is None else P(DATA, None, MODEL),
        acc=None if state.acc is None else ROWS_HEADS,
    )


def write_slots(buf, x, start):
    """Write ``x[B, T, H, D]`` into ``buf[B, H, S, D]`` at slots ``start..``."""
    return lax.dynamic_update_slice_in_dim(buf, x.transpose(0, 2, 1, 3).astype(buf.dtype), start, axis=2)


def stage_chunk(state: StagedKV, q, k, v, ctx: AttendContext, implementation: str = "auto"):
    """Prefill a chunk into the staging: write K/V, attend causally, record. Returns (output, state)."""
    rec = state.recording
    k_all, v_all = write_slots(state.k, k, ctx.start), write_slots(state.v, v, ctx.start)
    out = causal_cache_attention(q, k_all, v_all, q_start=ctx.start, pad=ctx.pad, scale=q.shape[-1] ** -0.5,
                                 block=rec.block, implementation=implementation)
    q_window, acc = state.q_window, state.acc
    if rec.window:
        q_window = jnp.concatenate([q_window, q.astype(q_window.dtype)], axis=1)[:, -rec.window:]
    if rec.accumulate:
        acc = acc + chunk_attention_sums(q, k_all, ctx.start, ctx.pad, rec.block)
    return out, state.replace(k=k_all, v=v_all, q_window=q_window, acc=acc)


def restrict(state: StagedKV, recording: Recording) -> StagedKV:
    """The staging as ``recording`` would have recorded it (a shorter window, no accumulation)."""
    if not state.recording.covers(recording):
        raise ValueError(f"the staging recorded {state.recording}, which does not cover {recording}")
    q_window = state.q_window[:, state.q_window.shape[1] - recording.window:] if recording.window else None
    return state.replace(q_window=q_window, acc=state.acc if recording.accumulate else None, recording=recording)
