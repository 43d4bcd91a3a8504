"""KVzip (Kim et al., 2025): query-agnostic eviction scored by context reconstruction.

After the context is prefilled, the model re-reads it: for each chunk of the context a second forward pass runs
"Repeat the previous context exactly." (later chunks: "Repeat the part of the previous context exactly, starting
with" + the previous chunk's last ``carry`` tokens), the chat template's end of turn, then the chunk itself, on top of
the prefilled cache. A context KV pair's score is the largest attention any query of that pass gives it, over the
queries and the KV head's query group; the softmax of that score is taken over the ``sinks`` first tokens, the
chunk and the pass's own tokens (NVIDIA kvpress ``KVzipPress``, the reference this module follows; the public code
is snu-mllab/KVzip). The pass's own output attends the whole context as a normal forward does; its tokens are then
dropped. The chat template before the context (system prompt, user header) is never scored: its first ``sinks``
tokens score 1 (kept), the rest 0 (evicted first); a context token among the first ``sinks`` keeps its own score.

Head budgets (``allocation``):

* ``global`` (the paper's and kvpress' default): one threshold over every layer's and head's scores of a row;
  kvpress: ``n = max(int(N * (1 - budget)) - 1, 0)``, pairs scoring at or below the ``n``-th smallest score are
  evicted (ties at the threshold go too), so layers and heads keep different counts;
* ``layer`` (kvpress ``layerwise=True``): each layer evicts ``int(Hkv * n * (1 - budget))`` pairs, heads of a
  layer still compete;
* ``head``: every KV head keeps the same number of pairs (``floor(budget * n)``).

Memory: the kept counts are data. :func:`score_context` runs the passes (:func:`reconstruct`), selects
(:func:`allocate`), reads the kept count of every (layer, KV head) to the host (the largest over the batch's rows)
and fixes them as the method's static ``allocated`` capacities, so the page pools hold exactly that (``kvjax.paged``): the device bytes are the
budget's, not a masked full cache. A batch compiles its compression once for its counts (the evaluation compiles
each batch anyway).

Cost: one extra forward pass per chunk over ``chunk`` + ~25 tokens, attending the whole context, plus a second softmax
per layer over the sinks, the chunk and the pass for every pass query (measured on a 2-core CPU: prefill plus passes
3.0x the full cache's prefill at 4K and 8K, docs/methods/kvzip.md). ``kvjax.generate`` reports it as ``timings["reconstruct_s"]``, ``kvjax eval`` as
each record's ``reconstruct_s``.
A left-padded batch works: each row's chunks start at its own context, every pass is right-padded to one length,
and a row without a chunk in a pass scores nothing in it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax

from kvjax.attention import MASK_VALUE, causal_cache_attention, resolve_implementation
from kvjax.budgets import budget_facts, check_budget
from kvjax.cache import Cache, CacheSpec
from kvjax.methods.base import LayerLocal, NoArtifact, PagedAppend
from kvjax.selection import check_lookahead, extend_forward, keep_to_indices
from kvjax.staging import Recording, StagedKV, init_staging, stage_chunk, staged_partition

ALLOCATIONS = ("global", "layer", "head")
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclasses.dataclass(frozen=True)
class ReconstructionPrompt:
    """Token ids of the reconstruction passes, from the model's tokenizer and chat template
    (``kvjax.models.tokenizer.reconstruction_prompt``).

    Attributes:
      prefix: template tokens before the context in every row (system prompt, user header): never scored.
      first: the first chunk's request (:data:`FIRST_PROMPT`).
      later: a later chunk's request (:data:`LATER_PROMPT`), followed by the previous chunk's last tokens.
      suffix: the template's end of the user turn and the assistant header (``"\\n"`` without a template).
    """

    prefix: int
    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]


@struct.dataclass
class KVzipPrefill:
    """One layer before compression: the dense staging, the reconstruction scores ``[B, Hkv, S]`` (f32), the
    chunk each row is scoring now (``span[B, 2]``: slots ``[lo, hi)``), each row's real tokens at the start of the
    current pass (``call_len[B]``, padding after) and the pairs each row evicts (``pruned[B]``, :func:`pruned_counts`)."""

    staged: StagedKV
    scores: jax.Array
    span: jax.Array
    call_len: jax.Array
    pruned: jax.Array


@dataclasses.dataclass(frozen=True)
class KVzip(NoArtifact, LayerLocal):
    """Keep each KV head's pairs that the model's reconstruction of the context attends most.

    Args:
      budget: :mod:`kvjax.budgets` (default 0.25); over all layers and heads with ``allocation="global"``.
      allocation: global | layer | head (module docstring).
      sinks: first tokens of each row always kept (kvpress ``n_sink``, 4).
      chunk: context tokens per reconstruction pass (2048, kvpress).
      carry: tokens of the previous chunk quoted in a later pass's request (8, kvpress).
      page_size, block, implementation: page pool, prefill attention block, decode attention implementation.
      lookahead: the scores extended this many positions forward before selection
        (:func:`kvjax.selection.extend_forward`; 0: none, the paper's).
      query_block: reconstruction queries scored at once (``B * Hq * query_block * (sinks + chunk + pass)`` floats;
        32 scored a 4K context in 0.90x the time of 128 and 0.69x that of 512 on a 2-core CPU).
      allocated: per layer, the prompt tokens each KV head keeps; set by :func:`score_context`, not by users.
    """

    budget: int | float = 0.25
    allocation: str = "global"
    sinks: int = 4
    chunk: int = 2048
    carry: int = 8
    page_size: int = 16
    block: int = 256
    implementation: str = "auto"
    lookahead: int = 0
    query_block: int = 32
    allocated: tuple = ()
    name = "kvzip"

    def __post_init__(self):
        check_budget(self.budget)
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {self.allocation!r}; allowed: {', '.join(ALLOCATIONS)}")
        for field in ("sinks", "carry"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")
        for field in ("chunk", "page_size", "block", "query_block"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        resolve_implementation(self.implementation)
        check_lookahead(self.lookahead)

    # -- protocol
    def rereads_context(self) -> bool:
        """Scored by reconstruction passes (:func:`score_context`) between prefill and compression."""
        return True

    def recording(self) -> None:
        """Its own prefill (its state carries the scores)."""
        return None

    def init_cache(self, spec: CacheSpec, artifact=None) -> Cache:
        """The dense staging plus zero scores per layer."""
        self.artifact_for(spec, artifact)
        if isinstance(self.budget, float) and math.floor(self.budget * spec.longest_row) <= 0:
            raise ValueError(f"budget {self.budget} of a {spec.longest_row}-token prompt keeps no token")
        staging = init_staging(spec, Recording(block=self.block))
        B, Hkv, S = spec.batch, spec.num_kv_heads, spec.prompt_slots
        layers = tuple(KVzipPrefill(st, jnp.zeros((B, Hkv, S), jnp.float32), jnp.zeros((B, 2), jnp.int32),
                                    jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32)) for st in staging)
        return Cache.create(layers, self, spec)

    def prefill_chunk(self, state: KVzipPrefill, q, k, v, ctx):
        """A prompt chunk into the staging; during a reconstruction pass (``ctx.reconstruction``) attend the
        context and the pass, record the scores of the chunk being scored, and keep the staging as it was."""
        if not ctx.reconstruction:
            out, staged = stage_chunk(state.staged, q, k, v, ctx)
            return out, state.replace(staged=staged)
        out, local = reconstruction_attention(q, k, v, state, pad=ctx.pad, sinks=self.sinks, chunk=self.chunk,
                                              query_block=self.query_block, block=self.block)
        B, Hkv, S = state.scores.shape
        lo, n = state.span[:, 0], state.span[:, 1] - state.span[:, 0]
        padded = jnp.concatenate([state.scores, jnp.zeros((B, Hkv, self.chunk), jnp.float32)], axis=-1)
        old = row_slices(padded, lo, self.chunk)
        new = jnp.where((jnp.arange(self.chunk)[None, :] < n[:, None])[:, None, :], local, old)
        padded = jax.vmap(lambda x, u, s: lax.dynamic_update_slice_in_dim(x, u, s, axis=1))(padded, new, lo)
        return out, state.replace(scores=padded[..., :S])

    def finish_prefill(self, state: KVzipPrefill, ctx):
        """The selection over every layer's scores (:func:`select`), the kept pairs into page pools of the
        allocated capacities."""
        if not self.allocated:
            raise ValueError("KVzip scores the context by reconstruction before compression: run "
                             "kvjax.methods.kvzip.score_context on the prefilled cache first (kvjax.generate, ask, "
                             "compare and kvjax eval do)")
        scores = jnp.stack([st.scores for st in ctx.layers]) if self.allocation == "global" else state.scores[None]
        keep = select(scores, ctx.pad, ctx.spec.prompt_slots, state.pruned, self.allocation, self.lookahead)
        keep = keep[ctx.layer] if self.allocation == "global" else keep[0]
        caps = self.allocated[ctx.layer]
        idx, lengths = keep_to_indices(keep, max(caps))
        return self.layout().build(state.staged, idx, lengths, caps, None, ctx.spec)

    def reconstruction_key(self) -> "KVzip":
        """What the scores depend on: configurations with the same key share one :func:`reconstruct` (they differ in
        the budget or the allocation only)."""
        return dataclasses.replace(self, budget=1.0, allocation="global", lookahead=0, allocated=())

    def uniform_allocation(self, spec: CacheSpec) -> "KVzip":
        """This method with every KV head allocated the budget's tokens of the longest row: the layout of a cache
        built without reconstruction (random data at scale, :mod:`kvjax.evals.synthetic`), whose bytes are the budget's."""
        from kvjax.budgets import tokens_per_head

        cap = tokens_per_head(self.budget, spec.longest_row)
        return dataclasses.replace(self, allocated=((cap,) * spec.num_kv_heads,) * spec.num_layers)

    def layout(self) -> PagedAppend:
        """Pages with room, appended after compression."""
        return PagedAppend(self.page_size, self.implementation)

    def decode_attend(self, state, q, k, v, ctx):
        """Append and attend (paged)."""
        return self.layout().decode_attend(state, q, k, v, ctx)

    def state_partition(self, state, spec: CacheSpec):
        """The staging by (row, head) and the scores likewise before compression; the pages after."""
        if isinstance(state, KVzipPrefill):
            from kvjax.sharding import ROWS_HEADS

            return state.replace(staged=staged_partition(state.staged), scores=ROWS_HEADS, span=None, call_len=None,
                                 pruned=None)
        return self.layout().partition(state)

    def stats(self, cache: Cache) -> dict:
        """The pools' facts and the budget's note (nothing before compression)."""
        if cache.stage != "compressed":
            return {}
        return {**self.layout().stats(cache.layers), **budget_facts(self.budget, cache.spec.longest_row)}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Every held pair of every head (0 before compression)."""
        return self.layout().read_bytes(cache.layers) if cache.stage == "compressed" else 0


# ------------------------------------------------------------------------------------ reconstruction attention
def row_slices(x, starts, size: int):
    """``x[b, :, starts[b]:starts[b] + size]`` per row of ``x[B, H, S, ...]`` (``x`` long enough: no clamping)."""
    return jax.vmap(lambda xb, s: lax.dynamic_slice_in_dim(xb, s, size, axis=1))(x, starts)


def reconstruction_attention(q, k, v, state: KVzipPrefill, *, pad, sinks: int, chunk: int, query_block: int,
                             block: int):
    """One layer of a reconstruction pass: ``(output [B, T, Hq, D], scores [B, Hkv, chunk])``.

    The pass's tokens follow the prompt, real first (``call_len[b]`` of them), padding after. The output is the
    pass's real attention (blocked, as a prefill chunk): each query sees every real prompt slot and the pass up to
    itself. The scores follow kvpress: a softmax (f32) over the row's first ``min(sinks, lo - pad)`` slots, the span
    ``[lo, hi)`` being scored and the pass's tokens; for each slot ``lo + j`` of the span (``j < chunk``) the largest
    probability over the real queries and the query group (0 past ``hi``).
    """
    B, T, Hq, D = q.shape
    st = state.staged
    Hkv, S = st.k.shape[1], state.scores.shape[-1]
    G = Hq // Hkv
    scale = D ** -0.5
    k_call, v_call = k.transpose(0, 2, 1, 3).astype(st.k.dtype), v.transpose(0, 2, 1, 3).astype(st.v.dtype)
    extra = -(-(S + T) // block) * block - (S + T)  # keys after every query: masked by causality
    zeros = jnp.zeros((B, Hkv, extra, D), st.k.dtype)
    k_all = jnp.concatenate([st.k[:, :, :S], k_call, zeros], axis=2)
    v_all = jnp.concatenate([st.v[:, :, :S], v_call, zeros], axis=2)
    out = causal_cache_attention(q, k_all, v_all, q_start=S, pad=pad, scale=scale, block=block, implementation="xla")

    lo, hi = state.span[:, 0], state.span[:, 1]
    call_len = state.call_len
    k_pad = jnp.concatenate([st.k[:, :, :S], jnp.zeros((B, Hkv, chunk + sinks, D), st.k.dtype)], axis=2)
    keys = jnp.concatenate([row_slices(k_pad, pad, sinks), row_slices(k_pad, lo, chunk), k_call], axis=2)
    keys = keys.astype(jnp.float32)  # [B, Hkv, sinks + chunk + T, D]
    cols = jnp.arange(sinks + chunk + T)[None, :]
    n_sink = jnp.minimum(sinks, lo - pad)[:, None]
    fixed = (cols < n_sink) | ((cols >= sinks) & (cols < sinks + (hi - lo)[:, None]))  # [B, K]
    j_call = cols - sinks - chunk  # the pass's key index (< 0: not the pass)
    Tb = min(query_block, T)
    nb = -(-T // Tb)
    qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, nb * Tb - T), (0, 0), (0, 0))).reshape(B, nb, Tb, Hkv, G, D)

    def scan_block(best, i):
        rows = i * Tb + jnp.arange(Tb)  # the block's query indices in the pass
        s = jnp.einsum("bthgd,bhkd->bhgtk", qf[:, i], keys, precision=lax.Precision.HIGHEST) * scale
        see = fixed[:, None, :] | ((j_call[:, None, :] >= 0) & (j_call[:, None, :] <= rows[None, :, None])
                                   & (j_call[:, None, :] < call_len[:, None, None]))  # [B, Tb, K]
        p = jax.nn.softmax(jnp.where(see[:, None, None], s, MASK_VALUE), axis=-1)[..., sinks:sinks + chunk]
        real = rows[None, :] < call_len[:, None]  # [B, Tb]
        p = jnp.where(real[:, None, None, :, None], p, 0.0)
        return jnp.maximum(best, p.max(axis=(2, 3))), None

    scores, _ = lax.scan(scan_block, jnp.zeros((B, Hkv, chunk), jnp.float32), jnp.arange(nb))
    in_span = jnp.arange(chunk)[None, :] < (hi - lo)[:, None]
    return out.astype(q.dtype), jnp.where(in_span[:, None, :], scores, 0.0)


# ------------------------------------------------------------------------------------------------- selection
def pruned_counts(method: KVzip, row_lengths: np.ndarray, num_layers: int, num_kv_heads: int) -> np.ndarray:
    """Pairs each row evicts (host integers, kvpress's arithmetic): ``[B]`` over the whole model (``global``),
    per layer (``layer``) or per KV head (``head``); -1 when a budget at or above the row keeps all of it."""
    out = []
    for n in row_lengths.tolist():
        kept_fraction = min(1.0, method.budget / n) if isinstance(method.budget, int) else float(method.budget)
        ratio = 1.0 - kept_fraction
        if ratio <= 0:
            out.append(-1)
            continue
        units = {"global": num_layers * num_kv_heads * n, "layer": num_kv_heads * n, "head": n}[method.allocation]
        if isinstance(method.budget, int):
            out.append(units - {"global": num_layers * num_kv_heads, "layer": num_kv_heads, "head": 1}[method.allocation]
                       * min(method.budget, n))
        elif method.allocation == "head":  # kvjax's budget: floor(budget * n) kept per head
            out.append(n - max(1, math.floor(method.budget * n)))
        else:  # kvpress' arithmetic
            out.append(int(units * ratio))
    return np.asarray(out, np.int64)


def select(scores, pad, prompt_slots: int, pruned, allocation: str, lookahead: int = 0):
    """Keep masks ``[L, B, Hkv, S]`` from the scores ``[L, B, Hkv, S]`` (every layer for ``global``, one layer at a
    time otherwise), extended forward by ``lookahead`` (:func:`kvjax.selection.extend_forward`): padding is never
    kept, and ``pruned[b]`` pairs of the lowest scores are evicted per row over the model (``global``: every pair at or
    below the ``max(pruned - 1, 0)``-th smallest score, ties included, kvpress), per layer or per head (lowest first,
    ties by position); ``pruned[b] < 0`` keeps the whole row."""
    L, B, Hkv, S = scores.shape
    slots = jnp.arange(S)
    real = (slots[None, :] >= pad[:, None]) & (slots[None, :] < prompt_slots)  # [B, S]
    s = extend_forward(scores, lookahead)
    pruned = jnp.asarray(pruned, jnp.int32)
    real_b = jnp.broadcast_to(real[None, :, None], s.shape)
    if allocation == "global":
        flat = jnp.where(real_b, s, jnp.inf).transpose(1, 0, 2, 3).reshape(B, -1)
        ordered = jnp.sort(flat, axis=-1)
        thr = jnp.take_along_axis(ordered, jnp.maximum(pruned - 1, 0)[:, None], axis=-1)[:, 0]  # [B]
        keep = s > thr[None, :, None, None]
        return jnp.where((pruned >= 0)[None, :, None, None], keep, True) & real_b
    if allocation == "layer":
        x = jnp.where(real_b, s, jnp.inf).reshape(L, B, Hkv * S)
    else:
        x = jnp.where(real_b, s, jnp.inf)
    order = jnp.argsort(x, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)  # 0 = lowest score
    keep = (rank >= jnp.maximum(pruned, 0).reshape((1, B) + (1,) * (x.ndim - 2))).reshape(L, B, Hkv, S)
    return keep & real_b


@functools.partial(jax.jit, static_argnames=("prompt_slots", "allocation", "lookahead"), donate_argnames=("cache",))
def _select_jit(cache: Cache, pruned, *, prompt_slots: int, allocation: str, lookahead: int):
    """The rows' evicted counts into every layer's state, and the kept pairs per (layer, KV head), largest row."""
    keep = select(jnp.stack([st.scores for st in cache.layers]), cache.pad, prompt_slots, pruned, allocation,
                  lookahead)
    layers = tuple(st.replace(pruned=jnp.asarray(pruned, jnp.int32)) for st in cache.layers)
    return cache.replace(layers=layers), keep.sum(-1).max(axis=1)


@functools.partial(jax.jit, static_argnames=("prefix", "sinks"), donate_argnames=("cache",))
def _template_scores_jit(cache: Cache, *, prefix: int, sinks: int) -> Cache:
    """The template before each row's context is never reconstructed: its first ``sinks`` slots score 1, the rest 0
    (kvpress; the passes then write the context's own scores, a sink inside the context among them)."""
    S = cache.layers[0].scores.shape[-1]
    slots = jnp.arange(S)[None, :]
    sink = (slots >= cache.pad[:, None]) & (slots < cache.pad[:, None] + min(sinks, prefix))
    return cache.replace(layers=tuple(st.replace(scores=jnp.broadcast_to(jnp.where(sink[:, None, :], 1.0, 0.0),
                                                                      st.scores.shape)) for st in cache.layers))


# ------------------------------------------------------------------------------------------------ the passes
@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _reconstruct_jit(graphdef, params, tokens, positions, span, call_len, cache: Cache) -> Cache:
    layers = tuple(st.replace(span=span, call_len=call_len) for st in cache.layers)
    model = nnx.merge(graphdef, params)
    _, new = model(tokens, positions, cache.replace(layers=layers, stage="reconstruction"), last_only=True)
    return new.replace(stage="prefill", length=cache.length)


def reconstruction_passes(tokens: np.ndarray, pad: np.ndarray, prompt: ReconstructionPrompt, chunk: int, carry: int):
    """The passes of a left-padded batch ``tokens[B, P]``: a list of ``(pass tokens [B, T], span [B, 2],
    call_len [B])``, every pass right-padded to one length ``T`` (one compilation). Row ``b``'s context is
    ``tokens[b, pad[b] + prompt.prefix:]``, cut into chunks of ``chunk`` from its start (kvpress); a row without a
    chunk in a pass has ``call_len`` 0 and an empty span."""
    B, P = tokens.shape
    T = max(len(prompt.later) + carry, len(prompt.first)) + len(prompt.suffix) + chunk
    starts = pad + prompt.prefix
    if np.any(starts >= P):
        raise ValueError(f"KVzip needs context after the template's {prompt.prefix} prefix tokens; a row of "
                         f"{int(P - pad.max())} tokens has none")
    counts = -(-(P - starts) // chunk)
    passes = []
    for i in range(int(counts.max())):
        rows = np.zeros((B, T), np.int32)
        span = np.zeros((B, 2), np.int32)
        call_len = np.zeros((B,), np.int32)
        for b in range(B):
            if i >= counts[b]:
                continue
            lo = int(starts[b]) + i * chunk
            hi = min(lo + chunk, P)
            request = list(prompt.first) if i == 0 else list(prompt.later) + tokens[b, max(lo - carry, starts[b]):lo].tolist()
            ids = request + list(prompt.suffix) + tokens[b, lo:hi].tolist()
            rows[b, :len(ids)] = ids
            span[b] = (lo, hi)
            call_len[b] = len(ids)
        passes.append((rows, span, call_len))
    return passes


def reconstruct(graphdef, params, cache: Cache, tokens, prompt: ReconstructionPrompt) -> Cache:
    """Run KVzip's reconstruction passes on a prefilled cache: every layer's state holds the scores (the cache is
    donated). The scores depend on ``sinks``, ``chunk`` and ``carry``, not on the budget: :func:`allocate` then selects
    for a budget, and one reconstruction can serve several (:meth:`KVzip.reconstruction_key`)."""
    method = cache.method
    if not isinstance(method, KVzip):
        raise ValueError(f"score_context needs a KVzip cache, got one of method {getattr(method, 'name', method)!r}")
    if cache.stage != "prefill" or int(cache.length) != cache.spec.prompt_slots:
        raise ValueError("score_context runs after the whole prompt is prefilled and before compression")
    tokens = np.asarray(tokens, np.int32)
    pad = np.asarray(cache.pad, np.int32)
    P = cache.spec.prompt_slots
    if tokens.shape != (cache.spec.batch, P):
        raise ValueError(f"tokens of shape {tokens.shape} are not the cache's prompt ({cache.spec.batch}, {P})")
    passes = reconstruction_passes(tokens, pad, prompt, method.chunk, method.carry)
    n_real = P - pad
    cache = _template_scores_jit(cache, prefix=prompt.prefix, sinks=method.sinks)
    for rows, span, call_len in passes:
        positions = (n_real[:, None] + np.arange(rows.shape[1])[None, :]).astype(np.int32)
        cache = _reconstruct_jit(graphdef, params, jnp.asarray(rows), jnp.asarray(positions), jnp.asarray(span),
                                 jnp.asarray(call_len), cache)
    return cache


def allocate(cache: Cache) -> Cache:
    """Select the kept pairs of a reconstructed cache for its method's budget and allocation, and fix the
    ``allocated`` capacities (each (layer, KV head)'s kept count, the largest over the rows) on the method. Compress
    it next. The cache is donated."""
    method, spec = cache.method, cache.spec
    n_real = spec.prompt_slots - np.asarray(cache.pad, np.int64)
    pruned = pruned_counts(method, n_real, spec.num_layers, spec.num_kv_heads)
    cache, kept = _select_jit(cache, jnp.asarray(pruned, jnp.int32), prompt_slots=spec.prompt_slots,
                              allocation=method.allocation, lookahead=method.lookahead)
    allocated = tuple(tuple(max(1, int(c)) for c in layer) for layer in np.asarray(kept))
    return cache.replace(method=dataclasses.replace(method, allocated=allocated))


def score_context(graphdef, params, cache: Cache, tokens, prompt: ReconstructionPrompt) -> Cache:
    """:func:`reconstruct` then :func:`allocate`: run KVzip's passes on a prefilled cache (``tokens[B, P]``, the prompt
    it was prefilled with, left-padded as ``cache.pad`` says), select, and fix the allocation. Returns the
    prefill-stage cache whose method carries the ``allocated`` capacities; compress it next
    (``kvjax.decoding.compress``). The cache is donated."""
    return allocate(reconstruct(graphdef, params, cache, tokens, prompt))
