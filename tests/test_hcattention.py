"""HCAttention: Eq. 4 on hand-computed distributions, one layer's output against a numpy reference (exact and
product-quantized keys, both value paths), tau = 1 with exact keys equal to the full cache (chunk padding, a
ragged batch, a question after compression), bytes held, compile-once without host callbacks, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.api import generate_tokens
from kvjax.artifacts import Artifact, model_identity
from kvjax.cache import AttendContext, CacheSpec, new_cache
from kvjax.decoding import TRACE_COUNTS, compress, decode_loop, decode_loop_jit, prefill
from kvjax.host_tier import to_host
from kvjax.methods import FullCache, HCAttention, get_method
from kvjax.methods.hcattention import HCAttentionKV
from kvjax.selection import top_p_select
from kvjax.pq_codebooks import encode_keys

L = 40


@pytest.fixture(scope="module")
def tiny(tiny_llama3):
    return tiny_llama3


def codebook_artifact(cfg, groups, centroids=8, seed=0, model_id=None):
    """Random codebooks ``[L, Hkv, g, c, D/g]`` (the selection and scoring do not depend on how they were fitted)."""
    shape = (cfg.num_layers, cfg.num_kv_heads, groups, centroids, cfg.head_dim // groups)
    cb = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    return Artifact(arrays={"codebooks": jnp.asarray(cb)}, kind="hcattention",
                    model_id=model_id or model_identity(cfg), meta=(("groups", groups), ("centroids", centroids)))


# ------------------------------------------------------------------------------------ Eq. 4 by hand
def _select(mass, tau, forced=0.0, total=None):
    mass = jnp.asarray([mass], jnp.float32)
    total = mass.sum(-1) + forced if total is None else jnp.asarray([total], jnp.float32)
    sel = top_p_select(mass, total, jnp.asarray([forced], jnp.float32), tau)
    return np.flatnonzero(np.asarray(sel[0])).tolist()


def test_top_p_hand_cases():
    assert _select([0.5, 0.25, 0.125, 0.125], 0.75) == [0, 1]  # 0.5 + 0.25 reaches 0.75: k* = 2
    assert _select([0.5, 0.25, 0.15, 0.1], 0.76) == [0, 1, 2]
    assert _select([0.5, 0.25, 0.15, 0.1], 0.3) == [0]
    # ties: sorted 0.5 (1), 0.25 (0), 0.125 (2), 0.125 (3); k* = 3 falls inside the tie, so both tied are kept
    assert _select([0.25, 0.5, 0.125, 0.125], 0.8) == [0, 1, 2, 3]
    assert _select([0.25, 0.5, 0.125, 0.125], 0.75) == [0, 1]  # reached before the tie
    # tiny masses (the search is exact on the float bit patterns, whatever the magnitude)
    assert _select([4e-20, 1e-20, 3e-20, 2e-20], 0.65) == [0, 2]
    assert _select([4e-20, 1e-20, 3e-20, 2e-20], 0.75) == [0, 2, 3]
    # tau = 1 keeps every token with non-zero mass, and only those
    assert _select([0.5, 0.0, 0.5, 0.0], 1.0) == [0, 2]
    assert _select([1e-30, 0.7, 0.3 - 1e-30], 1.0) == [0, 1, 2]
    # unnormalised masses: 2 of 4 reaches 0.5
    assert _select([2.0, 1.0, 1.0], 0.5) == [0]
    # always-kept tokens count first: 0.55 forced + 0.25 reaches 0.75
    assert _select([0.25, 0.2], 0.75, forced=0.55) == [0]
    assert _select([0.25, 0.25], 0.5, forced=0.5) == []


def _top_p_numpy(mass, target):
    """Eq. 4 by sorting (float64 sums): the k* largest masses reaching ``target``, ties at the k*-th kept."""
    out = np.zeros(mass.shape, bool)
    for idx in np.ndindex(mass.shape[:-1]):
        m, t = mass[idx].astype(np.float64), float(target[idx])
        if t <= 0:
            continue
        order = np.sort(m)[::-1]
        k = int(np.searchsorted(np.cumsum(order), t))  # first prefix reaching t
        out[idx] = (m >= order[min(k, len(order) - 1)]) & (m > 0)
    return out


@pytest.mark.parametrize("digit_bits,one_read", [(None, None), (1, False), (2, False), (3, True), (4, True), (4, False),
                                                 (8, True)])
def test_top_p_radix_search_matches_a_sort(digit_bits, one_read):
    """Every digit width and both reduction forms select what sorting selects: masses spanning 40 orders of
    magnitude, exact zeros, ties, a target forced mass alone reaches, and targets near the total. ``None``: the
    backend's default form."""
    rng = np.random.default_rng(digit_bits or 0)
    mass = np.exp(rng.standard_normal((3, 5, 257)) * 20).astype(np.float32)
    mass[..., :7] = 0.0
    mass[0, 0, 10:20] = mass[0, 0, 30]  # ties
    mass[1] = np.round(mass[1], 0)  # many exact ties and zeros
    total = mass.astype(np.float64).sum(-1)
    forced = np.zeros_like(total)
    forced[2, 0] = 5 * total[2, 0]  # forced alone reaches the target: nothing selected
    total = (total + forced).astype(np.float32)
    for tau in (0.1, 0.5, 0.9, 0.999):
        got = top_p_select(jnp.asarray(mass), jnp.asarray(total), jnp.asarray(forced, np.float32), tau,
                           digit_bits=digit_bits, one_read=one_read)
        target = tau * total.astype(np.float32) - forced.astype(np.float32)  # as the function computes it
        np.testing.assert_array_equal(np.asarray(got), _top_p_numpy(mass, target), err_msg=f"tau={tau}")
    with pytest.raises(ValueError, match="digit_bits"):
        top_p_select(jnp.asarray(mass), jnp.asarray(total), jnp.asarray(forced, np.float32), 0.5, digit_bits=0)


# ------------------------------------------------------------------------- one layer vs numpy
def _reference(q, keys, values, rk, rv, pad, n_prev, tau, renormalize=True, union=False):
    """Per query: exact softmax over prompt slots >= pad and newer tokens <= its own, Eq. 4 over the prompt
    with the newer tokens counted first, the (renormalised) weighted sum; float64. With ``union``, also the size of
    each (row, KV head)'s union of selections over its query heads and tokens ``[B, H]``."""
    B, T, Hq, D = q.shape
    H, S = keys.shape[1], keys.shape[2]
    G = Hq // H
    out = np.zeros((B, T, Hq, D))
    sets = [[set() for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for t in range(T):
            for hq in range(Hq):
                h = hq // G
                zp = keys[b, h, pad[b]:] @ q[b, t, hq] / np.sqrt(D)
                zr = rk[b, h, :n_prev + t + 1] @ q[b, t, hq] / np.sqrt(D)
                m = max(zp.max(), zr.max())
                pp, pr = np.exp(zp - m), np.exp(zr - m)
                total = pp.sum() + pr.sum()
                order = np.argsort(-pp, kind="stable")
                before = np.concatenate([[0.0], np.cumsum(pp[order])[:-1]])
                keep = order[(pr.sum() + before < tau * total) & (pp[order] > 0)] if tau < 1 else np.flatnonzero(pp > 0)
                num = pp[keep] @ values[b, h, pad[b]:][keep] + pr @ rv[b, h, :n_prev + t + 1]
                den = (pp[keep].sum() + pr.sum()) if renormalize else total
                out[b, t, hq] = num / den
                sets[b][h].update(int(i) for i in keep)
    if union:
        return out, np.array([[len(x) for x in row] for row in sets])
    return out


def _decoded(codes, codebooks):
    """numpy: the quantized keys ``[B, H, S, D]`` from codes ``[B, H, S, g]`` and codebooks ``[H, g, c, D/g]``."""
    B, H, S, g = codes.shape
    out = np.stack([np.stack([np.concatenate([codebooks[h, i][codes[b, h, :, i]] for i in range(g)], axis=-1)
                              for h in range(H)]) for b in range(B)])
    return out.astype(np.float64)


def _stored_values(values, kv_dtype):
    """numpy: (stored values, scales ``[..., 1]`` or None, their float64 dequantization) of the per-token absmax
    scheme, written out independently of :mod:`kvjax.kv_quantization`."""
    import ml_dtypes

    if kv_dtype is None:
        return values, None, values.astype(np.float64)
    if kv_dtype == "bfloat16":
        stored = values.astype(ml_dtypes.bfloat16)
        return stored, None, stored.astype(np.float64)
    qmax = {"int8": 127.0, "float8_e4m3fn": 448.0}[kv_dtype]
    s = np.abs(values.astype(np.float64)).max(-1, keepdims=True) / qmax
    y = values / np.where(s > 0, s, 1.0)
    stored = (np.clip(np.round(y), -127, 127).astype(np.int8) if kv_dtype == "int8"
              else np.clip(y, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn))
    return stored, s.astype(np.float32), stored.astype(np.float64) * s.astype(np.float32)


def _layer_case(quantized: bool, seed: int = 0, kv_dtype=None):
    """A hand-built compressed layer (2 rows, one left-padded; 2 newer tokens held), 3 new tokens to attend; the
    prompt values stored in ``kv_dtype`` (None: float32)."""
    rng = np.random.default_rng(seed)
    B, H, G, S, D, T, room = 2, 2, 3, 24, 8, 3, 6
    pad = np.array([0, 5])
    keys = rng.normal(size=(B, H, S, D)).astype(np.float32) * 2
    values = rng.normal(size=(B, H, S, D)).astype(np.float32)
    q = rng.normal(size=(B, T, H * G, D)).astype(np.float32)
    k_new = rng.normal(size=(B, T, H, D)).astype(np.float32)
    v_new = rng.normal(size=(B, T, H, D)).astype(np.float32)
    n_prev = 2
    rk = np.zeros((B, H, room, D), np.float32)
    rv = np.zeros((B, H, room, D), np.float32)
    rk[:, :, :n_prev] = rng.normal(size=(B, H, n_prev, D))
    rv[:, :, :n_prev] = rng.normal(size=(B, H, n_prev, D))
    art, codes, ref_keys = None, None, keys.astype(np.float64)
    if quantized:
        cb = rng.normal(size=(H, 4, 16, D // 4)).astype(np.float32)
        art = Artifact(arrays={"codebooks": jnp.asarray(cb[None])}, kind="hcattention", model_id="m")
        codes = encode_keys(jnp.asarray(keys), jnp.asarray(cb))
        ref_keys = _decoded(np.asarray(codes), cb)
    stored, scales, values = _stored_values(values, kv_dtype)
    state = HCAttentionKV(
        codes=codes, keys=None if quantized else jnp.asarray(keys), values=to_host(jnp.asarray(stored.reshape(B * H, S, D))),
        value_scales=None if scales is None else to_host(jnp.asarray(scales.reshape(B * H, S, 1))), recent_k=jnp.asarray(rk), recent_v=jnp.asarray(rv), selected=jnp.zeros(()), queries=jnp.zeros(()),
        rows=jnp.zeros(()), fetched=jnp.zeros(()), calls=jnp.zeros((), jnp.int32), moved=jnp.zeros(()),
        truncated=jnp.zeros((), jnp.int32))
    ctx = AttendContext(start=jnp.asarray(S + n_prev, jnp.int32), pad=jnp.asarray(pad, jnp.int32),
                        positions=jnp.zeros((B, T), jnp.int32), artifact=art, layer=0)
    rk[:, :, n_prev:n_prev + T] = k_new.transpose(0, 2, 1, 3)
    rv[:, :, n_prev:n_prev + T] = v_new.transpose(0, 2, 1, 3)

    def reference(tau, renormalize=True, union=False):
        return _reference(q.astype(np.float64), ref_keys, values.astype(np.float64), rk, rv, pad, n_prev, tau,
                          renormalize, union)

    return state, (jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new)), ctx, rk, reference


@pytest.mark.parametrize("value_path", ["host", "device"])
@pytest.mark.parametrize("quantized", [False, True], ids=["exact_keys", "pq_keys"])
@pytest.mark.parametrize("tau,renormalize", [(0.6, True), (0.9, False), (1.0, True)])
def test_layer_output_matches_numpy(value_path, quantized, tau, renormalize):
    state, qkv, ctx, rk_all, reference = _layer_case(quantized)
    method = HCAttention(groups=4 if quantized else 0, centroids=16, tau=tau, value_path=value_path, renormalize=renormalize)
    out, new = jax.jit(method.decode_attend)(state, *qkv, ctx)
    np.testing.assert_allclose(np.asarray(out), reference(tau, renormalize), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(new.recent_k), rk_all)
    if tau < 1:
        assert 0 < float(new.selected) / float(new.queries) < 1  # the comparison is not against the full attention


@pytest.mark.parametrize("value_path,choice", [("host", "host"), ("host", "device"), ("device", "device")])
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn", "bfloat16"])
def test_host_values_in_kv_dtype_match_their_dequantization(value_path, choice, kv_dtype):
    """Host values stored in ``kv_dtype`` (int8 / fp8 with a float32 scale per token and KV head, or bf16): the layer's
    output equals the float64 reference over the dequantized values on every path (whole prompt, a bucket of rows,
    rows moved to the device), and differs from the float32 values' output by the scheme's error; the device path
    moves each row's stored bytes and its scale."""
    state, qkv, ctx, _, reference = _layer_case(False, kv_dtype=kv_dtype)
    exact = _layer_case(False)[4]
    for tau in (0.4, 1.0):
        method = HCAttention(groups=0, tau=tau, value_path=value_path, row_buckets=5, row_size_choice=choice)
        out, new = jax.jit(method.decode_attend)(state, *qkv, ctx)
        np.testing.assert_allclose(np.asarray(out), reference(tau), atol=2e-5, rtol=2e-5)
        assert np.abs(np.asarray(out) - exact(tau)).max() > 1e-4  # the values really are stored coarser
    if value_path == "device":
        B, H, D = 2, 2, 8
        per_row = 4 + D * jnp.dtype(kv_dtype).itemsize + (0 if kv_dtype == "bfloat16" else 4)
        assert float(new.moved) == per_row * float(new.fetched)
        assert float(new.fetched) % (B * H) == 0


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_host_values_stored_in_kv_dtype(tiny, kv_dtype):
    """``kv_dtype`` stores HCAttention's host values (scales beside them in host memory, counted); the codes, the
    codebooks and the exact newer tokens on the device are unchanged."""
    cfg = tiny.config
    g, c = 4, 8
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, size=(1, L)).astype(np.int32))
    art = codebook_artifact(cfg, g, c)
    caches = {}
    for kv in (None, kv_dtype):
        cache = new_cache(HCAttention(groups=g, centroids=c, tau=0.9, block=16), cfg, 1, L, 4, tiny.dtype, artifact=art,
                          kv_dtype=kv)
        _, cache = prefill(tiny.graphdef, tiny.params, tokens, cache)
        caches[kv] = compress(cache)
    H, D = cfg.num_kv_heads, cfg.head_dim
    st, ref = caches[kv_dtype].layers[0], caches[None].layers[0]
    assert st.values.dtype == jnp.dtype(kv_dtype) and st.values.sharding.memory_kind == "pinned_host"
    scale_bytes = 0 if kv_dtype == "bfloat16" else 4
    if scale_bytes:
        assert st.value_scales.shape == (H, L, 1) and st.value_scales.sharding.memory_kind == "pinned_host"
        deq = np.asarray(st.values, np.float64) * np.asarray(st.value_scales)
        np.testing.assert_allclose(deq, np.asarray(ref.values), atol=np.abs(np.asarray(ref.values)).max() / 127 / 2 + 1e-7)
    else:
        assert st.value_scales is None
    s, s_ref = caches[kv_dtype].stats(), caches[None].stats()
    assert s["host_value_bytes"] == caches[kv_dtype].host_bytes() == cfg.num_layers * H * L * (
        D * jnp.dtype(kv_dtype).itemsize + scale_bytes)
    assert s["host_value_dtype"] == kv_dtype and s_ref["host_value_dtype"] == "float32"
    assert caches[kv_dtype].device_bytes() == caches[None].device_bytes()


@pytest.mark.parametrize("value_path", ["host", "device"])
def test_row_cap(value_path):
    """A cap on the value rows per KV head: exact while the union of the group's selections fits, counted
    (and different from Eq. 4) when it does not."""
    state, qkv, ctx, _, reference = _layer_case(False)
    out, new = jax.jit(HCAttention(groups=0, tau=0.3, max_selected=0.5, value_path=value_path).decode_attend)(state, *qkv, ctx)
    assert int(new.truncated) == 0 and float(new.rows) <= 2 * 2 * 12
    np.testing.assert_allclose(np.asarray(out), reference(0.3), atol=2e-5, rtol=2e-5)
    out, new = jax.jit(HCAttention(groups=0, tau=1.0, max_selected=0.25, value_path=value_path).decode_attend)(state, *qkv, ctx)
    assert int(new.truncated) == 4  # every (row, KV head) needs all of its prompt rows
    assert np.abs(np.asarray(out) - reference(1.0)).max() > 1e-3


@pytest.mark.parametrize("value_path,choice", [("host", "host"), ("host", "device"), ("device", "device")])
@pytest.mark.parametrize("tau", [0.05, 0.4, 0.8])
def test_value_rows_follow_the_selected_union(value_path, choice, tau):
    """``row_buckets=5`` on a 24-token prompt: transfer sizes 6, 9, 12, 17 and 24 rows per (row, KV head). The call
    moves (device path) or weighs on the host (host path) the smallest size that holds the largest union of
    selections, computed by numpy, and stays exact against the float64 reference whichever size it takes, also when
    the union exceeds the smallest size (the larger sizes are the fallback). ``rows`` counts the unions, ``fetched``
    the rows that crossed or were summed, ``moved`` the bytes that crossed."""
    state, qkv, ctx, _, reference = _layer_case(False)
    want, unions = reference(tau, union=True)
    B, H = unions.shape
    method = HCAttention(groups=0, tau=tau, value_path=value_path, row_buckets=5, row_size_choice=choice)
    assert method.row_sizes(24) == (6, 9, 12, 17, 24)
    out, new = jax.jit(method.decode_attend)(state, *qkv, ctx)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
    size = min(r for r in (6, 9, 12, 17, 24) if r >= unions.max())
    assert size == {0.05: 6, 0.4: 12, 0.8: 24}[tau]  # the smallest size, a middle one and the fallback all occur
    assert float(new.fetched) == B * H * size and float(new.rows) == unions.sum()
    G, T, S, D = 3, 3, 24, 8
    if value_path == "device":  # ids out, rows back
        assert float(new.moved) == 4 * B * H * size + B * H * size * D * 4
    elif choice == "host":  # dense weights and the size index out, the sums back
        assert float(new.moved) == 4 * B * H * G * T * S + 4 + 4 * B * H * G * T * D
    else:  # ids and weights of the chosen rows out, the sums back
        assert float(new.moved) == 4 * B * H * size + 4 * B * H * G * T * size + 4 * B * H * G * T * D


def test_row_size_choice_checked_and_auto_by_backend(monkeypatch):
    """``auto`` picks the host path's row count in the host computation except on a TPU; the device path has no
    host choice."""
    assert HCAttention(groups=0).sizes_on_host() is True  # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert HCAttention(groups=0).sizes_on_host() is False
    assert HCAttention(groups=0, row_size_choice="host").sizes_on_host() is True
    assert HCAttention(groups=0, value_path="device").sizes_on_host() is False
    with pytest.raises(ValueError, match="needs value_path='host'"):
        HCAttention(groups=0, value_path="device", row_size_choice="host")
    with pytest.raises(ValueError, match="row_size_choice must be one of"):
        HCAttention(groups=0, row_size_choice="gpu")


def test_pallas_interpret_scoring_equals_xla():
    rng = np.random.default_rng(1)
    B, H, G, S, D = 1, 2, 2, 40, 16
    cb = rng.normal(size=(H, 8, 16, D // 8)).astype(np.float32)
    keys = jnp.asarray(rng.normal(size=(B, H, S, D)).astype(np.float32))
    codes = encode_keys(keys, jnp.asarray(cb))
    art = Artifact(arrays={"codebooks": jnp.asarray(cb[None])}, kind="hcattention", model_id="m")
    ctx = AttendContext(start=jnp.asarray(S, jnp.int32), pad=jnp.zeros((B,), jnp.int32),
                        positions=jnp.zeros((B, 1), jnp.int32), artifact=art, layer=0)
    qg = jnp.asarray(rng.normal(size=(B, H, G, 1, D)).astype(np.float32))
    st = HCAttentionKV(codes=codes, keys=None, values=None, value_scales=None, recent_k=None, recent_v=None, selected=None,
                       queries=None, rows=None, fetched=None, calls=None, moved=None, truncated=None)
    xla = HCAttention(groups=8, centroids=16, implementation="xla").prompt_logits(st, qg, ctx)
    interp = HCAttention(groups=8, centroids=16, implementation="pallas_interpret").prompt_logits(st, qg, ctx)
    ref = np.einsum("bhgtd,bhsd->bhgts", np.asarray(qg, np.float64), _decoded(np.asarray(codes), cb)) / np.sqrt(D)
    np.testing.assert_allclose(np.asarray(xla), ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(interp), ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("value_path", ["host", "device"])
def test_tau_one_exact_keys_equals_full_cache(tiny, value_path):
    """tau = 1 with exact keys is the full attention: chunk padding, a ragged batch and a question after
    compression change nothing (values really come from host memory)."""
    rng = np.random.default_rng(11)
    rows = [list(rng.integers(0, 97, size=L)), list(rng.integers(0, 97, size=20))]
    method = HCAttention(groups=0, tau=1.0, block=16, value_path=value_path)
    full, _, _, _ = generate_tokens(tiny, rows, method=FullCache(block=16), max_new_tokens=8)
    for chunk in (None, 32):
        got, _, cache, _ = generate_tokens(tiny, rows, method=method, max_new_tokens=8, chunk_size=chunk)
        np.testing.assert_array_equal(got, full, err_msg=f"chunk_size={chunk}")
        s = cache.stats()
        assert s["host_value_bytes"] == cache.host_bytes() > 0 and s["selection_ratio"] == 1.0
    question = [list(rng.integers(0, 97, size=5)) for _ in rows]
    ref, _, _, _ = generate_tokens(tiny, [r + q for r, q in zip(rows, question)], method=FullCache(block=16),
                                   max_new_tokens=5)
    got, _, _, _ = generate_tokens(tiny, rows, method=method, max_new_tokens=5, question_rows=question)
    np.testing.assert_array_equal(got, ref)


def test_exact_prompt_tail_with_tau_one_and_exact_keys_equals_full_cache(tiny):
    """``local``: the last prompt tokens join the exact newer tokens. With tau = 1 and exact keys the attention
    is still the full one, also for a row shorter than the tail (its left padding inside the tail is masked)."""
    rng = np.random.default_rng(12)
    rows = [list(rng.integers(0, 97, size=L)), list(rng.integers(0, 97, size=20))]
    full, _, _, _ = generate_tokens(tiny, rows, method=FullCache(block=16), max_new_tokens=8)
    got, _, cache, _ = generate_tokens(tiny, rows, method=HCAttention(groups=0, tau=1.0, block=16, local=24),
                                       max_new_tokens=8, chunk_size=16)
    np.testing.assert_array_equal(got, full)
    P = cache.spec.prompt_slots  # 48: rows padded to the chunk grid
    for st in cache.layers:
        assert st.keys.shape[2] == st.values.shape[1] == P - 24 and st.recent_k.shape[2] == 24 + cache.spec.room


def test_exact_prompt_tail_holds_fewer_codes_and_its_keys_exactly(tiny):
    cfg = tiny.config
    g, c, local = 4, 8, 10
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, size=(1, L)).astype(np.int32))
    art = codebook_artifact(cfg, g, c)
    cache = new_cache(HCAttention(groups=g, centroids=c, tau=0.9, block=16, local=local), cfg, 1, L, 4, tiny.dtype,
                      artifact=art)
    _, cache = prefill(tiny.graphdef, tiny.params, tokens, cache)
    tail_k = np.asarray(cache.layers[0].k[:, :, L - local:L])  # before compression the staging holds every key
    cache = compress(cache)
    st = cache.layers[0]
    assert st.codes.shape == (1, cfg.num_kv_heads, L - local, g) and st.values.shape[1] == L - local
    np.testing.assert_array_equal(np.asarray(st.recent_k[:, :, :local]), tail_k)
    assert cache.stats()["code_bytes"] == cfg.num_layers * cfg.num_kv_heads * (L - local) * g
    with pytest.raises(ValueError, match="local=40 must be smaller than the prompt"):
        new_cache(HCAttention(groups=g, centroids=c, local=L), cfg, 1, L, 4, tiny.dtype, artifact=art)


def test_quantized_keys_hold_codes_not_keys(tiny):
    cfg = tiny.config
    g, c = 4, 8
    tokens = np.random.default_rng(2).integers(0, 97, size=(1, L)).astype(np.int32)
    art = codebook_artifact(cfg, g, c)
    method = HCAttention(groups=g, centroids=c, tau=0.9, block=16)
    cache = new_cache(method, cfg, 1, L, 4, tiny.dtype, artifact=art)
    _, cache = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens), cache)
    cache = compress(cache)
    s = cache.stats()
    H, D = cfg.num_kv_heads, cfg.head_dim
    for st in cache.layers:
        assert st.codes.shape == (1, H, L, g) and st.codes.dtype == jnp.uint8 and st.keys is None
        assert st.values.sharding.memory_kind == "pinned_host" and st.values.shape == (H, L, D)
    assert s["code_bytes"] == cfg.num_layers * H * L * g
    assert s["codebook_bytes"] == cfg.num_layers * H * c * D * 4
    assert s["host_value_bytes"] == cache.host_bytes() == cfg.num_layers * H * L * D * 4
    # device: codes + codebooks + 4 newer tokens' exact K/V + per-layer counters (a few scalars)
    newer = cfg.num_layers * 2 * H * 4 * D * 4
    assert s["code_bytes"] + s["codebook_bytes"] + newer <= cache.device_bytes() <= s["code_bytes"] + s["codebook_bytes"] + newer + 200
    assert s["key_representation"] == f"pq g={g} c={c}"


def test_decode_loop_compiles_once_without_host_callbacks(tiny):
    cfg = tiny.config
    art = codebook_artifact(cfg, 4)
    method = HCAttention(groups=4, centroids=8, tau=0.9, block=16)
    tokens = np.random.default_rng(5).integers(0, 97, size=(1, L)).astype(np.int32)

    def prefilled():
        cache = new_cache(method, cfg, 1, L, 6, tiny.dtype, artifact=art)
        _, cache = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens), cache)
        return compress(cache)

    before = TRACE_COUNTS["decode_loop"]
    for _ in range(2):
        decode_loop(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, -1]), prefilled(), jax.random.PRNGKey(0), max_new_tokens=6)
    assert TRACE_COUNTS["decode_loop"] - before == 1
    text = decode_loop_jit.lower(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, -1]), prefilled(), jax.random.PRNGKey(0),
                                 max_new_tokens=6).as_text()
    assert "callback" not in text.lower()
    assert "_xla_compute_type" in text  # the weighted sum over host values is a host-compute region


def test_budget_picks_the_key_representation():
    def spec(dtype):
        return CacheSpec(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, batch=1, prompt_slots=100,
                         longest_row=100, room=4, dtype=dtype)

    f32, bf16 = spec("float32"), spec("bfloat16")
    assert HCAttention(budget=0.5).key_groups(f32) == 0  # value offloading only
    assert HCAttention(budget=0.25).key_groups(f32) == 32  # g = D/2: 32 bytes of 512 = 6.25%
    assert HCAttention(budget=0.0625).key_groups(f32) == 32
    assert HCAttention(budget=0.05).key_groups(f32) == 16
    assert HCAttention(budget=0.25).key_groups(bf16) == 32  # 32 of 256 bytes = 12.5%
    assert HCAttention(budget=0.1).key_groups(bf16) == 16
    assert HCAttention(budget=0.125, centroids=1024).key_groups(f32) == 32  # uint16 codes: 64 of 512 bytes
    assert HCAttention(budget=0.1, centroids=1024).key_groups(f32) == 16
    assert HCAttention().key_groups(f32) == 32
    with pytest.raises(ValueError, match="below its smallest configuration"):
        HCAttention(budget=0.02).key_groups(f32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=0.25, groups=32), "either budget"),
    (dict(budget=64), "float fraction"),
    (dict(tau=0.0), "tau"),
    (dict(tau=1.5), "tau"),
    (dict(groups=-1), "groups"),
    (dict(centroids=70000), "centroids"),
    (dict(value_path="gpu"), "value_path"),
    (dict(max_selected=0.0), "max_selected"),
    (dict(local=-1), "local"),
    (dict(local=True), "local"),
])
def test_bad_hyper_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HCAttention(**kwargs)


def test_artifact_errors(tiny):
    cfg = tiny.config
    spec = CacheSpec.for_model(cfg, 1, L, 4, "float32")
    with pytest.raises(ValueError, match="made for model"):
        HCAttention(groups=4, centroids=8).init_cache(spec, codebook_artifact(cfg, 4, model_id="other:123"))
    with pytest.raises(ValueError, match="codebooks have shape"):
        HCAttention(groups=4, centroids=16).init_cache(spec, codebook_artifact(cfg, 4, 8))
    with pytest.raises(ValueError, match="divide the head dimension"):
        HCAttention(groups=5).init_cache(spec)
    with pytest.raises(ValueError, match="takes no artifact"):
        HCAttention(groups=0).init_cache(spec, codebook_artifact(cfg, 4))
    with pytest.raises(ValueError, match="no hcattention artifact .* none ships with kvjax"):
        HCAttention(groups=4, centroids=8).init_cache(spec)
    wrong_kind = Artifact(arrays={}, kind="heterocache", model_id=model_identity(cfg))
    with pytest.raises(ValueError, match="kind"):
        HCAttention(groups=4, centroids=8).init_cache(spec, wrong_kind)


def test_method_spec_and_cli_flags():
    from kvjax.cli import build_parser, method_from_args

    m = get_method("hcattention:groups=16:tau=0.5:value_path=device")
    assert (m.groups, m.tau, m.value_path) == (16, 0.5, "device")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--method", "hcattention", "--groups", "32", "--tau", "0.7",
                                      "--local", "64"])
    m = method_from_args(args)
    assert (m.groups, m.tau, m.local) == (32, 0.7, 64)
    for flag in (["--tau", "0.7"], ["--local", "64"]):
        args = build_parser().parse_args(["generate", "--prompt", "x", "--method", "snapkv", *flag])
        with pytest.raises(ValueError, match="apply to --method hcattention only"):
            method_from_args(args)
