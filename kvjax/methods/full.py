"""The full (uncompressed) KV cache: the reference every compression method is measured against."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct

from kvjax.attention import (causal_cache_attention, contiguous_decode_attention, kernel_reads_contiguous,
                             resolve_implementation)
from kvjax.cache import Cache, CacheSpec
from kvjax.methods.base import LayerLocal, StagedPrefill
from kvjax.sharding import ROWS_HEADS
from kvjax.staging import Recording, StagedKV, staged_partition, write_slots


@struct.dataclass
class DenseKV:
    """One layer's contiguous cache: ``k, v[B, Hkv, S, D]`` with one row per slot (post-RoPE keys)."""

    k: jnp.ndarray
    v: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class FullCache(StagedPrefill, LayerLocal):
    """Keep every token of the prompt and of the answer on the device: the staging (``[B, Hkv, round_up(prompt + room,
    block), D]`` per layer) becomes the cache.

    Args:
      block: key-block size of the prefill attention (memory O(T * block)); the cache holds a
        multiple of it.
      implementation: attention implementation, "auto" | "xla" | "pallas" | "pallas_interpret": a
        one-token decode step reads the contiguous cache with the paged Pallas kernel on an accelerator
        (:func:`kvjax.attention.contiguous_decode_attention`: one fused pass instead of XLA's score matrix
        and softmax), prefill and multi-token calls run the XLA path.
    """

    block: int = 256
    implementation: str = "auto"
    name = "full"

    def __post_init__(self):
        if self.block <= 0:
            raise ValueError(f"block must be positive, got {self.block}")
        resolve_implementation(self.implementation)

    def recording(self) -> Recording:
        """The plain staging (it already has room for the answer)."""
        return Recording(block=self.block)

    def finish_prefill(self, state: StagedKV, ctx) -> DenseKV:
        """Nothing to compress: the staging buffer becomes the cache (no copy)."""
        return DenseKV(k=state.k, v=state.v)

    def decode_attend(self, state: DenseKV, q, k, v, ctx):
        """Write k, v at slots ``ctx.start..`` and attend causally over all written slots."""
        k_new, v_new = write_slots(state.k, k, ctx.start), write_slots(state.v, v, ctx.start)
        B, T, Hq, D = q.shape
        if T == 1 and kernel_reads_contiguous(k_new.shape[2], D, self.implementation):
            out = contiguous_decode_attention(q[:, 0], k_new, v_new, length=ctx.start + 1, pad=ctx.pad,
                                              implementation=self.implementation, mesh=ctx.mesh)[:, None]
        else:
            out = causal_cache_attention(q, k_new, v_new, q_start=ctx.start, pad=ctx.pad, scale=D**-0.5,
                                         block=self.block, implementation=self.implementation)
        return out, DenseKV(k=k_new, v=v_new)

    def state_partition(self, state, spec: CacheSpec):
        """K/V by (row, KV head) in both stages."""
        if isinstance(state, StagedKV):
            return staged_partition(state)
        return DenseKV(k=ROWS_HEADS, v=ROWS_HEADS)

    def stats(self, cache: Cache) -> dict:
        """Nothing beyond the common statistics."""
        return {}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """K and V of every written slot of every row and KV head."""
        first = cache.layers[0]
        B, H, _, D = first.k.shape
        return len(cache.layers) * 2 * B * H * int(cache.length) * D * first.k.dtype.itemsize
