"""Paged decode attention: Pallas kernels (TPU and GPU forms) vs the jnp reference, and the
reference vs an independent numpy computation over contiguous K/V.

On CPU the kernels run in interpret mode (TPU form under ``pltpu.InterpretParams``, GPU form
under ``interpret=True``); on an accelerator the same tests run the compiled form of that
accelerator.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.pallas_kernels.paged_attention import (
    MASK_VALUE,
    check_block_table,
    paged_decode_attention,
    paged_decode_attention_reference,
)

ON_CPU = jax.default_backend() == "cpu"
IMPL = "pallas_interpret" if ON_CPU else "pallas"
if ON_CPU:
    FORMS = ["tpu", "gpu"]
elif jax.default_backend() == "tpu":
    FORMS = ["tpu"]
else:
    FORMS = ["gpu"]

# The Mosaic GPU form: interpreted on the CPU (Mosaic GPU's interpreter), compiled on a GPU.
MOSAIC = [] if jax.default_backend() == "tpu" else ["mosaic_gpu"]

TOL = {  # (atol, rtol) per K/V dtype
    jnp.float32: (2e-5, 2e-5) if ON_CPU else (2e-3, 2e-3),
    jnp.bfloat16: (2e-2, 2e-2),
}


def make_cache(seed, *, batch, kv_heads, group, head_dim, page_size, max_pages, lengths,
               kv_dtype, q_dtype=None, poison=True):
    """Random paged cache.  Used pages are distinct pages of a shuffled pool; the tails of
    partial pages, the unused pool pages and the unused table entries hold NaN / stale data
    so that a kernel that fails to mask shows up as NaN or a mismatch."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32).reshape(batch, kv_heads)
    pages_needed = -(-lengths // page_size)
    used_total = int(pages_needed.sum())
    num_pages = used_total + 3  # a few spare (poisoned) pages
    k = rng.standard_normal((num_pages, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_pages, page_size, head_dim)).astype(np.float32)
    perm = rng.permutation(num_pages)
    spare = perm[used_total:]
    table = rng.choice(spare, size=(batch, kv_heads, max_pages)).astype(np.int32)
    cursor = 0
    for b in range(batch):
        for h in range(kv_heads):
            n = pages_needed[b, h]
            table[b, h, :n] = perm[cursor:cursor + n]
            cursor += n
            tail = lengths[b, h] % page_size
            if poison and tail:
                last = table[b, h, n - 1]
                k[last, tail:] = np.nan
                v[last, tail:] = np.nan
    if poison:
        k[spare] = np.nan
        v[spare] = np.nan
    q = rng.standard_normal((batch, kv_heads * group, head_dim)).astype(np.float32)
    q_dtype = kv_dtype if q_dtype is None else q_dtype
    return (jnp.asarray(q, q_dtype), jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype),
            jnp.asarray(table), jnp.asarray(lengths))


def numpy_attention(q, k_pages, v_pages, table, lengths, scale=None, starts=None):
    """Independent f64 reference: build each head's contiguous K/V (tokens ``starts .. lengths - 1``), then dense
    attention."""
    q = np.asarray(q, np.float64)
    kp = np.asarray(jnp.asarray(k_pages, jnp.float32), np.float64)
    vp = np.asarray(jnp.asarray(v_pages, jnp.float32), np.float64)
    table, lengths = np.asarray(table), np.asarray(lengths)
    batch, num_q_heads, head_dim = q.shape
    kv_heads = table.shape[1]
    group = num_q_heads // kv_heads
    page_size = kp.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    out = np.zeros_like(q)
    for b in range(batch):
        for hq in range(num_q_heads):
            h = hq // group
            n = lengths[b, h]
            first = 0 if starts is None else int(np.asarray(starts)[b, h])
            if n <= first:
                continue
            tok = np.arange(first, n)
            pages = table[b, h, tok // page_size]
            k = kp[pages, tok % page_size]
            v = vp[pages, tok % page_size]
            s = k @ q[b, hq] * scale
            p = np.exp(s - s.max())
            out[b, hq] = p @ v / p.sum()
    return out


# (name, cache kwargs, pages_per_block)
CASES = [
    ("mha_f32_p16_odd", dict(batch=2, kv_heads=2, group=1, head_dim=64, page_size=16,
                              max_pages=20, lengths=[[1, 123], [0, 250]],
                              kv_dtype=jnp.float32), 4),
    ("gqa3_bf16_p64", dict(batch=1, kv_heads=2, group=3, head_dim=128, page_size=64,
                           max_pages=8, lengths=[[250, 0]], kv_dtype=jnp.bfloat16), 2),
    ("gqa4_f32q_bf16kv_full_blocks", dict(batch=1, kv_heads=2, group=4, head_dim=64,
                                          page_size=16, max_pages=8, lengths=[[128, 64]],
                                          kv_dtype=jnp.bfloat16, q_dtype=jnp.float32), 4),
    ("mqa8_f32_p64_len4099", dict(batch=1, kv_heads=1, group=8, head_dim=64, page_size=64,
                                  max_pages=66, lengths=[[4099]], kv_dtype=jnp.float32), None),
]


def test_reference_matches_numpy():
    """The jnp reference equals an independent dense f64 computation (incl. poisoned pages)."""
    for seed, (_, kw, _) in enumerate(CASES[:3]):
        kw = dict(kw, kv_dtype=jnp.float32, q_dtype=jnp.float32)
        q, k, v, bt, ln = make_cache(seed, **kw)
        got = paged_decode_attention_reference(q, k, v, bt, ln)
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, bt, ln),
                                   atol=1e-5, rtol=1e-5)
    # custom scale, and the public op with implementation="xla"
    q, k, v, bt, ln = make_cache(7, **dict(CASES[0][1]))
    got = paged_decode_attention(q, k, v, bt, ln, scale=0.3, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, bt, ln, scale=0.3),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", FORMS + ["xla"])
def test_starts_skip_each_heads_first_tokens(form):
    """``starts``: each head attends tokens ``starts .. lengths - 1`` only (a left-padded contiguous cache read as
    pages). The skipped tokens hold NaN, so an unmasked score or value shows; ``starts == lengths`` gives zeros; the
    result equals the float64 numpy attention over the kept tokens."""
    kw = dict(batch=2, kv_heads=2, group=2, head_dim=64, page_size=16, max_pages=20,
              lengths=[[1, 123], [40, 250]], kv_dtype=jnp.float32)
    q, k, v, bt, ln = make_cache(11, **kw)
    starts = np.array([[0, 37], [40, 200]], np.int32)  # (1, 0): nothing left to attend
    kn, vn = np.array(k), np.array(v)
    for b in range(2):
        for h in range(2):
            for t in range(starts[b, h]):
                page = int(bt[b, h, t // 16])
                kn[page, t % 16] = np.nan
                vn[page, t % 16] = np.nan
    k, v = jnp.asarray(kn), jnp.asarray(vn)
    impl = "xla" if form == "xla" else IMPL
    got = paged_decode_attention(q, k, v, bt, ln, starts=jnp.asarray(starts), implementation=impl,
                                 backend=None if form == "xla" else form, pages_per_block=2)
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[1, 0:2], 0.0)
    np.testing.assert_allclose(got, numpy_attention(q, k, v, bt, ln, starts=starts), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="starts must be int32"):
        paged_decode_attention(q, k, v, bt, ln, starts=jnp.asarray(starts[:1]), implementation="xla")


@pytest.mark.parametrize("form", FORMS + MOSAIC)
@pytest.mark.parametrize("name,kw,ppb", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_reference(form, name, kw, ppb):
    q, k, v, bt, ln = make_cache(sum(map(ord, name)), **kw)
    want = paged_decode_attention_reference(q, k, v, bt, ln)
    got = paged_decode_attention(q, k, v, bt, ln, implementation=IMPL, backend=form,
                                 pages_per_block=ppb)
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    atol, rtol = TOL[kw["kv_dtype"]]
    np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=atol, rtol=rtol)
    # heads of length 0 give exact zeros
    group = q.shape[1] // bt.shape[1]
    zero_heads = np.repeat(np.asarray(ln) == 0, group, axis=1)
    assert (got[zero_heads] == 0).all()


@pytest.mark.parametrize("form", MOSAIC)
@pytest.mark.parametrize("page_size, ppb, splits", [(16, None, 3), (128, None, None), (32, 4, 2)])
def test_mosaic_gpu_form_starts_splits_and_subpages(form, page_size, ppb, splits):
    """The Mosaic GPU form against the float64 numpy attention: ``starts`` (skipped tokens hold NaN), an empty head,
    a partial last page, stale table entries, split-K, 128-token pages read as 64-token sub-pages, 128-token blocks of
    32-token pages."""
    max_pages = 640 // page_size
    kw = dict(batch=2, kv_heads=2, group=3, head_dim=64, page_size=page_size, max_pages=max_pages,
              lengths=[[0, 301], [640, 77]], kv_dtype=jnp.float32)
    q, k, v, bt, ln = make_cache(page_size, **kw)
    starts = np.array([[0, 45], [130, 0]], np.int32)
    kn, vn = np.array(k), np.array(v)
    for b, h in np.ndindex(2, 2):
        for t in range(starts[b, h]):
            page = int(bt[b, h, t // page_size])
            kn[page, t % page_size] = vn[page, t % page_size] = np.nan
    k, v = jnp.asarray(kn), jnp.asarray(vn)
    got = paged_decode_attention(q, k, v, bt, ln, starts=jnp.asarray(starts), implementation=IMPL, backend=form,
                                 pages_per_block=ppb, num_splits=splits)
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[0, 0:3], 0.0)
    np.testing.assert_allclose(got, numpy_attention(q, k, v, bt, ln, starts=starts), atol=2e-5, rtol=2e-5)


def test_mosaic_gpu_form_refuses_what_does_not_fit():
    """Blocks must be whole 64-row register tiles, and double-buffered K/V blocks must fit 227 KiB of shared memory
    (f32, D = 128, 128-token blocks need about 262 KiB): each a ValueError before anything is built."""
    q, k, v, bt, ln = make_cache(1, batch=1, kv_heads=1, group=1, head_dim=128, page_size=16, max_pages=8,
                                 lengths=[[100]], kv_dtype=jnp.float32)
    with pytest.raises(ValueError, match="shared memory"):
        paged_decode_attention(q, k, v, bt, ln, implementation="pallas_interpret", backend="mosaic_gpu",
                               pages_per_block=8)
    with pytest.raises(ValueError, match="multiple of 64"):
        paged_decode_attention(q, k, v, bt, ln, implementation="pallas_interpret", backend="mosaic_gpu",
                               pages_per_block=2)


@pytest.mark.parametrize("form", FORMS)
def test_kernel_under_jit_single_page_blocks(form):
    """Traced inputs (block-table check skipped), one page per block, GPU split count 3."""
    q, k, v, bt, ln = make_cache(3, batch=2, kv_heads=1, group=2, head_dim=64, page_size=16,
                                 max_pages=6, lengths=[[37], [96]], kv_dtype=jnp.float32)
    fn = jax.jit(lambda *a: paged_decode_attention(
        *a, implementation=IMPL, backend=form, pages_per_block=1, num_splits=3))
    got = fn(q, k, v, bt, ln)
    want = numpy_attention(q, k, v, bt, ln)
    atol, rtol = TOL[jnp.float32]
    np.testing.assert_allclose(np.asarray(got), want, atol=atol, rtol=rtol)


def test_gpu_form_splits_pages_larger_than_a_block():
    """GPU form, f32, D=128: a K block holds at most 64 tokens, so 128-token pages are read as
    two 64-token sub-pages (default pages_per_block and an explicit 1 alike)."""
    q, k, v, bt, ln = make_cache(11, batch=1, kv_heads=2, group=2, head_dim=128, page_size=128,
                                 max_pages=3, lengths=[[300, 77]], kv_dtype=jnp.float32)
    want = numpy_attention(q, k, v, bt, ln)
    for ppb in (None, 1):
        got = paged_decode_attention(q, k, v, bt, ln, implementation=IMPL, backend="gpu",
                                     pages_per_block=ppb)
        np.testing.assert_allclose(np.asarray(got), want, atol=TOL[jnp.float32][0],
                                   rtol=TOL[jnp.float32][1])
    with pytest.raises(ValueError, match=r"pages_per_block <= 1"):
        paged_decode_attention(q, k, v, bt, ln, implementation=IMPL, backend="gpu",
                               pages_per_block=2)


@pytest.mark.skipif(not ON_CPU, reason="interpret-mode check of the TPU form")
def test_tpu_form_chunked_prefetch_and_any_page_size_in_interpret_mode(monkeypatch):
    """A block table over the SMEM budget is prefetched in several calls (budget shrunk here to
    two (row, head) pairs per call); interpret mode accepts a page size of 4 tokens, which the
    compiled TPU form rejects."""
    import kvjax.pallas_kernels.paged_attention as mod

    kw = dict(batch=3, kv_heads=2, group=3, head_dim=64, max_pages=10, kv_dtype=jnp.float32)
    q, k, v, bt, ln = make_cache(12, page_size=16, lengths=[[150, 0], [33, 160], [1, 97]], **kw)
    pages_padded = 10  # pages_per_block = min(max_pages, 512 // 16) = 10
    monkeypatch.setattr(mod, "_TPU_SMEM_PREFETCH_BYTES", 2 * 4 * (pages_padded + 1))
    got = paged_decode_attention(q, k, v, bt, ln, implementation=IMPL, backend="tpu")
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, bt, ln),
                               atol=2e-5, rtol=2e-5)
    monkeypatch.undo()
    q, k, v, bt, ln = make_cache(13, page_size=4, lengths=[[37, 0], [3, 40], [8, 9]], **kw)
    got = paged_decode_attention(q, k, v, bt, ln, implementation=IMPL, backend="tpu",
                                 pages_per_block=3)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, bt, ln),
                               atol=2e-5, rtol=2e-5)


def test_mask_value_is_finite():
    assert np.isfinite(MASK_VALUE) and MASK_VALUE == 0.7 * np.finfo(np.float32).min


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _good():
    return make_cache(0, batch=1, kv_heads=2, group=2, head_dim=64, page_size=16, max_pages=4,
                      lengths=[[20, 5]], kv_dtype=jnp.float32, poison=False)


def _call(q, k, v, bt, ln, **kw):
    return paged_decode_attention(q, k, v, bt, ln, **{"implementation": "xla", **kw})


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v, bt, ln: (q, k, v[:, :8], bt, ln), "v_pages shape"),
    (lambda q, k, v, bt, ln: (q[..., :32], k, v, bt, ln), "head_dim"),
    (lambda q, k, v, bt, ln: (q[:, :3], k, v, bt, ln), "multiple of H_kv"),
    (lambda q, k, v, bt, ln: (q, k, v, bt, ln[:, :1]), "lengths must have shape"),
    (lambda q, k, v, bt, ln: (q, k, v, bt[0], ln), "block_table must be"),
    (lambda q, k, v, bt, ln: (q[0], k, v, bt, ln), r"q must be \[B, H_q, D\]"),
    (lambda q, k, v, bt, ln: (q, k.astype(jnp.float16), v.astype(jnp.float16), bt, ln),
     "float16 not supported"),
    (lambda q, k, v, bt, ln: (q, k, v.astype(jnp.bfloat16), bt, ln), "v_pages dtype"),
    (lambda q, k, v, bt, ln: (q.astype(jnp.bfloat16), k, v, bt, ln), "q dtype bfloat16"),
    (lambda q, k, v, bt, ln: (q, k, v, bt.astype(jnp.float32), ln), "block_table dtype"),
    (lambda q, k, v, bt, ln: (q, k, v, np.asarray(bt, np.int64), ln), "block_table dtype"),
    (lambda q, k, v, bt, ln: (q, k, v, bt, ln.astype(jnp.float32)), "lengths dtype"),
])
def test_bad_shapes_and_dtypes(mutate, match):
    with pytest.raises(ValueError, match=match):
        _call(*mutate(*_good()))


def test_bad_block_table_and_lengths():
    q, k, v, bt, ln = _good()
    num_pages = k.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0, 0, 1\] = .* out of range"):
        _call(q, k, v, bt.at[0, 0, 1].set(num_pages), ln)
    with pytest.raises(ValueError, match=r"block_table\[0, 1, 0\] = -1 is out of range"):
        _call(q, k, v, bt.at[0, 1, 0].set(-1), ln, implementation=IMPL, backend=FORMS[0])
    with pytest.raises(ValueError, match="exceeds the block table capacity"):
        _call(q, k, v, bt, ln.at[0, 0].set(4 * 16 + 1))
    with pytest.raises(ValueError, match="negative"):
        _call(q, k, v, bt, ln.at[0, 1].set(-3))
    # unused entries may hold anything
    check_block_table(bt.at[0, 1, 3].set(10**6), ln, num_pages, 16)


def test_bad_options():
    args = _good()
    with pytest.raises(ValueError, match="implementation='cuda'"):
        _call(*args, implementation="cuda")
    with pytest.raises(ValueError, match="backend='cuda'"):
        _call(*args, backend="cuda")
    with pytest.raises(ValueError, match="pages_per_block=0"):
        _call(*args, pages_per_block=0)
    with pytest.raises(ValueError, match="power of two"):
        _call(*args, implementation="pallas_interpret", backend="gpu", pages_per_block=3)
    if ON_CPU:
        with pytest.raises(ValueError, match="needs a TPU or GPU"):
            _call(*args, implementation="pallas")
