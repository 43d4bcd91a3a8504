"""Jitted prefill, per-step decode and the ``lax.while_loop`` generate loop (cache donated).

Batches are left-padded: row ``b`` has ``pad[b]`` padding slots first, its real token at slot ``s``
has position ``s - pad[b]``; padding slots are never attended. Everything here is a pure function of
``(graphdef, params, ..., cache)``; the cache is donated so decode updates it in place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.cache import Cache

# Incremented each time a function below is traced (= compiled for new shapes / static args).
TRACE_COUNTS: Counter = Counter()


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Decoding rule: greedy when ``temperature == 0``, else temperature + nucleus (top-p) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens int32 [B] from logits [B, V] under ``sampling`` (``key`` unused when greedy)."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the top token always survives)
        cutoff_index = jnp.sum(cum < sampling.top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prompt_positions(pad: jax.Array, start: int, length: int) -> jax.Array:
    """Positions [B, length] of slots ``start..start+length`` for rows with left padding ``pad`` (pads -> 0)."""
    slots = start + jnp.arange(length, dtype=jnp.int32)
    return jnp.maximum(slots[None, :] - pad[:, None], 0)


@functools.partial(jax.jit, static_argnames=("graphdef", "last_chunk"), donate_argnames=("cache",))
def prefill(graphdef, params, tokens: jax.Array, cache: Cache, *, last_chunk: bool = True):
    """Run a prompt chunk ``tokens[B, T]`` at slots ``cache.length..``; returns (last logits [B, V], cache)."""
    from models.llama import forward

    TRACE_COUNTS["prefill"] += 1
    positions = jnp.maximum(cache.length + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :] - cache.pad[:, None], 0)
    logits, cache = forward(graphdef, params, tokens, positions, cache, last_only=True, last_chunk=last_chunk)
    return logits[:, -1], cache


@jax.jit
def compress(cache: Cache) -> Cache:
    """Run the method's post-prefill compression (selection + paging) in one jitted call.

    Not donated: the output pytree (page pools) differs from the input (staging), so no buffer could
    be reused; the staging is freed when the caller drops it.
    """
    TRACE_COUNTS["compress"] += 1
    return cache.method.compress(cache)


def _step(graphdef, params, tokens: jax.Array, cache: Cache):
    """One decode forward of ``tokens[B]`` at slot ``cache.length``; returns (logits [B, V], cache)."""
    from models.llama import forward

    positions = (cache.length - cache.pad)[:, None]
    logits, cache = forward(graphdef, params, tokens[:, None], positions, cache)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("cache",))
def decode_step(graphdef, params, tokens: jax.Array, cache: Cache, key: jax.Array, *, sampling: Sampling = Sampling()):
    """Per-step jitted decode for streaming: feed ``tokens[B]``, return (next tokens [B], logits [B, V], cache)."""
    TRACE_COUNTS["decode_step"] += 1
    logits, cache = _step(graphdef, params, tokens, cache)
    return sample(logits, key, sampling), logits, cache


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_ids", "sampling"), donate_argnames=("cache",)
)
def decode_loop(
    graphdef, params, first_tokens: jax.Array, cache: Cache, key: jax.Array, *,
    max_new_tokens: int, eos_ids: tuple[int, ...] = (), sampling: Sampling = Sampling(),
):
    """Generate up to ``max_new_tokens`` tokens in one ``lax.while_loop``.

    ``first_tokens[B]`` are the tokens sampled from the prefill logits (they count as generated).
    Stops when every row has produced an EOS token or at the length limit. Returns
    ``(tokens int32 [B, max_new_tokens], num_generated int32 [B] (EOS included), cache)``; positions
    after a row's EOS hold that EOS id.
    """
    TRACE_COUNTS["decode_loop"] += 1
    B = first_tokens.shape[0]
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def is_eos(tok):
        return jnp.any(tok[:, None] == eos[None, :], axis=-1)

    out = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(first_tokens)
    done = is_eos(first_tokens)
    count = jnp.ones((B,), jnp.int32)

    def cond(state):
        i, _, done, _, _, _, _ = state
        return (i < max_new_tokens - 1) & ~jnp.all(done)

    def body(state):
        i, tok, done, out, count, cache, key = state
        key, sub = jax.random.split(key)
        logits, cache = _step(graphdef, params, tok, cache)
        nxt = sample(logits, sub, sampling)
        nxt = jnp.where(done, tok, nxt)  # finished rows repeat their EOS
        out = lax.dynamic_update_slice_in_dim(out, nxt[:, None], i + 1, axis=1)
        count = count + (~done).astype(jnp.int32)
        return i + 1, nxt, done | is_eos(nxt), out, count, cache, key

    state = (jnp.zeros((), jnp.int32), first_tokens, done, out, count, cache, key)
    _, _, _, out, count, cache, _ = lax.while_loop(cond, body, state)
    # positions past a row's last generated token (loop ended early) repeat that token (its EOS)
    last = jnp.minimum(jnp.arange(max_new_tokens, dtype=jnp.int32)[None, :], count[:, None] - 1)
    return jnp.take_along_axis(out, last, axis=1), count, cache
