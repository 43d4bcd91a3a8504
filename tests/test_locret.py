"""Locret inference: eviction during chunked prefill with retaining-head scores, bounded memory, errors.

References: the full cache's tokens (nothing evicted), and a numpy simulation of Algorithm 1 on
layer 0, whose scores come from HF ``transformers``' own layer-0 projections (independent of kvjax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kvjax.api import generate_tokens
from kvjax.artifacts import Artifact, model_identity
from kvjax.cache import new_cache
from kvjax.decoding import TRACE_COUNTS, compress, decode_loop, prefill_prompt
from kvjax.methods import FullCache, Locret, get_method
from kvjax.retaining_heads import random_heads_artifact
from kvjax.models import load_model
from tests.tiny import CONFIGS, PEAKED, save_tiny

HIDDEN = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_locret")
    hf = save_tiny("qwen2", str(path), seed=9, scale=PEAKED)
    return load_model(str(path), "float32", tokenizer=False), hf


def heads_for(model, seed=0):
    c = model.config
    return random_heads_artifact(model_identity(c), c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, HIDDEN, seed)


def test_budget_covering_the_prompt_equals_the_full_cache(tiny):
    model, _ = tiny
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(0, 97, size=45)), list(rng.integers(0, 97, size=23))]
    full, *_ = generate_tokens(model, rows, method=FullCache(block=16), max_new_tokens=6)
    for chunk_size, pool in ((None, 1), (8, 1), (16, 1), (8, 5)):
        method = Locret(budget=45, chunk=8, local=4, stabilizers=2, pool=pool)
        got, _, cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=6, chunk_size=chunk_size,
                                           artifact=heads_for(model))
        np.testing.assert_array_equal(got, full)
        # every real token kept (the short row's budget above its length), then 5 decoded tokens appended
        assert np.asarray(cache.layers[0].lengths).tolist() == [[45 + 5] * 2, [23 + 5] * 2]


def prefilled(model, method, tokens, chunk_size, artifact):
    cache = new_cache(method, model.config, 1, tokens.shape[1], 4, model.dtype, artifact=artifact)
    _, cache = prefill_prompt(model.graphdef, model.params, tokens, cache, chunk_size=chunk_size)
    return cache


def layer0_scores(hf, w1, w2, tokens):
    """Retaining-head scores [T, Hkv] of layer 0 from HF's own embedding, norm and q/k/v projections (numpy head)."""
    with torch.no_grad():
        layer = hf.model.layers[0]
        x = layer.input_layernorm(hf.model.embed_tokens(torch.as_tensor(tokens)))
        feats = torch.cat([layer.self_attn.q_proj(x), layer.self_attn.k_proj(x), layer.self_attn.v_proj(x)], -1)[0].numpy()
    h = feats @ np.asarray(w1, np.float64)
    return (h / (1 + np.exp(-h))) @ np.asarray(w2, np.float64)


def simulate(scores, L, chunk, b, n_s, local):
    """Algorithm 1 on one head: held slots after the prompt (ties: the earlier slot)."""
    held: list[int] = []
    local_start = L - local
    for start in range(0, L, chunk):
        end = min(start + chunk, L)
        held += list(range(start, end))
        nonlocal_held = [s for s in held if s < local_start]
        forced = [s for s in nonlocal_held if s >= end - n_s] if end < local_start else []
        rest = sorted((s for s in nonlocal_held if s not in forced), key=lambda s: (-scores[s], s))
        held = sorted(forced + rest[: b - len(forced)] + [s for s in held if s >= local_start])
    return held


def max_pool_in_pieces(scores, chunk, kernel):
    """Each token's score ``[T, H]`` -> the max over the ``kernel`` tokens centred on it inside its piece of ``chunk``."""
    T, r = len(scores), kernel // 2
    out = np.empty_like(scores)
    for t in range(T):
        lo, hi = max(t - r, t // chunk * chunk), min(t + r + 1, (t // chunk + 1) * chunk, T)
        out[t] = scores[lo:hi].max(axis=0)
    return out


def test_pooling_within_pieces_on_a_hand_computed_case():
    """Kernel 3 over pieces of 4 tokens, slot 0 padding: neither padding (9) nor the next piece (t=3/t=4) lends its score."""
    from kvjax.methods.locret import pool_within_pieces

    scores = jnp.asarray([9.0, 1, 5, 7, 0, 3, 8])[None, :, None]
    real = jnp.asarray([[False] + [True] * 6])
    got = np.asarray(pool_within_pieces(scores, real, chunk=4, kernel=3))[0, 1:, 0]
    assert got.tolist() == [5, 7, 7, 3, 8, 8]
    assert np.asarray(pool_within_pieces(scores, real, chunk=4, kernel=1)).tolist() == np.asarray(scores).tolist()
    # a call shorter than a chunk (a question, a decoded token) is one piece
    assert np.asarray(pool_within_pieces(scores[:, 1:4], real[:, 1:4], chunk=8, kernel=3))[0, :, 0].tolist() == [5, 7, 7]
    assert np.asarray(pool_within_pieces(scores[:, 4:5], real[:, 4:5], chunk=8, kernel=3)).tolist() == [[[0.0]]]


@pytest.mark.parametrize("L,chunk,budget,n_s,local,pool", [(48, 8, 16, 3, 5, 1), (61, 16, 20, 4, 7, 1), (40, 8, 12, 0, 0, 1),
                                                           (61, 16, 20, 4, 7, 5)])
def test_layer0_survivors_match_a_numpy_simulation(tiny, L, chunk, budget, n_s, local, pool):
    """Layer 0's scores depend only on each token itself: Algorithm 1 simulated on HF's projections
    (max-pooled within each chunk in numpy for ``pool > 1``)."""
    model, hf = tiny
    tokens = np.random.default_rng(L).integers(0, 97, size=(1, L)).astype(np.int32)
    art = heads_for(model, seed=L)
    method = Locret(budget=budget, chunk=chunk, local=local, stabilizers=n_s, pool=pool)
    cache = prefilled(model, method, tokens, None, art)
    scores = max_pool_in_pieces(layer0_scores(hf, art.arrays["w1"][0], art.arrays["w2"][0], tokens), chunk, pool)
    b = budget - local
    for h in range(model.config.num_kv_heads):
        want = simulate(scores[:, h], L, chunk, b, n_s, local)
        slots = np.asarray(cache.layers[0].buffer.slots)[0, h]
        got = slots[slots >= 0].tolist()
        assert got == want
        assert set(range(L - local, L)) <= set(got)  # the local window is never evicted
        assert len(got) == budget


def test_default_chunk_and_stabilizers_are_the_papers_at_its_budget_and_follow_smaller_budgets(tiny):
    """Table 2 (Llama-3.1-8B): b = 16384, B = 1024, n_s = 2500; the defaults keep those proportions of b."""
    from kvjax.bounded_prefill import chunk_tokens

    model, _ = tiny
    art = heads_for(model)
    method = Locret(budget=16384 + 100)  # the budget counts the local window (b = budget - local)
    spec = new_cache(method, model.config, 1, 20000, 1024, model.dtype, artifact=art).spec
    assert method.sizes(spec) == (16384, 2500) and method.chunk_tokens(spec) == 1024
    small = Locret(budget=410)  # 10% of a 4K prompt: b = 310 -> B = ceil(310 / 16) = 20, n_s = floor(310 * 0.1526) = 47
    spec = new_cache(small, model.config, 1, 4100, 1024, model.dtype, artifact=art).spec
    assert small.sizes(spec) == (310, 47) and small.chunk_tokens(spec) == 20
    assert Locret(budget=410, chunk=1024).chunk_tokens(spec) == 1024  # an int is tokens, as in the paper
    assert chunk_tokens(0.25, 3) == 1 and chunk_tokens(0.5, 31) == 16
    cache = new_cache(small, model.config, 1, 4100, 1024, model.dtype, artifact=art)
    assert cache.layers[0].buffer.k.shape[2] == 410 + 20  # b + n_loc + B entries
    with pytest.raises(ValueError, match="fraction of b"):
        Locret(chunk=0.0)
    with pytest.raises(ValueError, match="fraction of b"):
        Locret(chunk=-3)


def test_fractional_chunk_matches_the_simulation_with_its_tokens(tiny):
    """chunk=0.5 of b = 16 - 5 = 11 gives pieces of 6 tokens: the numpy simulation with chunk 6 agrees."""
    model, hf = tiny
    L, budget, local, n_s = 53, 16, 5, 2
    tokens = np.random.default_rng(3).integers(0, 97, size=(1, L)).astype(np.int32)
    art = heads_for(model, seed=3)
    cache = prefilled(model, Locret(budget=budget, chunk=0.5, local=local, stabilizers=n_s), tokens, None, art)
    assert cache.layers[0].buffer.chunk == 6
    scores = layer0_scores(hf, art.arrays["w1"][0], art.arrays["w2"][0], tokens)
    for h in range(model.config.num_kv_heads):
        slots = np.asarray(cache.layers[0].buffer.slots)[0, h]
        assert slots[slots >= 0].tolist() == simulate(scores[:, h], L, 6, budget - local, n_s, local)


def rope_np(x, positions, theta):
    """RoPE of ``x[N, H, D]`` at ``positions[N]`` (numpy float64, rotate-half layout as HF)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.asarray(positions, np.float64)[:, None, None] * inv_freq
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def test_shift_rope_moves_a_key_to_another_position():
    from kvjax.rope import shift_rope

    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 2, 8))
    p = np.array([0, 3, 7, 100, 4000])
    delta = np.array([5, -3, 0, 900, -3999])
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    got = shift_rope(jnp.asarray(rope_np(x, p, 10000.0), jnp.float32), jnp.asarray(delta)[:, None],
                     jnp.asarray(inv_freq, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), rope_np(x, p + delta, 10000.0), atol=2e-5)
    with pytest.raises(ValueError, match="inverse frequencies"):
        shift_rope(jnp.ones((2, 8)), jnp.zeros((2,), jnp.int32), None)


@pytest.mark.parametrize("positions", ["original", "contiguous"])
@pytest.mark.parametrize("new_tokens", [1, 4])
def test_kept_keys_sit_at_the_chosen_positions(tiny, positions, new_tokens):
    """Layer 0, left-padded batch, after the prompt (1 token: no decode step) and after 3 decode steps that
    evict: each kept key equals HF's pre-RoPE key of its token, RoPE'd at its own position ("original") or
    at consecutive positions ending at the last stored token ("contiguous", the reference code's
    re-application of RoPE to the compacted cache)."""
    model, hf = tiny
    rng = np.random.default_rng(5)
    rows = [list(rng.integers(0, 97, size=45)), list(rng.integers(0, 97, size=30))]
    method = Locret(budget=14, chunk=8, local=4, stabilizers=2, positions=positions, evict_during_decode=True)
    got, _, cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=new_tokens, artifact=heads_for(model))
    buf = cache.layers[0].buffer
    P = 45
    last = P + new_tokens - 2  # slot of the last stored token (the last generated token is not fed back)
    D, Hkv = model.config.head_dim, model.config.num_kv_heads
    for r, row in enumerate(rows):
        pad = P - len(row)
        seq = row + [int(t) for t in np.asarray(got)[r, : new_tokens - 1]]
        with torch.no_grad():
            attn = hf.model.layers[0]
            x = attn.input_layernorm(hf.model.embed_tokens(torch.as_tensor([seq])))
            k_pre = attn.self_attn.k_proj(x)[0].numpy().astype(np.float64).reshape(len(seq), Hkv, D)
        for h in range(Hkv):
            slots = np.asarray(buf.slots)[r, h]
            held = slots[slots >= 0]
            assert held.max() == last and len(held) <= 14
            assert (np.diff(held) > 1).any()  # evicted tokens left gaps: the two conventions differ here
            n = len(held)
            pos = held - pad if positions == "original" else last - pad - n + 1 + np.arange(n)
            want = rope_np(k_pre[held - pad][:, h:h + 1], pos, CONFIGS["qwen2"][2]["rope_theta"])[:, 0]
            np.testing.assert_allclose(np.asarray(buf.k)[r, h, :n], want, atol=2e-4)


def test_stabilizers_are_kept_after_every_chunk_but_the_last(tiny):
    """With scores that rank the newest tokens last, only the stabilizers can keep them."""
    model, _ = tiny
    c = model.config
    art = heads_for(model)
    # w2 = 0 and a negative bias-like ramp are impossible with a bias-free head; instead check through
    # the simulation's forced set on a chunk boundary: after the first chunk of 8 with n_s = 3 the
    # slots 5, 6, 7 must be held whatever their scores.
    L = 24
    tokens = np.random.default_rng(3).integers(0, 97, size=(1, L)).astype(np.int32)
    method = Locret(budget=8, chunk=8, local=2, stabilizers=3)
    cache = new_cache(method, c, 1, L, 2, model.dtype, artifact=art)
    _, cache = prefill_prompt(model.graphdef, model.params, tokens[:, :8], cache, chunk_size=8)
    for layer in cache.layers:
        slots = np.asarray(layer.buffer.slots)[0]
        for h in range(c.num_kv_heads):
            assert {5, 6, 7} <= set(slots[h][slots[h] >= 0].tolist())
            assert (slots[h] >= 0).sum() == 6  # b = 8 - 2 local


def test_schedule_is_independent_of_the_prefill_call_size(tiny):
    model, _ = tiny
    tokens = np.random.default_rng(7).integers(0, 97, size=(1, 64)).astype(np.int32)
    art = heads_for(model, seed=1)
    for method in (Locret(budget=20, chunk=8, local=6, stabilizers=3), Locret(budget=20, chunk=8, local=6, stabilizers=3, pool=5)):
        ref = prefilled(model, method, tokens, 8, art)
        for chunk_size in (None, 16, 32):
            got = prefilled(model, method, tokens, chunk_size, art)
            for a, b in zip(ref.layers, got.layers):
                np.testing.assert_array_equal(np.asarray(a.buffer.slots), np.asarray(b.buffer.slots))
                np.testing.assert_allclose(np.asarray(a.buffer.k), np.asarray(b.buffer.k), atol=1e-5)


def test_memory_is_bounded_by_budget_plus_chunk(tiny):
    model, _ = tiny
    art = heads_for(model)
    method = Locret(budget=24, chunk=16, local=4, stabilizers=2)
    caches = [new_cache(method, model.config, 1, L, 4, model.dtype, artifact=art) for L in (64, 400)]
    for cache in caches:
        for layer in cache.layers:
            assert layer.buffer.k.shape[2] == 24 + 16  # b + n_loc + B entries per (row, KV head)
    assert caches[0].device_bytes() == caches[1].device_bytes()
    full = [new_cache(FullCache(block=16), model.config, 1, L, 4, model.dtype).device_bytes() for L in (64, 400)]
    assert full[1] > full[0]
    # the heads are weights: the statistics give their bytes apart from the cache's
    heads = sum(x.nbytes for x in jax.tree_util.tree_leaves(art) if hasattr(x, "nbytes"))
    assert heads > 0 and caches[0].stats()["artifact_device_bytes"] == heads
    assert new_cache(FullCache(block=16), model.config, 1, 64, 4, model.dtype).stats()["artifact_device_bytes"] == 0


def test_decode_loop_compiles_once_and_fractional_budgets(tiny):
    model, _ = tiny
    art = heads_for(model)
    method = Locret(budget=0.5, chunk=16, local=4)
    before = TRACE_COUNTS["decode_loop"]
    for seed in range(2):
        tokens = np.random.default_rng(seed).integers(0, 97, size=(1, 48)).astype(np.int32)
        cache = prefilled(model, method, tokens, 16, art)
        cache = compress(cache)
        assert np.asarray(cache.layers[0].lengths).tolist() == [[24, 24]]
        decode_loop(model.graphdef, model.params, jnp.asarray(tokens[:, -1]), cache, jax.random.PRNGKey(0), max_new_tokens=4)
    assert TRACE_COUNTS["decode_loop"] - before == 1


def test_cli_spec_and_stats(tiny):
    model, _ = tiny
    method = get_method("locret:budget=16:chunk=8:local=4:stabilizers=0.5")
    assert method == Locret(budget=16, chunk=8, local=4, stabilizers=0.5)
    assert get_method("locret:positions=contiguous") == Locret(positions="contiguous")
    _, _, cache, _ = generate_tokens(model, [[1, 2, 3] * 10], method=method, max_new_tokens=2, artifact=heads_for(model))
    st = cache.stats()
    assert (st["b"], st["stabilizers"], st["local"], st["prefill_buffer_tokens_per_head"]) == (12, 6, 4, 24)
    assert st["kept_tokens_per_head"] == [[16, 16]] * model.config.num_layers


def test_bad_input_is_a_clear_error(tiny):
    model, _ = tiny
    c = model.config
    art = heads_for(model)
    with pytest.raises(ValueError, match="chunk"):
        Locret(chunk=0)
    with pytest.raises(ValueError, match="stabilizers"):
        Locret(stabilizers=1.5)
    with pytest.raises(ValueError, match="positions must be one of original, contiguous"):
        Locret(positions="packed")
    for bad in (0, 2, 3.0, True):
        with pytest.raises(ValueError, match="pool must be an odd int >= 1"):
            Locret(pool=bad)
    with pytest.raises(ValueError, match="n_s=12 must be smaller than b=12"):
        new_cache(Locret(budget=16, local=4, stabilizers=12), c, 1, 40, 2, model.dtype, artifact=art)
    with pytest.raises(ValueError, match="longer than the local window"):
        new_cache(Locret(budget=8, local=50), c, 1, 40, 2, model.dtype, artifact=art)
    with pytest.raises(ValueError, match="no room beyond the local window"):
        new_cache(Locret(budget=8, local=8), c, 1, 40, 2, model.dtype, artifact=art)
    other = Artifact(arrays=art.arrays, kind="locret", model_id="another-model:0123", meta=art.meta)
    with pytest.raises(ValueError, match="made for model 'another-model:0123'"):
        new_cache(Locret(budget=16, local=4), c, 1, 40, 2, model.dtype, artifact=other)
    bad = Artifact(arrays={"w1": art.arrays["w1"][:1], "w2": art.arrays["w2"][:1]}, kind="locret",
                   model_id=art.model_id, meta=art.meta)
    with pytest.raises(ValueError, match="retaining heads are for"):
        new_cache(Locret(budget=16, local=4), c, 1, 40, 2, model.dtype, artifact=bad)
    with pytest.raises(ValueError, match="no shipped or installed Locret retaining heads"):
        new_cache(Locret(budget=16, local=4), c, 1, 40, 2, model.dtype)


def test_heads_from_a_file(tiny, tmp_path):
    """``locret:heads=<file>`` (a ``kvjax train-locret`` output) runs those heads; a missing file is a clear error."""
    from kvjax.artifacts import save_artifact
    from kvjax.methods import get_method

    model, _ = tiny
    art = heads_for(model, seed=5)
    save_artifact(art, tmp_path / "heads.npz")
    rows = [list(np.random.default_rng(4).integers(0, 97, size=40))]
    method = Locret(budget=12, chunk=8, local=4, stabilizers=2)
    want, _, want_cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=4, artifact=art)
    from_file = get_method(f"locret:budget=12:chunk=8:local=4:stabilizers=2:heads={tmp_path / 'heads.npz'}")
    got, _, got_cache, _ = generate_tokens(model, rows, method=from_file, max_new_tokens=4)
    np.testing.assert_array_equal(got, want)
    leaves = lambda c: [np.asarray(x) for x in jax.tree_util.tree_leaves(c.layers)]
    for a, b in zip(leaves(got_cache), leaves(want_cache)):
        np.testing.assert_array_equal(a, b)
    # other heads keep other tokens at this budget: the file's heads were the ones used
    _, _, other, _ = generate_tokens(model, rows, method=method, max_new_tokens=4, artifact=heads_for(model, seed=6))
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(other), leaves(want_cache)))
    with pytest.raises(ValueError, match="loads its heads from that file"):
        new_cache(from_file, model.config, 1, 40, 2, model.dtype, artifact=art)
    with pytest.raises(ValueError, match="no heads file"):
        new_cache(Locret(budget=16, local=4, heads=str(tmp_path / "none.npz")), model.config, 1, 40, 2, model.dtype)
    with pytest.raises(ValueError, match="heads .npz file"):
        Locret(heads="best")


def test_compiled_prefill_memory_is_flat_in_the_prompt_length(tiny):
    """XLA's memory analysis of the compiled chunk step (the ``kvjax bench locret-memory`` measurement)."""
    from kvjax.evals.locret_memory import measure, table

    model, _ = tiny
    art = heads_for(model)
    rows = [measure(model, m, L, 16, artifact=a) for L in (64, 256)
            for m, a in ((FullCache(block=16), None), (Locret(budget=24, chunk=16, local=4), art))]
    full, loc = rows[0::2], rows[1::2]
    assert full[1]["cache_device_bytes_during_prefill"] > full[0]["cache_device_bytes_during_prefill"]
    assert loc[0]["cache_device_bytes_during_prefill"] == loc[1]["cache_device_bytes_during_prefill"]
    if loc[0]["prefill_step"]:  # memory_analysis() is available on this backend
        assert loc[0]["prefill_step"]["temp_size_in_bytes"] == loc[1]["prefill_step"]["temp_size_in_bytes"]
    assert "| 256 |" in table(rows, "cmd", "cpu")
    from kvjax.evals.locret_memory import run_and_read_peak

    peak = run_and_read_peak(model, FullCache(block=16), 64, 16)  # --measure's child: runs the prefill
    assert peak["weights_device_bytes"] == sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    if peak["peak_device_bytes_measured"] is not None:  # an accelerator's statistics
        assert peak["peak_device_bytes_measured"] >= peak["weights_device_bytes"]
    elif peak["peak_rss_bytes"] is not None:  # CPU on Linux: the resident high-water mark of the run
        assert peak["peak_rss_bytes"] >= peak["rss_before_prefill_bytes"] > peak["weights_device_bytes"]
        row = dict(rows[0], **peak)
        assert "prefill's resident growth, measured" in table([row, rows[1]], "cmd", "cpu")


def test_resident_peak_measurement_sees_a_known_allocation():
    """The CPU path of ``--measure``: after a reset, the resident high-water mark rises by an allocation's size."""
    from kvjax.evals.bench_machine import proc_status_kib, reset_peak_rss

    before = proc_status_kib("VmRSS") * 1024
    if not before or not reset_peak_rss():
        pytest.skip("no /proc/self/status or clear_refs (not Linux)")
    mark = proc_status_kib("VmHWM") * 1024
    assert mark < before + 16 * 2**20  # the reset brought the mark down to the current size
    # 512 MiB, touched; the mark must rise by at least half of it (the kernel may reclaim other pages meanwhile)
    block = np.ones(512 * 2**20 // 8)
    assert proc_status_kib("VmHWM") * 1024 >= mark + 256 * 2**20


def test_eviction_during_decoding_keeps_the_budget(tiny):
    model, _ = tiny
    art = heads_for(model)
    rng = np.random.default_rng(11)
    rows = [list(rng.integers(0, 97, size=30)), list(rng.integers(0, 97, size=21))]
    # budget = the longest prompt: a decoded token attends over everything before the eviction that follows it,
    # so the first two generated tokens equal the full cache's
    full, *_ = generate_tokens(model, rows, method=FullCache(block=16), max_new_tokens=2)
    big = Locret(budget=30, chunk=16, local=4, stabilizers=2, evict_during_decode=True)
    got, *_ = generate_tokens(model, rows, method=big, max_new_tokens=2, artifact=art)
    np.testing.assert_array_equal(got, full)

    method = Locret(budget=12, chunk=16, local=4, stabilizers=2, evict_during_decode=True)
    before = TRACE_COUNTS["decode_loop"]
    _, _, cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=8, artifact=art)
    assert TRACE_COUNTS["decode_loop"] - before == 1
    last = int(cache.length) - 1
    for layer in cache.layers:
        slots = np.asarray(layer.buffer.slots)
        assert slots.shape[-1] == 12 + 16  # the buffer never grows
        held = slots >= 0
        assert (held.sum(-1) == 12).all()  # the budget's tokens per (row, head) after 7 decode steps
        for b in range(2):
            for h in range(model.config.num_kv_heads):
                assert set(range(last - 3, last + 1)) <= set(slots[b, h][held[b, h]].tolist())  # the sliding window
    assert cache.stats()["evicts_during_decode"] is True
