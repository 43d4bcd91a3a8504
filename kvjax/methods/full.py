"""The full (uncompressed) KV cache: the reference every compression method is measured against."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct
from jax import lax

from kvjax.attention import causal_cache_attention, resolve_implementation
from kvjax.cache import AttendContext, Cache
from kvjax.methods.base import round_up


@struct.dataclass
class DenseKV:
    """One layer's contiguous cache: ``k, v[B, Hkv, S, D]`` with one row per slot (post-RoPE keys)."""

    k: jnp.ndarray
    v: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class FullCache:
    """Keep every token of the prompt and of the answer on the device.

    Args:
      block: key-block size of the prefill attention (memory O(T * block)); the cache holds a
        multiple of it.
      implementation: attention implementation, "auto" | "xla" | "pallas" | "pallas_interpret"
        (a dense cache always runs the XLA path; the name is validated).
    """

    block: int = 256
    implementation: str = "auto"
    name: str = dataclasses.field(default="full", init=False)

    def __post_init__(self):
        if self.block <= 0:
            raise ValueError(f"block must be positive, got {self.block}")
        resolve_implementation(self.implementation)

    def init_cache(self, config, batch: int, prompt_len: int, max_new_tokens: int, dtype) -> Cache:
        """Zero-filled ``[B, Hkv, round_up(prompt_len + max_new_tokens, block), D]`` per layer."""
        if batch <= 0 or prompt_len <= 0 or max_new_tokens < 0:
            raise ValueError(f"need batch > 0, prompt_len > 0, max_new_tokens >= 0; got {batch}, {prompt_len}, {max_new_tokens}")
        capacity = round_up(prompt_len + max_new_tokens, self.block)
        shape = (batch, config.num_kv_heads, capacity, config.head_dim)
        layers = tuple(
            DenseKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)) for _ in range(config.num_layers)
        )
        return Cache(
            layers=layers,
            length=jnp.zeros((), jnp.int32),
            pad=jnp.zeros((batch,), jnp.int32),
            method=self,
            capacity=capacity,
        )

    def compress(self, cache: Cache) -> Cache:
        """Nothing to compress: the full cache keeps every token."""
        return cache

    def attend(self, state: DenseKV, q, k, v, ctx: AttendContext):
        """Write k, v at slots ``ctx.start..`` and attend causally over all written slots."""
        k_new = lax.dynamic_update_slice_in_dim(state.k, k.transpose(0, 2, 1, 3).astype(state.k.dtype), ctx.start, axis=2)
        v_new = lax.dynamic_update_slice_in_dim(state.v, v.transpose(0, 2, 1, 3).astype(state.v.dtype), ctx.start, axis=2)
        out = causal_cache_attention(
            q, k_new, v_new, q_start=ctx.start, pad=ctx.pad, scale=q.shape[-1] ** -0.5,
            block=self.block, implementation=self.implementation,
        )
        return out, DenseKV(k=k_new, v=v_new)
