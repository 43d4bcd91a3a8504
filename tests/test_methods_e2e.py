"""Methods end to end on a tiny model: full budget == full cache, real memory savings, host tier, Pallas in the loop, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.api import generate_tokens
from kvjax.cache import CacheSpec, new_cache
from kvjax.decoding import compress, decode_step, prefill
from kvjax.methods import H2O, HBW, FullCache, PyramidKV, Quest, SnapKV, StreamingLLM
from kvjax.methods.quest import QuestKV, select_pages
from kvjax.paged import PagedKV, build_paged

L = 48


@pytest.fixture(scope="module")
def tiny(tiny_llama3):
    return tiny_llama3


def step_logits(model, method, tokens, steps=6):
    """Prefill, compress, then teacher-forced decode logits for ``steps`` tokens."""
    cache = new_cache(method, model.config, 1, L, steps, model.dtype)
    first, cache = prefill(model.graphdef, model.params, jnp.asarray(tokens[:, :L]), cache)
    cache = compress(cache)
    out = [np.asarray(first)]
    for t in range(L, L + steps - 1):
        _, logits, cache = decode_step(model.graphdef, model.params, jnp.asarray(tokens[:, t]), cache, jax.random.PRNGKey(0))
        out.append(np.asarray(logits))
    return np.stack(out), cache


ALL = [
    SnapKV(budget=L, window=8, block=16), HBW(budget=L, window=8, block=16), StreamingLLM(budget=L, block=16),
    H2O(budget=L, block=16), PyramidKV(budget=L, window=8, block=16),
    SnapKV(budget=1.0, window=8, block=16, page_size=5), Quest(budget=L, block=16, page_size=8, dense_layers=0),
]


@pytest.mark.parametrize("method", ALL, ids=lambda m: f"{m.name}-{m.budget}")
def test_whole_prompt_budget_equals_full_cache(tiny, method):
    tokens = np.random.default_rng(0).integers(0, 97, size=(1, L + 6)).astype(np.int32)
    ref, _ = step_logits(tiny, FullCache(block=16), tokens)
    got, _ = step_logits(tiny, method, tokens)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)


def test_compressed_logits_differ_from_full(tiny):  # the comparison above can fail
    tokens = np.random.default_rng(0).integers(0, 97, size=(1, L + 6)).astype(np.int32)
    ref, _ = step_logits(tiny, FullCache(block=16), tokens)
    got, _ = step_logits(tiny, SnapKV(budget=12, window=4, block=16), tokens)
    assert np.abs(got[1:] - ref[1:]).max() > 1e-3


def test_device_bytes_equal_sum_of_head_capacities(tiny):
    cfg = tiny.config
    tokens = np.random.default_rng(1).integers(0, 97, size=(1, L + 6)).astype(np.int32)
    for method, ps in [(PyramidKV(budget=20, window=4, block=16, page_size=4), 4), (SnapKV(budget=0.5, window=4, block=16, page_size=8), 8)]:
        _, cache = step_logits(tiny, method, tokens)
        total = 0
        for st in cache.layers:
            assert isinstance(st, PagedKV)
            # arrays' own sizes: pages of K and V
            total += st.k_pages.size * st.k_pages.dtype.itemsize + st.v_pages.size * st.v_pages.dtype.itemsize
            expected_slots = sum(-(-(c + 6) // ps) * ps for c in st.capacities)  # capacity + decode room, page-rounded
            assert st.k_pages.shape[0] * ps == expected_slots
        bytes_per_slot = 2 * cfg.head_dim * 4
        caps = [c for st in cache.layers for c in st.capacities]
        assert sum(caps) == (20 * cfg.num_layers * cfg.num_kv_heads if ps == 4 else (L // 2) * cfg.num_layers * cfg.num_kv_heads)
        assert abs(total - sum(caps + [6] * len(caps)) * bytes_per_slot) <= len(caps) * ps * bytes_per_slot
        assert cache.device_bytes() >= total


def test_generate_api_accepts_method_names_and_instances(tiny):
    row = list(np.random.default_rng(3).integers(0, 97, size=40))
    out, count, cache, _ = generate_tokens(tiny, [row, row[:30]], method=HBW(budget=16, window=4, block=16), max_new_tokens=4)
    assert out.shape == (2, 4)
    assert cache.stats()["kept_tokens_per_head"][0] == [16, 16]


@pytest.mark.parametrize("bad, match", [
    (lambda: SnapKV(budget=0), "budget must be > 0"),
    (lambda: SnapKV(budget=1.5), r"fractional budget must be in \(0, 1\]"),
    (lambda: SnapKV(budget=8, window=32).head_capacities(spec(40)), "window 32 is larger than the budget of 8"),
    (lambda: HBW(budget=16, window=4, block_size=32).head_capacities(spec(40)), "block size 32 is larger than the capacity of 16"),
    (lambda: StreamingLLM(budget=3, sinks=4).head_capacities(spec(40)), "sinks 4 is larger than the budget of 3"),
    (lambda: SnapKV(gqa="median"), "unknown GQA aggregation 'median'"),
    (lambda: kvjax.get_method("snapkvv"), "unknown method 'snapkvv'; available: chunked_eviction, full, h2o, hbw"),
])
def test_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def spec(prompt_len):
    return CacheSpec(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, batch=1, prompt_slots=prompt_len,
                     longest_row=prompt_len, room=0)


def test_budget_larger_than_longest_row_keeps_the_whole_prompt(tiny):
    """A token budget above every row keeps every row whole: the full cache's tokens, capacities of the longest row."""
    rows = [list(np.random.default_rng(5).integers(0, 97, size=40)), list(np.random.default_rng(6).integers(0, 97, size=10))]
    assert SnapKV(budget=100).head_capacities(spec(40)) == SnapKV(budget=40).head_capacities(spec(40))
    full, full_count, _, _ = generate_tokens(tiny, rows, method=FullCache(), max_new_tokens=6)
    out, count, cache, _ = generate_tokens(tiny, rows, method=SnapKV(budget=41, window=4), max_new_tokens=6)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(full))
    stats = cache.stats()
    assert stats["kept_tokens_per_head"] == [[40, 40], [40, 40]]  # per layer and KV head: the longest row
    assert stats["budget_note"] == "budget of 41 tokens per head is above the prompt's 40 tokens: the whole prompt is kept"
    _, _, cache, _ = generate_tokens(tiny, rows, method=SnapKV(budget=40, window=4), max_new_tokens=2)
    assert "budget_note" not in cache.stats()  # a budget of exactly the longest row needs no note


EVERY = [
    lambda b: SnapKV(budget=b, window=4, block=16), lambda b: HBW(budget=b, window=4, block=16),
    lambda b: StreamingLLM(budget=b, block=16), lambda b: H2O(budget=b, block=16),
    lambda b: PyramidKV(budget=b, window=4, block=16), lambda b: Quest(budget=b, block=16, page_size=8, dense_layers=0),
]
NAMES = ["snapkv", "hbw", "streaming_llm", "h2o", "pyramidkv", "quest"]  # H2O with decode-time eviction evicts by design


@pytest.mark.parametrize("make", EVERY, ids=NAMES)
def test_budget_one_equals_full_cache_under_chunk_padding_and_ragged_batch(tiny, make):
    """Budget 1.0 keeps exactly each row's real tokens: chunk padding and a ragged batch change nothing.

    Before per-row capacities, padding slots were kept and attended (SnapKV(1.0) on a 40-token prompt
    with chunk_size=32 generated other tokens than the full cache).
    """
    rng = np.random.default_rng(11)
    rows = [list(rng.integers(0, 97, size=40)), list(rng.integers(0, 97, size=20))]
    full, _, _, _ = generate_tokens(tiny, rows, method=FullCache(block=16), max_new_tokens=6)
    for chunk in (None, 32):
        got, _, cache, _ = generate_tokens(tiny, rows, method=make(1.0), max_new_tokens=6, chunk_size=chunk)
        np.testing.assert_array_equal(got, full, err_msg=f"chunk_size={chunk}")
    # an int budget equal to the shortest row keeps that row whole (not PyramidKV, whose per-layer
    # capacities go below the average, nor Quest, which reads a budget of pages per step)
    if make(20).name not in ("pyramidkv", "quest"):
        got, _, _, _ = generate_tokens(tiny, rows, method=make(20), max_new_tokens=6, chunk_size=32)
        np.testing.assert_array_equal(got[1], full[1])


def test_padding_is_never_kept(tiny):
    """PyramidKV(budget=20) on a ragged batch: the 20-token row holds exactly its 20 tokens in every layer."""
    rng = np.random.default_rng(12)
    rows = [list(rng.integers(0, 97, size=40)), list(rng.integers(0, 97, size=20))]
    _, _, cache, _ = generate_tokens(tiny, rows, method=PyramidKV(budget=20, window=4, block=16), max_new_tokens=1)
    for st in cache.layers:
        cap = st.capacities[0]
        assert np.asarray(st.lengths)[1].tolist() == [min(cap, 20)] * 2  # never the layer's capacity above 20


def test_decoding_past_the_room_is_an_error(tiny):
    tokens = np.random.default_rng(13).integers(0, 97, size=(1, 24)).astype(np.int32)
    cache = new_cache(SnapKV(budget=8, window=4, block=16), tiny.config, 1, 24, 2, tiny.dtype)
    _, cache = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens), cache)
    with pytest.raises(ValueError, match="compress first"):
        prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, :1]), cache)
    cache = compress(cache)
    key = jax.random.PRNGKey(0)
    for _ in range(2):
        _, _, cache = decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, 0]), cache, key)
    with pytest.raises(ValueError, match="exceed the cache's room"):
        decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, 0]), cache, key)


@pytest.mark.parametrize("make", EVERY, ids=NAMES)
def test_question_after_compression_equals_question_inside_at_full_budget(tiny, make):
    """Prefilling a question onto a compressed cache (query-agnostic) equals prefilling it with the
    context when nothing is evicted, and differs from it at a small budget for a scoring method."""
    rng = np.random.default_rng(14)
    context = [list(rng.integers(0, 97, size=36)), list(rng.integers(0, 97, size=30))]
    question = [list(rng.integers(0, 97, size=5)) for _ in context]
    whole = [c + q for c, q in zip(context, question)]
    ref, _, _, _ = generate_tokens(tiny, whole, method=FullCache(block=16), max_new_tokens=5)
    got, _, cache, _ = generate_tokens(tiny, context, method=make(1.0), max_new_tokens=5, question_rows=question)
    np.testing.assert_array_equal(got, ref)
    assert int(cache.length) == 36 + 5 + 4
    with pytest.raises(ValueError, match="one non-zero length"):
        generate_tokens(tiny, context, method=make(1.0), max_new_tokens=2, question_rows=[question[0], question[1][:3]])


def test_quest_selects_top_pages_plus_last_page():
    # one row, one KV head, 4 pages of 2 tokens, 7 tokens held; keys chosen so page bounds are known
    keys = jnp.asarray([[1, 0], [0, 0], [-1, 0], [-2, 0], [5, 1], [4, 0], [0, 9]], jnp.float32)
    k = jnp.zeros((1, 1, 8, 2)).at[0, 0, :7].set(keys)
    idx = jnp.arange(8, dtype=jnp.int32)[None, None]
    paged = build_paged(k, k, idx, jnp.array([[7]], jnp.int32), (7,), room=1, page_size=2)
    from kvjax.methods.quest import page_bounds
    kmin, kmax = page_bounds(paged)
    st = QuestKV(paged, kmin, kmax, pages_per_step=2)  # one top page + the last page
    # q = (1, 0): bounds = max over page of k_0 -> pages 0: 1, 1: -1, 2: 5; last page (3) always kept
    table, lengths = select_pages(jnp.asarray([[[1.0, 0.0]]]), st, "mean")
    assert np.asarray(table).tolist() == [[[2, 3]]] and int(lengths[0, 0]) == 3
    # q = (-1, 0): page 1 has min -2 -> bound 2, the best
    table, lengths = select_pages(jnp.asarray([[[-1.0, 0.0]]]), st, "mean")
    assert np.asarray(table).tolist() == [[[1, 3]]]


def test_quest_keeps_everything_on_device(tiny):
    tokens = np.random.default_rng(5).integers(0, 97, size=(1, L + 6)).astype(np.int32)
    _, full = step_logits(tiny, FullCache(block=16), tokens)
    _, quest = step_logits(tiny, Quest(budget=16, block=16, page_size=8), tokens)
    stats = quest.stats()
    assert stats["saves"].startswith("bandwidth")
    assert stats["page_pool_bytes"] >= 2 * L * tiny.config.head_dim * 4 * tiny.config.num_layers * tiny.config.num_kv_heads
    assert stats["kv_bytes_read_per_step"] < stats["page_pool_bytes"]


@pytest.mark.parametrize("method_cls", [HBW, Quest, FullCache])
def test_pallas_interpret_generate_equals_xla(tiny, method_cls):
    """The Pallas block-sparse kernel (interpret mode) under generate gives the XLA path's tokens; for the full cache
    it reads the contiguous cache as pages, the short row's left padding skipped (``starts``)."""
    rows = [list(np.random.default_rng(7).integers(0, 97, size=40)), list(np.random.default_rng(8).integers(0, 97, size=33))]
    kw = {Quest: dict(budget=24, block=16, page_size=8), HBW: dict(budget=24, window=4, block=16, page_size=8),
          FullCache: {}}[method_cls]
    xla, _, _, _ = generate_tokens(tiny, rows, method=method_cls(implementation="xla", **kw), max_new_tokens=5)
    pallas, _, cache, _ = generate_tokens(tiny, rows, method=method_cls(implementation="pallas_interpret", **kw),
                                          max_new_tokens=5)
    np.testing.assert_array_equal(pallas, xla)


@pytest.mark.parametrize("name", ["hcattention", "heterocache"])
def test_pallas_interpret_decode_loop_with_host_tier_equals_xla(name):
    """The Pallas kernels (interpret mode, the CPU default form) inside a decode loop that also holds ``pinned_host``
    arrays (HCAttention's values with the PQ kernel; HeteroCache's satellites with the paged kernel, recalls forced)
    give the XLA path's tokens. With the TPU form's interpreter jax 0.10 failed to lower this loop."""
    from kvjax.methods import HCAttention, HeteroCache
    from tests.mesh_worker import CONFIG_D16, codebooks, recall_artifacts, tiny_model

    rows = [list(np.random.default_rng(0).integers(1, 128, size=n)) for n in (100, 90)]
    if name == "hcattention":
        model = tiny_model()
        make, artifact = lambda impl: HCAttention(groups=4, centroids=8, tau=0.9, implementation=impl), codebooks()
    else:  # the paged kernel's GPU form needs head_dim >= 16
        model = tiny_model(CONFIG_D16)
        make = lambda impl: HeteroCache(budget=0.5, window=2, tau_drift=1.0, block=32, implementation=impl)
        artifact = recall_artifacts(CONFIG_D16)[0]
    tokens = {}
    for impl in ("xla", "pallas_interpret"):
        out, _, cache, _ = generate_tokens(model, rows, method=make(impl), max_new_tokens=4, chunk_size=32,
                                           artifact=artifact)
        assert cache.stats()["host_bytes"] > 0
        tokens[impl] = np.asarray(out)
    np.testing.assert_array_equal(tokens["pallas_interpret"], tokens["xla"])
