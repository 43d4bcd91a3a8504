"""Static methods end to end on a tiny model: full budget == full cache, real memory savings, host tier, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.api import generate_tokens
from kvjax.generate import compress, decode_step, prefill
from kvjax.methods import H2O, HBW, FullCache, PyramidKV, Quest, SnapKV, StreamingLLM
from kvjax.methods.quest import QuestKV, select_pages
from kvjax.paged import PagedKV, build_paged, offload, recall_into
from models import load_model
from tests.tiny import save_tiny
from kvjax.cache import new_cache

L = 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama3")
    save_tiny("llama3_rope", str(path), seed=3)
    return load_model(str(path), "float32", tokenizer=False)


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


def test_host_tier_roundtrip_and_memory_kinds():
    rng = np.random.default_rng(2)
    B, H, S, D = 2, 2, 40, 8
    k = jnp.asarray(rng.normal(size=(B, H, S, D)).astype(np.float32))
    v = jnp.asarray(rng.normal(size=(B, H, S, D)).astype(np.float32))
    host = offload(k, v, [(1, 0), (0, 1)])
    assert host.k.sharding.memory_kind == "pinned_host" and host.v.sharding.memory_kind == "pinned_host"
    keep = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (B, H, 10))
    paged = build_paged(k, v, keep, (10, 10), room=4, page_size=4)
    assert paged.k_pages.sharding.memory_kind == "device"
    rows = jnp.asarray([33, 5, 17, 0, 0], jnp.int32)

    @jax.jit
    def recall(paged, host, rows):
        return recall_into(paged, host, host_head=0, row=1, kv_head=0, rows=rows, count=jnp.int32(3), dst_start=2)

    out = recall(paged, host, rows)
    assert out.k_pages.sharding.memory_kind == "device"
    table = np.asarray(out.block_table)
    def head_rows(pool, b, h, n):
        flat = np.asarray(pool).reshape(-1, D)
        return np.stack([flat[table[b, h, j // 4] * 4 + j % 4] for j in range(n)])
    got_k = head_rows(out.k_pages, 1, 0, 10)
    np.testing.assert_array_equal(got_k[2:5], np.asarray(k)[1, 0, [33, 5, 17]])  # recalled rows
    np.testing.assert_array_equal(got_k[:2], np.asarray(k)[1, 0, :2])  # untouched slots
    np.testing.assert_array_equal(got_k[5:], np.asarray(k)[1, 0, 5:10])
    np.testing.assert_array_equal(head_rows(out.v_pages, 1, 0, 10)[2:5], np.asarray(v)[1, 0, [33, 5, 17]])
    np.testing.assert_array_equal(head_rows(out.k_pages, 0, 0, 10), np.asarray(k)[0, 0, :10])  # other heads intact


def test_generate_api_accepts_method_names_and_instances(tiny):
    row = list(np.random.default_rng(3).integers(0, 97, size=40))
    out, count, cache, _ = generate_tokens(tiny, [row, row[:30]], method=HBW(budget=16, window=4, block=16), max_new_tokens=4)
    assert out.shape == (2, 4)
    assert cache.stats()["kept_tokens_per_head"][0] == [16, 16]


@pytest.mark.parametrize("bad, match", [
    (lambda: SnapKV(budget=0), "budget must be > 0"),
    (lambda: SnapKV(budget=1.5), r"fractional budget must be in \(0, 1\]"),
    (lambda: SnapKV(budget=100).layer_capacities(2, 40), "larger than the prompt"),
    (lambda: SnapKV(budget=8, window=32).layer_capacities(2, 40), "window 32 is larger than the budget of 8"),
    (lambda: HBW(budget=16, window=4, block_size=32).layer_capacities(2, 40), "block size 32 is larger than the capacity of 16"),
    (lambda: StreamingLLM(budget=3, sinks=4).layer_capacities(2, 40), "sinks 4 is larger than the budget of 3"),
    (lambda: SnapKV(gqa="median"), "unknown GQA aggregation 'median'"),
    (lambda: kvjax.get_method("snapkvv"), "unknown method 'snapkvv'; available: full, h2o, hbw"),
])
def test_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_budget_larger_than_shortest_row(tiny):
    with pytest.raises(ValueError, match="larger than the shortest prompt"):
        generate_tokens(tiny, [[1] * 40, [1] * 10], method=SnapKV(budget=20, window=4), max_new_tokens=2)


def test_quest_selects_top_pages_plus_last_page():
    # one row, one KV head, 4 pages of 2 tokens, 7 tokens held; keys chosen so page bounds are known
    keys = jnp.asarray([[1, 0], [0, 0], [-1, 0], [-2, 0], [5, 1], [4, 0], [0, 9]], jnp.float32)
    k = jnp.zeros((1, 1, 8, 2)).at[0, 0, :7].set(keys)
    idx = jnp.arange(8, dtype=jnp.int32)[None, None]
    paged = build_paged(k, k, idx, (7,), room=1, page_size=2).replace(lengths=jnp.array([[7]], jnp.int32))
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


@pytest.mark.parametrize("method_cls", [HBW, Quest])
def test_pallas_interpret_generate_equals_xla(tiny, method_cls):
    """The Pallas block-sparse kernel (interpret mode) under generate gives the XLA path's tokens."""
    rows = [list(np.random.default_rng(7).integers(0, 97, size=40)), list(np.random.default_rng(8).integers(0, 97, size=33))]
    kw = dict(budget=24, block=16, page_size=8) if method_cls is Quest else dict(budget=24, window=4, block=16, page_size=8)
    xla, _, _, _ = generate_tokens(tiny, rows, method=method_cls(implementation="xla", **kw), max_new_tokens=5)
    pallas, _, cache, _ = generate_tokens(tiny, rows, method=method_cls(implementation="pallas_interpret", **kw),
                                          max_new_tokens=5)
    np.testing.assert_array_equal(pallas, xla)
