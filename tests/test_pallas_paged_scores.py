"""The paged-scores kernel (:mod:`kvjax.pallas_kernels.paged_scores`) against numpy in float64: its TPU form interpreted on a
CPU and its XLA form, on the edges the recall leaders hit (a pair with nothing held, one holding its whole table,
lengths inside a page, repeated page ids, bfloat16 pages), block tables split over several calls, its lowering for a
TPU, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.pallas_kernels.backend import MASK_VALUE
from kvjax.pallas_kernels.paged_scores import paged_scores
from tests.test_kernel_lowering import export_for, lower_kernels

S = jax.ShapeDtypeStruct


def _case(rng, N, G, D, P, ps, M, lengths, dtype):
    k = jnp.asarray(rng.normal(size=(P, ps, D)), dtype)
    q = jnp.asarray(rng.normal(size=(N, G, D)), jnp.float32)
    table = jnp.asarray(rng.integers(0, P, size=(N, M)), jnp.int32)
    return q, k, table, jnp.asarray(lengths, jnp.int32)


def _numpy(q, k, table, lengths):
    N, G, D = q.shape
    ps, M = k.shape[1], table.shape[1]
    keys = np.asarray(k.astype(jnp.float32), np.float64)[np.asarray(table)].reshape(N, M * ps, D)
    qq = np.asarray(q.astype(k.dtype).astype(jnp.float32), np.float64)  # the query rounded to the keys' dtype
    s = np.einsum("ngd,nsd->ngs", qq, keys) / np.sqrt(D)
    seen = np.arange(M * ps)[None, None, :] < np.asarray(lengths)[:, None, None]
    return np.where(seen, s, MASK_VALUE)


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("dtype,ps", [(jnp.float32, 8), (jnp.bfloat16, 16), (jnp.float32, 48)],
                         ids=["f32-ps8", "bf16-ps16", "f32-ps48"])
def test_logits_match_numpy(implementation, dtype, ps):
    """Nothing held, a length inside a page, a whole table (several blocks of pages), G = 7 (the default model's)."""
    rng = np.random.default_rng(ps)
    M = 2 * 512 // ps + 3  # more than two blocks of about 512 tokens
    q, k, table, lengths = _case(rng, 4, 7, 64, 50, ps, M, [0, ps + 3, M * ps, 700], dtype)
    got = np.asarray(paged_scores(q, k, table, lengths, implementation=implementation))
    want = _numpy(q, k, table, lengths)
    assert got.shape == (4, 7, M * ps) and got.dtype == np.float32
    np.testing.assert_array_equal(got == MASK_VALUE, want == MASK_VALUE)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_block_tables_over_the_smem_budget_split_into_calls():
    """4,100 pages per pair: the SMEM budget holds 7 pairs' tables, so 9 pairs take two calls (interpreted); short
    lengths keep the interpreter to a few blocks."""
    rng = np.random.default_rng(1)
    q, k, table, lengths = _case(rng, 9, 2, 16, 64, 8, 4100, rng.integers(0, 600, 9), jnp.float32)
    got = np.asarray(paged_scores(q, k, table, lengths, implementation="pallas_interpret"))
    np.testing.assert_allclose(got, _numpy(q, k, table, lengths), rtol=1e-5, atol=1e-5)
    kernels = lower_kernels(lambda *a: paged_scores(*a, implementation="pallas", backend="tpu"),
                            (S(q.shape, q.dtype), S(k.shape, k.dtype), S(table.shape, jnp.int32), S((9,), jnp.int32)),
                            "tpu")
    assert len(kernels) == 2


@pytest.mark.parametrize("heads", [(7, 64, jnp.float32), (4, 128, jnp.bfloat16)], ids=["qwen0.5b-f32", "llama8b-bf16"])
def test_lowers_for_a_tpu(heads):
    """The Mosaic module verifies for the recall leaders' shapes (one kernel, its SMEM within the budget); the whole
    step compiles for a v5e-8 in ``tests/test_accelerator_compile.py``."""
    G, D, dtype = heads
    args = (S((8, G, D), jnp.float32), S((512, 16, D), dtype), S((8, 256), jnp.int32), S((8,), jnp.int32))
    kernels = lower_kernels(lambda *a: paged_scores(*a, implementation="pallas", backend="tpu"), args, "tpu")
    assert len(kernels) == 1 and 0 < kernels[0]["smem_bytes"] <= 128 * 1024


def test_bad_calls_raise():
    rng = np.random.default_rng(0)
    q, k, table, lengths = _case(rng, 2, 2, 16, 8, 8, 4, [3, 5], jnp.float32)
    with pytest.raises(ValueError, match="disagree"):
        paged_scores(q, k, table[:1], lengths)
    with pytest.raises(ValueError, match=r"need q\[N, G, D\]"):
        paged_scores(q[0], k, table, lengths)
    with pytest.raises(ValueError, match="implementation"):
        paged_scores(q, k, table, lengths, implementation="cuda")
    with pytest.raises(NotImplementedError, match="TPU form only"):
        paged_scores(q, k, table, lengths, implementation="pallas", backend="gpu")
    with pytest.raises(ValueError, match="page_size to be a multiple of 16"):
        export_for(lambda *a: paged_scores(*a, implementation="pallas", backend="tpu"),
                   (S((2, 2, 16), jnp.float32), S((8, 8, 16), jnp.bfloat16), S((2, 4), jnp.int32), S((2,), jnp.int32)),
                   "tpu")
