"""The full (uncompressed) KV cache: the reference every compression method is measured against.

With a ``kv_dtype`` other than the model's (:mod:`kvjax.kv_quantization`) the cache stores every token in that dtype
(int8 / float8_e4m3fn with one float32 scale per token and KV head): the prefill runs in the model's dtype on the
dense staging, which is quantized when it becomes the cache; each later token is quantized when it is written.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct
from jax import lax

from kvjax.attention import (causal_cache_attention, contiguous_decode_attention, kernel_reads_contiguous,
                             resolve_implementation)
from kvjax.cache import Cache, CacheSpec
from kvjax.kv_quantization import dequantize, quantize
from kvjax.methods.base import LayerLocal, StagedPrefill
from kvjax.sharding import ROWS_HEADS
from kvjax.staging import Recording, StagedKV, staged_partition, write_slots


@struct.dataclass
class DenseKV:
    """One layer's contiguous cache: ``k, v[B, Hkv, S, D]`` with one row per slot (post-RoPE keys), in the cache's
    ``kv_dtype``; ``k_scales, v_scales[B, Hkv, S]`` (float32): the per-token scales of an int8 / fp8 cache, None
    otherwise."""

    k: jnp.ndarray
    v: jnp.ndarray
    k_scales: jnp.ndarray | None = None
    v_scales: jnp.ndarray | None = None

    @property
    def quantized(self) -> bool:
        """Whether ``k, v`` hold quantized values with per-token scales."""
        return self.k_scales is not None


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

    def check_spec(self, spec: CacheSpec) -> None:
        """Every ``kv_dtype`` of the scheme is stored (validated by the spec itself): nothing to reject."""

    def finish_prefill(self, state: StagedKV, ctx) -> DenseKV:
        """Nothing to compress: the staging buffer becomes the cache (no copy), quantized when the spec's ``kv_dtype``
        is not the model's."""
        if ctx.spec.kv_dtype == state.k.dtype.name:
            return DenseKV(k=state.k, v=state.v)
        (k, k_scales), (v, v_scales) = quantize(state.k, ctx.spec.kv_dtype), quantize(state.v, ctx.spec.kv_dtype)
        return DenseKV(k=k, v=v, k_scales=k_scales, v_scales=v_scales)

    def decode_attend(self, state: DenseKV, q, k, v, ctx):
        """Write k, v at slots ``ctx.start..`` (quantized like the cache) and attend causally over all written slots."""
        if state.quantized:
            (k_all, k_scales), (v_all, v_scales) = (write_quantized(state.k, state.k_scales, k, ctx.start),
                                                    write_quantized(state.v, state.v_scales, v, ctx.start))
            new = DenseKV(k=k_all, v=v_all, k_scales=k_scales, v_scales=v_scales)
        else:  # written in the stored dtype (a bfloat16 cache: the scheme's cast)
            new = DenseKV(k=write_slots(state.k, k, ctx.start), v=write_slots(state.v, v, ctx.start))
        B, T, Hq, D = q.shape
        if T == 1 and kernel_reads_contiguous(new.k.shape[2], D, self.implementation):
            out = contiguous_decode_attention(q[:, 0], new.k, new.v, length=ctx.start + 1, pad=ctx.pad,
                                              implementation=self.implementation, mesh=ctx.mesh,
                                              k_scales=new.k_scales, v_scales=new.v_scales)[:, None]
        else:
            k_all, v_all = new.k, new.v
            if k_all.dtype != q.dtype:  # XLA path: the whole cache dequantized (a transient float copy)
                k_all, v_all = dequantize(k_all, new.k_scales, q.dtype), dequantize(v_all, new.v_scales, q.dtype)
            out = causal_cache_attention(q, k_all, v_all, q_start=ctx.start, pad=ctx.pad, scale=D**-0.5,
                                         block=self.block, implementation=self.implementation)
        return out, new

    def state_partition(self, state, spec: CacheSpec):
        """K/V (and their scales) by (row, KV head) in both stages."""
        if isinstance(state, StagedKV):
            return staged_partition(state)
        scales = ROWS_HEADS if state.quantized else None
        return DenseKV(k=ROWS_HEADS, v=ROWS_HEADS, k_scales=scales, v_scales=scales)

    def stats(self, cache: Cache) -> dict:
        """Nothing beyond the common statistics."""
        return {}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """K and V of every written slot of every row and KV head, in the stored dtype with their scales."""
        first = cache.layers[0]
        B, H, _, D = first.k.shape
        scale_bytes = 4 if isinstance(first, DenseKV) and first.quantized else 0
        return len(cache.layers) * 2 * B * H * int(cache.length) * (D * first.k.dtype.itemsize + scale_bytes)


def write_quantized(buf, scales, x, start):
    """``(buf, scales)`` with ``x[B, T, H, D]`` quantized to ``buf``'s int8 / fp8 dtype
    (:func:`kvjax.kv_quantization.quantize`, one scale per token and head) and written at slots ``start..`` of
    ``buf[B, H, S, D]`` and ``scales[B, H, S]``."""
    q, s = quantize(x, buf.dtype.name)
    return write_slots(buf, q, start), lax.dynamic_update_slice_in_dim(scales, s.transpose(0, 2, 1), start, axis=2)
