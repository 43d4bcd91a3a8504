"""Selection logic of the static methods on small hand-computed arrays (and a numpy reference for scores)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvjax.methods import H2O, HBW, SnapKV, StreamingLLM
from kvjax.cache import CacheSpec, FinishContext
from kvjax.methods.hbw import hierarchical_block_keep
from kvjax.selection import (WindowAttentionScores, gqa_aggregate, keep_to_indices, keep_top, pool1d,
                             pyramid_capacities, small_median)
from kvjax.staging import Recording, StagedKV


def mask_to_indices(keep, cap):
    return keep_to_indices(keep, cap)[0]


class Staged(NamedTuple):
    st: StagedKV
    prompt_len: int


def select(method, staged, pad, cap):
    """The method's keep mask for a staging whose longest row is the prompt (``cap`` is the method's budget)."""
    st, P = staged
    B, Hkv, S, D = st.k.shape
    spec = CacheSpec(num_layers=1, num_heads=Hkv, num_kv_heads=Hkv, head_dim=D, batch=B, prompt_slots=P,
                     longest_row=P, room=0)
    return method.keep_mask(st, FinishContext(pad=pad, layer=0, spec=spec))[0]


def snapkv_scores(st, pad, *, window, kernel, pooling, gqa):
    return WindowAttentionScores(window, kernel, pooling, gqa)(st.st, pad, st.prompt_len)


def kept(mask):
    return [list(np.flatnonzero(np.asarray(m))) for m in np.asarray(mask).reshape(-1, mask.shape[-1])]


def staged(S, prompt_len, Hkv=1, Hq=1, D=4, window=0, acc=None, k=None, q=None, B=1):
    k = jnp.zeros((B, Hkv, S, D)) if k is None else k
    st = StagedKV(k, k, q, acc, recording=Recording(window=0 if q is None else q.shape[1], accumulate=acc is not None))
    return Staged(st, prompt_len)


def test_keep_top_forced_plus_best():
    scores = jnp.array([[5.0, 1.0, 4.0, 3.0, 9.0, 0.0]])
    forced = jnp.array([[False, False, False, False, False, True]])
    cand = jnp.array([[True, True, True, True, False, False]])
    # slot 5 forced, slot 4 not a candidate; best two candidates: 0 (5.0) and 2 (4.0)
    assert kept(keep_top(scores, forced, cand, 3)) == [[0, 2, 5]]
    assert np.asarray(mask_to_indices(keep_top(scores, forced, cand, 3), 3)).tolist() == [[0, 2, 5]]


def test_pooling_avg_and_max_match_hand_values():
    x = jnp.array([[1.0, 0.0, 0.0, 6.0, 0.0]])
    valid = jnp.array([[True, True, True, True, False]])
    np.testing.assert_allclose(np.asarray(pool1d(x, valid, 3, "avg")), [[1 / 3, 1 / 3, 2.0, 2.0, 2.0]])
    np.testing.assert_allclose(np.asarray(pool1d(x, valid, 3, "max")), [[1.0, 1.0, 6.0, 6.0, 6.0]])


def test_gqa_aggregation_mean_and_max():
    s = jnp.array([[[1.0, 4.0], [3.0, 0.0], [5.0, 5.0], [1.0, 1.0]]])  # Hq=4 -> Hkv=2
    np.testing.assert_allclose(np.asarray(gqa_aggregate(s, 2, "mean")), [[[2.0, 2.0], [3.0, 3.0]]])
    np.testing.assert_allclose(np.asarray(gqa_aggregate(s, 2, "max")), [[[3.0, 4.0], [5.0, 5.0]]])


def test_streaming_llm_keeps_sinks_and_recent_per_row_padding():
    m = StreamingLLM(budget=5, sinks=2)
    pad = jnp.array([0, 3])
    keep = select(m, staged(12, 10, Hkv=2, B=2), pad, 5)
    assert kept(keep) == [[0, 1, 7, 8, 9]] * 2 + [[3, 4, 7, 8, 9]] * 2


def test_h2o_recent_plus_heavy_hitters_with_gqa():
    acc = jnp.array([[[0.0, 9, 1, 7, 2, 0, 0, 0], [0.0, 1, 1, 9, 8, 0, 0, 0]]])  # Hq=2 on one KV head
    st = staged(8, 8, acc=acc)
    # cap 4, recent 2 -> slots 6, 7; heavy (mean over group): slot1 5.0, slot3 8.0, slot4 5.0 -> 3 and 1 (tie: lower index)
    assert kept(select(H2O(budget=4), st, jnp.array([0]), 4)) == [[1, 3, 6, 7]]
    # max over group: slot1 9, slot3 9, slot4 8 -> 1 and 3
    assert kept(select(H2O(budget=4, gqa="max"), st, jnp.array([0]), 4)) == [[1, 3, 6, 7]]


def test_lookahead_keeps_a_values_tokens_together():
    """A hand-made cache: a needle's key (slot 2, score 9) and its 4-token value (slots 3-6, 0.1 each: attention goes to
    where reading starts), then filler scoring 1-2, then the recent window. H2O at 12 tokens keeps 6 recent and the 6
    best others: the key and five filler tokens without ``lookahead``; with ``lookahead=4`` the scores carry 9 over
    slots 3-6, so key and value stay whole (and the best filler token). The same step for SnapKV: its window-attention
    scores extended likewise."""
    acc = np.zeros((1, 1, 24), np.float32)
    acc[0, 0, 2] = 9.0
    acc[0, 0, 3:7] = 0.1
    acc[0, 0, 8:18] = np.linspace(1.0, 2.0, 10)
    st = staged(24, 24, acc=jnp.asarray(acc))
    recent = list(range(18, 24))
    assert kept(select(H2O(budget=12), st, jnp.array([0]), 12)) == [[2, 13, 14, 15, 16, 17] + recent]
    assert kept(select(H2O(budget=12, lookahead=4), st, jnp.array([0]), 12)) == [[2, 3, 4, 5, 6, 17] + recent]
    # SnapKV: one window query attending to slot 2 most (its key aligned with the query), to the filler at 8-14 a
    # little (logit 2) and to the value at 3-5 least (logit 0)
    k = np.zeros((1, 1, 16, 4), np.float32)
    k[0, 0, :, 1] = 1.0
    k[0, 0, 2] = [8.0, 0.0, 0.0, 0.0]
    k[0, 0, 8:15, 0] = 0.5
    q = np.asarray([[[[8.0, 0.0, 0.0, 0.0]]]], np.float32)  # [B, W=1, Hq, D]
    snap = staged(16, 16, k=jnp.asarray(k), q=jnp.asarray(q))
    base = dict(budget=5, window=1, kernel=1)
    assert kept(select(SnapKV(**base), snap, jnp.array([0]), 5)) == [[2, 8, 9, 10, 15]]
    assert kept(select(SnapKV(**base, lookahead=3), snap, jnp.array([0]), 5)) == [[2, 3, 4, 5, 15]]
    with pytest.raises(ValueError, match="lookahead must be an int >= 0"):
        SnapKV(lookahead=-2)
    with pytest.raises(ValueError, match="a look-ahead changes nothing"):
        StreamingLLM(lookahead=4)


def numpy_snapkv_scores(q, k, window, kernel, prompt_len):
    """Independent numpy SnapKV scoring (one row, MHA): window softmax, sum, avg pool (count_include_pad)."""
    _, W, H, D = q.shape
    out = []
    for h in range(H):
        s = q[0, :, h] @ k[0, h, :prompt_len].T / np.sqrt(D)
        for w in range(W):
            s[w, prompt_len - W + w + 1:] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        agg = p.sum(0)[: prompt_len - W]
        padded = np.concatenate([np.zeros(kernel // 2), agg, np.zeros(kernel // 2)])
        pooled = np.array([padded[i:i + kernel].mean() for i in range(len(agg))])
        out.append(pooled)
    return np.stack(out)


def test_snapkv_scores_match_numpy_reference():
    rng = np.random.default_rng(0)
    S, L, W, D, H = 16, 14, 4, 8, 2
    k = rng.normal(size=(1, H, S, D)).astype(np.float32)
    q = rng.normal(size=(1, W, H, D)).astype(np.float32)
    st = staged(S, L, Hkv=H, k=jnp.asarray(k), q=jnp.asarray(q))
    got = np.asarray(snapkv_scores(st, jnp.array([0]), window=W, kernel=3, pooling="avg", gqa="mean"))[0]
    np.testing.assert_allclose(got[:, : L - W], numpy_snapkv_scores(q, k, W, 3, L), rtol=1e-5, atol=1e-6)


def test_snapkv_select_keeps_window_and_top_prefix():
    rng = np.random.default_rng(1)
    S, L, W, D = 16, 12, 3, 8
    k = rng.normal(size=(1, 1, S, D)).astype(np.float32)
    q = rng.normal(size=(1, W, 1, D)).astype(np.float32)
    st = staged(S, L, k=jnp.asarray(k), q=jnp.asarray(q))
    ref = numpy_snapkv_scores(q, k, W, 1, L)[0]
    top = sorted(np.argsort(-ref, kind="stable")[:3])
    keep = select(SnapKV(budget=6, window=W, kernel=1), st, jnp.array([0]), 6)
    assert kept(keep) == [top + [9, 10, 11]]


def test_hbw_blocks_and_groups_hand_computed():
    # prefix of 16 slots (window 2 at slots 16, 17), block 2 -> 8 blocks; scores chosen per block
    block_scores = [1, 9, 2, 3, 8, 0, 4, 5]
    scores = jnp.asarray(np.repeat(block_scores, 2).tolist() + [0, 0], jnp.float32)[None, None]
    pad = jnp.array([0])
    # cap 10: prefix capacity 8, rounds M=(1, 2): 4 tokens each. Round 1: 2 blocks globally -> blocks 1 (9), 4 (8).
    # Round 2: 2 groups of 8 slots, 1 block each: group 0 blocks 0-3 unchosen best = 3 (3); group 1 blocks 4-7 -> 7 (5).
    keep = hierarchical_block_keep(scores, pad, 18, 2, 10, 2, (1, 2))
    assert kept(keep) == [[2, 3, 6, 7, 8, 9, 14, 15, 16, 17]]
    # one round of 8 tokens: the 4 best blocks 1, 4, 7, 6
    keep = hierarchical_block_keep(scores, pad, 18, 2, 10, 2, (1,))
    assert kept(keep) == [[2, 3, 8, 9, 12, 13, 14, 15, 16, 17]]


def test_hbw_leftover_capacity_filled_by_best_tokens():
    scores = jnp.asarray([1.0, 2, 9, 3, 0, 0, 7, 0, 0, 0], jnp.float32)[None, None]
    # prefix 8 (window 2), cap 5 -> prefix cap 3, block 2 -> one block (slots 2,3: mean 6) + best single token (6)
    keep = hierarchical_block_keep(scores, jnp.array([0]), 10, 2, 5, 2, (1,))
    assert kept(keep) == [[2, 3, 6, 8, 9]]


def test_hbw_degenerates_to_snapkv():
    rng = np.random.default_rng(2)
    S, L, W, D = 64, 60, 4, 8
    k = jnp.asarray(rng.normal(size=(2, 2, S, D)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(2, W, 4, D)).astype(np.float32))
    st = staged(S, L, k=k, q=q)
    pad = jnp.array([0, 5])
    a = select(SnapKV(budget=20, window=W), st, pad, 20)
    b = select(HBW(budget=20, window=W, block_size=1, groups=(1,)), st, pad, 20)
    assert kept(a) == kept(b)


def test_pyramid_capacities_linear_and_total():
    caps = pyramid_capacities(4, 100, 8, 20.0)
    # C - w = 92, min = 4.6, max = 179.4: 179.4, 121.67, 63.93, 6.2 (+8), rounding fixed to total 400
    assert caps == (187, 129, 71, 13) and sum(caps) == 400


@settings(max_examples=10, deadline=None)
@given(
    L=st.integers(20, 80), extra=st.integers(0, 16), pad0=st.integers(0, 6), data=st.data(),
    method=st.sampled_from(["snapkv", "hbw", "streaming", "h2o"]),
)
def test_kept_indices_properties(L, extra, pad0, data, method):
    rng = np.random.default_rng(L * 7 + extra)
    S, D, Hkv, Hq, W = L + extra, 4, 2, 4, 4
    pad = jnp.array([0, pad0])
    real_len = L - pad0
    cap = data.draw(st.integers(W + 1, real_len))
    k = jnp.asarray(rng.normal(size=(2, Hkv, S, D)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(2, W, Hq, D)).astype(np.float32))
    acc = jnp.asarray(rng.random(size=(2, Hq, S)).astype(np.float32))
    st_ = staged(S, L, k=k, q=q, acc=acc)
    m = {"snapkv": SnapKV(budget=cap, window=W), "hbw": HBW(budget=cap, window=W, groups=(1, 3)),
         "streaming": StreamingLLM(budget=cap, sinks=2), "h2o": H2O(budget=cap)}[method]
    keep = np.asarray(select(m, st_, pad, cap))
    idx = np.asarray(mask_to_indices(jnp.asarray(keep), cap))
    for b in range(2):
        for h in range(Hkv):
            row = idx[b, h]
            assert keep[b, h].sum() == cap  # count = budget
            assert len(set(row)) == cap and list(row) == sorted(row)  # unique, sorted
            assert row.min() >= int(pad[b]) and row.max() < L  # within the real prompt
            if method in ("snapkv", "hbw"):
                assert set(range(L - W, L)) <= set(row)  # window kept
            if method == "streaming":
                assert {int(pad[b]), int(pad[b]) + 1} <= set(row)  # sinks kept


def test_hbw_prefix_capacity_is_whole_blocks():
    """C - w = 62 tokens with T = 2: 31 whole blocks (16 in round M=1, 15 = 8 + 7 in round M=8) and no single
    tokens. The old token-share rounding kept 15 + 8 blocks and 16 single tokens."""
    rng = np.random.default_rng(5)
    P, w, cap, T = 4 + 200, 4, 4 + 62, 2
    scores = jnp.asarray(rng.random((1, 1, P)).astype(np.float32))
    keep = np.asarray(hierarchical_block_keep(scores, jnp.array([0]), P, w, cap, T, (1, 8)))[0, 0]
    assert keep.sum() == cap and keep[P - w:].all()
    blocks = keep[: P - w].reshape(-1, T)
    assert set(blocks.sum(-1).tolist()) <= {0, T}  # every block kept whole or not at all
    assert blocks.all(-1).sum() == 31
    # each of the 8 groups of round 2 holds at least one block chosen in its own range
    groups = np.array_split(np.arange(blocks.shape[0]), 8)
    assert all(blocks[g].all(-1).any() for g in groups)


def test_per_head_capacities_are_held_and_paid_for():
    """An allocator may give every KV head its own capacity: lengths and device bytes follow it."""
    from kvjax.methods.base import PagedAppend, PromptCompression
    from kvjax.selection import TopTokens

    @dataclasses.dataclass(frozen=True)
    class PerHead:
        def capacities(self, budget, spec):
            return ((4, 12),) * spec.num_layers

    @dataclasses.dataclass(frozen=True)
    class TwoCapacities(PromptCompression):
        name = "two_capacities"

        def components(self):
            return (WindowAttentionScores(4, 1, "max", "mean"), PerHead(), TopTokens(4), PagedAppend(page_size=4))

    rng = np.random.default_rng(6)
    B, Hkv, Hq, S, D, P = 2, 2, 4, 32, 8, 30
    k = jnp.asarray(rng.normal(size=(B, Hkv, S, D)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(B, 4, Hq, D)).astype(np.float32))
    st = StagedKV(k, k, q, None, recording=Recording(window=4))
    spec = CacheSpec(num_layers=1, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, batch=B, prompt_slots=P,
                     longest_row=P, room=2)
    paged = TwoCapacities(budget=12).finish_prefill(st, FinishContext(pad=jnp.array([0, 24]), layer=0, spec=spec))
    assert paged.capacities == (4, 12)
    assert np.asarray(paged.lengths).tolist() == [[4, 12], [4, 6]]  # row 1 has 6 real tokens
    # pages: per row, ceil((4 + 2) / 4) + ceil((12 + 2) / 4) = 2 + 4
    assert paged.k_pages.shape[0] == 2 * (2 + 4)


@pytest.mark.parametrize("n,axis", [(5, 0), (1, 0), (7, 1), (3, -1), (4, 0)])
def test_small_median_equals_numpy_with_ties(n, axis):
    """The sort-free median against numpy's, on values with many ties (drawn from 4 levels) and distinct ones."""
    rng = np.random.default_rng(n)
    shape = [3, 4, 2]
    shape[axis] = n
    for x in (rng.integers(0, 4, shape) / 4, rng.random(shape)):
        x = x.astype(np.float32)
        np.testing.assert_array_equal(np.asarray(small_median(jnp.asarray(x), axis=axis)), np.median(x, axis=axis))
