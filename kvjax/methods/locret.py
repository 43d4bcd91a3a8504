"""Locret (Huang et al.): trained retaining heads score each token; chunked prefill evicts to a fixed budget.

Algorithm 1 of the paper, per layer and KV head, with device memory bounded by ``b + n_loc + B``
tokens whatever the prompt's length (:mod:`kvjax.working_buffer`):

1. the prompt except its last ``n_loc`` tokens is prefilled in chunks of ``B`` tokens; every
   token gets its causal importance score once, when it is first seen, from the layer's retaining
   head applied to its own pre-RoPE ``[Q, K, V]`` (:mod:`kvjax.retaining_heads`);
2. after each chunk the head keeps its ``b`` highest-scored tokens, the last ``n_s`` tokens
   ("stabilizers") forced among them except after the last chunk; survivors stay in position order;
3. the last ``n_loc`` prompt tokens are prefilled without eviction (they attend to the compressed
   cache); decoding appends to the ``b + n_loc`` survivors and does not evict (the paper's setting).

Deviations and choices (documented, measured where they change results):

* **Budget.** ``budget`` follows kvjax's semantics (:mod:`kvjax.budgets`): tokens kept per KV head
  *including* the local window, so Locret holds the same device bytes as every other method at the
  same budget; the paper's ``b`` is ``budget - local``.
* **Stabilizers.** ``stabilizers`` may be a fraction of ``b`` (default 0.25): the paper's 2500 tokens
  are 42% of Phi-3's b = 6000 and 15% of Llama's b = 16384, which cannot be used at the budgets of a
  4K prompt. An int is a token count as in the paper.
* **Positions.** Keys stay post-RoPE at their original positions (kvjax's cache convention, no
  per-step re-rotation). The reference caches pre-RoPE keys and re-applies RoPE at contiguous
  positions of the compacted cache on every step.
* **Chunk grid.** Each prefill call is split into pieces of ``chunk`` tokens from its start (slot
  0 for the first call), and the head evicts after every piece; so prefilling in one call, or in
  calls of any multiple of ``chunk`` tokens, gives the same cache. Calls shorter than ``chunk``
  evict after each call. In a left-padded batch the grid counts padding slots (rows share slots).
* **Ragged batches.** A row keeps ``b_r = row budget - local`` tokens outside its local window (its
  own length decides a fractional budget, :func:`kvjax.selection.row_capacities`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from kvjax.artifacts import require_artifact, shipped_artifact
from kvjax.attention import attention_by_slots, resolve_implementation
from kvjax.budgets import check_budget, tokens_per_head
from kvjax.cache import AttendContext, Cache, CacheSpec, FinishContext
from kvjax.paged import PagedKV, append_and_attend, build_paged, paged_device_bytes, paged_read_bytes
from kvjax.retaining_heads import KIND, apply_head, check_heads, head_features, random_heads_artifact
from kvjax.selection import keep_top, row_capacities
from kvjax.working_buffer import WorkingKV, buffer_chunk, compact, init_working, kept_indices

HEADS = ("trained", "random")


@struct.dataclass
class LocretPrefill:
    """One layer during prefill: the bounded working buffer and the static sizes its evictions use.

    ``buffer`` holds at most ``budget + chunk`` tokens per (row, KV head) (:class:`WorkingKV`);
    ``spec`` is the cache's spec (prompt slots, longest row), ``b`` and ``n_s`` the sizes of
    :meth:`Locret.sizes`.
    """

    buffer: WorkingKV
    spec: CacheSpec = struct.field(pytree_node=False, default=None)
    b: int = struct.field(pytree_node=False, default=0)
    n_s: int = struct.field(pytree_node=False, default=0)


@dataclasses.dataclass(frozen=True)
class Locret:
    """Locret: retaining-head scores, eviction during chunked prefill, bounded memory (see module docstring).

    Args:
      budget: tokens kept per KV head (int) or fraction of the prompt's KV bytes (float), the local
        window included (``b = budget - local``).
      chunk: ``B``, tokens prefilled between evictions (the paper's 1024 for Llama-3.1).
      stabilizers: ``n_s``, the last tokens forced into the kept set after each chunk but the last:
        an int (tokens) or a float fraction of ``b`` in [0, 1).
      local: ``n_loc``, the last prompt tokens prefilled without eviction (the paper's 100).
      heads: "trained" (the artifact given, else the heads shipped for the model) or "random"
        (untrained heads of the shipped heads' size, seeded: the paper's Table 6 control).
      seed: seed of the random heads.
      page_size: tokens per page of the compressed pools.
      implementation: decode attention implementation, auto | xla | pallas | pallas_interpret.
    """

    budget: int | float = 0.25
    chunk: int = 1024
    stabilizers: int | float = 0.25
    local: int = 100
    heads: str = "trained"
    seed: int = 0
    page_size: int = 16
    implementation: str = "auto"
    name = "locret"

    def __post_init__(self):
        check_budget(self.budget)
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"locret: chunk (B) must be an int >= 1, got {self.chunk!r}")
        if isinstance(self.local, bool) or not isinstance(self.local, int) or self.local < 0:
            raise ValueError(f"locret: local (n_loc) must be an int >= 0, got {self.local!r}")
        s = self.stabilizers
        if isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0 or (isinstance(s, float) and s >= 1.0):
            raise ValueError(f"locret: stabilizers (n_s) must be an int >= 0 or a fraction of b in [0, 1), got {s!r}")
        if self.heads not in HEADS:
            raise ValueError(f"locret: heads must be one of {', '.join(HEADS)}, got {self.heads!r}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        resolve_implementation(self.implementation)

    # -- sizes
    def sizes(self, spec: CacheSpec) -> tuple[int, int]:
        """``(b, n_s)`` for the longest row of ``spec`` (validated)."""
        if spec.longest_row <= self.local:
            raise ValueError(f"locret: the prompt ({spec.longest_row} tokens) must be longer than the local window "
                             f"local={self.local} (n_loc): nothing would be evicted; lower local or use the full cache")
        cap = tokens_per_head(self.budget, spec.longest_row)
        b = cap - self.local
        if b <= 0:
            raise ValueError(f"locret: a budget of {cap} tokens per KV head leaves no room beyond the local window of "
                             f"{self.local} tokens (b = budget - local = {b}); raise the budget or lower local")
        n_s = self.stabilizers if isinstance(self.stabilizers, int) else int(self.stabilizers * b)
        if n_s >= b:
            raise ValueError(f"locret: stabilizers n_s={n_s} must be smaller than b={b} (budget {cap} - local "
                             f"{self.local}): the stabilizers would fill the whole budget")
        return b, n_s

    # -- protocol
    def recording(self) -> None:
        """Own prefill (eviction during prefill): no shared staging."""
        return None

    def artifact_for(self, spec: CacheSpec, artifact: Any = None):
        """The retaining heads: given, else shipped for the model; "random": untrained heads of the shipped size."""
        if self.heads == "random":
            if artifact is not None:
                raise ValueError("locret with heads='random' makes its own heads; do not pass an artifact")
            hidden = shipped_artifact(KIND, spec.model_id).arrays["w1"].shape[2]
            return random_heads_artifact(spec.model_id, spec.num_layers, spec.num_heads, spec.num_kv_heads,
                                         spec.head_dim, int(hidden), self.seed)
        if artifact is None:
            try:
                artifact = shipped_artifact(KIND, spec.model_id)
            except ValueError:
                raise ValueError(f"no shipped Locret retaining heads for model {spec.model_id!r}; train them with "
                                 "`kvjax train-locret --model <model>` and pass the artifact") from None
        art = require_artifact(artifact, KIND, spec.model_id)
        check_heads(art.arrays, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        return art

    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Bounded working buffers of ``budget + chunk`` tokens per KV head; the heads travel as the artifact."""
        art = self.artifact_for(spec, artifact)
        self.sizes(spec)
        b, n_s = self.sizes(spec)
        layers = tuple(LocretPrefill(buf, spec=spec, b=b, n_s=n_s) for buf in init_working(spec, b + self.local, self.chunk))
        return Cache.create(layers, self, spec, artifact=art)

    def prefill_chunk(self, state: LocretPrefill, q, k, v, ctx: AttendContext):
        """Score the call's tokens with the layer's head, then store / attend / evict piece by piece (``chunk`` tokens)."""
        heads = ctx.artifact.arrays
        scores = apply_head(heads["w1"][ctx.layer], heads["w2"][ctx.layer],
                            head_features(ctx.q_pre_rope, ctx.k_pre_rope, v))  # [B, T, Hkv]
        T, P = q.shape[1], self.chunk
        n_full, rem = divmod(T, P)
        outs = []
        if n_full:
            def split(x):
                return x[:, : n_full * P].reshape(x.shape[0], n_full, P, *x.shape[2:]).swapaxes(0, 1)

            def body(st, xs):
                i, qi, ki, vi, si = xs
                out, st = self._piece(st, qi, ki, vi, si, ctx.start + i * P, ctx)
                return st, out

            state, out = lax.scan(body, state, (jnp.arange(n_full), split(q), split(k), split(v), split(scores)))
            outs.append(out.swapaxes(0, 1).reshape(q.shape[0], n_full * P, *q.shape[2:]))
        if rem:
            s = n_full * P
            out, state = self._piece(state, q[:, s:], k[:, s:], v[:, s:], scores[:, s:], ctx.start + s, ctx)
            outs.append(out)
        return jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0], state

    def _piece(self, state: LocretPrefill, q, k, v, scores, start, ctx: AttendContext):
        """One piece of at most ``chunk`` tokens at slot ``start``: store and attend, then evict.

        Eviction keeps, per (row, KV head), every local-window token plus the row's ``b_r`` best
        scored other tokens, the last ``n_s`` of them forced unless no evictable token follows the
        piece. Local-window queries of the piece that ends the evictable part attend to the evicted
        cache (Algorithm 1 prefills the last ``n_loc`` tokens after the last eviction).
        """
        spec = state.spec
        P = q.shape[1]
        local_start = spec.prompt_slots - self.local  # first slot of the local window (rows end together)
        out_all, buf = buffer_chunk(state.buffer, q, k, v, ctx.replace(start=start), scores)
        held = buf.slots >= 0
        local = buf.slots >= local_start
        evictable = held & ~local
        end = start + P
        forced = evictable & (buf.slots >= end - state.n_s) & (end < local_start)
        caps = row_capacities((state.b + self.local,), self.budget, spec, ctx.pad)  # [B, 1]
        b_rows = jnp.maximum(caps - self.local, 0)
        keep = held & (local | keep_top(buf.scores, forced, evictable, b_rows))
        evicted = compact(buf, keep)

        def local_queries_see_the_evicted_cache():
            q_slots = start + jnp.arange(P, dtype=jnp.int32)
            out_local = attention_by_slots(q, q_slots, evicted.k, evicted.v, evicted.slots, ctx.pad,
                                           scale=q.shape[-1] ** -0.5)
            return jnp.where((q_slots >= local_start)[None, :, None, None], out_local, out_all)

        straddles = (start < local_start) & (end > local_start)
        out = lax.cond(straddles, local_queries_see_the_evicted_cache, lambda: out_all)
        return out, state.replace(buffer=evicted)

    def finish_prefill(self, state: LocretPrefill, ctx: FinishContext) -> PagedKV:
        """The survivors (``<= budget`` per head) into page pools with room for later tokens."""
        buf = state.buffer
        idx, count = kept_indices(buf)
        return build_paged(buf.k, buf.v, idx, count, (buf.capacity,) * buf.k.shape[1], ctx.spec.room, self.page_size)

    def decode_attend(self, state: PagedKV, q, k, v, ctx: AttendContext):
        """Append without eviction (the paper's decoding) and attend (paged kernel on accelerators)."""
        return append_and_attend(state, q, k, v, self.implementation)

    def stats(self, cache: Cache) -> dict:
        """Sizes (b, n_s, n_loc, B), the prefill buffer bound, kept tokens per head and the page pools' bytes."""
        b, n_s = self.sizes(cache.spec)
        facts = {"b": b, "stabilizers": n_s, "local": self.local, "chunk": self.chunk, "heads": self.heads,
                 "head_hidden": int(cache.artifact.arrays["w1"].shape[2]),
                 "prefill_buffer_tokens_per_head": b + self.local + self.chunk}
        if cache.stage == "compressed":
            facts["kept_tokens_per_head"] = [list(st.capacities) for st in cache.layers]
            facts["page_pool_bytes"] = sum(paged_device_bytes(st) for st in cache.layers)
        return facts

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Every held token of every head (0 before compression)."""
        return sum(paged_read_bytes(st) for st in cache.layers) if cache.stage == "compressed" else 0
