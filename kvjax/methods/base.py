"""The compression-method protocol every cache method implements.

A method is a small frozen dataclass of hyper-parameters (hashable: it is a static field of the
cache) with two jobs:

* ``init_cache(config, batch, prompt_len, max_new_tokens, dtype)`` allocates the
  :class:`kvjax.cache.Cache` (device and host tiers) with static shapes;
* ``compress(cache)`` runs once after prefill (jitted): static methods select tokens here;
* ``attend(state, q, k, v, ctx)`` takes one layer's new ``q[B,T,Hq,D]``, ``k, v[B,T,Hkv,D]``
  (post-RoPE, at the slots ``ctx.start..``), writes them into the layer ``state``, runs the
  method's own logic (compression at the end of the prompt, per-step selection, ...) and returns
  ``(attention output [B,T,Hq,D], new state)``.

The model calls ``attend`` and nothing else, so adding a method never touches the model code.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from kvjax.cache import AttendContext, Cache


@runtime_checkable
class CompressionMethod(Protocol):
    """Protocol of a KV-cache method (see module docstring)."""

    name: str

    def init_cache(self, config: Any, batch: int, prompt_len: int, max_new_tokens: int, dtype: Any) -> Cache:
        """Allocate an empty cache for ``batch`` rows of ``prompt_len`` slots plus ``max_new_tokens``."""
        ...

    def attend(self, state: Any, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttendContext) -> tuple[jax.Array, Any]:
        """Write one layer's new k, v and attend the new queries; return (output, new state)."""
        ...

    def compress(self, cache: Cache) -> Cache:
        """After the whole prompt is prefilled: build the compressed state (identity for the full cache)."""
        ...


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple
