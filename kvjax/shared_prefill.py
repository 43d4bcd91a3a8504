"""One prefill, many methods: stage a prompt once and derive each method's cache from the staging.

Every method whose :meth:`recording` is not None (the full cache, SnapKV, StreamingLLM, H2O,
PyramidKV, HBW-KV, Quest, HeteroCache, SyncKV) prefills into a dense staging (:mod:`kvjax.staging`) and differs only in
what it records and in ``finish_prefill``. A :class:`SharedStaging` records the union, so one
prefill serves them all. Recording does not change the prefill, so a method's cache derived here
equals the cache of its own prefill (tested in ``tests/test_shared_prefill.py``). Methods without a
recording (they evict during prefill, or keep other state) run their own prefill.

    staged = init_shared_cache(methods, spec)
    logits, staged = prefill_prompt(graphdef, params, tokens, staged, chunk_size=...)
    for m in methods: cache = compress(cache_for(staged, m)); decode_loop(..., cache, ...)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from kvjax.artifacts import no_artifact
from kvjax.cache import Cache, CacheSpec, own_arrays
from kvjax.methods.base import LayerLocal
from kvjax.staging import Recording, init_staging, restrict, stage_chunk, staged_partition


@dataclasses.dataclass(frozen=True)
class SharedStaging(LayerLocal):
    """Prefill-only method recording what a set of methods needs; derive their caches with :func:`cache_for`."""

    shared: Recording = Recording()
    name = "shared_staging"

    def recording(self) -> Recording:
        """The union of the methods' recordings."""
        return self.shared

    def artifact_for(self, spec: CacheSpec, artifact=None) -> None:
        """The staging carries no artifact (each derived cache gets its method's, :func:`cache_for`)."""
        no_artifact(artifact, self.name)

    def init_cache(self, spec: CacheSpec, artifact=None) -> Cache:
        """The staging cache."""
        self.artifact_for(spec, artifact)
        return Cache.create(init_staging(spec, self.shared), self, spec)

    def prefill_chunk(self, state, q, k, v, ctx):
        """Write the staging, record, attend causally."""
        return stage_chunk(state, q, k, v, ctx)

    def finish_prefill(self, state, ctx):
        """Not a method of its own: derive a method's cache first."""
        raise ValueError("a shared staging cache cannot be compressed itself; use kvjax.shared_prefill.cache_for(staged, method)")

    def decode_attend(self, state, q, k, v, ctx):
        """Not a method of its own."""
        raise ValueError("a shared staging cache cannot decode; use kvjax.shared_prefill.cache_for(staged, method)")

    def state_partition(self, state, spec: CacheSpec):
        """The staging's specs."""
        return staged_partition(state)

    def stats(self, cache: Cache) -> dict:
        """Nothing beyond the common statistics."""
        return {}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Not decoded."""
        return 0


def can_share_prefill(method) -> bool:
    """True for the methods whose prefill is a dense staging (their recording is not None)."""
    return not isinstance(method, SharedStaging) and method.recording() is not None


def init_shared_cache(methods: Sequence, spec: CacheSpec, artifacts: Sequence | None = None) -> Cache:
    """A staging cache recording what every one of ``methods`` needs (each validated against ``spec`` with
    its artifact: ``artifacts[i]`` for ``methods[i]``, None = the shipped one or none)."""
    if not methods:
        raise ValueError("need at least one method to share a prefill")
    others = [m.name for m in methods if not can_share_prefill(m)]
    if others:
        raise ValueError(f"methods {', '.join(others)} run their own prefill and cannot share one")
    artifacts = [None] * len(methods) if artifacts is None else list(artifacts)
    if len(artifacts) != len(methods):
        raise ValueError(f"need one artifact (or None) per method: {len(artifacts)} for {len(methods)} methods")
    for m, a in zip(methods, artifacts):
        jax.eval_shape(lambda m=m, a=a: m.init_cache(spec, a))  # validates budgets against the spec, allocates nothing
    return SharedStaging(Recording.union(m.recording() for m in methods)).init_cache(spec)


def cache_for(staged: Cache, method, artifact=None) -> Cache:
    """``method``'s prefill-stage cache derived from a prefilled shared staging (fresh copies of every array).

    The cache carries ``method.artifact_for(spec, artifact)`` (calibration data: the given artifact
    or the shipped one). Compress it next (``kvjax.decoding.compress``, which donates it). Raises
    ValueError when the staging did not record what ``method`` needs.
    """
    if not isinstance(staged.method, SharedStaging):
        raise ValueError(f"cache_for needs a cache from init_shared_cache, got one of method {staged.method.name!r}")
    if staged.stage != "prefill":
        raise ValueError("the shared staging cache was already compressed")
    if not can_share_prefill(method):
        raise ValueError(f"method {method.name!r} runs its own prefill and cannot share one")
    rec = method.recording()
    if not staged.method.shared.covers(rec):
        raise ValueError(f"{method.name} needs {rec}; the staging recorded {staged.method.shared}")
    art = method.artifact_for(staged.spec, artifact)
    layers = jax.tree_util.tree_map(jnp.copy, tuple(restrict(st, rec) for st in staged.layers))
    return staged.replace(layers=layers, length=jnp.copy(staged.length), pad=jnp.copy(staged.pad), method=method,
                          artifact=own_arrays(art))
