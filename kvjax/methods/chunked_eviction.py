"""SnapKV, H2O and StreamingLLM evicting *during* chunked prefill with bounded memory (Locret's baselines).

The Locret paper compares against cache-eviction methods run with the same chunked prefill and the
same fixed budget (its Fig. 6a: SnapKV with chunked prefill). This method is Locret's schedule
(:mod:`kvjax.bounded_prefill`: pieces of ``chunk`` tokens, a buffer of at most
``b + n_loc + B`` tokens per KV head, the last ``n_loc`` prompt tokens never evicted) with one of
the baselines' scores instead of a trained head. The scores are those of :mod:`kvjax.selection`'s
scorers, rescoring the held tokens after each piece (their ``held_scores``):

* ``"snapkv"`` (:class:`~kvjax.selection.WindowAttentionScores`): the attention of the piece's last
  ``window`` queries over the held tokens (f32 softmax, summed over the window, mean over the GQA
  group), max-pooled over ``kernel`` neighbouring held tokens; the window itself is kept
  (stabilizers = ``window``);
* ``"h2o"`` (:class:`~kvjax.selection.AccumulatedAttentionScores`): accumulated attention: each
  piece adds every query's attention (mean over the group) to the held tokens' scores; the recent
  half of ``b`` is forced (stabilizers = 0.5);
* ``"streaming_llm"`` (:class:`~kvjax.selection.RecencyScores`): the ``sinks`` first tokens of each
  row plus the most recent ones.

Deviations: the static methods (``snapkv``, ``h2o``, ``streaming_llm``) see the whole prompt before
choosing; here every choice is made with the tokens seen so far, as the bounded memory requires.
SnapKV's pooling runs over neighbouring *held* tokens (the buffer is compacted; neighbours may be
distant slots). Stabilizers, like Locret's, are not forced after the last piece; the local window
(``n_loc``) and sinks always are. Decoding appends and does not evict.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kvjax.bounded_prefill import (BoundedPrefill, bounded_sizes, check_schedule, chunk_tokens, init_bounded, paged_facts,
                                   prefill_in_pieces)
from kvjax.budgets import budget_facts, check_budget
from kvjax.cache import AttendContext, Cache, CacheSpec
from kvjax.methods.base import BoundedEvictionMethod, NoArtifact
from kvjax.selection import AccumulatedAttentionScores, RecencyScores, WindowAttentionScores

SCORERS = ("snapkv", "h2o", "streaming_llm")
DEFAULT_STABILIZERS = {"h2o": 0.5, "streaming_llm": 0}


@dataclasses.dataclass(frozen=True)
class ChunkedEviction(NoArtifact, BoundedEvictionMethod):
    """A baseline's scores under Locret's bounded chunked prefill (see module docstring).

    Args:
      scorer: snapkv | h2o | streaming_llm.
      budget: tokens kept per KV head (int) or fraction of the prompt's KV bytes (float), the local
        window (and sinks) included.
      chunk: tokens prefilled between evictions (B): an int, or a float fraction of ``b`` (Locret's
        default is 1/16; SnapKV's scorer needs pieces of at least ``window`` tokens).
      local: the last prompt tokens never evicted (n_loc, Locret's 100).
      stabilizers: last tokens forced after each piece but the last (int, or a fraction of b);
        None: the scorer's own rule (snapkv: ``window``; h2o: 0.5; streaming_llm: 0).
      window, kernel: SnapKV's observation window and pooling kernel.
      sinks: StreamingLLM's first tokens always kept (0 for the other scorers).
      page_size, implementation: the decode layout's page size and attention implementation.
    """

    scorer: str = "snapkv"
    budget: int | float = 0.25
    chunk: int | float = 1024
    local: int = 100
    stabilizers: int | float | None = None
    window: int = 32
    kernel: int = 7
    sinks: int = 4
    page_size: int = 16
    implementation: str = "auto"
    name = "chunked_eviction"

    def __post_init__(self):
        if self.scorer not in SCORERS:
            raise ValueError(f"chunked_eviction: scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")
        check_budget(self.budget)
        check_schedule(self.name, self.chunk, self.local, self.n_stabilizers)
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0 or self.sinks < 0:
            raise ValueError(f"chunked_eviction: need window >= 1, an odd kernel >= 1 and sinks >= 0, got "
                             f"{self.window}, {self.kernel}, {self.sinks}")
        self.check_paging()

    @property
    def n_stabilizers(self) -> int | float:
        """The stabilizers in effect (the scorer's rule when ``stabilizers`` is None)."""
        if self.stabilizers is not None:
            return self.stabilizers
        return self.window if self.scorer == "snapkv" else DEFAULT_STABILIZERS[self.scorer]

    # -- scorers
    def scores(self) -> WindowAttentionScores | AccumulatedAttentionScores | RecencyScores:
        """The :mod:`kvjax.selection` scorer named by ``scorer`` (max pooling and mean over the GQA group)."""
        if self.scorer == "snapkv":
            return WindowAttentionScores(self.window, self.kernel, pooling="max", gqa="mean")
        return AccumulatedAttentionScores(gqa="mean") if self.scorer == "h2o" else RecencyScores()

    def rescore(self, buf, probs, start):
        """Priorities ``[B, Hkv, C]`` of the held tokens after a piece is stored."""
        return self.scores().held_scores(buf.scores, probs, buf.slots)

    # -- protocol
    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Bounded working buffers of ``budget + chunk`` tokens per KV head."""
        self.artifact_for(spec, artifact)
        sinks = self.sinks if self.scorer == "streaming_llm" else 0
        layers = init_bounded(spec, self.name, self.budget, self.chunk, self.local, self.n_stabilizers, sinks)
        return Cache.create(layers, self, spec)

    def prefill_chunk(self, state: BoundedPrefill, q, k, v, ctx: AttendContext):
        """The bounded schedule with this scorer."""
        zeros = jnp.zeros((*k.shape[:3],), jnp.float32)
        return prefill_in_pieces(state, q, k, v, ctx, zeros, self.rescore, needs_probs=self.scores().needs_probs)

    def stats(self, cache: Cache) -> dict:
        """Sizes, the prefill buffer bound, kept tokens per head and the page pools' bytes."""
        b, n_s = bounded_sizes(self.name, self.budget, self.local, self.n_stabilizers, cache.spec)
        B = chunk_tokens(self.chunk, b)
        facts = {"scorer": self.scorer, "b": b, "stabilizers": n_s, "local": self.local, "chunk": B,
                 "prefill_buffer_tokens_per_head": b + self.local + B}
        return {**facts, **paged_facts(cache), **budget_facts(self.budget, cache.spec.longest_row)}
