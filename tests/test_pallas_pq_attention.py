"""PQ attention scores: Pallas kernels (TPU one-hot form, GPU gather form) vs the jnp reference,
and the reference vs a brute-force decode of the keys (K_hat from the codebooks, q . K_hat).

On CPU the kernels run in interpret mode; on an accelerator the same tests run compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.pallas_kernels.pq_attention import MASK_VALUE, pq_scores, pq_scores_reference

ON_CPU = jax.default_backend() == "cpu"
IMPL = "pallas_interpret" if ON_CPU else "pallas"
if ON_CPU:
    FORMS = ["tpu", "gpu"]
elif jax.default_backend() == "tpu":
    FORMS = ["tpu"]
else:
    FORMS = ["gpu"]


def make_inputs(seed, *, batch, kv_heads, group, head_dim, groups, centroids, seq,
                lengths="random", q_dtype=jnp.float32, cb_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, kv_heads * group, head_dim)).astype(np.float32)
    cb = rng.standard_normal((kv_heads, groups, centroids, head_dim // groups)).astype(np.float32)
    code_dtype = np.uint8 if centroids <= 256 else np.uint16
    codes = rng.integers(0, centroids, (batch, kv_heads, seq, groups)).astype(code_dtype)
    if lengths == "random":
        ln = rng.integers(1, seq + 1, (batch, kv_heads)).astype(np.int32)
        ln.flat[0] = 0  # one empty head
        ln.flat[-1] = seq  # one full head
        ln = jnp.asarray(ln)
    else:
        ln = lengths
    return (jnp.asarray(q, q_dtype), jnp.asarray(cb, cb_dtype), jnp.asarray(codes), ln)


def brute_force(q, cb, codes, lengths):
    """Decode K_hat[b, h, j] = concat_g C[h, g, codes[b, h, j, g]], then scaled q . K_hat (f64)."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    cb = np.asarray(jnp.asarray(cb, jnp.float32), np.float64)
    codes = np.asarray(codes).astype(np.int64)
    batch, num_q_heads, head_dim = q.shape
    kv_heads, groups, _, _ = cb.shape
    seq = codes.shape[2]
    group = num_q_heads // kv_heads
    z = np.empty((batch, num_q_heads, seq))
    for b in range(batch):
        for h in range(kv_heads):
            k_hat = np.concatenate([cb[h, gi][codes[b, h, :, gi]] for gi in range(groups)],
                                   axis=-1)  # [S, D]
            z[b, h * group:(h + 1) * group] = q[b, h * group:(h + 1) * group] @ k_hat.T
    z *= head_dim**-0.5
    ln = np.full((batch, kv_heads), seq) if lengths is None else np.asarray(lengths)
    valid = np.repeat(np.arange(seq)[None, None] < ln[..., None], group, axis=1)
    m = np.where(valid, z, -np.inf).max(-1)
    l = np.where(valid, np.exp(z - np.where(np.isfinite(m), m, 0)[..., None]), 0).sum(-1)
    return np.where(valid, z, MASK_VALUE), np.where(np.isfinite(m), m, MASK_VALUE), l


def test_reference_matches_brute_force_decode():
    for seed, kw in enumerate([
        dict(batch=2, kv_heads=2, group=3, head_dim=64, groups=16, centroids=256, seq=77),
        dict(batch=1, kv_heads=1, group=2, head_dim=128, groups=32, centroids=1024, seq=50),
    ]):
        q, cb, codes, ln = make_inputs(seed, **kw)
        z, m, l = pq_scores_reference(q, cb, codes, ln, return_stats=True)
        zw, mw, lw = brute_force(q, cb, codes, ln)
        np.testing.assert_allclose(np.asarray(z), zw, atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(m), mw, atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(l), lw, atol=1e-4, rtol=1e-4)
        # public op with implementation="xla" and no lengths
        z2 = pq_scores(q, cb, codes, implementation="xla")
        np.testing.assert_allclose(np.asarray(z2), brute_force(q, cb, codes, None)[0],
                                   atol=1e-4, rtol=1e-5)


# (name, kwargs, block_s)
CASES = [
    ("d64_g16_c256_gqa3", dict(batch=2, kv_heads=2, group=3, head_dim=64, groups=16,
                               centroids=256, seq=300), 128),
    ("d128_g32_c1024_uint16_mha", dict(batch=1, kv_heads=2, group=1, head_dim=128, groups=32,
                                       centroids=1024, seq=250), 128),
    ("d64_g16_c256_gqa11_rows_over_a_program", dict(batch=2, kv_heads=2, group=11, head_dim=64, groups=16,
                                                    centroids=256, seq=200), 64),  # GPU form: 2 row blocks, 5 rows padded
    ("d128_g64_c4096_mqa4_bf16q", dict(batch=1, kv_heads=1, group=4, head_dim=128, groups=64,
                                       centroids=4096, seq=123, q_dtype=jnp.bfloat16,
                                       cb_dtype=jnp.bfloat16), None),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name,kw,block_s", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_reference(form, name, kw, block_s):
    q, cb, codes, ln = make_inputs(sum(map(ord, name)), **kw)
    if block_s is not None and form == "tpu":
        block_s = max(128, block_s)
    zw, mw, lw = pq_scores_reference(q, cb, codes, ln, return_stats=True)
    z, m, l = pq_scores(q, cb, codes, ln, return_stats=True, implementation=IMPL,
                        backend=form, block_s=block_s)
    assert z.shape == (q.shape[0], q.shape[1], codes.shape[2]) and z.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(z), np.asarray(zw), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(m), np.asarray(mw), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(l), np.asarray(lw), atol=1e-4, rtol=1e-4)
    group = kw["group"]
    empty = np.repeat(np.asarray(ln) == 0, group, axis=1)
    assert (np.asarray(l)[empty] == 0).all() and (np.asarray(z)[empty] == MASK_VALUE).all()


@pytest.mark.parametrize("form", FORMS)
def test_kernel_no_lengths_under_jit(form):
    q, cb, codes, _ = make_inputs(5, batch=1, kv_heads=2, group=2, head_dim=64, groups=16,
                                  centroids=256, seq=200)
    fn = jax.jit(lambda *a: pq_scores(*a, implementation=IMPL, backend=form))
    z = fn(q, cb, codes)
    np.testing.assert_allclose(np.asarray(z), brute_force(q, cb, codes, None)[0],
                               atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not ON_CPU, reason="interpret-mode check of the TPU form")
def test_tpu_form_block_s_64_in_interpret_mode():
    """The compiled TPU form needs block_s % 128 == 0 (tests/test_kernel_lowering.py); interpret
    mode keeps accepting other tile sizes."""
    q, cb, codes, ln = make_inputs(6, batch=1, kv_heads=2, group=3, head_dim=64, groups=16,
                                   centroids=256, seq=150)
    z, m, l = pq_scores(q, cb, codes, ln, return_stats=True, implementation=IMPL, backend="tpu",
                        block_s=64)
    zw, mw, lw = pq_scores_reference(q, cb, codes, ln, return_stats=True)
    for got, want in ((z, zw), (m, mw), (l, lw)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _good():
    return make_inputs(0, batch=1, kv_heads=2, group=2, head_dim=64, groups=16, centroids=256,
                       seq=32)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, cb, p, ln: (q, cb, p.astype(jnp.uint16), ln), "expected uint8"),
    (lambda q, cb, p, ln: (q, cb, p.astype(jnp.int32), ln), "codes dtype int32"),
    (lambda q, cb, p, ln: (q, jnp.zeros((2, 16, 1024, 4)), p, ln), "expected uint16"),
    (lambda q, cb, p, ln: (q, cb[:, :, :, :3], p, ln), "does not split D=64"),
    (lambda q, cb, p, ln: (q[:, :3], cb, p, ln), "multiple of H_kv"),
    (lambda q, cb, p, ln: (q, cb, p[..., :8], ln), r"codes must be \[B, H_kv, S, g\]"),
    (lambda q, cb, p, ln: (q, cb, p, ln[:, :1]), "lengths must have shape"),
    (lambda q, cb, p, ln: (q, cb, p, ln.astype(jnp.float32)), "lengths dtype"),
    (lambda q, cb, p, ln: (q.astype(jnp.int32), cb, p, ln), "q dtype int32"),
    (lambda q, cb, p, ln: (q, cb, p[0], ln), r"codes must be \[B, H_kv, S, g\]"),
])
def test_bad_input(mutate, match):
    with pytest.raises(ValueError, match=match):
        pq_scores(*mutate(*_good()), implementation="xla")


def test_bad_options():
    args = _good()
    with pytest.raises(ValueError, match="implementation='triton'"):
        pq_scores(*args, implementation="triton")
    with pytest.raises(ValueError, match="backend='cpu'"):
        pq_scores(*args, backend="cpu")
    with pytest.raises(ValueError, match="block_s=0"):
        pq_scores(*args, block_s=0)
    with pytest.raises(ValueError, match="powers of two"):
        pq_scores(*args, implementation="pallas_interpret", backend="gpu", block_s=48)
    if ON_CPU:
        with pytest.raises(ValueError, match="needs a TPU or GPU"):
            pq_scores(*args, implementation="pallas")
