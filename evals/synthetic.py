"""Compressed caches and calibration artifacts built directly at a given length, for timing and planning at scale.

Timing a decode step at 128K tokens x 32 rows must not need a 128K-token prefill per row, and the models of the papers'
scale (``kvjax.models.registry.SHAPE_MODELS``) have neither weights nor calibrations here. This module builds what a decode
step reads without them:

* :func:`synthetic_artifact`: a calibrated method's artifact for any model shape, built with the method's own artifact
  builders from synthetic statistics (HeteroCache: the head-class mix the paper publishes for Llama-3.1-8B, 33 pivot /
  196 satellite / 17 volatile / 10 anchor of 256 KV heads, laid out per group of 8 heads; SyncKV: clusters of random
  similarities; HCAttention: random codebooks of the configured size; Locret: untrained heads of the paper's width).
* :func:`abstract_compressed_cache`: the compressed cache's shapes, dtypes and memory kinds (``pinned_host`` for host
  tiers), from tracing ``init_cache`` + ``compress`` (nothing allocated): what the planner compiles for.
* :func:`filled_cache`: a real compressed cache: the method's prefill-stage state filled with random keys, values and
  recorded queries (KVzip: random scores, every head allocated the budget's tokens, :func:`planned_method`), then
  the method's own ``finish_prefill`` (its real selection and layout: pages, per-head
  capacities, host copies, PQ codes). Bounded-prefill methods (Locret, chunked eviction) keep at most ``budget + chunk``
  tokens per head during prefill, so their prefill state is filled the same way.
* :func:`replicated_cache`: the same for many rows with one row staged: the row tiled to the batch (page tables offset
  per row), equal leaf for leaf to :func:`filled_cache` of a batch whose rows are identical.

Decode from such a cache takes the time decode from a real prefill's cache takes (``python -m research.bench_scale
--compare-prefill``: 0.94-1.19 on this CPU, smollm2-135m shapes at 2K tokens). What random data cannot reproduce:
which tokens a method keeps (selection from random scores is arbitrary, which does not change the bytes a step reads),
and the per-step behaviour that depends on attention patterns: HeteroCache's drift trigger rate (the decode benchmark
runs it at both ends, ``tau_drift=0``: never, ``tau_drift=1``: at nearly every check) and SyncKV's re-anchoring on a
question (none in a decode loop). SyncKV's anticipation runs every ``stride`` steps whatever the data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import Cache, CacheSpec

# The HeteroCache paper's head classes for Llama-3.1-8B (256 KV heads), per group of 8 units: every group has a pivot
# (unit 0) whose satellites are units 1-6; unit 7 is a second pivot's satellite (1 group: 33 pivots), its pivot's
# satellite (4 groups: 196 satellites), volatile (17) or an anchor (10). Other shapes keep these fractions.
PAPER_CLASS_COUNTS = {"groups": 32, "two_stars": 1, "seventh_satellite": 4, "volatile": 17}


def synthetic_group_layers(num_kv_heads: int) -> int:
    """Adjacent layers per calibration group so a group holds about 8 KV heads (a Llama-3.1-8B layer), at least one."""
    return max(1, round(8 / num_kv_heads))


def synthetic_head_statistics(num_layers: int, num_kv_heads: int, group_layers: int, seed: int = 0):
    """:class:`kvjax.calibration.HeadStatistics` for groups of ``group_layers`` layers whose HeteroCache classes follow
    :data:`PAPER_CLASS_COUNTS` (with groups of 8 units, :func:`synthetic_group_layers`) and whose similarities give
    SyncKV clusters; stabilities drawn in [0.2, 0.9] (anchors >= 0.5, volatile heads < 0.5)."""
    from kvjax.calibration import HeadStatistics, unit_groups

    rng = np.random.default_rng(seed)
    groups = unit_groups(num_layers, num_kv_heads, group_layers)
    G = len(groups)
    per = {k: int(round(v * G / PAPER_CLASS_COUNTS["groups"])) for k, v in PAPER_CLASS_COUNTS.items() if k != "groups"}
    kinds = (["two_stars"] * per["two_stars"] + ["seventh_satellite"] * per["seventh_satellite"]
             + ["volatile"] * per["volatile"])
    kinds = (kinds + ["anchor"] * G)[:G]
    rng.shuffle(kinds)
    stability = rng.uniform(0.2, 0.9, (num_layers, num_kv_heads))
    sim = []
    for units, kind in zip(groups, kinds):
        U = len(units)
        s = rng.uniform(0.0, 0.3, (U, U))
        s = (s + s.T) / 2
        last = U - 1
        stars = [(0, range(1, last))]
        if U >= 4 and kind == "two_stars":
            stars = [(0, range(1, last - 1)), (last - 1, [last])]
        elif kind == "seventh_satellite" or U < 3:
            stars = [(0, range(1, U))]
        for pivot, sats in stars:
            for j in sats:
                s[pivot, j] = s[j, pivot] = 0.9
        if U >= 3 and kind in ("volatile", "anchor"):
            l, h = units[last]
            stability[l, h] = rng.uniform(0.2, 0.45) if kind == "volatile" else rng.uniform(0.55, 0.9)
        np.fill_diagonal(s, 1.0)
        sim.append(s)
    similarity = np.zeros((num_layers, num_kv_heads))
    for units, s in zip(groups, sim):
        off = s - np.eye(len(units)) * 2
        for u, (l, h) in enumerate(units):
            similarity[l, h] = off[u].max() if len(units) > 1 else 0.0
    return HeadStatistics(stability=stability, stability_curve=stability[None], group_layers=group_layers,
                          sim_mean=sim, sim_median=sim, similarity=similarity, topk=1024, samples=0, decode_steps=0,
                          tokens=0)


def synthetic_artifact(method, spec: CacheSpec, seed: int = 0):
    """An artifact for ``method`` on ``spec``'s model shape, or None for a method without one (see module docstring).

    Its outputs are meaningless (nothing was calibrated); its shapes, classes and sizes are those a calibration of the
    model would have, so the cache it makes holds and moves the bytes a calibrated one would."""
    from kvjax.calibration import auto_group_layers
    from kvjax.methods import HCAttention, HeteroCache, Locret, SyncKV
    from kvjax.calibration.heterocache import heterocache_artifact
    from kvjax.calibration.synckv import synckv_artifact
    from kvjax.pq_codebooks import hcattention_artifact
    from kvjax.retaining_heads import random_heads_artifact

    if isinstance(method, HeteroCache):  # the paper's per-layer classes (8 KV heads a group)
        group_layers = method.group_layers or synthetic_group_layers(spec.num_kv_heads)
        stats = synthetic_head_statistics(spec.num_layers, spec.num_kv_heads, group_layers, seed)
        return heterocache_artifact(stats, spec.model_id)
    if isinstance(method, SyncKV):  # kvjax's default groups (at least 16 KV heads a group)
        group_layers = method.group_layers or auto_group_layers(spec.num_kv_heads)
        stats = synthetic_head_statistics(spec.num_layers, spec.num_kv_heads, group_layers, seed)
        return synckv_artifact(stats, spec.model_id, seed=seed)
    if isinstance(method, HCAttention):
        g = method.key_groups(spec)
        if not g:
            return None
        rng = np.random.default_rng(seed)
        cbs = rng.standard_normal((spec.num_layers, spec.num_kv_heads, g, method.centroids, spec.head_dim // g))
        return hcattention_artifact(cbs.astype(np.float32), spec.model_id, samples=0, tokens=0, iterations=0, batch=0,
                                    seed=seed)
    if isinstance(method, Locret):
        return random_heads_artifact(spec.model_id, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                     hidden=1024, seed=seed)
    return None


def planned_method(method, spec: CacheSpec):
    """``method`` as a cache built without its data holds it: KVzip, whose head budgets come from its reconstruction
    of a real context, with every KV head allocated the budget's tokens (the same bytes); any other method as is."""
    from kvjax.methods import KVzip

    return method.uniform_allocation(spec) if isinstance(method, KVzip) else method


def compressed_structure(method, spec: CacheSpec, artifact=None):
    """``(traced compress, output tree structure)`` of ``method`` on ``spec``: the compressed cache's avals (with their
    memory spaces) without allocating anything."""
    from kvjax.decoding import compress_jit

    method = planned_method(method, spec)

    def compressed():
        cache = method.init_cache(spec, artifact)
        return compress_jit(cache.replace(length=jnp.asarray(spec.prompt_slots, jnp.int32)))

    traced = jax.jit(compressed).trace()
    return traced, jax.tree_util.tree_structure(traced.out_info)


def abstract_compressed_cache(method, spec: CacheSpec, mesh, artifact=None) -> Cache:
    """The compressed cache as ``jax.ShapeDtypeStruct`` leaves placed on ``mesh`` (any (data, model) mesh, of real
    or topology devices): on a multi-device mesh with the cache's own layout (:func:`kvjax.sharding.cache_shardings`),
    on one device replicated, host tiers in ``pinned_host`` either way."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvjax.sharding import cache_shardings, is_split

    traced, tree = compressed_structure(method, spec, artifact)
    avals = traced.jaxpr.out_avals
    kinds = {"Host": "pinned_host", "Device": "device"}
    abstract = jax.tree_util.tree_unflatten(tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    if is_split(spec.mesh):
        shardings = jax.tree_util.tree_leaves(cache_shardings(abstract))
    else:
        shardings = [NamedSharding(mesh, P(), memory_kind=kinds[a.memory_space.name]) for a in avals]
    return jax.tree_util.tree_unflatten(tree, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                                               for a, s in zip(avals, shardings)])


def fill_random(tree, key, *, same_rows: int = 0):
    """Every floating-point array leaf of ``tree`` replaced by standard-normal values of its dtype (in its memory kind),
    integer leaves kept. ``same_rows=B``: leaves whose leading axis has ``B`` entries (a batch's rows) get the same
    values in every row."""
    leaves, tree_def = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, max(1, len(leaves)))
    out = []
    for k, x in zip(keys, leaves):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            if same_rows and x.ndim and x.shape[0] == same_rows:
                y = jnp.broadcast_to(jax.random.normal(k, (1, *x.shape[1:]), x.dtype), x.shape)
            else:
                y = jax.random.normal(k, x.shape, x.dtype)
            sharding = getattr(x, "sharding", None)
            out.append(jax.device_put(y, sharding) if sharding is not None else y)
        else:
            out.append(x)
    return jax.tree_util.tree_unflatten(tree_def, out)


def filled_cache(method, spec: CacheSpec, artifact=None, seed: int = 0, *, same_rows: bool = False) -> Cache:
    """A compressed cache of ``method`` for ``spec`` whose prompt is random (see module docstring): the prefill-stage
    layers filled with random values (``same_rows``: every row the same), the slot counter at the prompt's end, then
    the method's ``finish_prefill``. Builds the prefill-stage state of all rows at once (at 128K tokens one
    Llama-3.1-8B-shaped row stages 16 GiB): for many rows, :func:`replicated_cache`."""
    from kvjax.decoding import compress

    cache = planned_method(method, spec).init_cache(spec, artifact)
    layers = fill_random(cache.layers, jax.random.PRNGKey(seed), same_rows=spec.batch if same_rows else 0)
    cache = cache.replace(layers=layers, length=jnp.asarray(spec.prompt_slots, jnp.int32))
    return compress(cache)


def _tile_rows(x, shape, batch: int):
    """``x`` (one row's leaf) as the ``batch``-row leaf of ``shape``: unchanged, or tiled along its one axis that
    grows ``batch``-fold (a row axis of one, or row-major blocks: page pools, host heads)."""
    if tuple(x.shape) == tuple(shape):
        return x
    grown = [i for i, (a, b) in enumerate(zip(x.shape, shape)) if a != b]
    if len(x.shape) != len(shape) or len(grown) != 1 or shape[grown[0]] != batch * x.shape[grown[0]]:
        raise ValueError(f"cannot replicate a leaf of shape {tuple(x.shape)} to {tuple(shape)} for {batch} rows")
    axis = grown[0]
    if "host" in str(getattr(x.sharding, "memory_kind", "")):  # tiled in host memory, never on the device
        return jax.device_put(np.concatenate([np.asarray(x)] * batch, axis=axis), x.sharding)
    return jnp.concatenate([x] * batch, axis=axis)


def replicated_cache(method, spec: CacheSpec, artifact=None, seed: int = 0) -> Cache:
    """A compressed cache of ``spec.batch`` rows, every row the one row :func:`filled_cache` builds: only one row is
    ever staged, so 128K tokens x 30 rows of an 8B-shaped model fit where the compressed rows do. Equal, leaf for
    leaf, to ``filled_cache(..., same_rows=True)`` (tested). One device only (a mesh lays pages out by block)."""
    from kvjax.paged import PagedKV
    from kvjax.sharding import is_split

    if is_split(spec.mesh):
        raise ValueError("replicated_cache builds a cache for one device; a mesh lays its pages out by device block")
    import dataclasses

    one = filled_cache(method, dataclasses.replace(spec, batch=1), artifact, seed)
    if spec.batch == 1:
        return one
    B = spec.batch

    def pages(p):  # row b's pages follow row b-1's (kvjax.paged.page_layout without a mesh): offset the table
        pool = p.k_pages.shape[0]
        table = jnp.concatenate([p.block_table + b * pool for b in range(B)])
        return p.replace(k_pages=jnp.concatenate([p.k_pages] * B), v_pages=jnp.concatenate([p.v_pages] * B),
                         block_table=table, lengths=jnp.concatenate([p.lengths] * B))

    one = jax.tree_util.tree_map(lambda x: pages(x) if isinstance(x, PagedKV) else x, one,
                                 is_leaf=lambda x: isinstance(x, PagedKV))
    traced, tree = compressed_structure(method, spec, artifact)
    leaves = jax.tree_util.tree_leaves(one)
    avals = traced.jaxpr.out_avals
    if len(leaves) != len(avals):
        raise ValueError(f"{method.name}: the one-row cache has {len(leaves)} arrays, the {B}-row one {len(avals)}")
    cache = jax.tree_util.tree_unflatten(tree, [_tile_rows(x, a.shape, B) for x, a in zip(leaves, avals)])
    return cache.replace(pad=jnp.zeros((B,), jnp.int32))


def cpu_mesh():
    """A one-device ``(data, model)`` mesh of the CPU (where an abstract cache is built for a compile-only target)."""
    from jax.sharding import Mesh

    from kvjax.sharding import AXES

    return Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), AXES)


__all__ = ["PAPER_CLASS_COUNTS", "planned_method", "synthetic_group_layers", "synthetic_head_statistics", "synthetic_artifact",
           "compressed_structure", "abstract_compressed_cache", "fill_random", "filled_cache", "replicated_cache", "cpu_mesh"]
