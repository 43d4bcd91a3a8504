"""Quest stored in a quantized ``kv_dtype``: page bounds of the dequantized stored keys against a numpy reference,
decode logits with every page read equal to the full cache stored in the same dtype, device bytes counted by hand,
and the paged kernel reading the quantized pages under Quest's selected block table."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.api import generate_tokens
from kvjax.methods import FullCache, Quest
from tests.test_kv_quantization_full import ragged, teacher_forced

PAGE = 8


@pytest.fixture(scope="module")
def tiny(tiny_llama3):
    return tiny_llama3


def quest(budget=1.0, implementation="xla"):
    return Quest(budget=budget, page_size=PAGE, dense_layers=0, block=64, implementation=implementation)


def numpy_bounds(st) -> tuple[np.ndarray, np.ndarray]:
    """Per pool page, the element-wise min / max of the keys held there (the first ``lengths[b, h]`` logical slots of
    each row and KV head), each key dequantized in numpy from its stored codes times its scale; +-inf for a page
    holding none."""
    paged = st.paged
    codes = np.asarray(paged.k_pages).astype(np.float32)  # int8 / float8 codes as float32 values (exact)
    scales = np.asarray(paged.k_scales)
    table, lengths = np.asarray(paged.block_table), np.asarray(paged.lengths)
    P, _, D = codes.shape
    kmin, kmax = np.full((P, D), np.inf, np.float32), np.full((P, D), -np.inf, np.float32)
    for b in range(table.shape[0]):
        for h in range(table.shape[1]):
            for j in range(lengths[b, h]):
                p, o = table[b, h, j // PAGE], j % PAGE
                key = codes[p, o] * scales[p, o]  # float32, as attention dequantizes
                kmin[p], kmax[p] = np.minimum(kmin[p], key), np.maximum(kmax[p], key)
    return kmin, kmax


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_page_bounds_are_those_of_the_dequantized_stored_keys(tiny, kv_dtype):
    """After the prompt (a left-padded ragged batch, chunk padding), a question prefilled after compression and 5
    decode steps, every page's bounds equal numpy's min / max of its stored keys dequantized: the prompt's pages from
    compression, the pages the question and the decoded tokens went into from their updates."""
    rows, question, feed = ragged()
    _, cache = teacher_forced(tiny, quest(), rows, feed, chunk=32, kv_dtype=kv_dtype, question=question)
    for layer, st in enumerate(cache.layers):
        assert st.paged.k_pages.dtype == jnp.dtype(kv_dtype) and st.paged.quantized
        assert st.kmin.dtype == jnp.float32 and st.kmax.dtype == jnp.float32
        assert int(st.paged.lengths.max()) == 40 + 3 + 5
        kmin, kmax = numpy_bounds(st)
        np.testing.assert_array_equal(np.asarray(st.kmin), kmin, err_msg=f"layer {layer}")
        np.testing.assert_array_equal(np.asarray(st.kmax), kmax, err_msg=f"layer {layer}")
        # not vacuous: the stored codes alone (no scales) have other extremes
        codes = np.asarray(st.paged.k_pages).astype(np.float32)
        used = np.isfinite(kmax).all(-1)
        assert np.abs(codes.max(1)[used] - kmax[used]).max() > 1.0


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_every_page_read_equals_the_full_cache_stored_in_int8(tiny, implementation):
    """A budget of the whole longest row reads every page at every step, so Quest's int8 logits (the prompt's, a
    question prefilled after compression, 5 decode steps; a left-padded ragged batch with chunk padding) equal the
    full cache's stored in int8 (the same per-token quantization) up to float32 summation order, while both differ
    from the float32 cache's by the quantization's effect (larger than the tolerance)."""
    rows, question, feed = ragged()
    full8, _ = teacher_forced(tiny, FullCache(block=64, implementation=implementation), rows, feed, chunk=32,
                              kv_dtype="int8", question=question)
    got, cache = teacher_forced(tiny, quest(implementation=implementation), rows, feed, chunk=32, kv_dtype="int8",
                                question=question)
    full32, _ = teacher_forced(tiny, FullCache(block=64, implementation=implementation), rows, feed, chunk=32,
                               kv_dtype=None, question=question)
    np.testing.assert_allclose(got, full8, atol=2e-5, rtol=1e-5)
    assert cache.layers[0].paged.k_pages.dtype == jnp.int8 and cache.layers[0].pages_per_step == 40 // PAGE + 1
    assert np.abs(got[:, 1:] - full32[:, 1:]).max() > 20 * 2e-5  # the int8 storage moves the logits past the tolerance


@pytest.mark.parametrize("kv_dtype, itemsize, scale_bytes", [("float32", 4, 0), ("int8", 1, 4),
                                                             ("float8_e4m3fn", 1, 4)])
def test_device_bytes_count_stored_pages_scales_and_bounds(tiny, kv_dtype, itemsize, scale_bytes):
    """Rows of 40 and 20 tokens, a 3-token question and 5 decode steps: each (row, KV head) owns ceil((40 + 8) / 8)
    = 6 pages of 8 slots. Per layer: K and V pools of D values per slot in ``kv_dtype``, quantized one float32 scale
    per slot each; the page bounds kmin and kmax, D float32 values per page each; the block table (6 int32 per row and
    KV head) and lengths. Plus the cache's length counter and the rows' padding."""
    cfg = tiny.config
    rows, question, feed = ragged()
    _, cache = teacher_forced(tiny, quest(), rows, feed, chunk=32, kv_dtype=kv_dtype, question=question)
    B, Hkv, D = len(rows), cfg.num_kv_heads, cfg.head_dim
    pages = B * Hkv * 6
    pools = pages * PAGE * 2 * (D * itemsize + scale_bytes)
    bounds = pages * 2 * D * 4
    tables = B * Hkv * (6 + 1) * 4
    stats = cache.stats()
    assert stats["page_pool_bytes"] == cfg.num_layers * pools
    assert stats["device_bytes"] == cfg.num_layers * (pools + bounds + tables) + 4 + B * 4
    assert all(st.paged.k_pages.dtype == jnp.dtype(kv_dtype) for st in cache.layers)
    assert all(st.paged.quantized == (scale_bytes > 0) for st in cache.layers)
    # a step reads every held token (48 and 28 per KV head: all 6 pages selected), each with its scale, and the bounds
    held = Hkv * (40 + 8 + 20 + 8)
    assert stats["kv_bytes_read_per_step"] == cfg.num_layers * (2 * held * (D * itemsize + scale_bytes) + bounds)


def test_selected_pages_kernel_reads_quantized_pages(tiny):
    """At a budget of 2 pages of the 5-page prompt (pages selected at every step), the Pallas kernel (interpret mode)
    reading the int8 / fp8 pages with their scales under Quest's selected block table generates the XLA path's
    tokens."""
    rng = np.random.default_rng(7)
    rows = [list(rng.integers(0, 97, size=40)), list(rng.integers(0, 97, size=33))]
    for kv_dtype in ("int8", "float8_e4m3fn"):
        xla, _, cache, _ = generate_tokens(tiny, rows, method=quest(16, "xla"), max_new_tokens=5, kv_dtype=kv_dtype)
        pallas, _, _, _ = generate_tokens(tiny, rows, method=quest(16, "pallas_interpret"), max_new_tokens=5,
                                          kv_dtype=kv_dtype)
        assert cache.layers[0].pages_per_step == 3 and cache.layers[0].paged.k_scales is not None
        np.testing.assert_array_equal(pallas, xla, err_msg=kv_dtype)
