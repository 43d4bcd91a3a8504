"""Locret (Huang et al.): trained retaining heads score each token; chunked prefill evicts to a fixed budget.

Algorithm 1 of the paper, per layer and KV head, with device memory bounded by ``b + n_loc + B``
tokens whatever the prompt's length (the schedule is :mod:`kvjax.bounded_prefill`, shared with the
bounded baselines of :mod:`kvjax.methods.chunked_eviction`):

1. the prompt except its last ``n_loc`` tokens is prefilled in chunks of ``B`` tokens; every
   token gets its causal importance score once, when it is first seen, from the layer's retaining
   head applied to its own pre-RoPE ``[Q, K, V]`` (:mod:`kvjax.retaining_heads`);
2. after each chunk the head keeps its ``b`` highest-scored tokens, the last ``n_s`` tokens
   ("stabilizers") forced among them except after the last chunk; survivors stay in position order;
3. the last ``n_loc`` prompt tokens are prefilled without eviction (they attend to the compressed
   cache); decoding appends to the ``b + n_loc`` survivors and does not evict (the paper's setting).
   ``evict_during_decode=True`` keeps the budget fixed while decoding instead: every later token is
   scored by the head, and each head keeps the last ``n_loc`` slots (a sliding window) plus its
   ``b`` best-scored other tokens (attention over the bounded buffer, XLA path).

Deviations and choices (documented, measured where they change results):

* **Budget.** ``budget`` follows kvjax's semantics (:mod:`kvjax.budgets`): tokens kept per KV head
  *including* the local window, so Locret holds the same device bytes as every other method at the
  same budget; the paper's ``b`` is ``budget - local``.
* **Chunk and stabilizers follow the budget.** The paper fixes ``B`` and ``n_s`` in tokens for budgets
  of 6,000-16,384 (Llama-3.1-8B: ``b`` = 16,384, ``B`` = 1,024, ``n_s`` = 2,500). At a 4K prompt's 10%
  (``b`` near 300) those tokens would make a chunk several times the budget and stabilizers larger than
  it, the opposite of the paper's regime. The defaults keep the paper's Llama-3.1 proportions instead:
  ``chunk = 1/16`` of ``b`` (rounded up) and ``stabilizers = 2500/16384`` of ``b`` (rounded down), which
  are the paper's values at its budget (``b`` = 16,384 gives ``B`` = 1,024 and ``n_s`` = 2,500). An
  int is a token count as in the paper (``chunk=1024`` gives its fixed chunk at every budget).
* **Positions.** ``positions="original"`` (default): keys stay post-RoPE at their original
  positions (kvjax's cache convention; evicted tokens leave gaps). The reference caches pre-RoPE
  keys and re-applies RoPE at contiguous positions of the compacted cache on every step;
  ``positions="contiguous"`` gives the same attention (relative positions) by moving the survivors'
  keys after every eviction (:func:`kvjax.bounded_prefill.pack_positions`); later tokens keep their
  own positions. Cost: one rotation of the buffer per eviction. In a bfloat16 cache a kept key is
  rounded once per rotation (the reference rotates its pre-RoPE copy afresh). Measured in
  docs/RESULTS.md ("Locret").
* **Chunk grid.** Each prefill call is split into pieces of ``chunk`` tokens from its start, so one
  call, or calls of any multiple of ``chunk`` tokens, give the same cache. In a left-padded batch
  the grid counts padding slots (rows share slots); the paper's grid starts at the first token.
* **Ragged batches.** A row keeps ``b_r = row budget - local`` tokens outside its local window.
* **Score pooling** (``pool``, off by default: the paper's method). ``pool=k`` (odd) replaces each
  token's head score by the maximum over the ``k`` tokens centred on it, within the same piece of
  ``B`` tokens (padding excluded), once, when the piece is first scored; the pooled score is the one
  stored. The paper asks for adjacent important tokens through its smoothness loss only; SnapKV
  (kernel 7, max) and HeteroCache's reference (kernel 5) pool their scores so that a kept token keeps
  its neighbours, and the ready models' tokenizers split a number into single digits, each of which
  must survive. Measured in docs/RESULTS.md ("Locret").
* **Training.** Heads shipped with kvjax are smaller (``d_R = 128``) and trained on less data than the
  paper's (``kvjax train-locret``; the report in ``docs/results/`` states size, data and wall time; the
  paper's ``d_R = 1024`` on the same data gave the same held-out overlap, 0.525 against 0.523), on labels
  standardised per head (:mod:`kvjax.train.locret`: a deviation that raised Qwen's held-out overlap from
  0.46 to 0.52 and its 4K accuracy by one prompt in three of four cells; the file's ``label_norm``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp

from kvjax.artifacts import installed_artifact, load_artifact, require_artifact
from kvjax.bounded_prefill import (BoundedPrefill, bounded_sizes, buffer_read_bytes, check_schedule, chunk_tokens,
                                   evict_decoding, init_bounded, paged_facts, prefill_in_pieces)
from kvjax.budgets import budget_facts, check_budget
from kvjax.cache import AttendContext, Cache, CacheSpec, FinishContext
from kvjax.kv_quantization import reject_kv_dtype
from kvjax.methods.base import BoundedEvictionMethod
from kvjax.retaining_heads import KIND, apply_head, check_heads, head_features, random_heads_artifact
from kvjax.selection import pool1d

HEADS = ("trained", "random")
# The paper's Llama-3.1-8B setting (Table 2): b = 16384, B = 1024, n_s = 2500, as fractions of b.
PAPER_BUDGET_TOKENS = 16384
PAPER_CHUNK_FRACTION = 1024 / PAPER_BUDGET_TOKENS
PAPER_STABILIZER_FRACTION = 2500 / PAPER_BUDGET_TOKENS


def pool_within_pieces(scores, real, chunk: int, kernel: int):
    """Max-pool ``scores[B, T, H]`` over ``kernel`` tokens within pieces of ``chunk`` tokens from the call's start.

    ``real[B, T]`` marks the tokens that are not padding: padding never lends its score to a neighbour
    (padding's own entries are meaningless: padding is never stored). The pieces are those
    :func:`kvjax.bounded_prefill.prefill_in_pieces` evicts after, so a call of any multiple of
    ``chunk`` tokens pools the same way.
    """
    B, T, H = scores.shape
    piece = min(chunk, T)  # a call shorter than a chunk is one piece (no padding to a whole chunk)
    n = -(-T // piece)
    extra = n * piece - T
    x = jnp.pad(scores, ((0, 0), (0, extra), (0, 0))).reshape(B, n, piece, H).transpose(0, 1, 3, 2)
    ok = jnp.pad(real, ((0, 0), (0, extra))).reshape(B, n, 1, piece)
    pooled = pool1d(x, ok, kernel, "max").transpose(0, 1, 3, 2).reshape(B, n * piece, H)
    return pooled[:, :T]


@dataclasses.dataclass(frozen=True)
class Locret(BoundedEvictionMethod):
    """Locret: retaining-head scores, eviction during chunked prefill, bounded memory (see module docstring).

    Args:
      budget: tokens kept per KV head (int) or fraction of the prompt's KV bytes (float), the local
        window included (``b = budget - local``).
      chunk: ``B``, tokens prefilled between evictions: an int (tokens) or a float fraction of ``b``
        (default 1/16: the paper's 1024 at its Llama-3.1 budget of 16,384; module docstring).
      stabilizers: ``n_s``, the last tokens forced into the kept set after each chunk but the last:
        an int (tokens) or a float fraction of ``b`` in [0, 1) (default 2500/16384, the paper's
        Llama-3.1 proportion).
      local: ``n_loc``, the last prompt tokens prefilled without eviction (the paper's 100).
      heads: "trained" (the artifact given, else the heads shipped for the model), "random"
        (untrained heads of the shipped heads' size, seeded: the paper's Table 6 control), or the path
        of a heads file (``heads.npz`` of ``kvjax train-locret --out``), e.g. ``locret:heads=run/heads.npz``.
      seed: seed of the random heads.
      evict_during_decode: keep ``budget`` tokens per head while decoding too (module docstring, step 3).
      positions: "original" (keys at their own positions) or "contiguous" (the reference's: the
        compacted cache moved to consecutive positions after every eviction; module docstring).
      pool: odd kernel of the max-pooling of the head scores within each piece of ``chunk`` tokens
        (1: none, the paper's; a deviation, module docstring).
      page_size: tokens per page of the compressed pools.
      implementation: decode attention implementation, auto | xla | pallas | pallas_interpret.
    """

    budget: int | float = 0.25
    chunk: int | float = PAPER_CHUNK_FRACTION
    stabilizers: int | float = PAPER_STABILIZER_FRACTION
    local: int = 100
    heads: str = "trained"
    seed: int = 0
    evict_during_decode: bool = False
    positions: str = "original"
    pool: int = 1
    page_size: int = 16
    implementation: str = "auto"
    name = "locret"

    def __post_init__(self):
        check_budget(self.budget)
        check_schedule(self.name, self.chunk, self.local, self.stabilizers, self.positions)
        if not isinstance(self.heads, str) or (self.heads not in HEADS and not self.heads.endswith(".npz")):
            raise ValueError(f"locret: heads must be one of {', '.join(HEADS)} or a heads .npz file, got {self.heads!r}")
        if isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"locret: pool must be an odd int >= 1 (1: no pooling), got {self.pool!r}")
        self.check_paging()

    # -- sizes
    def sizes(self, spec: CacheSpec) -> tuple[int, int]:
        """``(b, n_s)`` for the longest row of ``spec`` (validated)."""
        return bounded_sizes(self.name, self.budget, self.local, self.stabilizers, spec)

    def chunk_tokens(self, spec: CacheSpec) -> int:
        """``B`` in tokens for ``spec``'s longest row."""
        return chunk_tokens(self.chunk, self.sizes(spec)[0])

    # -- protocol
    def artifact_for(self, spec: CacheSpec, artifact: Any = None):
        """The retaining heads: given, else shipped for the model; "random": untrained heads of the shipped size; or a file's."""
        if self.heads == "random":
            if artifact is not None:
                raise ValueError("locret with heads='random' makes its own heads; do not pass an artifact")
            hidden = installed_artifact(KIND, spec.model_id).arrays["w1"].shape[2]
            return random_heads_artifact(spec.model_id, spec.num_layers, spec.num_heads, spec.num_kv_heads,
                                         spec.head_dim, int(hidden), self.seed)
        if self.heads not in HEADS:  # a heads file
            if artifact is not None:
                raise ValueError(f"locret with heads={self.heads!r} loads its heads from that file; do not pass an artifact")
            if not os.path.exists(self.heads):
                raise ValueError(f"locret: no heads file {self.heads!r} (train one with `kvjax train-locret --out DIR`)")
            artifact = load_artifact(self.heads)
        if artifact is None:
            try:
                artifact = installed_artifact(KIND, spec.model_id)
            except ValueError:
                raise ValueError(f"no shipped or installed Locret retaining heads for model {spec.model_id!r}; train "
                                 "them with `kvjax train-locret --model <model> --out DIR --install` or pass the "
                                 "artifact") from None
        art = require_artifact(artifact, KIND, spec.model_id)
        check_heads(art.arrays, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        return art

    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Bounded working buffers of ``budget + B`` tokens per KV head; the heads travel as the artifact."""
        if self.evict_during_decode:
            reject_kv_dtype(spec, "locret with evict_during_decode=True",
                            "decoding keeps the bounded working buffer, not the paged pool")
        art = self.artifact_for(spec, artifact)
        layers = init_bounded(spec, self.name, self.budget, self.chunk, self.local, self.stabilizers,
                              positions=self.positions)
        return Cache.create(layers, self, spec, artifact=art)

    def token_scores(self, v, ctx: AttendContext, chunk: int):
        """Each new token's score ``[B, T, Hkv]`` from the layer's retaining head (its own pre-RoPE q, k and v),
        max-pooled within pieces of ``chunk`` tokens when ``pool > 1``."""
        heads = ctx.artifact.arrays
        scores = apply_head(heads["w1"][ctx.layer], heads["w2"][ctx.layer], head_features(ctx.q_pre_rope, ctx.k_pre_rope, v))
        if self.pool == 1:
            return scores
        real = ctx.start + jnp.arange(scores.shape[1], dtype=jnp.int32)[None, :] >= ctx.pad[:, None]  # [B, T]
        return pool_within_pieces(scores, real, chunk, self.pool)

    def prefill_chunk(self, state: BoundedPrefill, q, k, v, ctx: AttendContext):
        """Score the call's tokens once with the layer's retaining head, then the bounded schedule (:mod:`kvjax.bounded_prefill`)."""
        return prefill_in_pieces(state, q, k, v, ctx, self.token_scores(v, ctx, state.buffer.chunk))

    def finish_prefill(self, state: BoundedPrefill, ctx: FinishContext):
        """The survivors into page pools with room for later tokens (the buffer itself when decoding evicts)."""
        if self.evict_during_decode:
            return state
        return super().finish_prefill(state, ctx)

    def decode_attend(self, state, q, k, v, ctx: AttendContext):
        """Append without eviction (the paper's decoding; paged kernel on accelerators), or evict to the budget."""
        if self.evict_during_decode:
            if q.shape[1] > state.buffer.chunk:
                raise ValueError(f"locret with evict_during_decode: {q.shape[1]} tokens after the prompt in one call "
                                 f"exceed the buffer's chunk of {state.buffer.chunk}")
            return evict_decoding(state, q, k, v, ctx, self.token_scores(v, ctx, state.buffer.chunk))
        return super().decode_attend(state, q, k, v, ctx)

    def stats(self, cache: Cache) -> dict:
        """Sizes (b, n_s, n_loc, B), the prefill buffer bound, kept tokens per head and the page pools' bytes."""
        b, n_s = self.sizes(cache.spec)
        B = chunk_tokens(self.chunk, b)
        facts = {"b": b, "stabilizers": n_s, "local": self.local, "chunk": B, "heads": self.heads,
                 "head_hidden": int(cache.artifact.arrays["w1"].shape[2]),
                 "prefill_buffer_tokens_per_head": b + self.local + B,
                 "evicts_during_decode": self.evict_during_decode, "positions": self.positions, "pool": self.pool,
                 **budget_facts(self.budget, cache.spec.longest_row)}
        if self.evict_during_decode:
            held = [int(x) for x in (cache.layers[0].buffer.slots >= 0).sum(axis=-1).max(axis=0)]
            return {**facts, "held_tokens_per_head_layer0": held}
        return {**facts, **paged_facts(cache)}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Every held token of every head (0 before compression); the whole buffer when decoding evicts."""
        if self.evict_during_decode:
            return buffer_read_bytes(cache) if cache.stage == "compressed" else 0
        return super().bytes_read_per_step(cache)
