"""Token selection for evict-after-prefill methods: scorers, allocators and selectors, composed per method.

A compressing method is a composition (``kvjax.methods.base.PromptCompression``):

* a **scorer** maps one layer's staging (:class:`kvjax.staging.StagedKV`) to f32 scores per KV head
  and slot ``[B, Hkv, S]`` and declares what the staging must record;
* an **allocator** gives each layer and KV head its capacity (prompt tokens kept) for the longest
  row, and each row its own share (:func:`row_capacities`);
* a **selector** turns scores and per-row capacities into a keep mask ``[B, Hkv, S]``;
* a **layout** (``kvjax.methods.base``) stores the kept tokens (pages with room, or H2O's evicting pool).

The scorers also rescore a bounded working buffer while it is prefilled in pieces
(:mod:`kvjax.bounded_prefill`, used by ``kvjax.methods.chunked_eviction``): ``held_scores`` maps the
previous priorities, one piece's attention probabilities and the buffer's slots to new priorities,
and ``needs_probs`` says whether it reads the probabilities.

Selection works on *slots*: row ``b``'s real prompt tokens are slots ``pad[b] .. P - 1`` (``P`` =
prompt slots). Padding is never kept, and a row never keeps more than its own capacity, so a budget
at or above a row's length keeps exactly that row's tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.attention import MASK_VALUE
from kvjax.budgets import check_budget, tokens_per_head
from kvjax.cache import CacheSpec
from kvjax.staging import Recording, StagedKV

GQA_AGGREGATIONS = ("mean", "max")
NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------------------- helpers
def gqa_aggregate(scores, num_kv_heads: int, how: str):
    """``[B, Hq, S]`` -> ``[B, Hkv, S]`` by mean or max over each KV head's query group."""
    B, Hq, S = scores.shape
    g = scores.reshape(B, num_kv_heads, Hq // num_kv_heads, S)
    if how == "mean":
        return g.mean(axis=2)
    if how == "max":
        return g.max(axis=2)
    raise ValueError(f"unknown GQA aggregation {how!r}; allowed: {', '.join(GQA_AGGREGATIONS)}")


def pool1d(x, valid, kernel: int, how: str):
    """Stride-1 pooling over the last axis with padding ``kernel // 2``, restricted to ``valid`` entries.

    ``avg`` divides by ``kernel`` (zeros outside, PyTorch's ``count_include_pad=True``, as SnapKV);
    ``max`` ignores entries outside ``valid``. ``kernel=1`` returns ``x``.
    """
    if kernel == 1:
        return x
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd, got {kernel}")
    dims = (1,) * (x.ndim - 1) + (kernel,)
    pads = [(0, 0)] * (x.ndim - 1) + [(kernel // 2, kernel // 2)]
    if how == "avg":
        return lax.reduce_window(jnp.where(valid, x, 0.0), 0.0, lax.add, dims, (1,) * x.ndim, pads) / kernel
    if how == "max":
        return lax.reduce_window(jnp.where(valid, x, NEG_INF), NEG_INF, lax.max, dims, (1,) * x.ndim, pads)
    raise ValueError(f"unknown pooling {how!r}; allowed: avg, max")


def check_lookahead(lookahead) -> None:
    """A look-ahead is a whole number of positions, >= 0."""
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
        raise ValueError(f"lookahead must be an int >= 0, got {lookahead!r}")


def extend_forward(scores, lookahead: int):
    """Each position's score raised to the largest of the ``lookahead`` positions before it (``scores[..., S]``).

    What a method's scores single out is where reading starts (the key of a needle, a question, the first token of a
    copy), less the tokens after it: a long value (a UUID, a 7-digit number) is then kept without its tail. Extended
    forward, a kept token holds the next ``lookahead`` tokens too: the step every scorer shares (``lookahead`` of the
    evict-after-prefill methods, KVzip and the recall family; docs/ARCHITECTURE.md)."""
    check_lookahead(lookahead)
    if lookahead == 0:
        return scores
    window = (1,) * (scores.ndim - 1) + (lookahead + 1,)
    pad = ((0, 0),) * (scores.ndim - 1) + ((lookahead, 0),)
    return lax.reduce_window(scores, -jnp.inf, lax.max, window, (1,) * scores.ndim, pad)


def small_median(x, axis: int = 0):
    """``jnp.median(x, axis)`` of finite values along a short axis, without a sort: an odd count takes the element
    of middle rank (ranks by comparisons, ties by position: the value a sort gives), which the compiler fuses with
    its neighbours where a sort is a kernel of its own on a GPU; an even count is ``jnp.median``."""
    n = x.shape[axis]
    if n % 2 == 0:
        return jnp.median(x, axis=axis)
    x = jnp.moveaxis(x, axis, 0)
    i = jnp.arange(n).reshape((n, 1) + (1,) * (x.ndim - 1))
    j = jnp.arange(n).reshape((1, n) + (1,) * (x.ndim - 1))
    xi, xj = x[:, None], x[None, :]
    rank = ((xj < xi) | ((xj == xi) & (j < i))).sum(axis=1)  # [n, ...]
    return jnp.where(rank == n // 2, x, 0).sum(axis=0)


def slot_masks(pad, S: int, prompt_slots: int, protect):
    """(real [B, S], prefix [B, S]): the row's real prompt slots, and those before its last ``protect`` slots.

    ``protect`` is an int or an int array broadcastable to ``[B, 1]``.
    """
    slots = jnp.arange(S)[None, :]
    real = (slots >= pad[:, None]) & (slots < prompt_slots)
    return real, real & (slots < prompt_slots - jnp.asarray(protect).reshape(-1, 1))


def rank_desc(scores, candidates):
    """Rank (0 = best) of each candidate by descending score along the last axis (ties: lower index first).

    Non-candidates get a rank past every candidate.
    """
    s = jnp.where(candidates, scores, NEG_INF)
    order = jnp.argsort(-s, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    return jnp.where(candidates, rank, scores.shape[-1])


def keep_top(scores, forced, candidates, cap):
    """Keep mask of at most ``cap`` slots: forced slots first (the most recent if they exceed ``cap``),
    then candidates by descending score.

    ``cap``: int or int array broadcastable to ``scores.shape[:-1]`` (per row / head).
    """
    cap = jnp.asarray(cap)[..., None] if jnp.ndim(cap) else cap
    n_forced = forced.sum(axis=-1, keepdims=True)
    later_forced = n_forced - jnp.cumsum(forced, axis=-1)  # forced slots after this one
    keep_forced = forced & (later_forced < cap)
    cand = candidates & ~forced
    return keep_forced | (cand & (rank_desc(scores, cand) < cap - n_forced))


def keep_to_indices(keep, capacity: int):
    """(kept slots ascending ``[..., capacity]`` int32, count ``[...]``); entries past the count are unused."""
    idx = jnp.argsort(~keep, axis=-1, stable=True)[..., :capacity].astype(jnp.int32)
    return idx, jnp.minimum(keep.sum(axis=-1), capacity).astype(jnp.int32)


def piece_attention(probs, first: int, how: str):
    """Attention of a piece's queries from index ``first`` on, summed over them and aggregated over the GQA group.

    ``probs[B, Hkv, G, P, C]``: the piece's ``P`` queries' probabilities over ``C`` buffer entries -> ``[B, Hkv, C]``.
    """
    B, Hkv, G, _, C = probs.shape
    return gqa_aggregate(probs[:, :, :, first:].sum(axis=3).reshape(B, Hkv * G, C), Hkv, how)


def window_attention(q_window, k, pad, prompt_slots: int):
    """Softmax (f32) of the last W prompt queries over the prompt's keys, summed over the window: [B, Hq, S].

    Window queries in a row's left padding (rows shorter than the window) contribute nothing.
    """
    B, W, Hq, D = q_window.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q_window.reshape(B, W, Hkv, Hq // Hkv, D).astype(jnp.float32)
    s = jnp.einsum("bwhgd,bhsd->bhgws", qg, k.astype(jnp.float32), precision=lax.Precision.HIGHEST) * D**-0.5
    q_slots = prompt_slots - W + jnp.arange(W)
    slots = jnp.arange(S)
    mask = (slots[None, None, :] <= q_slots[None, :, None]) & (slots[None, None, :] >= pad[:, None, None])
    p = jax.nn.softmax(jnp.where(mask[:, None, None], s, MASK_VALUE), axis=-1)
    p = jnp.where((q_slots[None, :] >= pad[:, None])[:, None, None, :, None], p, 0.0)
    return p.sum(axis=-2).reshape(B, Hq, S)


# ----------------------------------------------------------------------------------------- scorers
@dataclasses.dataclass(frozen=True)
class WindowAttentionScores:
    """SnapKV scores: the last ``window`` prompt queries attend (causally, f32 softmax) to all keys,
    summed over the window, pooled over the prefix (``kernel``, avg | max), aggregated over the GQA group."""

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"
    needs_probs = True

    def recording(self, block: int) -> Recording:
        """The staging must keep the last ``window`` queries."""
        return Recording(window=self.window, block=block)

    def __call__(self, st: StagedKV, pad, prompt_slots: int):
        """Scores ``[B, Hkv, S]``."""
        sums = window_attention(st.q_window[:, st.q_window.shape[1] - self.window:], st.k, pad, prompt_slots)
        _, prefix = slot_masks(pad, sums.shape[-1], prompt_slots, self.window)
        pooled = pool1d(sums, prefix[:, None, :], self.kernel, self.pooling)
        return gqa_aggregate(pooled, st.k.shape[1], self.gqa)

    def held_scores(self, previous, probs, slots):
        """A bounded buffer's priorities ``[B, Hkv, C]`` after a piece: its last ``window`` queries' attention.

        The sums are aggregated over the GQA group first, then pooled over neighbouring *held* entries
        in slot order (``slots`` -1 = empty; the buffer is compacted, so neighbours may be distant
        slots). ``previous`` is not used: each piece's window replaces the scores.
        """
        P = probs.shape[3]
        s = piece_attention(probs, P - min(self.window, P), self.gqa)
        if self.kernel == 1:
            return s
        held = slots >= 0
        order = jnp.argsort(jnp.where(held, slots, jnp.iinfo(jnp.int32).max), axis=-1, stable=True)
        ranked, ranked_held = (jnp.take_along_axis(x, order, axis=-1) for x in (s, held))
        pooled = pool1d(ranked, ranked_held, self.kernel, self.pooling)
        return jnp.take_along_axis(pooled, jnp.argsort(order, axis=-1), axis=-1)


@dataclasses.dataclass(frozen=True)
class AccumulatedAttentionScores:
    """H2O scores: attention of every prompt query (causal, f32), summed per key, aggregated over the GQA group."""

    gqa: str = "mean"
    needs_probs = True

    def recording(self, block: int) -> Recording:
        """The staging must accumulate attention."""
        return Recording(accumulate=True, block=block)

    def __call__(self, st: StagedKV, pad, prompt_slots: int):
        """Scores ``[B, Hkv, S]``."""
        return gqa_aggregate(st.acc, st.k.shape[1], self.gqa)

    def held_scores(self, previous, probs, slots):
        """A bounded buffer's priorities ``[B, Hkv, C]`` after a piece: ``previous`` plus every query's attention."""
        return previous + piece_attention(probs, 0, self.gqa)


@dataclasses.dataclass(frozen=True)
class RecencyScores:
    """StreamingLLM's order: later slots score higher."""

    needs_probs = False

    def recording(self, block: int) -> Recording:
        """Nothing to record."""
        return Recording(block=block)

    def __call__(self, st: StagedKV, pad, prompt_slots: int):
        """Scores ``[B, Hkv, S]`` = slot index."""
        B, Hkv, S, _ = st.k.shape
        return jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32), (B, Hkv, S))

    def held_scores(self, previous, probs, slots):
        """A bounded buffer's priorities ``[B, Hkv, C]``: each held entry's slot (``probs`` may be None)."""
        return slots.astype(jnp.float32)


# -------------------------------------------------------------------------------------- allocators
@dataclasses.dataclass(frozen=True)
class UniformCapacity:
    """Every layer and KV head keeps the budget's tokens per head."""

    def capacities(self, budget, spec: CacheSpec) -> tuple[tuple[int, ...], ...]:
        """Per layer, per KV head capacity for the longest row."""
        cap = tokens_per_head(budget, spec.longest_row)
        return ((cap,) * spec.num_kv_heads,) * spec.num_layers


@dataclasses.dataclass(frozen=True)
class PyramidCapacity:
    """PyramidKV: ``window +`` a per-layer budget linear from max (layer 0) to min = (C - w) / beta."""

    window: int = 32
    beta: float = 20.0

    def capacities(self, budget, spec: CacheSpec) -> tuple[tuple[int, ...], ...]:
        """Per layer (same for every KV head of a layer); the mean over layers is the budget."""
        avg = tokens_per_head(budget, spec.longest_row)
        caps = pyramid_capacities(spec.num_layers, avg, min(self.window, avg), self.beta, limit=spec.longest_row)
        return tuple((c,) * spec.num_kv_heads for c in caps)


def pyramid_capacities(num_layers: int, average: int, window: int, beta: float, limit: int | None = None) -> tuple[int, ...]:
    """Per-layer capacities: ``window +`` a budget linear from max (layer 0) to min = (C - w) / beta.

    max = 2 (C - w) - min, so the mean over layers is C; integer rounding is corrected so the total
    equals ``num_layers * average`` exactly. Capacities above ``limit`` (the longest row) are clipped
    and the excess is given to the other layers, largest first (a budget equal to the prompt keeps
    everything in every layer).
    """
    c = average - window
    lo = c / beta
    hi = 2 * c - lo
    raw = [float(c)] if num_layers == 1 else [hi - (hi - lo) * i / (num_layers - 1) for i in range(num_layers)]
    caps = [int(x) for x in raw]
    short = num_layers * c - sum(caps)
    for i in sorted(range(num_layers), key=lambda i: raw[i] - caps[i], reverse=True)[:short]:
        caps[i] += 1
    caps = [window + x for x in caps]
    if limit is not None:
        excess = sum(max(0, c - limit) for c in caps)
        caps = [min(c, limit) for c in caps]
        while excess > 0:
            room = [i for i in range(num_layers) if caps[i] < limit]
            if not room:
                break
            for i in room[:excess]:
                caps[i] += 1
            excess -= min(excess, len(room))
    return tuple(caps)


def row_capacities(head_caps, budget, spec: CacheSpec, pad):
    """Prompt tokens each row keeps per KV head, ``[B, Hkv]`` int32, from the heads' capacities ``head_caps``.

    The capacities are for the longest row. A row of ``n`` real tokens keeps ``min(cap, n)`` for an
    int budget, and its proportional share ``max(1, floor(cap * n / longest))`` for a fractional one
    (a float budget applies to each row's own length, never to padding).
    """
    check_budget(budget)
    n = (spec.prompt_slots - pad).astype(jnp.int32)[:, None]  # [B, 1]
    caps = jnp.asarray(head_caps, jnp.int32)[None, :]
    if isinstance(budget, int):
        return jnp.minimum(caps, n)
    share = (caps * n) // spec.longest_row
    return jnp.minimum(jnp.maximum(share, jnp.minimum(n, 1)), n).astype(jnp.int32)


# --------------------------------------------------------------------------------------- selectors
@dataclasses.dataclass(frozen=True)
class TopTokens:
    """The last ``protect`` prompt slots (SnapKV's window) forced, then the best-scored tokens."""

    protect: int = 0

    def __call__(self, scores, pad, prompt_slots: int, row_caps, head_caps):
        """Keep mask ``[B, Hkv, S]``."""
        real, prefix = slot_masks(pad, scores.shape[-1], prompt_slots, self.protect)
        return keep_top(scores, (real & ~prefix)[:, None, :], prefix[:, None, :], row_caps)


@dataclasses.dataclass(frozen=True)
class RecentAndTop:
    """H2O: the most recent ``int(cap * recent_ratio)`` prompt slots of each row forced, then the best-scored."""

    recent_ratio: float = 0.5

    def __call__(self, scores, pad, prompt_slots: int, row_caps, head_caps):
        """Keep mask ``[B, Hkv, S]``."""
        S = scores.shape[-1]
        recent = jnp.floor(row_caps * self.recent_ratio).astype(jnp.int32)  # [B, Hkv]
        slots = jnp.arange(S)[None, None, :]
        real = ((slots >= pad[:, None, None]) & (slots < prompt_slots))
        forced = real & (slots >= prompt_slots - recent[..., None])
        return keep_top(scores, forced, real & ~forced, row_caps)


@dataclasses.dataclass(frozen=True)
class SinksAndRecent:
    """StreamingLLM: the first ``sinks`` real tokens of each row, then the most recent (scores = recency)."""

    sinks: int = 4

    def __call__(self, scores, pad, prompt_slots: int, row_caps, head_caps):
        """Keep mask ``[B, Hkv, S]``; sinks win over recent tokens when the row's capacity is smaller."""
        S = scores.shape[-1]
        slots = jnp.arange(S)[None, :]
        real = (slots >= pad[:, None]) & (slots < prompt_slots)
        sink = real & (slots < pad[:, None] + self.sinks)
        # priority: sinks (by position) first, then recency
        priority = jnp.where(sink, 2.0 * S - slots, slots.astype(jnp.float32))[:, None, :]
        return keep_top(jnp.broadcast_to(priority, scores.shape), jnp.zeros(scores.shape, bool), real[:, None, :], row_caps)


# :func:`top_p_select`'s search per backend: (bits of the threshold found per pass over the masses, whether each
# pass is one multi-output reduction). Accelerators are bound by the reads, a CPU by the compares.
TOP_P_SEARCH = {"cpu": (2, False)}
TOP_P_SEARCH_ACCELERATOR = (4, True)


def top_p_select(mass, total, forced, tau: float, *, digit_bits: int | None = None, one_read: bool | None = None):
    """Eq. 4 per query: the tokens of largest mass whose cumulative mass, after ``forced``, reaches ``tau * total``.

    Args:
      mass: non-negative unnormalised probabilities ``[..., S]`` of the candidate tokens.
      total: ``[...]`` the softmax normaliser (candidates plus ``forced``).
      forced: ``[...]`` mass of tokens that are always kept (counted before any candidate).
      tau: threshold in (0, 1]; ``tau >= 1`` keeps every candidate with non-zero mass.
      digit_bits: bits of the threshold found per pass over the masses.
      one_read: sum each pass's thresholds in one multi-output reduction.
      Both default to :data:`TOP_P_SEARCH` for the backend jax traces for (:data:`TOP_P_SEARCH_ACCELERATOR` for
      any other).

    Returns:
      bool ``[..., S]``: ``mass >= t`` for the largest value ``t`` whose set reaches the target, i.e. the
      ``k*`` largest masses of Eq. 4. Tokens tied with the ``k*``-th are all kept (the set does not depend
      on the order of positions). Nothing is selected when ``forced`` alone reaches the target.

    Sort-free and exact: ``t`` is found digit by digit over the bit patterns of the (non-negative) float32 masses
    (a radix search over 31 bits), each pass summing the masses at or above ``2**digit_bits - 1`` candidate
    thresholds, so the masses are read ``ceil(31 / digit_bits)`` times. On an accelerator the reads bound it: 8 passes
    of 15 thresholds, each one multi-output reduction. On a CPU the compares bound it: 16 passes of 3. Both choices
    and the sort this replaces are measured in ``docs/RESULTS.md`` (HCAttention).
    """
    mass = mass.astype(jnp.float32)
    if tau >= 1.0:
        return mass > 0
    default_bits, default_one_read = TOP_P_SEARCH.get(jax.default_backend(), TOP_P_SEARCH_ACCELERATOR)
    digit_bits = default_bits if digit_bits is None else digit_bits
    one_read = default_one_read if one_read is None else one_read
    if not 1 <= digit_bits <= 8:
        raise ValueError(f"digit_bits must be in [1, 8], got {digit_bits}")
    target = tau * total - forced
    bits = lax.bitcast_convert_type(mass, jnp.int32)  # monotone in the value for non-negative floats
    lo = jnp.zeros(target.shape, jnp.int32)  # invariant: the masses at or above lo reach the target
    left = 31
    while left > 0:
        width = min(digit_bits, left)
        left -= width
        thresholds = [lo + (j << left) for j in range(1, 1 << width)]
        reached = _masses_at_or_above(bits, mass, thresholds, one_read=one_read) >= target[..., None]
        lo = lo + (reached.sum(-1).astype(jnp.int32) << left)  # sums fall as the threshold grows
    return (bits >= lo[..., None]) & (mass > 0) & (target > 0)[..., None]


def _masses_at_or_above(bits, mass, thresholds, *, one_read: bool):
    """``[..., k]``: per threshold, the sum of the masses whose bits are at or above it. ``one_read``: one variadic
    reduction (every threshold's sum from one read of each mass); else one reduction over a broadcast
    ``[..., k, S]`` (XLA:CPU runs it faster)."""
    if one_read:
        parts = tuple(jnp.where(bits >= t[..., None], mass, 0.0) for t in thresholds)
        sums = lax.reduce(parts, tuple(jnp.float32(0) for _ in parts),
                          lambda a, b: tuple(x + y for x, y in zip(a, b)), (mass.ndim - 1,))
        return jnp.stack(sums, -1)
    t = jnp.stack(thresholds, -1)
    return jnp.where(bits[..., None, :] >= t[..., :, None], mass[..., None, :], 0.0).sum(-1)
