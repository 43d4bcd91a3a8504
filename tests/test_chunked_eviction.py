"""SnapKV / H2O / StreamingLLM evicting during chunked prefill (Locret's bounded schedule).

References: the full cache's tokens when nothing is evicted, and a numpy simulation of each scorer
on layer 0 from HF ``transformers``' own post-RoPE q and k (layer 0 does not depend on the cache).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.api import generate_tokens
from kvjax.cache import new_cache
from kvjax.decoding import prefill_prompt
from kvjax.methods import ChunkedEviction, FullCache, get_method
from kvjax.models import load_model
from tests.test_locret_train import hf_projections
from tests.tiny import PEAKED, save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_chunked")
    hf = save_tiny("qwen2", str(path), seed=5, scale=PEAKED)
    return load_model(str(path), "float32", tokenizer=False), hf


@pytest.mark.parametrize("scorer", ["snapkv", "h2o", "streaming_llm"])
def test_budget_covering_the_prompt_equals_the_full_cache(tiny, scorer):
    model, _ = tiny
    rng = np.random.default_rng(1)
    rows = [list(rng.integers(0, 97, size=40)), list(rng.integers(0, 97, size=19))]
    full, *_ = generate_tokens(model, rows, method=FullCache(block=16), max_new_tokens=5)
    method = ChunkedEviction(scorer=scorer, budget=40, chunk=8, local=4, window=3, sinks=2)
    got, _, cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=5, chunk_size=16)
    np.testing.assert_array_equal(got, full)
    assert np.asarray(cache.layers[1].lengths).tolist() == [[40 + 4] * 2, [19 + 4] * 2]


def simulate(scorer, q, k, L, chunk, b, n_s, local, window, kernel, sinks):
    """Held slots of one KV head after the prompt; ``q[G, L, D]`` (its query heads), ``k[L, D]`` post-RoPE."""
    G, _, D = q.shape
    held: list[int] = []
    acc = np.zeros(L)
    local_start = L - local
    for start in range(0, L, chunk):
        end = min(start + chunk, L)
        held += list(range(start, end))
        probs = np.zeros((end - start, L))  # mean over the group of each query's attention over held slots
        for t in range(start, end):
            vis = [s for s in held if s <= t]
            logits = q[:, t] @ k[vis].T / np.sqrt(D)  # [G, |vis|]
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            probs[t - start, vis] = p.mean(0)
        if scorer == "h2o":
            acc[held] += probs.sum(0)[held]
            prio = acc
        elif scorer == "snapkv":
            w = min(window, end - start)
            s = probs[-w:].sum(0)
            ordered = sorted(held)
            prio = np.zeros(L)
            for i, slot in enumerate(ordered):
                lo, hi = max(0, i - kernel // 2), min(len(ordered), i + kernel // 2 + 1)
                prio[slot] = max(s[x] for x in ordered[lo:hi])
        else:
            prio = np.arange(L, dtype=float)
        sink = [s for s in held if s < sinks]
        evictable = [s for s in held if sinks <= s < local_start]
        forced = [s for s in evictable if s >= end - n_s] if end < local_start else []
        rest = sorted((s for s in evictable if s not in forced), key=lambda s: (-prio[s], s))
        keep_b = b - sinks
        held = sorted(sink + forced + rest[: keep_b - len(forced)] + [s for s in held if s >= local_start])
    return held


@pytest.mark.parametrize("scorer,L,chunk,budget,local", [("h2o", 45, 8, 16, 4), ("snapkv", 45, 8, 16, 4),
                                                         ("snapkv", 37, 16, 14, 6), ("streaming_llm", 45, 8, 16, 4)])
def test_layer0_survivors_match_a_numpy_simulation(tiny, scorer, L, chunk, budget, local):
    model, hf = tiny
    tokens = np.random.default_rng(L + chunk).integers(0, 97, size=(1, L)).astype(np.int32)
    method = ChunkedEviction(scorer=scorer, budget=budget, chunk=chunk, local=local, window=3, kernel=3, sinks=2)
    cache = new_cache(method, model.config, 1, L, 2, model.dtype)
    _, cache = prefill_prompt(model.graphdef, model.params, tokens, cache, chunk_size=chunk)
    _, _, _, qr, kr = hf_projections(hf, list(tokens[0]))[0]
    Hkv = model.config.num_kv_heads
    G = model.config.num_heads // Hkv
    b = budget - local
    n_s = cache.layers[0].n_s
    sinks = 2 if scorer == "streaming_llm" else 0
    for h in range(Hkv):
        want = simulate(scorer, qr[h * G:(h + 1) * G].astype(np.float64), kr[h].astype(np.float64), L, chunk, b, n_s,
                        local, 3, 3, sinks)
        slots = np.asarray(cache.layers[0].buffer.slots)[0, h]
        assert slots[slots >= 0].tolist() == want


def test_spec_defaults_and_errors(tiny):
    model, _ = tiny
    assert get_method("chunked_eviction:scorer=h2o").n_stabilizers == 0.5
    assert get_method("chunked_eviction").n_stabilizers == 32
    with pytest.raises(ValueError, match="scorer must be one of"):
        ChunkedEviction(scorer="quest")
    with pytest.raises(ValueError, match="odd kernel"):
        ChunkedEviction(kernel=4)
    with pytest.raises(ValueError, match="n_s=32 must be smaller than b=12"):
        new_cache(ChunkedEviction(budget=16, local=4), model.config, 1, 40, 2, model.dtype)
    with pytest.raises(ValueError, match="takes no artifact"):
        ChunkedEviction(budget=16, local=4, window=2).init_cache(None, artifact=object())
