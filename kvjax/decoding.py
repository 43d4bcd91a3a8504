"""Jitted prefill, per-step decode and the ``lax.while_loop`` generate loop (cache donated).

The model's forward comes from the loaded model itself (``nnx.merge(graphdef, params)``), so this
module imports no model code. Each public function checks the cache's room on the host and calls
its jitted body (``*_jit``, also usable for ahead-of-time lowering); on a GPU the decode functions compile with
:data:`GPU_DECODE_COMPILER_OPTIONS` (the latency-hiding scheduler, so host recalls overlap decoding).

On a device mesh (``cache.spec.mesh``, :mod:`kvjax.sharding`) every jitted call constrains the cache it
returns to the mesh layout; the parameters carry their own shardings. Batches are left-padded: row ``b`` has ``pad[b]`` padding slots first, its real token at slot ``s``
has position ``s - pad[b]``; padding slots are never attended. Everything here is a pure function of
``(graphdef, params, ..., cache)``; the cache is donated so decode updates it in place.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from kvjax.cache import Cache, FinishContext
from kvjax.sharding import constrain_cache

# Incremented each time a function below is traced (= compiled for new shapes / static args).
TRACE_COUNTS: Counter = Counter()

# XLA options for the decode programs on a GPU. XLA:GPU's latency-hiding scheduler is off by default (jax 0.10.2 and
# 0.11.2); without it the start and the done of a host-offloaded computation are scheduled back to back, so the host
# gathers of a recall (HeteroCache, SyncKV, HCAttention) never overlap the step's device work. With it they span the
# step's kernels that do not need their result (``python -m kvjax.evals.gpu_schedule``, docs/results/gpu_schedule_h100/).
GPU_DECODE_COMPILER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}
XLA_DEFAULTS_ENV = "KVJAX_DECODE_XLA_DEFAULTS"  # set to 1: decode compiles with XLA's defaults everywhere


def decode_compiler_options(platform: str | None = None) -> dict:
    """XLA options to compile a top-level decode program with on ``platform`` (default: jax's default backend):
    :data:`GPU_DECODE_COMPILER_OPTIONS` on a GPU, none elsewhere, and none anywhere when the environment sets
    ``KVJAX_DECODE_XLA_DEFAULTS=1`` (XLA's own defaults, e.g. to compare, or if the scheduler misbehaves on a GPU).

    :func:`decode_step` and :func:`decode_loop` use them. jax refuses compiler options on a jit nested in another,
    so :func:`decode_step_jit` and :func:`decode_loop_jit` (nestable, for lowering) do not carry them: pass
    ``compiler_options=decode_compiler_options()`` to ``.lower(...).compile`` when compiling those ahead of time.
    """
    platform = jax.default_backend() if platform is None else platform
    if os.environ.get(XLA_DEFAULTS_ENV, "") not in ("", "0"):
        return {}
    return dict(GPU_DECODE_COMPILER_OPTIONS) if platform in ("gpu", "cuda", "rocm") else {}


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


def _forward(graphdef, params, tokens, positions, cache: Cache, *, last_only: bool):
    """The loaded model's own forward (``graphdef`` + ``params`` merged inside the trace); on a compressed cache,
    inside the method's ``around_layers``."""
    model = nnx.merge(graphdef, params)

    def run(cache):
        return model(tokens, positions, cache, last_only=last_only)

    return run(cache) if cache.stage == "prefill" else cache.method.around_layers(cache, tokens.shape[1], run)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def prefill_jit(graphdef, params, tokens: jax.Array, cache: Cache):
    """Jitted body of :func:`prefill` (no room check; use it for ahead-of-time lowering). After a multi-token call on
    the compressed cache, the method's ``finish_question``."""
    TRACE_COUNTS["prefill"] += 1
    positions = jnp.maximum(cache.length + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :] - cache.pad[:, None], 0)
    question = cache.stage == "compressed" and tokens.shape[1] > 1
    logits, cache = _forward(graphdef, params, tokens, positions, cache, last_only=True)
    if question:
        cache = cache.method.finish_question(cache)
    return logits[:, -1], constrain_cache(cache)


def check_room(cache: Cache, new_tokens: int) -> None:
    """Raise ValueError when ``new_tokens`` more slots would not fit in the cache's stage.

    Before compression the prompt may fill ``spec.prompt_slots``; after it, later tokens fill the
    room (``spec.room`` slots per head). Reads ``cache.length`` (one small device-to-host copy).
    """
    spec = cache.spec
    length = int(cache.length)
    if cache.stage == "prefill":
        if length + new_tokens > spec.prompt_slots:
            raise ValueError(f"prefill of {new_tokens} tokens at slot {length} overflows the prompt's {spec.prompt_slots} "
                             "slots the cache was made for; compress first (kvjax.decoding.compress), then add tokens")
    elif length + new_tokens > spec.total_slots:
        raise ValueError(f"{new_tokens} more tokens at slot {length} exceed the cache's room: it was made for "
                         f"{spec.prompt_slots} prompt slots + {spec.room} later tokens; allocate more room "
                         "(max_new_tokens / question length) when creating the cache")


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def rehearse_jit(graphdef, params, tokens: jax.Array, cache: Cache) -> Cache:
    """A rehearsal of a question on a compressed cache (stage ``"rehearsal"``; every pass but the last of
    :func:`prefill`): returns the cache with what the method changed (recall, re-anchoring) and without the
    tokens (``length`` unchanged)."""
    TRACE_COUNTS["rehearse"] += 1
    positions = prompt_positions(cache.pad, cache.length, tokens.shape[1])
    _, new = _forward(graphdef, params, tokens, positions, cache.replace(stage="rehearsal"), last_only=True)
    return constrain_cache(new.replace(stage="compressed", length=cache.length))


def question_passes(cache: Cache, tokens: int) -> int:
    """Forward passes a call of ``tokens`` tokens takes: ``method.question_passes()`` for a multi-token call on a
    compressed cache (a question), else 1."""
    if cache.stage != "compressed" or tokens < 2:
        return 1
    passes = cache.method.question_passes()
    if passes < 1:
        raise ValueError(f"{cache.method.name}.question_passes() must be >= 1, got {passes}")
    return passes


def prefill(graphdef, params, tokens: jax.Array, cache: Cache):
    """Run ``tokens[B, T]`` at slots ``cache.length..``; returns (last logits [B, V], cache) (cache donated).

    Before compression this is a prompt chunk (``method.prefill_chunk``); after it, the tokens (a
    question, a second turn) are appended uncompressed (``method.decode_attend``). A method whose
    ``question_passes()`` is ``n > 1`` sees such a multi-token call ``n`` times: ``n - 1`` rehearsals
    (:func:`rehearse_jit`, each may change what it holds), then the call itself.
    """
    check_room(cache, tokens.shape[1])
    for _ in range(question_passes(cache, tokens.shape[1]) - 1):
        cache = rehearse_jit(graphdef, params, tokens, cache)
    return prefill_jit(graphdef, params, tokens, cache)


def prefill_prompt(graphdef, params, tokens, cache: Cache, *, chunk_size: int | None = None, progress: bool = False,
                   step=None):
    """Prefill a whole prompt ``tokens[B, L]`` in chunks of ``chunk_size`` (None: one call); (last logits, cache).

    The one prefill loop of kvjax (API, evaluation, fidelity, benchmarks). ``progress`` shows a bar
    that follows the computation (each chunk is waited for); ``step`` replaces the jitted chunk
    call (e.g. an ahead-of-time compiled executable taking ``(params, chunk, cache)``).
    """
    L = tokens.shape[1]
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 or None, got {chunk_size}")
    size = L if chunk_size is None else chunk_size
    starts = list(range(0, L, size))
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc=f"prefill {L} tokens", unit="chunk", leave=False)
    check_room(cache, L)
    logits = None
    for s in starts:
        chunk = jnp.asarray(tokens[:, s:s + size])
        if step is None:
            logits, cache = prefill_jit(graphdef, params, chunk, cache)
        else:
            logits, cache = step(params, chunk, cache)
        if progress:
            logits.block_until_ready()  # the bar follows the computation, not the asynchronous dispatch
    return logits, cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def compress_jit(cache: Cache) -> Cache:
    """Jitted body of :func:`compress` (the prefill-stage cache is donated)."""
    TRACE_COUNTS["compress"] += 1
    layers = tuple(
        cache.method.finish_prefill(st, FinishContext(pad=cache.pad, artifact=cache.artifact, layers=cache.layers, layer=i,
                                                    spec=cache.spec))
        for i, st in enumerate(cache.layers)
    )
    return constrain_cache(cache.replace(layers=layers, stage="compressed"))


def compress(cache: Cache) -> Cache:
    """After the prompt: run ``method.finish_prefill`` on every layer (selection + layout), in one jitted call.

    The prefill-stage cache is donated (the full cache keeps its buffers; other methods free the
    staging); derive caches from a shared staging with :func:`kvjax.shared_prefill.cache_for`,
    which copies.
    """
    if cache.stage != "prefill":
        raise ValueError("the cache is already compressed")
    length = int(cache.length)
    if length != cache.spec.prompt_slots:
        raise ValueError(f"compress after the whole prompt: the cache holds {length} of its {cache.spec.prompt_slots} prompt slots")
    with warnings.catch_warnings():  # staging buffers a method does not keep cannot be reused: expected
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return compress_jit(cache)


def forward_step(graphdef, params, tokens: jax.Array, cache: Cache):
    """One decode forward of ``tokens[B]`` at slot ``cache.length``; returns (logits [B, V], cache)."""
    positions = (cache.length - cache.pad)[:, None]
    logits, cache = _forward(graphdef, params, tokens[:, None], positions, cache, last_only=False)
    return logits[:, 0], cache


def _decode_step(graphdef, params, tokens: jax.Array, cache: Cache, key: jax.Array, *, sampling: Sampling = Sampling()):
    """Jitted body of :func:`decode_step` (as ``decode_step_jit``: nestable, without :func:`decode_compiler_options`):
    ``(cache, next tokens [B], logits [B, V])``, the cache first. A donated input's buffer goes to the first output of
    its shape and dtype, in output order; the next tokens (int32 ``[B]``) first would take the buffer of the cache's
    first int32 ``[B]`` leaf, and every later such leaf its neighbour's, one device copy each per step."""
    TRACE_COUNTS["decode_step"] += 1
    logits, cache = forward_step(graphdef, params, tokens, cache)
    return constrain_cache(cache), sample(logits, key, sampling), logits


_DECODE_STEP_JIT = dict(static_argnames=("graphdef", "sampling"), donate_argnames=("cache",))
decode_step_jit = jax.jit(_decode_step, **_DECODE_STEP_JIT)
_decode_step_gpu = jax.jit(_decode_step, **_DECODE_STEP_JIT, compiler_options=GPU_DECODE_COMPILER_OPTIONS)


def decode_step(graphdef, params, tokens: jax.Array, cache: Cache, key: jax.Array, *, sampling: Sampling = Sampling()):
    """Per-step decode for streaming: feed ``tokens[B]``, return (next tokens [B], logits [B, V], cache).

    Raises ValueError when the cache has no room left for the token.
    """
    check_room(cache, 1)
    step = _decode_step_gpu if decode_compiler_options() else decode_step_jit
    cache, tokens, logits = step(graphdef, params, tokens, cache, key, sampling=sampling)
    return tokens, logits, cache


def _decode_loop(
    graphdef, params, first_tokens: jax.Array, cache: Cache, key: jax.Array, *,
    max_new_tokens: int, eos_ids: tuple[int, ...] = (), sampling: Sampling = Sampling(),
):
    """Jitted body of :func:`decode_loop`: generate up to ``max_new_tokens`` tokens in one ``lax.while_loop``.

    ``first_tokens[B]`` are the tokens sampled from the prefill logits (they count as generated).
    Stops when every row has produced an EOS token or at the length limit. Returns
    ``(cache, tokens int32 [B, max_new_tokens], num_generated int32 [B] (EOS included))``, the cache first (see
    :func:`_decode_step`); positions after a row's EOS hold that EOS id. As ``decode_loop_jit`` it is nestable and
    compiles without :func:`decode_compiler_options` (pass them to ``.lower(...).compile`` ahead of time).
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
        logits, cache = forward_step(graphdef, params, tok, cache)
        cache = constrain_cache(cache)  # the carry keeps the mesh layout
        nxt = sample(logits, sub, sampling)
        nxt = jnp.where(done, tok, nxt)  # finished rows repeat their EOS
        out = lax.dynamic_update_slice_in_dim(out, nxt[:, None], i + 1, axis=1)
        count = count + (~done).astype(jnp.int32)
        return i + 1, nxt, done | is_eos(nxt), out, count, cache, key

    state = (jnp.zeros((), jnp.int32), first_tokens, done, out, count, cache, key)
    _, _, _, out, count, cache, _ = lax.while_loop(cond, body, state)
    # positions past a row's last generated token (loop ended early) repeat that token (its EOS)
    last = jnp.minimum(jnp.arange(max_new_tokens, dtype=jnp.int32)[None, :], count[:, None] - 1)
    return cache, jnp.take_along_axis(out, last, axis=1), count


_DECODE_LOOP_JIT = dict(static_argnames=("graphdef", "max_new_tokens", "eos_ids", "sampling"), donate_argnames=("cache",))
decode_loop_jit = jax.jit(_decode_loop, **_DECODE_LOOP_JIT)
_decode_loop_gpu = jax.jit(_decode_loop, **_DECODE_LOOP_JIT, compiler_options=GPU_DECODE_COMPILER_OPTIONS)


def decode_loop(graphdef, params, first_tokens: jax.Array, cache: Cache, key: jax.Array, *,
                max_new_tokens: int, eos_ids: tuple[int, ...] = (), sampling: Sampling = Sampling()):
    """Generate up to ``max_new_tokens`` tokens in one jitted ``lax.while_loop`` (cache donated).

    ``first_tokens[B]`` are the tokens sampled from the prefill logits (they count as generated), so
    ``max_new_tokens - 1`` tokens are fed to the cache; raises ValueError when they do not fit.
    Returns ``(tokens int32 [B, max_new_tokens], num_generated int32 [B] (EOS included), cache)``.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    check_room(cache, max_new_tokens - 1)
    loop = _decode_loop_gpu if decode_compiler_options() else decode_loop_jit
    cache, tokens, count = loop(graphdef, params, first_tokens, cache, key, max_new_tokens=max_new_tokens,
                                eos_ids=tuple(eos_ids), sampling=sampling)
    return tokens, count, cache
