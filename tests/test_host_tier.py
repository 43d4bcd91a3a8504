"""Host (pinned_host) tier: offload, one-transfer recall inside jit, prefetch in a while_loop, paged write-back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jex_core

from kvjax import host_tier as ht
from kvjax.kv_quantization import quantize

B, HKV, S, D, PS = 2, 3, 37, 8, 8  # S not a multiple of PS: exercises the padded last page
HEADS = [(0, 1), (1, 2), (1, 0), (0, 0)]
N = len(HEADS)


@pytest.fixture(scope="module")
def kv():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    return k, v


@pytest.fixture(scope="module")
def host(kv):
    k, v = kv
    return ht.offload(jnp.asarray(k), jnp.asarray(v), HEADS, page_size=PS)


def np_take(x_heads, idx, count, block=1):
    """Reference: rows (block=1) or pages of `block` rows of each head of ``x_heads[n, S_pad, ...]``, zero past
    count."""
    x_heads, idx, count = np.asarray(x_heads), np.asarray(idx), np.asarray(count)
    out = np.zeros((x_heads.shape[0], idx.shape[1] * block, *x_heads.shape[2:]), x_heads.dtype)
    for h in range(x_heads.shape[0]):
        for r in range(int(count[h])):
            out[h, r * block:(r + 1) * block] = x_heads[h, idx[h, r] * block:(idx[h, r] + 1) * block]
    return out


def np_recall(x, idx, count, block=1):
    """:func:`np_take` of the stored heads ``HEADS`` of ``x[B, Hkv, S, D]``, padded to whole pages."""
    x_heads = np.stack([x[b, h] for b, h in HEADS])  # [N, S, D]
    return np_take(np.pad(x_heads, ((0, 0), (0, (-S) % PS), (0, 0))), idx, count, block)


# ------------------------------------------------------------------ jaxpr / HLO inspection helpers
def _sub_jaxprs(eqn):
    for p in eqn.params.values():
        for q in p if isinstance(p, (tuple, list)) else (p,):
            if isinstance(q, jex_core.ClosedJaxpr):
                yield q.jaxpr
            elif isinstance(q, jex_core.Jaxpr):
                yield q


def host_ops_outside_host_regions(jaxpr):
    """Primitives outside any compute_on region that read a host-memory value (device_put excepted)."""
    bad, n_regions = [], 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "compute_on":
            n_regions += 1
            continue
        subs = list(_sub_jaxprs(eqn))
        if subs:  # pjit / while / cond: look inside, the container itself just passes values through
            for s in subs:
                b, r = host_ops_outside_host_regions(s)
                bad += b
                n_regions += r
            continue
        if eqn.primitive.name == "device_put":
            continue
        if any(getattr(getattr(x, "aval", None), "memory_space", None) == ht.HOST for x in eqn.invars):
            bad.append(eqn.primitive.name)
    return bad, n_regions


def lowered_text(fn, *args):
    """(StableHLO, platform): as XLA:GPU would get it (cuda lowering needs no GPU), else the default.

    The host region and its device-placed output appear on every platform; ``device_put`` inside
    jit becomes an ``annotate_device_placement`` only in TPU/GPU lowerings.
    """
    traced = jax.jit(fn).trace(*args)
    try:
        return traced.lower(lowering_platforms=("cuda",)).as_text(), "cuda"
    except Exception:  # pragma: no cover - lowering for another platform unavailable
        return traced.lower().as_text(), jax.default_backend()


def count_transfers(txt):
    to_device = txt.count('_xla_buffer_placement = "device"')
    host_calls = sum(1 for ln in txt.splitlines() if "call @compute_on" in ln and '_xla_compute_type = "host"' in ln)
    return to_device, host_calls


# ------------------------------------------------------------------ tests
def test_offload_is_pinned_host_eager_and_in_jit(kv, host):
    k, v = kv
    assert host.k.sharding.memory_kind == "pinned_host"
    assert host.v.sharding.memory_kind == "pinned_host"
    assert host.k.shape == (N, 40, D) and host.length == S and host.num_pages == 5 and host.heads == tuple(HEADS)
    np.testing.assert_array_equal(np.asarray(host.k)[:, :S], np.stack([k[b, h] for b, h in HEADS]))
    np.testing.assert_array_equal(np.asarray(host.v)[:, S:], 0)  # page padding
    jitted = jax.jit(lambda k, v: ht.offload(k, v, HEADS, page_size=PS))(jnp.asarray(k), jnp.asarray(v))
    assert jitted.k.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(jitted.v), np.asarray(host.v))


@pytest.mark.parametrize("mechanism", ht.MECHANISMS)
def test_recall_matches_numpy(kv, host, mechanism):
    k, v = kv
    R = 5
    rng = np.random.default_rng(1)
    idx = rng.integers(0, S, (N, R)).astype(np.int32)
    count = np.array([R, 0, 3, 1], np.int32)  # full, empty, partial
    idx[2, 3:] = [-5, 1000]  # garbage past count: ignored
    idx[3, 0] = S - 1  # last stored token
    f = jax.jit(lambda h, i, c: ht.recall(h, i, c, mechanism=mechanism))
    k_r, v_r, k_s, v_s = f(host, jnp.asarray(idx), jnp.asarray(count))
    assert k_s is None and v_s is None  # a float tier has no scales
    assert k_r.sharding.memory_kind == "device" and k_r.shape == (N, R, D)
    np.testing.assert_array_equal(np.asarray(k_r), np_recall(k, idx, count))
    np.testing.assert_array_equal(np.asarray(v_r), np_recall(v, idx, count))
    assert not np.asarray(k_r)[1].any() and not np.asarray(v_r)[2, 3:].any()

    # page granular: count counts pages; page 4 holds tokens 32..36 + 3 zero padding rows
    pages = np.array([[4, 0], [1, 2], [3, 3], [2, 9]], np.int32)
    pcount = np.array([2, 1, 0, 1], np.int32)
    kp, vp, _, _ = jax.jit(lambda h, i, c: ht.recall_pages(h, i, c, mechanism=mechanism))(host, pages, pcount)
    assert kp.shape == (N, 2 * PS, D)
    np.testing.assert_array_equal(np.asarray(kp), np_recall(k, pages, pcount, block=PS))
    np.testing.assert_array_equal(np.asarray(vp), np_recall(v, pages, pcount, block=PS))


def test_recall_is_one_transfer_and_no_host_gather(host):
    R = 6
    idx = jnp.zeros((N, R), jnp.int32)
    count = jnp.full((N,), R, jnp.int32)
    fn = lambda h, i, c: ht.recall(h, i, c)
    bad, regions = host_ops_outside_host_regions(jax.make_jaxpr(fn)(host, idx, count).jaxpr)
    assert bad == [] and regions == 1
    txt, platform = lowered_text(fn, host, idx, count)
    assert count_transfers(txt) == (1, 1)  # one host region, one host->device placement, all heads, K and V
    gathers = [ln for ln in txt.splitlines() if "stablehlo.gather" in ln]
    assert gathers and all('_xla_compute_type = "host"' in ln for ln in gathers)

    # contrast: the dynamic_slice + device_put fallback moves every (head, row) separately
    if platform == "cuda":
        txt_slices, _ = lowered_text(lambda h, i, c: ht.recall(h, i, c, mechanism="slices"), host, idx, count)
        assert count_transfers(txt_slices) == (2 * N * R, 0)


def test_prefetch_issued_at_i_consumed_at_i_plus_1(kv, host):
    k, v = kv
    R, T = 4, 5
    heads_off = jnp.arange(N, dtype=jnp.int32)[:, None]

    def idx_of(t):
        return (jnp.arange(R, dtype=jnp.int32)[None, :] * 5 + 3 * t + 7 * heads_off) % S

    def count_of(t):
        return (t + jnp.arange(N, dtype=jnp.int32)) % (R + 1)

    def run(host):
        out = jnp.zeros((T, N, R, D), jnp.float32)

        def body(carry):
            t, pf, outk, outv = carry
            k_r, v_r = ht.take(pf)  # recalled in iteration t-1 (t=0: before the loop)
            outk, outv = outk.at[t].set(k_r), outv.at[t].set(v_r)
            pf = ht.issue(host, idx_of(t + 1), count_of(t + 1))  # for iteration t+1
            return t + 1, pf, outk, outv

        carry0 = (jnp.int32(0), ht.issue(host, idx_of(0), count_of(0)), out, out)
        return lax.while_loop(lambda c: c[0] < T, body, carry0)

    _, pf_last, outk, outv = jax.jit(run)(host)
    for t in range(T):
        idx_t, cnt_t = np.asarray(idx_of(t)), np.asarray(count_of(t))
        np.testing.assert_array_equal(np.asarray(outk[t]), np_recall(k, idx_t, cnt_t))
        np.testing.assert_array_equal(np.asarray(outv[t]), np_recall(v, idx_t, cnt_t))
    np.testing.assert_array_equal(np.asarray(pf_last.count), np.asarray(count_of(T)))
    # empty_prefetch is a valid initial carry: same pytree, shapes and dtypes as issue()
    for pages in (False, True):
        want = jax.eval_shape(lambda h: ht.issue(h, idx_of(0), count_of(0), pages=pages), host)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), ht.empty_prefetch(host, R, pages=pages)) == jax.tree.map(
            lambda a: (a.shape, a.dtype), want
        )

    # Structure: in the loop body the recall's outputs reach only the carried Prefetch, never this
    # iteration's results, and the loop holds exactly one host region / one transfer.
    closed = jax.make_jaxpr(run)(host)
    (loop,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "while"]
    body = loop.params["body_jaxpr"].jaxpr
    tainted = set()
    for eqn in body.eqns:
        reads = [x for x in eqn.invars if not isinstance(x, jex_core.Literal)]
        if eqn.primitive.name == "compute_on" or any(x in tainted for x in reads):
            tainted.update(eqn.outvars)
    carried = [o in tainted for o in body.outvars]  # (t, pf.k, pf.v, pf.idx, pf.count, outk, outv)
    assert carried == [False, True, True, False, False, False, False]
    bad, regions = host_ops_outside_host_regions(closed.jaxpr)
    assert bad == [] and regions == 2  # one before the loop, one in the body
    assert count_transfers(lowered_text(run, host)[0]) == (2, 2)


def test_write_recalled_into_paged_pools(kv, host):
    k, _ = kv
    ps, max_pages, Hkv = 4, 3, HKV
    table = np.arange(B * Hkv * max_pages, dtype=np.int32).reshape(B, Hkv, max_pages)
    table = table[:, :, ::-1].copy()  # pages in a non-trivial order
    num_pages = B * Hkv * max_pages
    kp0 = np.full((num_pages, ps, D), -7.0, np.float32)
    vp0 = np.full((num_pages, ps, D), -9.0, np.float32)
    R = 5
    idx = np.arange(N * R, dtype=np.int32).reshape(N, R) % S
    count = np.array([5, 2, 0, 5], np.int32)
    dst = np.array([2, 9, 0, 9], np.int32)  # head 3: slots 12, 13 are past its block table -> dropped

    def f(kp, vp, host, idx, count, dst):
        rows = ht.recall(host, idx, count)
        return ht.write_recalled(kp, vp, jnp.asarray(table), rows.k, rows.v, host.heads, dst, count)

    kp, vp = jax.jit(f)(jnp.asarray(kp0), jnp.asarray(vp0), host, idx, count, dst)
    rk = np_recall(k, idx, count)
    want = kp0.copy()
    for i, (b, h) in enumerate(HEADS):
        for r in range(int(count[i])):
            slot = int(dst[i]) + r
            if slot < max_pages * ps:
                want[table[b, h, slot // ps], slot % ps] = rk[i, r]
    np.testing.assert_array_equal(np.asarray(kp), want)
    assert (np.asarray(vp) != -9.0).sum() == (want != -7.0).sum()


def test_bad_inputs(kv, host):
    k, v = (jnp.asarray(x) for x in kv)
    with pytest.raises(ValueError, match=r"\[B, Hkv, S, D\]"):
        ht.offload(k[0], v[0], HEADS)
    with pytest.raises(ValueError, match="outside"):
        ht.offload(k, v, [(0, HKV)])
    with pytest.raises(ValueError, match="duplicate"):
        ht.offload(k, v, [(0, 1), (0, 1)])
    with pytest.raises(ValueError, match="page_size"):
        ht.offload(k, v, HEADS, page_size=0)
    idx, count = jnp.zeros((N, 3), jnp.int32), jnp.full((N,), 3, jnp.int32)
    with pytest.raises(ValueError, match="n_heads"):
        ht.recall(host, idx[:2], count)
    with pytest.raises(ValueError, match="n_heads"):
        ht.recall(host, idx[:, 0], count)
    with pytest.raises(ValueError, match="integer"):
        ht.recall(host, idx.astype(jnp.float32), count)
    with pytest.raises(ValueError, match="count"):
        ht.recall(host, idx, count[:2])
    with pytest.raises(ValueError, match=r"count must be in \[0, R=3\]"):
        ht.recall(host, idx, count + 1)
    with pytest.raises(ValueError, match=r"idx\[1, 2\] = 37 is outside \[0, 37\)"):
        ht.recall(host, idx.at[1, 2].set(S), count)
    ht.recall(host, idx.at[1, 2].set(S), count.at[1].set(2))  # past count: not checked
    with pytest.raises(ValueError, match=r"pages\[0, 0\] = 5 is outside \[0, 5\)"):
        ht.recall_pages(host, idx.at[0, 0].set(5), count)
    with pytest.raises(ValueError, match="mechanism"):
        ht.recall(host, idx, count, mechanism="gather")
    with pytest.raises(TypeError, match="HostKV"):
        ht.recall((host.k, host.v), idx, count)
    pools = jnp.zeros((6, 4, D))
    table = jnp.zeros((B, HKV, 3), jnp.int32)
    rk = jnp.zeros((N, 3, D))
    with pytest.raises(ValueError, match="n_heads=4"):
        ht.write_recalled(pools, pools, table, rk[:2], rk[:2], HEADS, 0, count)
    with pytest.raises(ValueError, match="head dim"):
        ht.write_recalled(pools, pools, table, rk[..., :4], rk[..., :4], HEADS, 0, count)
    with pytest.raises(ValueError, match="block table"):
        ht.write_recalled(pools, pools, table[:1], rk, rk, HEADS, 0, count)


def test_recall_many_matches_numpy_per_tier():
    """Two host tiers of different head counts and widths gathered in one host computation (jitted): each tier's
    rows ``idx[h, r]`` for ``r < count[h]`` and zeros past it, against numpy indexing; mismatched arguments raise."""
    rng = np.random.default_rng(3)
    tiers, idxs, counts = [], [], []
    for n, S, R in ((2, 40, 5), (3, 24, 2)):
        k, v = (jnp.asarray(rng.standard_normal((1, n, S, 8)), jnp.float32) for _ in range(2))
        tiers.append(ht.offload(k, v, [(0, h) for h in range(n)], page_size=8))
        idxs.append(jnp.asarray(rng.integers(0, S, (n, R)), jnp.int32))
        counts.append(jnp.asarray(rng.integers(0, R + 1, (n,)), jnp.int32).at[0].set(R))
    got = jax.jit(ht.recall_many)(tiers, idxs, counts)
    for tier, idx, count, rows in zip(tiers, idxs, counts, got):
        assert rows.k_scales is None and rows.v_scales is None
        for dev, src in ((rows.k, tier.k), (rows.v, tier.v)):
            want = np.asarray(src)[np.arange(idx.shape[0])[:, None], np.asarray(idx)]
            want[np.arange(idx.shape[1])[None, :] >= np.asarray(count)[:, None]] = 0
            np.testing.assert_array_equal(np.asarray(dev), want)
    with pytest.raises(ValueError, match="one idx and count per host tier"):
        ht.recall_many(tiers, idxs[:1], counts)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_tier_recalls_rows_and_their_scales(kv_dtype):
    """A quantized tier's recall (token rows, whole pages, several tiers at once) returns the stored rows in their
    dtype and their per-token scales, as numpy indexes them, zero past each head's count; jitted."""
    rng = np.random.default_rng(5)
    n, S, D, R, page = 3, 20, 8, 4, 8
    pad = (-S) % page
    stored = [quantize(jnp.asarray(rng.standard_normal((n, S, D)) * 3, jnp.float32), kv_dtype) for _ in range(2)]
    (qk, sk), (qv, sv) = [(jnp.pad(q, ((0, 0), (0, pad), (0, 0))), jnp.pad(s, ((0, 0), (0, pad)))) for q, s in stored]
    host = ht.HostKV(*(jax.device_put(x, ht.HOST) for x in (qk, qv, sk, sv)), heads=tuple((0, h) for h in range(n)),
                     length=S, page_size=page)
    idx = jnp.asarray(rng.integers(0, S, (n, R)), jnp.int32)
    count = jnp.asarray([R, 0, 2], jnp.int32)

    rows = jax.jit(ht.recall)(host, idx, count)
    (tier_rows,) = jax.jit(ht.recall_many)([host], [idx], [count])
    for got in (rows, tier_rows):
        assert got.k.dtype == jnp.dtype(kv_dtype) and got.k_scales.dtype == jnp.float32
        for x, src in zip(got, (qk, qv, sk, sv)):
            np.testing.assert_array_equal(np.asarray(x).astype(np.float64),
                                          np_take(np.asarray(src, np.float64), idx, count))
    pages = jnp.asarray([[2, 0], [1, 1], [0, 2]], jnp.int32)
    pcount = jnp.asarray([2, 1, 0], jnp.int32)
    got = jax.jit(ht.recall_pages)(host, pages, pcount)
    for x, src in zip(got, (qk, qv, sk, sv)):
        np.testing.assert_array_equal(np.asarray(x).astype(np.float64),
                                      np_take(np.asarray(src, np.float64), pages, pcount, block=page))
    with pytest.raises(ValueError, match="host_gather"):
        ht.recall(host, idx, count, mechanism="slices")


def test_gather_rows_and_weighted_rows_on_host_against_numpy():
    """HCAttention's value paths with the size chosen on the device: selected rows to the device (rows past count
    zero), and the weighted sum computed on the host (only ids and weights go out, [n, Q, D] comes back)."""
    from kvjax.host_tier import gather_rows, to_host, weighted_rows_on_host

    rng = np.random.default_rng(3)
    n, S, D, R = 3, 17, 4, 5
    x = rng.normal(size=(n, S, D)).astype(np.float32)
    idx = rng.integers(0, S, size=(n, R)).astype(np.int32)
    count = np.array([5, 2, 0], np.int32)
    host = to_host(jnp.asarray(x))
    assert host.sharding.memory_kind == "pinned_host"
    rows = jax.jit(gather_rows)(host, jnp.asarray(idx), jnp.asarray(count))
    want = np.stack([np.where(np.arange(R)[:, None] < count[i], x[i][idx[i]], 0) for i in range(n)])
    np.testing.assert_array_equal(np.asarray(rows), want)
    w = rng.random(size=(n, 2, R)).astype(np.float32)
    out = jax.jit(weighted_rows_on_host)(host, jnp.asarray(idx), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(out), np.einsum("nqr,nrd->nqd", w, np.stack([x[i][idx[i]] for i in range(n)])),
                               rtol=1e-5, atol=1e-6)


def test_weighted_union_on_host_sums_only_the_chosen_size():
    """HCAttention's host value path: the weighted sum computed on the host over ``sizes[which]`` rows per head.
    Every head has 5 rows of nonzero weight and its other rows hold NaN: size 5 reads only the weighted rows (finite,
    equal to numpy), sizes 9 and 17 also read NaN rows (0 * NaN), so the size the host took is visible."""
    from kvjax.host_tier import to_host, weighted_union_on_host

    rng = np.random.default_rng(3)
    n, S, D, Q, nnz = 3, 17, 4, 2, 5
    x = rng.normal(size=(n, S, D)).astype(np.float32)
    w = np.zeros((n, Q, S), np.float32)
    for i in range(n):
        w[i][:, rng.choice(S, nnz, replace=False)] = rng.random(size=(Q, nnz)) + 0.1
    x[(w == 0).all(1)] = np.nan
    host = to_host(jnp.asarray(x))
    run = jax.jit(weighted_union_on_host, static_argnums=2)
    want = np.einsum("nqs,nsd->nqd", w, np.nan_to_num(x))
    np.testing.assert_allclose(np.asarray(run(host, jnp.asarray(w), (5, 9, 17), 0)), want, rtol=1e-5, atol=1e-6)
    for which in (1, 2):
        assert np.isnan(np.asarray(run(host, jnp.asarray(w), (5, 9, 17), which))).all()
    np.testing.assert_allclose(np.asarray(run(host, jnp.asarray(w), (5,), 0)), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="sizes"):
        weighted_union_on_host(host, jnp.asarray(w), (5, 18), 0)


def test_format_bytes_hand_computed():
    from kvjax.cache import format_bytes

    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 5 * 2**20 + 2**19, 2**30, 3 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.5 MiB", "1.0 GiB", "3072.0 GiB"]
    assert format_bytes(366 * 1024, 2) == "366.00 KiB"
