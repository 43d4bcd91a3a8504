"""One shared prefill gives every method the same cache and logits as the method's own prefill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.decoding import compress, decode_step, prefill
from kvjax.artifacts import Artifact, model_identity
from kvjax.methods import H2O, HBW, FullCache, HeteroCache, PyramidKV, Quest, SnapKV, StreamingLLM, SyncKV
from kvjax.cache import CacheSpec
from kvjax.shared_prefill import cache_for, init_shared_cache
from kvjax.models import load_model
from tests.tiny import PEAKED, save_tiny
from kvjax.cache import new_cache

L, STEPS = 48, 5
METHODS = [
    FullCache(block=16), SnapKV(budget=12, window=4, block=16), HBW(budget=16, window=8, block=16, block_size=2),
    StreamingLLM(budget=10, block=16), H2O(budget=12, block=16), PyramidKV(budget=0.3, window=4, block=16),
    Quest(budget=16, block=16, page_size=8, dense_layers=1), HeteroCache(budget=0.6, block=16, window=2, tau_drift=1.0),
    SyncKV(budget=0.5, block=16, stride=2, num_representatives=1),
]


def artifact_for(method, model):
    """Hand-made calibrations for the tiny model (2 layers x 2 KV heads, one cross-layer group)."""
    mid = model_identity(model.config)
    lead = (((-1, -1), (0, 0)), ((0, 0), (-1, -1)))
    if method.name == "heterocache":
        meta = (("roles", (("pivot", "satellite"), ("satellite", "anchor"))), ("pivot_of", lead),
                ("stability", ((0.9, 0.5), (0.4, 0.8))), ("group_layers", 2))
        return Artifact(arrays={}, kind="heterocache", model_id=mid, meta=meta)
    if method.name == "synckv":
        lead = (((-1, -1), (0, 0)), ((0, 0), (0, 0)))
        meta = (("clusters", ((1, (("R", "NR"), ("NR", "NR")), lead),)), ("group_layers", 2))
        return Artifact(arrays={}, kind="synckv", model_id=mid, meta=meta)
    return None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny("qwen2", str(path), seed=5, scale=PEAKED)
    return load_model(str(path), "float32", tokenizer=False)


def decode_logits(model, cache, first, tokens):
    """Teacher-forced decode logits after the prompt (the first entry is the prefill's)."""
    out = [np.asarray(first)]
    for t in range(L, L + STEPS - 1):
        _, logits, cache = decode_step(model.graphdef, model.params, jnp.asarray(tokens[:, t]), cache, jax.random.PRNGKey(0))
        out.append(np.asarray(logits))
    return np.stack(out)


def test_shared_prefill_equals_own_prefill(tiny):
    tokens = np.random.default_rng(1).integers(0, 97, size=(2, L + STEPS)).astype(np.int32)
    tokens[1, :5] = 0  # row 1 is left-padded by 5 slots
    pad = np.asarray([0, 5], np.int32)  # a fresh device array per cache: prefill donates it
    spec = CacheSpec.for_model(tiny.config, 2, L, STEPS, tiny.dtype)
    arts = [artifact_for(m, tiny) for m in METHODS]
    staged = init_shared_cache(METHODS, spec, arts).replace(pad=jnp.asarray(pad))
    assert staged.method.shared.window == 8 and staged.method.shared.accumulate
    for i in range(0, L, 16):  # chunked: the window and accumulation are recorded across chunks
        first_shared, staged = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, i:i + 16]), staged)
    for method, art in zip(METHODS, arts):
        own = new_cache(method, tiny.config, 2, L, STEPS, tiny.dtype, artifact=art).replace(pad=jnp.asarray(pad))
        for i in range(0, L, 16):
            first_own, own = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, i:i + 16]), own)
        own = compress(own)
        derived = compress(cache_for(staged, method, art))
        assert jax.tree_util.tree_structure(derived) == jax.tree_util.tree_structure(own), method.name
        for a, b in zip(jax.tree_util.tree_leaves(derived), jax.tree_util.tree_leaves(own)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=method.name)
        np.testing.assert_allclose(decode_logits(tiny, derived, first_shared, tokens),
                                   decode_logits(tiny, own, first_own, tokens), atol=2e-5, rtol=1e-5, err_msg=method.name)
    # the staging survived every derivation (cache_for copies; compress donates the copy)
    assert all(not leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(staged))


def test_shared_prefill_errors(tiny):
    with pytest.raises(ValueError, match="at least one method"):
        init_shared_cache([], CacheSpec.for_model(tiny.config, 1, L, 2, tiny.dtype))
    snap_only = init_shared_cache([SnapKV(budget=12, window=4, block=16)], CacheSpec.for_model(tiny.config, 1, L, 2, tiny.dtype))
    with pytest.raises(ValueError, match="window=8"):
        cache_for(snap_only, SnapKV(budget=12, window=8, block=16))
    with pytest.raises(ValueError, match="accumulate=True"):
        cache_for(snap_only, H2O(budget=12, block=16))
    with pytest.raises(ValueError, match="init_shared_cache"):
        cache_for(new_cache(FullCache(), tiny.config, 1, L, 2, tiny.dtype), SnapKV(budget=12))
    with pytest.raises(ValueError, match="holds 0 of its 48 prompt slots"):
        compress(snap_only)
    _, snap_only = prefill(tiny.graphdef, tiny.params, jnp.zeros((1, L), jnp.int32), snap_only)
    with pytest.raises(ValueError, match="cannot be compressed"):
        compress(snap_only)


def test_compare_gives_each_methods_own_tokens_with_one_shared_prefill(tiny):
    """``compare_tokens`` over a ragged batch, with a question after compression and a method that runs its own
    prefill: every method's tokens equal its own ``generate_tokens``; the shareable ones say one prefill served
    them all."""
    from kvjax.api import compare_tokens, generate_tokens
    from kvjax.methods import ChunkedEviction

    rng = np.random.default_rng(21)
    rows = [list(rng.integers(0, 97, size=L)), list(rng.integers(0, 97, size=L - 9))]
    question = [list(rng.integers(0, 97, size=4)) for _ in rows]
    methods = [FullCache(block=16), SnapKV(budget=12, window=4, block=16), ChunkedEviction(budget=16, chunk=8, local=4, stabilizers=4),
               HeteroCache(budget=0.6, block=16, window=2, tau_drift=1.0)]
    artifacts = [artifact_for(m, tiny) for m in methods]
    got = compare_tokens(tiny, rows, methods, artifacts=artifacts, max_new_tokens=STEPS, chunk_size=16,
                         question_rows=question)
    for m, a, (out, count, cache, timings) in zip(methods, artifacts, got):
        ref, ref_count, _, _ = generate_tokens(tiny, rows, method=m, artifact=a, max_new_tokens=STEPS, chunk_size=16,
                                               question_rows=question)
        np.testing.assert_array_equal(out, ref, err_msg=m.name)
        np.testing.assert_array_equal(count, ref_count)
        assert cache.method == m
        assert timings.get("prefill_shared_by") == (None if m.name == "chunked_eviction" else 3), m.name
    # step by step (the demo's steady-state timings): the same tokens, every step handed over, the first step apart
    seen = []
    stepped = compare_tokens(tiny, rows, methods[:2], artifacts=artifacts[:2], max_new_tokens=STEPS, chunk_size=16,
                             question_rows=question, on_token=seen.append)
    for (out, count, _, timings), (ref, ref_count, _, _) in zip(stepped, got):
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(count, ref_count)
        assert timings["first_step_s"] > 0 and timings["decode_steady_ms_per_token"] > 0
    assert len(seen) == 2 * STEPS and all(t.shape == (2,) for t in seen)
