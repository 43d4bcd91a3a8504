"""XLA attention paths (kvjax.attention, H2O's accumulated attention) against float64 numpy references.

Covers causal masking, GQA, left padding, later prompt chunks and uneven block sizes.
"""

import numpy as np
import pytest
import jax.numpy as jnp

from kvjax.attention import blocked_causal_attention, causal_cache_attention, dense_causal_attention


def reference_attention(q, k, v, q_start, pad, scale):
    """Plain softmax attention in float64: query t (slot q_start + t) sees key slots pad[b] .. its own slot."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = np.zeros((B, T, Hq, D))
    for b in range(B):
        for h in range(Hq):
            kh, vh = k[b, h // G], v[b, h // G]
            for t in range(T):
                slot = q_start + t
                visible = [s for s in range(S) if pad[b] <= s <= slot]
                if not visible:  # a padding query: every key is masked, the kernels average all visited keys
                    continue
                scores = kh[visible] @ q[b, t, h] * scale
                w = np.exp(scores - scores.max())
                out[b, t, h] = (w / w.sum()) @ vh[visible]
    return out


def _inputs(B, T, Hq, Hkv, S, D=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    return q, k, v


def _real_rows(out, q_start, pad):
    """Mask of query rows that are not left padding (those are compared)."""
    B, T = out.shape[:2]
    return np.array([[q_start + t >= pad[b] for t in range(T)] for b in range(B)])


@pytest.mark.parametrize(
    "T,q_start,S,block,q_block,pad",
    [
        (64, 0, 64, 16, 16, (0, 0)),  # one-shot prefill, query blocks = key blocks
        (64, 0, 80, 16, 24, (0, 5)),  # T not a multiple of q_block; empty slots after the prompt; left padding
        (40, 24, 80, 16, 512, (0, 30)),  # a later chunk; q_block larger than the chunk; padding past the chunk start
        (17, 31, 64, 32, 8, (3, 0)),  # chunk straddling key blocks, uneven sizes
    ],
)
def test_blocked_attention_matches_reference(T, q_start, S, block, q_block, pad):
    q, k, v = _inputs(len(pad), T, Hq=6, Hkv=2, S=S)
    pad_arr = jnp.asarray(pad, jnp.int32)
    got = np.asarray(blocked_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_start=q_start,
                                              pad=pad_arr, scale=0.3, block=block, q_block=q_block))
    want = reference_attention(q, k, v, q_start, pad, 0.3)
    rows = _real_rows(got, q_start, pad)
    np.testing.assert_allclose(got[rows], want[rows], rtol=2e-5, atol=2e-5)


def test_dense_and_dispatch_match_reference():
    q, k, v = _inputs(2, 24, Hq=4, Hkv=1, S=48)
    pad = (0, 7)
    for fn in (dense_causal_attention, lambda *a, **kw: causal_cache_attention(*a, block=16, **kw)):
        got = np.asarray(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_start=10,
                            pad=jnp.asarray(pad, jnp.int32), scale=0.5))
        want = reference_attention(q, k, v, 10, pad, 0.5)
        rows = _real_rows(got, 10, pad)
        np.testing.assert_allclose(got[rows], want[rows], rtol=2e-5, atol=2e-5)


def test_decode_query_matches_reference():
    q, k, v = _inputs(1, 1, Hq=4, Hkv=2, S=32)
    got = np.asarray(dense_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_start=20,
                                            pad=jnp.zeros((1,), jnp.int32), scale=0.5))
    np.testing.assert_allclose(got, reference_attention(q, k, v, 20, (0,), 0.5), rtol=2e-5, atol=2e-5)


def test_blocked_attention_rejects_bad_blocks():
    q, k, v = (jnp.asarray(x) for x in _inputs(1, 8, Hq=2, Hkv=1, S=40))
    with pytest.raises(ValueError, match="multiple of the attention block 16"):
        blocked_causal_attention(q, k, v, q_start=0, pad=jnp.zeros((1,), jnp.int32), scale=1.0, block=16)
    with pytest.raises(ValueError, match="q_block must be positive"):
        blocked_causal_attention(q, k[:, :, :32], v[:, :, :32], q_start=0, pad=jnp.zeros((1,), jnp.int32), scale=1.0,
                                 block=16, q_block=0)


def reference_column_sums(q, k, q_start, pad):
    """H2O's accumulated attention in float64: each real query's softmax weights added to its keys' columns."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    acc = np.zeros((B, Hq, S))
    for b in range(B):
        for h in range(Hq):
            for t in range(T):
                slot = q_start + t
                if slot < pad[b]:
                    continue  # left padding does not vote
                visible = np.arange(pad[b], slot + 1)
                scores = k[b, h // (Hq // Hkv)][visible] @ q[b, t, h] / np.sqrt(D)
                w = np.exp(scores - scores.max())
                acc[b, h, visible] += w / w.sum()
    return acc


@pytest.mark.parametrize(
    "T,q_start,S,block,q_block,pad",
    [
        (64, 0, 64, 16, 16, (0, 0)),
        (50, 0, 80, 16, 24, (0, 5)),  # uneven query blocks, empty future slots, left padding
        (40, 24, 80, 16, 512, (0, 30)),  # a later chunk; padding past the chunk start
    ],
)
def test_chunk_attention_sums_match_reference(T, q_start, S, block, q_block, pad):
    from kvjax.attention import chunk_attention_sums

    q, k, _ = _inputs(len(pad), T, Hq=6, Hkv=2, S=S)
    got = np.asarray(chunk_attention_sums(jnp.asarray(q), jnp.asarray(k), q_start, jnp.asarray(pad, jnp.int32),
                                          block, q_block=q_block))
    np.testing.assert_allclose(got, reference_column_sums(q, k, q_start, pad), rtol=1e-5, atol=1e-5)


def reference_by_slots(q, q_slots, k, v, k_slots, pad, scale):
    """float64 numpy attention where each stored key carries its slot (-1 = empty)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = np.zeros((B, T, Hq, D))
    for b in range(B):
        for t in range(T):
            for h in range(Hq):
                kv = h // G
                vis = (k_slots[b, kv] <= q_slots[t]) & (k_slots[b, kv] >= pad[b])
                if not vis.any():
                    continue
                s = k[b, kv][vis].astype(np.float64) @ q[b, t, h].astype(np.float64) * scale
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[b, kv][vis].astype(np.float64)
    return out


@pytest.mark.parametrize("S,block,q_block", [(40, 16, 8), (37, 256, 512), (64, 16, 5)])
def test_attention_by_slots_dense_and_blocked_match_reference(S, block, q_block):
    from kvjax.attention import attention_by_slots, blocked_attention_by_slots

    rng = np.random.default_rng(S)
    B, T, Hq, Hkv, D = 2, 9, 4, 2, 8
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    # compacted buffers: held entries at increasing (gapped) slots, then empty entries (-1), per row and head
    k_slots = np.full((B, Hkv, S), -1, np.int32)
    for b in range(B):
        for h in range(Hkv):
            n = rng.integers(S // 2, S)
            k_slots[b, h, :n] = np.sort(rng.choice(60, size=n, replace=False))
    pad = np.array([0, 30], np.int32)  # row 1: slots before 30 are padding; its first queries see nothing
    q_slots = np.arange(51, 60, dtype=np.int32) - np.array([0, 0, 0, 0, 0, 0, 0, 0, 25])[::-1]
    want = reference_by_slots(q, q_slots, k, v, k_slots, pad, D**-0.5)
    args = (jnp.asarray(q), jnp.asarray(q_slots), jnp.asarray(k), jnp.asarray(v), jnp.asarray(k_slots), jnp.asarray(pad))
    np.testing.assert_allclose(np.asarray(attention_by_slots(*args, scale=D**-0.5)), want, atol=1e-5)
    got = blocked_attention_by_slots(*args, scale=D**-0.5, block=block, q_block=q_block)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
