"""The method protocol every KV-cache method implements, and the evict-after-prefill composition.

A method is a frozen dataclass of hyper-parameters (hashable: a static field of the cache) with an
explicit per-layer lifecycle. Every function is required; nothing is discovered with ``getattr``:

``recording()``
    What a dense staging prefill must record for this method (:class:`kvjax.staging.Recording`), or
    ``None`` when the method runs its own prefill. A method that returns a recording promises that
    its prefill state is that staging (:class:`kvjax.staging.StagedKV`), so one prefill can serve
    several methods (:mod:`kvjax.shared_prefill`).
``artifact_for(spec, artifact=None)``
    The artifact the cache carries: ``None`` for a method without one (being given one is an
    error), else the given artifact checked against the model, or the one shipped for it.
``init_cache(spec, artifact=None)``
    Allocate the cache (stage ``"prefill"``) for a :class:`kvjax.cache.CacheSpec`; validates the
    budget against the spec and the artifact against the model (:meth:`artifact_for`).
``prefill_chunk(state, q, k, v, ctx)``
    One layer, one prompt chunk (``q[B,T,Hq,D]``, ``k, v[B,T,Hkv,D]`` post-RoPE at slots
    ``ctx.start..``): store, attend causally, record, possibly evict. Returns ``(output, state)``.
``rereads_context()``
    True for a method scored by extra forward passes over the prefilled prompt before compression (KVzip's
    reconstruction: :func:`kvjax.methods.kvzip.score_context`, which the API and the evaluation run between
    prefill and :func:`kvjax.decoding.compress`); False for every other method.
``finish_prefill(state, ctx)``
    One layer, after the whole prompt: selection and layout (pages, host tier, codes).
``decode_attend(state, q, k, v, ctx)``
    One layer, any later tokens (T >= 1: a question or one decoded token): append them
    uncompressed, run the per-step logic (page selection, eviction, recall...) and attend.
``question_passes()``
    Forward passes a multi-token call on the compressed cache (a question, a later turn) takes: 1,
    or more for a method whose earlier layers follow choices its later layers make on those tokens.
    Every pass but the last is a rehearsal (``ctx.rehearsal``; :func:`kvjax.decoding.prefill`): the
    method may change what it holds (recall, re-anchoring) and returns its state without the call's tokens.
``finish_question(cache)``
    Called once after a multi-token call's last pass on the compressed cache (inside the same jitted call): work
    the call left for layers earlier than the ones that created it (HeteroCache and SyncKV: followers before their
    leader's layer apply its re-anchoring), so that a one-token decode step never has to check for it. Most
    methods return the cache unchanged: :class:`LayerLocal` gives ``around_layers``, ``question_passes`` and
    ``finish_question`` to a method whose layers each do all their own work.
``state_partition(state, spec)``
    Partition specs of one layer's state (either stage) over the mesh ``spec.mesh``, by row on
    ``data`` and by KV head on ``model`` (:mod:`kvjax.sharding`); a state that cannot be split that
    way raises ValueError instead of being replicated.
``stats(cache)`` / ``bytes_read_per_step(cache)``
    The method's own facts for ``cache.stats()``; K/V (and side-data) bytes a decode step reads.

The prompt is compressed by ``kvjax.decoding.compress``, which calls ``finish_prefill`` per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax

from kvjax.artifacts import no_artifact
from kvjax.attention import resolve_implementation
from kvjax.bounded_prefill import BoundedPrefill, bounded_partition, paged_cache_read_bytes, to_pages
from kvjax.budgets import budget_facts, check_budget
from kvjax.cache import AttendContext, Cache, CacheSpec, FinishContext
from kvjax.kv_quantization import reject_kv_dtype
from kvjax.paged import PagedKV, append_and_attend, build_paged, paged_device_bytes, paged_partition, paged_read_bytes
from kvjax.selection import GQA_AGGREGATIONS, check_lookahead, extend_forward, keep_to_indices, row_capacities
from kvjax.staging import Recording, StagedKV, init_staging, stage_chunk, staged_partition


@runtime_checkable
class Method(Protocol):
    """Protocol of a KV-cache method (see module docstring)."""

    name: str

    def recording(self) -> Recording | None:
        """What a shared staging prefill must record, or None (own prefill)."""
        ...

    def artifact_for(self, spec: CacheSpec, artifact: Any = None) -> Any:
        """The artifact the cache carries (None when the method takes none)."""
        ...

    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Allocate the cache for ``spec`` (stage "prefill")."""
        ...

    def prefill_chunk(self, state: Any, q, k, v, ctx: AttendContext) -> tuple[jax.Array, Any]:
        """Store one layer's prompt chunk and attend; may record and evict."""
        ...

    def rereads_context(self) -> bool:
        """True when the prompt is scored by extra passes before compression (KVzip)."""
        ...

    def finish_prefill(self, state: Any, ctx: FinishContext) -> Any:
        """Selection and layout of one layer after the prompt."""
        ...

    def around_layers(self, cache: Cache, tokens: int, run) -> tuple[jax.Array, Cache]:
        """A call of ``tokens`` tokens per row on the compressed cache: ``run(cache) -> (logits, cache)`` runs the
        layers; a method may work on the whole cache before or after (e.g. one recall for every layer). Most
        return ``run(cache)``."""
        ...

    def decode_attend(self, state: Any, q, k, v, ctx: AttendContext) -> tuple[jax.Array, Any]:
        """Append later tokens to one compressed layer and attend."""
        ...

    def question_passes(self) -> int:
        """Forward passes of a multi-token call after compression: 1, or ``n > 1`` (``n - 1`` rehearsals first)."""
        ...

    def finish_question(self, cache: Cache) -> Cache:
        """Work a question's last pass leaves for layers before the ones that made it (once, after the pass)."""
        ...

    def state_partition(self, state: Any, spec: CacheSpec) -> Any:
        """Partition specs of one layer's state on ``spec.mesh`` (:mod:`kvjax.sharding`); raises ValueError
        when the state cannot be split over the mesh."""
        ...

    def stats(self, cache: Cache) -> dict:
        """The method's own cache facts."""
        ...

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Cache bytes one decode step reads."""
        ...


class LayerLocal:
    """The protocol's whole-cache hooks for a method whose layers each do all their own work: a question takes one
    pass and is appended and attended like any later token, nothing runs around the layers, and a question leaves
    no work for other layers."""

    def question_passes(self) -> int:
        """One pass."""
        return 1

    def rereads_context(self) -> bool:
        """Compressed from what the prefill recorded alone."""
        return False

    def around_layers(self, cache: Cache, tokens: int, run) -> tuple[jax.Array, Cache]:
        """The layers alone."""
        return run(cache)

    def finish_question(self, cache: Cache) -> Cache:
        """Nothing."""
        return cache


class NoArtifact:
    """A method that takes no artifact (trained or calibrated arrays): a given one is an error."""

    def artifact_for(self, spec: CacheSpec, artifact: Any = None) -> None:
        """No artifact (a given one is an error)."""
        no_artifact(artifact, self.name)


class StagedPrefill(NoArtifact):
    """A method without artifact that prefills into the shared dense staging (:mod:`kvjax.staging`) with what
    :meth:`recording` asks for, and compresses in ``finish_prefill``."""

    def check_spec(self, spec: CacheSpec) -> None:
        """Reject a spec the method cannot serve (clear errors before any array is made); by default a ``kv_dtype``
        other than the model's (:mod:`kvjax.kv_quantization`), which only the paged pools (and the full cache) store."""
        reject_kv_dtype(spec, self.name, "its compressed cache is not the paged pool")

    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Dense staging of the prompt (and room for the answer); the compressed layout comes in ``finish_prefill``."""
        self.artifact_for(spec, artifact)
        self.check_spec(spec)
        return Cache.create(init_staging(spec, self.recording()), self, spec)

    def prefill_chunk(self, state: StagedKV, q, k, v, ctx: AttendContext):
        """Write the staging, record, attend causally."""
        return stage_chunk(state, q, k, v, ctx)


class BoundedEvictionMethod(LayerLocal):
    """Base of the methods that evict during a bounded chunked prefill (:mod:`kvjax.bounded_prefill`; frozen
    dataclasses with ``page_size`` and ``implementation`` fields): their own prefill (no shared staging), the
    survivors into page pools, decoding that appends without eviction."""

    def check_paging(self) -> None:
        """Validate ``page_size`` and ``implementation`` (call from ``__post_init__``)."""
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        resolve_implementation(self.implementation)

    def recording(self) -> None:
        """Own prefill (eviction during prefill): no shared staging."""
        return None

    def finish_prefill(self, state: BoundedPrefill, ctx: FinishContext):
        """The survivors into page pools with room for later tokens."""
        return to_pages(state, ctx.spec.room, self.page_size)

    def decode_attend(self, state: PagedKV, q, k, v, ctx: AttendContext):
        """Append without eviction and attend."""
        return append_and_attend(state, q, k, v, self.implementation, ctx.mesh)

    def state_partition(self, state, spec: CacheSpec):
        """The working buffer by (row, KV head), then the pages (:func:`kvjax.bounded_prefill.bounded_partition`)."""
        return bounded_partition(state)

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Every held token of every head (0 before compression)."""
        return paged_cache_read_bytes(cache)


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


def check_common(page_size: int, block: int, gqa: str, implementation: str) -> None:
    """Validate the hyper-parameters most methods share."""
    if gqa not in GQA_AGGREGATIONS:
        raise ValueError(f"unknown GQA aggregation {gqa!r}; allowed: {', '.join(GQA_AGGREGATIONS)}")
    if page_size <= 0 or block <= 0:
        raise ValueError(f"page_size and block must be positive, got {page_size}, {block}")
    resolve_implementation(implementation)


# ------------------------------------------------------------------------------------------ layouts
@dataclasses.dataclass(frozen=True)
class PagedAppend:
    """Layout: kept tokens in page pools with room; later tokens appended; paged attention (kernel on accelerators)."""

    page_size: int = 16
    implementation: str = "auto"

    def build(self, st: StagedKV, idx, lengths, head_caps, scores, spec: CacheSpec):
        """Gather the kept tokens into pages."""
        return build_paged(st.k, st.v, idx, lengths, head_caps, spec.room, self.page_size, spec.mesh, spec.kv_dtype)

    def decode_attend(self, state: PagedKV, q, k, v, ctx: AttendContext):
        """Append and attend."""
        return append_and_attend(state, q, k, v, self.implementation, ctx.mesh)

    def partition(self, state: PagedKV) -> PagedKV:
        """Partition specs of the compressed layer (:func:`kvjax.paged.paged_partition`)."""
        return paged_partition(state)

    def stats(self, states) -> dict:
        """Kept tokens per head (allocation) and the page pools' bytes."""
        return {"kept_tokens_per_head": [list(st.capacities) for st in states],
                "page_pool_bytes": sum(paged_device_bytes(st) for st in states)}

    def read_bytes(self, states) -> int:
        """Every held token is read each step."""
        return sum(paged_read_bytes(st) for st in states)


# ------------------------------------------------------------------------------- the composition
@dataclasses.dataclass(frozen=True)
class PromptCompression(StagedPrefill, LayerLocal):
    """Evict once after prefill: scorer + allocator + selector + layout (see :mod:`kvjax.selection`).

    The lifecycle is fixed: prefill into a dense staging (recording what the scorer needs), then per
    layer score -> per-head, per-row capacities -> keep mask -> layout. A concrete method only says
    which components it composes (:meth:`components`); the defaults here are its common arguments.

    Args:
      budget: see :mod:`kvjax.budgets`.
      page_size: tokens per page of the compressed pools.
      gqa: aggregation of a KV head's query-group scores, mean | max.
      block: key-block size of the prefill attention.
      implementation: decode attention implementation, auto | xla | pallas | pallas_interpret.
      lookahead: the scores extended this many positions forward before selection, so that a kept token keeps
        the tokens after it (:func:`kvjax.selection.extend_forward`; 0: none, the papers').
    """

    budget: int | float = 0.25
    page_size: int = 16
    gqa: str = "mean"
    block: int = 256
    implementation: str = "auto"
    lookahead: int = 0
    name = "prompt_compression"

    def __post_init__(self):
        check_common(self.page_size, self.block, self.gqa, self.implementation)
        check_budget(self.budget)
        check_lookahead(self.lookahead)

    def components(self):
        """``(scorer, allocator, selector, layout)`` of this method."""
        raise NotImplementedError(f"{type(self).__name__} must say which components it composes")

    def check_capacity(self, cap: int) -> None:
        """Reject a head capacity the method cannot use (e.g. a block larger than the capacity)."""

    # -- protocol
    def recording(self) -> Recording:
        """What the scorer needs."""
        return self.components()[0].recording(self.block)

    def head_capacities(self, spec: CacheSpec) -> tuple[tuple[int, ...], ...]:
        """Prompt tokens kept per layer and KV head, for the longest row (validated)."""
        caps = self.components()[1].capacities(self.budget, spec)
        for c in sorted({c for layer in caps for c in layer}):
            self.check_capacity(c)
        return caps

    def check_spec(self, spec: CacheSpec) -> None:
        """The head capacities of ``spec`` are valid; another ``kv_dtype`` than the model's needs the paged layout."""
        if not isinstance(self.components()[3], PagedAppend):
            reject_kv_dtype(spec, f"{self.name} ({type(self.components()[3]).__name__} layout)",
                            "its compressed cache is not the paged pool")
        self.head_capacities(spec)

    def keep_mask(self, state: StagedKV, ctx: FinishContext):
        """(keep mask ``[B, Hkv, S]``, scores ``[B, Hkv, S]``) of one layer: score, allocate per head and row, select."""
        scorer, _, selector, _ = self.components()
        spec = ctx.spec
        head_caps = self.head_capacities(spec)[ctx.layer]
        scores = extend_forward(scorer(state, ctx.pad, spec.prompt_slots), self.lookahead)
        row_caps = row_capacities(head_caps, self.budget, spec, ctx.pad)
        return selector(scores, ctx.pad, spec.prompt_slots, row_caps, head_caps), scores

    def finish_prefill(self, state: StagedKV, ctx: FinishContext):
        """:meth:`keep_mask`, then the layout."""
        keep, scores = self.keep_mask(state, ctx)
        head_caps = self.head_capacities(ctx.spec)[ctx.layer]
        idx, lengths = keep_to_indices(keep, max(head_caps))
        return self.components()[3].build(state, idx, lengths, head_caps, scores, ctx.spec)

    def decode_attend(self, state, q, k, v, ctx):
        """The layout's decode path."""
        return self.components()[3].decode_attend(state, q, k, v, ctx)

    def state_partition(self, state, spec: CacheSpec):
        """The staging's specs before compression, the layout's after."""
        if isinstance(state, StagedKV):
            return staged_partition(state)
        return self.components()[3].partition(state)

    def stats(self, cache: Cache) -> dict:
        """The layout's facts (empty before compression) and the budget's note."""
        if cache.stage != "compressed":
            return {}
        return {**self.components()[3].stats(cache.layers), **budget_facts(self.budget, cache.spec.longest_row)}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """The layout's reads (0 before compression)."""
        return self.components()[3].read_bytes(cache.layers) if cache.stage == "compressed" else 0
