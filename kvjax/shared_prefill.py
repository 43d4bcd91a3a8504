"""One prefill, many methods: stage a prompt once and derive each method's cache from the staging.

Every static method (:class:`kvjax.methods.compressed.StaticMethod`: SnapKV, StreamingLLM, H2O,
PyramidKV, HBW-KV, Quest) prefills into the same dense staging cache and differs only in what it
records (the observation-window queries, H2O's accumulated attention) and in ``compress``. A
:class:`SharedStaging` records the union (the largest window, accumulation if any method needs it),
so one prefill serves them all, and the full cache too (its dense buffer is the staging's K/V).
The prefill is not changed by what is recorded, so a method's cache derived here equals the cache
of its own prefill (tested in ``tests/test_shared_prefill.py``).

    staged = init_shared_cache(methods, config, batch, prompt_len, max_new_tokens, dtype)
    for chunk in chunks: logits, staged = prefill(graphdef, params, chunk, staged, last_chunk=...)
    for m in methods: cache = compress(cache_for(staged, m)); decode_loop(..., cache, ...)

``compress`` does not donate its input, so the staging survives every derivation; drop it when done.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp

from kvjax.cache import Cache
from kvjax.methods.base import round_up
from kvjax.methods.compressed import StagedKV, StaticMethod
from kvjax.methods.full import DenseKV, FullCache


@dataclasses.dataclass(frozen=True)
class SharedStaging(StaticMethod):
    """Staging-only method recording what a set of methods needs; derive caches with :func:`cache_for`."""

    budget: float = 1.0
    window: int = 0
    accumulate: bool = False
    name = "shared_staging"

    def select(self, layer, st, pad, cap):
        """Not a compression method: derive a method's cache with :func:`cache_for` first."""
        raise ValueError("a shared staging cache cannot be compressed itself; use kvjax.shared_prefill.cache_for(staged, method)")


def can_share_prefill(method) -> bool:
    """True for the methods whose prefill is the shared staging (full cache and static methods)."""
    return isinstance(method, (FullCache, StaticMethod)) and not isinstance(method, SharedStaging)


def shared_staging(methods: Sequence) -> SharedStaging:
    """The staging that records the largest observation window and accumulation if any method needs it."""
    if not methods:
        raise ValueError("need at least one method to share a prefill")
    others = [m for m in methods if not can_share_prefill(m)]
    if others:
        names = ", ".join(getattr(m, "name", type(m).__name__) for m in others)
        raise ValueError(f"methods {names} cannot share a prefill (only the full cache and static methods can)")
    static = [m for m in methods if isinstance(m, StaticMethod)]
    return SharedStaging(
        window=max((m.window for m in static), default=0),
        accumulate=any(m.accumulate for m in static),
        block=static[0].block if static else FullCache().block,
    )


def init_shared_cache(methods: Sequence, config, batch: int, prompt_len: int, max_new_tokens: int, dtype) -> Cache:
    """A staging cache for ``methods`` (prefill it with :func:`kvjax.generate.prefill`)."""
    return shared_staging(methods).init_cache(config, batch, prompt_len, max_new_tokens, dtype)


def cache_for(staged: Cache, method) -> Cache:
    """``method``'s cache derived from a prefilled shared staging: compress it (``kvjax.generate.compress``) next.

    For the full cache the result is already final (its dense buffer holds the prompt's K/V).
    Raises ValueError when the staging did not record what ``method`` needs.
    """
    if not isinstance(staged.method, SharedStaging):
        raise ValueError(f"cache_for needs a cache from init_shared_cache, got one of method {getattr(staged.method, 'name', staged.method)!r}")
    if not can_share_prefill(method):
        raise ValueError(f"method {getattr(method, 'name', method)!r} cannot share a prefill")
    first = staged.layers[0]
    if not isinstance(first, StagedKV):
        raise ValueError("the shared staging cache was already compressed")
    L, room = first.prompt_len, first.room
    # fresh copies: decode_loop donates the derived cache, which must not delete the staging's arrays
    staged = staged.replace(length=jnp.array(staged.length, copy=True), pad=jnp.array(staged.pad, copy=True))
    if isinstance(method, FullCache):
        capacity = round_up(L + room, method.block)
        B, H, S, D = first.k.shape

        def dense(x):
            out = jnp.zeros((B, H, capacity, D), x.dtype)
            return out.at[:, :, : min(S, capacity)].set(x[:, :, : min(S, capacity)])

        layers = tuple(DenseKV(k=dense(st.k), v=dense(st.v)) for st in staged.layers)
        return staged.replace(layers=layers, method=method, capacity=capacity)
    staging = staged.method
    if method.window > staging.window:
        raise ValueError(f"{method.name} needs an observation window of {method.window}; the staging recorded {staging.window}")
    if method.accumulate and not staging.accumulate:
        raise ValueError(f"{method.name} needs accumulated attention; the staging did not record it")
    caps = method.layer_capacities(len(staged.layers), L)
    layers = []
    for i, st in enumerate(staged.layers):
        q_window = None
        if method.window:
            q_window = st.q_window[:, st.q_window.shape[1] - method.window:]
        layers.append(st.replace(
            q_window=q_window, acc=st.acc if method.accumulate else None,
            capacities=(caps[i],) * st.k.shape[1],
        ))
    return staged.replace(layers=tuple(layers), method=method)
