"""HeteroCache and SyncKV: calibration statistics and clustering on hand-built cases, attended sets against
HF attention, recall correctness against numpy/jnp references, full-budget equality, compile-once, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import kvjax.host_tier as host_tier
from kvjax.api import generate_tokens
from kvjax.artifacts import Artifact, model_identity
from kvjax.cache import AttendContext, new_cache
from kvjax.calibration import attended_set, head_statistics, record_sets, unit_groups
from kvjax.decoding import TRACE_COUNTS, compress, decode_loop, decode_loop_jit, decode_step, prefill, prefill_jit, rehearse_jit
from kvjax.methods.recall.schedules import SpreadRecall, apply_anchors, spread_moves
from kvjax.methods.recall.scores import leader_probs, leader_queries, prompt_only, top_slots
from kvjax.selection import extend_forward
from kvjax.methods import FullCache, HeteroCache, SyncKV
from kvjax.calibration.heterocache import classify_group, star_clustering
from kvjax.calibration.synckv import cluster_group, kmeans
from kvjax.methods.recall.heterocache import head_capacities, spread_capped
from kvjax.paged import build_paged
from kvjax.models import load_model
from tests.tiny import save_tiny

L = 48  # prompt tokens


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama3_hc")
    save_tiny("llama3_rope", str(path), seed=3)
    return load_model(str(path), "float32", tokenizer=False), str(path)


@pytest.fixture(scope="module")
def tiny(tiny_pair):
    return tiny_pair[0]


# 2 layers x 2 KV heads, one cross-layer group: (0,0) leads (0,1) and (1,0); (1,1) is an anchor (HeteroCache).
def hc_artifact(model, model_id=None):
    roles = (("pivot", "satellite"), ("satellite", "anchor"))
    pivot_of = (((-1, -1), (0, 0)), ((0, 0), (-1, -1)))
    meta = (("roles", roles), ("pivot_of", pivot_of), ("stability", ((0.9, 0.5), (0.4, 0.8))), ("group_layers", 2))
    return Artifact(arrays={}, kind="heterocache", model_id=model_id or model_identity(model.config), meta=meta)


def sk_artifact(model, model_id=None):
    lead = (((-1, -1), (0, 0)), ((0, 0), (0, 0)))
    clusters = ((1, (("R", "NR"), ("NR", "NR")), lead),)
    return Artifact(arrays={}, kind="synckv", model_id=model_id or model_identity(model.config),
                    meta=(("clusters", clusters), ("group_layers", 2)))


# ------------------------------------------------------------------------------ calibration pieces
def test_attended_set_finds_a_fixed_target():
    """A query aligned with keys 3 and 9 attends to them most: both are in its top-2 set (pooling kernel 1)."""
    rng = np.random.default_rng(0)
    k = 0.01 * rng.standard_normal((1, 1, 12, 8)).astype(np.float32)
    k[0, 0, 3] = k[0, 0, 9] = 3.0
    q = np.full((1, 2, 8), 3.0, np.float32)  # two query heads on one KV head
    top = attended_set(jnp.asarray(q), jnp.asarray(k), 11, jnp.zeros(1, jnp.int32), topk=2, kernel=1, gqa="mean")
    assert sorted(np.asarray(top)[0, 0].tolist()) == [3, 9]
    # slots after the query and left padding are never attended
    top = attended_set(jnp.asarray(q), jnp.asarray(k), 8, jnp.array([4]), topk=2, kernel=1, gqa="mean")
    assert 9 not in np.asarray(top)[0, 0] and 3 not in np.asarray(top)[0, 0]


def _hf_sets(hf, tokens, positions, topk, kernel=5):
    """Attended sets from HF attention probabilities (eager), group mean, avg pooling (zeros outside, /kernel)."""
    import torch

    with torch.no_grad():
        out = hf(torch.tensor(tokens), output_attentions=True)
    sets = []
    for a in out.attentions:  # [1, Hq, T, T]
        a = a[0].numpy()
        Hq = a.shape[0]
        g = a.reshape(2, Hq // 2, *a.shape[1:]).mean(axis=1)  # [Hkv, T, T]
        per_pos = []
        for p in positions:
            row = g[:, p, :p + 1]
            padded = np.pad(row, ((0, 0), (kernel // 2, kernel // 2)))
            pooled = np.stack([padded[:, i:i + kernel].sum(1) / kernel for i in range(p + 1)], axis=1)
            per_pos.append([set(np.argsort(-pooled[h], kind="stable")[:topk].tolist()) for h in range(2)])
        sets.append(per_pos)
    return sets  # [layer][position][head] -> set


def test_recorded_sets_match_hf_attention(tiny_pair):
    """The prefill set (last prompt query) and the first decode step's set equal those from HF's attention."""
    model, path = tiny_pair
    rng = np.random.default_rng(1)
    row = rng.integers(0, 97, size=40).tolist()
    (prefill_sets, step_sets), = record_sets(model, [row], decode_steps=2, topk=8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    import torch

    with torch.no_grad():
        first = int(hf(torch.tensor([row])).logits[0, -1].argmax())
    ref = _hf_sets(hf, [row + [first]], [39, 40], topk=8)
    for layer in range(2):
        for h in range(2):
            assert set(prefill_sets[layer, h].tolist()) == ref[layer][0][h]
            assert set(step_sets[0, layer, h].tolist()) == ref[layer][1][h]


def test_statistics_on_hand_built_sets():
    """Head 0 keeps its prefill set (stable); heads 1 and 2 share sets that move every step (similar, unstable)."""
    k = 4
    prefill = np.array([[[0, 1, 2, 3], [10, 11, 12, 13], [10, 11, 12, 13]]])  # [L=1, H=3, k]
    steps = np.stack([
        np.array([[[0, 1, 2, 3], [10, 11, 20, 21], [10, 11, 20, 21]]]),
        np.array([[[0, 1, 2, 3], [10, 30, 31, 32], [10, 30, 31, 32]]]),
        np.array([[[0, 1, 2, 3], [40, 41, 42, 43], [40, 41, 42, 43]]]),
    ])  # [T=3, L, H, k]
    stats = head_statistics([(prefill, steps)], topk=k, group_layers=1)
    np.testing.assert_allclose(stats.stability[0], [1.0, 0.25, 0.25])  # medians of (1,1,1) and (0.5, 0.25, 0)
    np.testing.assert_allclose(stats.similarity[0], [0.0, 1.0, 1.0])
    np.testing.assert_allclose(stats.sim_mean[0], [[1, 0, 0], [0, 1, 1], [0, 1, 1]])
    roles, leader = classify_group(stats.stability[0], stats.sim_median[0], tau_sim=0.5, tau_stable=0.5)
    assert roles == ["anchor", "pivot", "satellite"] and leader == [-1, -1, 1]
    roles, rep = cluster_group(stats.sim_mean[0], 2)
    assert roles.count("R") == 2 and rep[1] == rep[2] and rep[0] == 0


def test_unit_groups_span_adjacent_layers():
    assert unit_groups(3, 2, 2) == [[(0, 0), (0, 1), (1, 0), (1, 1)], [(2, 0), (2, 1)]]
    with pytest.raises(ValueError, match="group_layers"):
        unit_groups(3, 2, 0)


def test_star_clustering_hand_case():
    adj = np.zeros((6, 6), bool)
    for i, j in [(0, 1), (0, 2), (3, 4), (4, 5), (3, 5), (2, 5)]:
        adj[i, j] = adj[j, i] = True
    # degrees: 0:2 1:1 2:2 3:2 4:2 5:3 -> pivot 5 takes 2,3,4; then 0 (free neighbour 1) takes 1
    assert star_clustering(adj) == [(5, [2, 3, 4]), (0, [1])]
    assert star_clustering(np.zeros((3, 3), bool)) == []


def test_kmeans_separates_clear_clusters_deterministically():
    x = np.array([[0, 0], [0.1, 0], [0, 0.2], [10, 10], [10.2, 10]], np.float32)
    a1, c1 = kmeans(x, 2, seed=0)
    a2, _ = kmeans(x, 2, seed=0)
    np.testing.assert_array_equal(a1, a2)
    assert a1[0] == a1[1] == a1[2] != a1[3] == a1[4]
    with pytest.raises(ValueError, match="k-means"):
        kmeans(x, 6)


def test_representative_is_closest_to_centroid():
    # heads 0-2 similar (0 most central), heads 3-4 similar
    S = np.array([[1, .9, .9, 0, 0], [.9, 1, .6, 0, 0], [.9, .6, 1, 0, 0], [0, 0, 0, 1, .8], [0, 0, 0, .8, 1]])
    roles, rep = cluster_group(S, 2)
    assert rep[:3] == [0, 0, 0] and rep[3] == rep[4] and roles[0] == "R"


def test_inverse_stability_capacities_hand_case():
    stab = [[0.9, 0.5, 1.0, 0.25]]
    full = [[True, False, False, False]]
    caps, base = head_capacities(stab, full, 0.5, 100)
    # base = (0.5*4 - 1) * 100 / 3 = 33.33; w = 2, 1, 4 normalised to mean 1 -> 6/7, 3/7, 12/7
    assert base == 33 and caps == [[100, 28, 14, 57]]
    caps, _ = head_capacities(stab, full, 0.5, 100, allocation=False)
    assert caps == [[100, 33, 33, 33]]
    with pytest.raises(ValueError, match="needs budget > 0.250"):
        head_capacities(stab, full, 0.25, 100)
    caps, _ = head_capacities(stab, full, 1.0, 100)  # capped shares give their excess to the others
    assert caps == [[100, 100, 100, 100]]
    np.testing.assert_allclose(spread_capped(300, np.array([6, 3, 12]) / 7, 100), [100, 100, 100])


def test_leader_picks_hand_case():
    """A leader whose query matches stored positions 2, 5, 7 picks those prompt slots (shifted by the row's padding)."""
    D = 8
    k = 0.01 * np.random.default_rng(2).standard_normal((1, 1, 12, D)).astype(np.float32)
    for j in (2, 5, 7, 10):
        k[0, 0, j] = 2.0
    idx = jnp.arange(12, dtype=jnp.int32)[None, None]
    paged = build_paged(jnp.asarray(k), jnp.asarray(k), idx, jnp.array([[12]]), (12,), 0, 4)
    q = jnp.full((1, 1, 2, D), 2.0)  # two query heads on the one KV head
    scores = leader_probs(paged, (0,), leader_queries(q, (0,), 1), 1, "max")[:, :, -1]
    picks = top_slots(prompt_only(scores, jnp.array([10])), jnp.array([3]), 3)  # position 10 is not prompt
    assert sorted(np.asarray(picks)[0, 0].tolist()) == [3 + 2, 3 + 5, 3 + 7]


def _extend_forward_numpy(x, lookahead):
    """Each position's value raised to the largest of the ``lookahead`` before it (last axis)."""
    return np.stack([x[..., max(0, j - lookahead):j + 1].max(-1) for j in range(x.shape[-1])], -1)


def test_extend_forward_hand_case():
    """A peak at position 5 of 12, and a smaller one at 1: with look-ahead 3, positions 5-8 score the peak, 1-4 the
    smaller one (position 4 is within 3 after 1), 9-11 are back to their own; -inf (unseen) stays -inf."""
    x = np.array([0.0, 0.5, 0.1, 0.0, 0.0, 0.9, 0.0, 0.2, 0.0, 0.0, 0.3, -np.inf], np.float32)
    got = np.asarray(extend_forward(jnp.asarray(x)[None, None], 3))[0, 0]
    want = [0.0, 0.5, 0.5, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9, 0.2, 0.3, 0.3]
    np.testing.assert_array_equal(got, np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(extend_forward(jnp.asarray(x), 0)), x)


def _leader_probs_numpy(k, lengths, heads, qg, kernel, gqa, lookahead=0):
    """float64 reference of :func:`leader_probs` from each head's stored keys ``k[B, Hkv, S, D]`` in order."""
    B, T, n, G, D = qg.shape
    S = k.shape[2]
    out = np.full((B, n, T, S), -np.inf)
    for b in range(B):
        for i, h in enumerate(heads):
            for t in range(T):
                seen = lengths[b, h] - (T - 1 - t)
                p = np.zeros((G, S))
                for g in range(G):
                    s = k[b, h, :seen].astype(np.float64) @ qg[b, t, i, g].astype(np.float64) / np.sqrt(D)
                    e = np.exp(s - s.max())
                    p[g, :seen] = e / e.sum()
                half = kernel // 2
                padded = np.pad(p, ((0, 0), (half, half)))
                pooled = np.stack([padded[:, j:j + kernel].sum(-1) / kernel for j in range(S)], -1)
                agg = pooled.max(0) if gqa == "max" else pooled.mean(0)
                out[b, i, t, :seen] = _extend_forward_numpy(agg[:seen], lookahead)
    return out


@pytest.mark.parametrize("T,gqa,path,lookahead", [(1, "max", "matmul", 0), (1, "max", "multiply_reduce", 0),
                                                   (1, "mean", "multiply_reduce", 0), (1, "max", "kernel", 0),
                                                   (3, "max", "matmul", 0), (3, "mean", "multiply_reduce", 0),
                                                   (1, "max", "matmul", 4), (3, "max", "matmul", 2)])
def test_leader_probs_match_numpy(T, gqa, path, lookahead):
    """The leaders' pooled attention over their paged keys, one query (a decode step) and several (a multi-token
    call), as a matmul (this CPU's default), as a multiply-reduce (a GPU's for one query) and through the paged-scores
    kernel (a TPU's for one query; its TPU form interpreted here): ragged lengths, a leader that is not head 0, pages
    not aligned to the lengths; extended forward (``lookahead``) only over the positions a query saw."""
    rng = np.random.default_rng(T)
    B, H, S, D, G, heads = 2, 3, 21, 8, 2, (2, 0)
    k = rng.standard_normal((B, H, S, D)).astype(np.float32)
    lengths = np.array([[21, 9, 17], [13, 21, 6]], np.int32)
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, H, S))
    paged = build_paged(jnp.asarray(k), jnp.asarray(k), idx, jnp.asarray(lengths), (S,) * H, 0, 4)
    qg = rng.standard_normal((B, T, len(heads), G, D)).astype(np.float32)
    how = {"matmul": dict(multiply_reduce=False), "multiply_reduce": dict(multiply_reduce=True),
           "kernel": dict(implementation="pallas_interpret")}[path]
    got = np.asarray(leader_probs(paged, heads, jnp.asarray(qg), 3, gqa, lookahead=lookahead, **how))
    want = _leader_probs_numpy(np.pad(k, ((0, 0), (0, 0), (0, got.shape[-1] - S), (0, 0))), lengths, heads, qg, 3,
                               gqa, lookahead)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(np.where(np.isinf(want), 0, got), np.where(np.isinf(want), 0, want), rtol=1e-5,
                               atol=1e-7)


# --------------------------------------------------------------------------------- runtime
def _prefilled(model, method, tokens, artifact, room=8):
    cache = new_cache(method, model.config, tokens.shape[0], tokens.shape[1], room, model.dtype, artifact=artifact)
    _, cache = prefill(model.graphdef, model.params, jnp.asarray(tokens), cache)
    return compress(cache)


def _held_rows(state, b, h):
    """Rows a head holds, in storage order: ``[lengths, D]``."""
    p = state.paged
    n = int(p.lengths[b, h])
    return np.asarray(p.k_pages[p.block_table[b, h]]).reshape(-1, p.k_pages.shape[-1])[:n]


@pytest.mark.parametrize("which,schedule", [("heterocache", "whole"), ("heterocache-reanchor", "whole"),
                                            ("heterocache-pivot", "whole"), ("synckv", "whole"),
                                            ("heterocache", "pipelined"), ("synckv", "spread"), ("synckv", "pipelined")])
def test_budget_one_equals_full_cache_under_chunk_padding_and_ragged_batch(tiny, which, schedule):
    rng = np.random.default_rng(11)
    rows = [list(rng.integers(0, 97, size=40)), list(rng.integers(0, 97, size=20))]
    full, _, _, _ = generate_tokens(tiny, rows, method=FullCache(block=16), max_new_tokens=8)
    if which.startswith("heterocache"):
        method = HeteroCache(budget=1.0, block=16, window=2, tau_drift=1.0, recall_schedule=schedule,
                             reanchor=which.endswith("reanchor"), prefill_from_pivot=which.endswith("pivot"))
        art = hc_artifact(tiny)
    else:
        method = SyncKV(budget=1.0, block=16, stride=2, num_representatives=1, recall_schedule=schedule)
        art = sk_artifact(tiny)
    for chunk in (None, 32):
        got, _, cache, _ = generate_tokens(tiny, rows, method=method, max_new_tokens=8, chunk_size=chunk, artifact=art)
        np.testing.assert_array_equal(got, full, err_msg=f"chunk_size={chunk}")
        assert cache.stats()["recall_events"] > 0  # refreshes happened and changed nothing at a full budget
    # a question after compression at a full budget equals the question inside the prompt
    question = [list(rng.integers(0, 97, size=5)) for _ in rows]
    ref, _, _, _ = generate_tokens(tiny, [r + q for r, q in zip(rows, question)], method=FullCache(block=16),
                                   max_new_tokens=5)
    got, _, _, _ = generate_tokens(tiny, rows, method=method, max_new_tokens=5, question_rows=question, artifact=art)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("which", ["heterocache", "synckv"])
def test_token_budget_above_the_prompt_keeps_it_whole(tiny, which):
    """A budget of 60 tokens per head on rows of 40 and 20 tokens keeps every row whole: the full cache's tokens,
    and the statistics say why."""
    rng = np.random.default_rng(13)
    rows = [list(rng.integers(0, 97, size=40)), list(rng.integers(0, 97, size=20))]
    full, _, _, _ = generate_tokens(tiny, rows, method=FullCache(block=16), max_new_tokens=8)
    if which == "heterocache":
        method, art = HeteroCache(budget=60, block=16, window=2, tau_drift=1.0), hc_artifact(tiny)
    else:
        method, art = SyncKV(budget=60, block=16, stride=2, num_representatives=1), sk_artifact(tiny)
    got, _, cache, _ = generate_tokens(tiny, rows, method=method, max_new_tokens=8, artifact=art)
    np.testing.assert_array_equal(got, full)
    assert cache.stats()["budget_note"] == ("budget of 60 tokens per head is above the prompt's 40 tokens: "
                                            "the whole prompt is kept")


def test_heterocache_recall_writes_the_pivots_picks(tiny):
    """Drift forced every step: each satellite's first slots then hold exactly the host rows of its pivot's picks
    (same-layer and cross-layer satellites), checked in numpy; the host rows are the prompt's K (full cache's,
    up to f32 rounding of a differently fused prefill); the anchor never changes."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 97, size=(1, L + 3)).astype(np.int32)
    method = HeteroCache(budget=0.6, block=16, window=1, tau_drift=1.0)
    cache = _prefilled(tiny, method, tokens[:, :L], hc_artifact(tiny))
    full = _prefilled(tiny, FullCache(block=16), tokens[:, :L], None)
    anchor_before = _held_rows(cache.layers[1], 0, 1)
    key = jax.random.PRNGKey(0)
    for t in range(L, L + 2):
        _, _, cache = decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, t]), cache, key)
    picks = np.asarray(cache.layers[0].picks)[0, 0]
    assert int(cache.layers[0].version[0, 0]) == 2
    for layer, head in [(0, 1), (1, 0)]:
        st = cache.layers[layer]
        count = int(st.region_count[0, [f.head for f in st.plan.followers].index(head)])
        held = _held_rows(st, 0, head)
        host_k = np.asarray(st.host.k)[st.host.heads.index((0, head))]
        np.testing.assert_array_equal(held[:count], host_k[picks[:count]])
        np.testing.assert_allclose(host_k[:L], np.asarray(full.layers[layer].k)[0, head, :L], atol=1e-6)
    np.testing.assert_array_equal(_held_rows(cache.layers[1], 0, 1)[:len(anchor_before)], anchor_before)
    s = cache.stats()
    assert s["recall_events"] == 4 and s["rows_recalled"] > 0 and s["host_bytes"] > 0
    assert s["decode_steps"] == 2 and s["recall_trigger_rate"] == 1.0  # both satellites refreshed at both steps


def test_spread_moves_hand_case():
    """Held [10, 11, 12, 13], choice [12, 20, 10, 21] (best first): the missing 20, 21 replace the dropped 11, 13
    at positions 1, 3, ``ceil(4 / m)`` per step; entries past ``count`` are ignored; nothing missing: no moves."""
    held = jnp.asarray([[[10, 11, 12, 13]]], jnp.int32)
    target = jnp.asarray([[[12, 20, 10, 21]]], jnp.int32)
    four = jnp.asarray([[4]], jnp.int32)

    def moves(held, target, count, m):
        ids, pos, n = (np.asarray(x)[0, 0] for x in spread_moves(held, target, count, m, 32))
        return ids[:n].tolist(), pos[:n].tolist()

    assert moves(held, target, four, 2) == ([20, 21], [1, 3])
    assert moves(held, target, four, 4) == ([20], [1])
    assert moves(jnp.asarray([[[10, 20, 12, 13]]]), target, four, 4) == ([21], [3])
    assert moves(held, target, jnp.asarray([[3]], jnp.int32), 1) == ([20], [1])  # 21 and 13 are past count
    assert moves(target, target, four, 1) == ([], [])
    # several followers padded to one width: ``most`` caps each one's moves (1 for the first, 2 for the second)
    both = jnp.concatenate([held, held], axis=1)
    ids, pos, n = (np.asarray(x)[0] for x in spread_moves(both, jnp.concatenate([target, target], axis=1),
                                                            jnp.asarray([[4, 4]], jnp.int32), 2, 32,
                                                            jnp.asarray([[1, 2]], jnp.int32)))
    assert n.tolist() == [1, 2] and ids[0, :1].tolist() == [20] and ids[1].tolist() == [20, 21]
    assert pos[0, :1].tolist() == [1] and pos[1].tolist() == [1, 3]


@pytest.mark.parametrize("which,schedule", [("heterocache", "spread"), ("synckv", "spread"), ("heterocache", "pipelined"),
                                            ("synckv", "pipelined"), ("synckv", "pipelined-kernel")])
def test_spread_recall_reaches_the_leaders_choice_without_duplicates(tiny, which, schedule):
    """``recall_schedule="spread"`` with a new choice every m=3 steps: m steps after it, each follower's region
    holds exactly the host rows of its leader's choice (matched to host rows in numpy, as a set, no row twice),
    same-layer and cross-layer followers; after the first of those steps only part of it. ``"pipelined"`` holds the
    same once the next call has chosen them (from the loop carry, before its layers) and written them
    (after its layers), and not before; also when it writes them with the row-write kernel (``"pipelined-kernel"``:
    the method's implementation ``"pallas_interpret"``, the kernel's GPU form interpreted)."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 97, size=(1, L + 6)).astype(np.int32)
    implementation = "pallas_interpret" if schedule == "pipelined-kernel" else "auto"
    schedule = schedule.removesuffix("-kernel")
    if which == "heterocache":
        method = HeteroCache(budget=0.5, block=16, window=3, tau_drift=1.0, recall_schedule=schedule,
                             implementation=implementation)
        art, followers = hc_artifact(tiny), [(0, 1), (1, 0)]
    else:
        method = SyncKV(budget=0.5, block=16, stride=3, num_representatives=1, recall_schedule=schedule,
                        implementation=implementation)
        art, followers = sk_artifact(tiny), [(0, 1), (1, 0), (1, 1)]
    cache = _prefilled(tiny, method, tokens[:, :L], art)
    key = jax.random.PRNGKey(0)

    def written(layers):  # every move chosen so far (pipelined: that the carry implies) written
        if schedule != "pipelined":
            return list(layers)
        return method.schedule.write_moves(*method.schedule.gather_moves(layers, None, drain=False), None)

    def regions(state, landed=True):  # {follower: set of prompt slots its region holds}, no token held twice
        out = {}
        layers = written(state.layers) if landed else state.layers
        for layer, head in followers:
            st = layers[layer]
            i = [f.head for f in st.plan.followers].index(head)
            start, count = int(st.region_start[0, i]), int(st.region_count[0, i])
            host_k = np.asarray(st.host.k)[st.host.heads.index((0, head))]
            region = _held_rows(st, 0, head)[start:start + count]
            out[layer, head] = [int(np.flatnonzero((host_k == row).all(-1))[0]) for row in region]
            assert len(set(out[layer, head])) == count, f"a token held twice by {(layer, head)}"
        return {f: set(x) for f, x in out.items()}

    per_step = {}
    for t in range(L, L + 5):  # the leader publishes at the 3rd step; the followers move at the 3rd, 4th, 5th
        _, _, cache = decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, t]), cache, key)
        per_step[t - L + 1] = regions(cache)
        if schedule == "pipelined" and t - L + 1 == 3:  # the choice at the 3rd step, its moves not yet chosen
            assert regions(cache, landed=False) == per_step[2]
        if schedule == "pipelined" and t - L + 1 == 4:  # chosen before the 4th step's layers, written after them
            assert regions(cache, landed=False) == per_step[3]
    assert int(cache.layers[0].version[0, 0]) == 1  # one choice, published at the 3rd step
    picks = np.asarray(cache.layers[0].picks)[0, 0]
    changed = 0
    for f in followers:
        want = set(picks[:len(per_step[5][f])].tolist())
        width = min(cache.layers[f[0]].held.shape[-1], len(picks))  # the most a region or a choice holds
        moves = -(-width // 3)  # ceil(W / m) per step
        assert per_step[2][f] == per_step[1][f]  # nothing moves before the first choice
        before = len(per_step[2][f] - want)  # tokens the choice drops
        assert len(per_step[3][f] - want) == max(0, before - moves)  # after one step: up to ceil(W / m) moved
        assert per_step[5][f] == want  # after m steps: exactly the choice
        changed += before
    assert changed > 0 and cache.replace(layers=tuple(written(cache.layers))).stats()["rows_recalled"] == changed


def test_pipelined_moves_of_every_layer_at_once_equal_each_layers_own(tiny):
    """``recall_schedule="pipelined"`` chooses every layer's moves in one padded batch (layer 0 has one follower,
    layer 1 two) and gathers them in one host computation: per layer, the same moves, region slots, held tokens,
    versions and counters as the layer-by-layer spread step on the same states, and the gathered rows are the host
    rows of the moved tokens (numpy)."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 97, size=(1, L + 3)).astype(np.int32)
    method = SyncKV(budget=0.5, block=16, stride=3, num_representatives=1, recall_schedule="pipelined")
    cache = _prefilled(tiny, method, tokens[:, :L], sk_artifact(tiny))
    key = jax.random.PRNGKey(0)
    for t in range(L, L + 3):  # the leader's choice at the 3rd step
        _, _, cache = decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, t]), cache, key)
    layers = cache.layers
    assert [len(st.plan.followers) for st in layers] == [1, 2]
    batched, (moving, block, dsts) = method.schedule.gather_moves(layers, None, drain=False)
    assert moving == [0, 1]
    moved_any, at = 0, 0
    for i, st in enumerate(layers):
        own, ids, count, dst = SpreadRecall(method.schedule.every).moves(st, layers, i, None)
        n = np.asarray(count)
        np.testing.assert_array_equal(np.asarray(dsts[i]), np.asarray(dst))  # -1 past each follower's moves
        rows = np.asarray(block)[at:at + 2 * ids.size].reshape(2, *ids.shape, -1)  # keys then values
        at += 2 * ids.size
        for h in range(len(n)):
            for x, host in enumerate((st.host.k, st.host.v)):
                np.testing.assert_array_equal(rows[x, h, :n[h]], np.asarray(host)[h][np.asarray(ids)[h, :n[h]]])
                assert not rows[x, h, n[h]:].any()  # zero past the moves
        for field in ("held", "applied", "recalls", "rows_moved"):
            np.testing.assert_array_equal(np.asarray(getattr(batched[i], field)), np.asarray(getattr(own, field)))
        moved_any += int(n.sum())
    assert moved_any > 0


# Leaders in both layers, two in layer 0 and one in layer 1, each publishing for followers of different widths.
def hc_two_layer_artifact(model):
    roles = (("pivot", "pivot"), ("pivot", "satellite"))
    pivot_of = (((-1, -1), (-1, -1)), ((-1, -1), (0, 1)))
    meta = (("roles", roles), ("pivot_of", pivot_of), ("stability", ((0.9, 0.5), (0.4, 0.8))), ("group_layers", 2))
    return Artifact(arrays={}, kind="heterocache", model_id=model_identity(model.config), meta=meta)


def sk_two_layer_artifact(model):
    lead = (((-1, -1), (-1, -1)), ((-1, -1), (0, 1)))
    clusters = ((1, (("R", "R"), ("R", "NR")), lead),)
    return Artifact(arrays={}, kind="synckv", model_id=model_identity(model.config),
                    meta=(("clusters", clusters), ("group_layers", 2)))


@pytest.mark.parametrize("which", ["heterocache", "synckv"])
def test_pipelined_decisions_after_the_layers_equal_each_layers_own(tiny, monkeypatch, which):
    """``recall_schedule="pipelined"`` lets the leaders of every layer decide after the layers, side by side (two
    leaders in layer 0, one in layer 1, picks of different widths): the same tokens, versions, picks, trackers and
    follower slots, step by step, as each layer deciding in its own call (the schedule told to decide in the
    layers), with decisions published in both layers."""
    if which == "heterocache":
        method = HeteroCache(budget=0.85, block=16, window=2, tau_drift=0.9, recall_schedule="pipelined")
        art = hc_two_layer_artifact(tiny)
    else:
        method = SyncKV(budget=0.85, block=16, stride=2, num_representatives=1, recall_schedule="pipelined")
        art = sk_two_layer_artifact(tiny)
    tokens = np.random.default_rng(21).integers(0, 97, size=(2, L)).astype(np.int32)
    key = jax.random.PRNGKey(0)

    def run():
        cache = _prefilled(tiny, method, tokens, art)
        assert [len(st.plan.leaders) for st in cache.layers] == [2, 1]
        out, states, nxt = [], [], jnp.asarray(tokens[:, -1])
        for _ in range(6):
            nxt, _, cache = decode_step(tiny.graphdef, tiny.params, nxt, cache, key)
            out.append(np.asarray(nxt))
            states.append([{f: np.asarray(x) for f, x in (("version", st.version), ("picks", st.picks),
                                                           ("held", st.held), ("applied", st.applied))}
                           | {f"tracker.{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(st.tracker))}
                           for st in cache.layers])
        return out, states

    after, after_states = run()
    from kvjax.methods.recall.schedules import PipelinedRecall

    monkeypatch.setattr(PipelinedRecall, "decides_after_layers", False)
    jax.clear_caches()  # the jitted calls read the schedule when traced: trace them again, and after the test
    try:
        inside, inside_states = run()
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    np.testing.assert_array_equal(np.stack(after), np.stack(inside))
    for step, (a, b) in enumerate(zip(after_states, inside_states)):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert x.keys() == y.keys()
            for f in x:
                np.testing.assert_array_equal(x[f], y[f], err_msg=f"step {step}, layer {layer}, {f}")
    assert all((layer["version"] > 0).any() for layer in after_states[-1])  # both layers' leaders published


@pytest.mark.parametrize("schedule,reanchor", [("whole", True), ("whole", False), ("spread", True)])
def test_synckv_recall_moves_the_dynamic_set_not_the_whole_capacity(tiny, monkeypatch, schedule, reanchor):
    """A one-token decode step's host transfer is as wide as what a follower refreshes: its dynamic set (whole
    schedule) or ceil(dynamic / m) rows (spread), not its whole capacity (static + dynamic), with or without
    re-anchoring. Only a re-anchoring (applied outside one-token steps) moves the whole kept set. A recall that moved
    the capacity produced the same tokens (the extra rows were masked) at twice the bytes."""
    widths = []
    real = host_tier.recall  # every follower gather goes through it (host_tier.issue)

    def recording(host, idx, count, **kw):
        widths.append(idx.shape[-1])
        return real(host, idx, count, **kw)

    monkeypatch.setattr(host_tier, "recall", recording)
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, 97, size=(1, L)).astype(np.int32)
    method = SyncKV(budget=0.5, block=16, stride=3, num_representatives=1, static_ratio=0.5, recall_schedule=schedule,
                    reanchor=reanchor)
    cache = _prefilled(tiny, method, tokens, sk_artifact(tiny))
    st = cache.layers[0]
    dynamic = int(st.region_count[0, 0])
    capacity = st.plan.capacities[1]  # the NR-head's static + dynamic tokens
    D = tiny.config.head_dim
    q, k, v = (jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in [(1, 1, 4, D), (1, 1, 2, D), (1, 1, 2, D)])
    ctx = AttendContext(start=cache.length, pad=cache.pad, positions=jnp.array([[L]]), layers=cache.layers, layer=0)
    _, after = method.decode_attend(st, q, k, v, ctx)
    want = dynamic if schedule == "whole" else -(-dynamic // 3)
    assert 0 < dynamic < capacity  # a static part exists: moving the capacity would be wider
    assert widths == [want]
    if reanchor:
        apply_anchors(after, (after, *cache.layers[1:]), 0, None)
        assert widths == [want, capacity]


def _ref_attention(q, k, v):
    """Softmax attention of ``q[G, D]`` over ``k, v[n, D]`` (numpy, f64)."""
    s = q.astype(np.float64) @ k.T.astype(np.float64) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)


@pytest.mark.parametrize("lookahead", [0, 3])
def test_synckv_recall_every_step_equals_attention_over_static_and_recalled(tiny, lookahead):
    """stride=1: the R-head picks the best prompt tokens outside the static set (numpy reference on its softmax,
    extended ``lookahead`` positions forward); the NR-head then attends exactly over static ∪ picked ∪ new tokens
    (numpy reference attention)."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 97, size=(1, L)).astype(np.int32)
    method = SyncKV(budget=0.5, block=16, stride=1, num_representatives=1, static_ratio=0.5, lookahead=lookahead)
    cache = _prefilled(tiny, method, tokens, sk_artifact(tiny))
    full = _prefilled(tiny, FullCache(block=16), tokens, None)
    kf, vf = np.asarray(full.layers[0].k)[0], np.asarray(full.layers[0].v)[0]  # [H, S, D]
    st = cache.layers[0]
    D = kf.shape[-1]
    nr_rows = _held_rows(st, 0, 1)
    held_slots = [int(np.argmin(np.abs(kf[1, :L] - r).sum(-1))) for r in nr_rows]
    static = held_slots[:int(st.region_start[0, 0])]
    q1, k1, v1 = (jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in [(1, 1, 4, D), (1, 1, 2, D), (1, 1, 2, D)])
    ctx = AttendContext(start=cache.length, pad=cache.pad, positions=jnp.array([[L]]), layers=cache.layers, layer=0)
    out1, st1 = method.decode_attend(st, q1, k1, v1, ctx)
    # NR-head output of the first step: its initial tokens + the new one
    ref = _ref_attention(np.asarray(q1)[0, 0, 2:], np.concatenate([kf[1, held_slots], np.asarray(k1)[0, 0, 1:]]),
                         np.concatenate([vf[1, held_slots], np.asarray(v1)[0, 0, 1:]]))
    np.testing.assert_allclose(np.asarray(out1)[0, 0, 2:], ref, atol=1e-5)
    # the R-head's picks: top k_dyn of its group-max softmax over prompt + new token, prompt only, static excluded
    kr = np.concatenate([kf[0, :L], np.asarray(k1)[0, 0, :1]])
    s = np.asarray(q1)[0, 0, :2] @ kr.T / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = _extend_forward_numpy((p / p.sum(-1, keepdims=True)).max(0), lookahead)[:L]
    p[static] = -np.inf
    k_dyn = int(st.region_count[0, 0])
    picks = np.asarray(st1.picks)[0, 0, :k_dyn]
    assert set(picks.tolist()) == set(np.argsort(-p, kind="stable")[:k_dyn].tolist())
    assert not set(picks.tolist()) & set(static)
    # second step: the NR-head attends over static ∪ picks ∪ both new tokens
    q2, k2, v2 = (jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in [(1, 1, 4, D), (1, 1, 2, D), (1, 1, 2, D)])
    ctx2 = ctx.replace(start=cache.length + 1, positions=jnp.array([[L + 1]]), layers=(st1,) + cache.layers[1:])
    out2, _ = method.decode_attend(st1, q2, k2, v2, ctx2)
    slots = static + picks.tolist()
    keys = np.concatenate([kf[1, slots], np.asarray(k1)[0, 0, 1:], np.asarray(k2)[0, 0, 1:]])
    vals = np.concatenate([vf[1, slots], np.asarray(v1)[0, 0, 1:], np.asarray(v2)[0, 0, 1:]])
    np.testing.assert_allclose(np.asarray(out2)[0, 0, 2:], _ref_attention(np.asarray(q2)[0, 0, 2:], keys, vals), atol=1e-5)


@pytest.mark.parametrize("reanchor,window,lookahead", [(True, 1, 0), (False, 1, 0), (True, 2, 0), (True, 2, 3)])
def test_synckv_question_reanchors_the_whole_kept_set(tiny, reanchor, window, lookahead):
    """A question (3 tokens) on the compressed cache of a batch whose second row is left-padded: with ``reanchor``
    the R-head redoes Eq. 3-4 for the question's last ``window`` queries (numpy softmax of each over the row's
    prompt and the question tokens it sees, group max, summed over the queries, prompt only): its best ``rho k``
    become the static set and every NR-head, in the R-head's layer (same call) and the next (its own call), then
    holds exactly the host rows of the top ``k`` (best first); with ``lookahead`` each query's scores are first
    extended forward over the tokens it sees. Without it the static half is the prefill's."""
    rng = np.random.default_rng(8)
    pads = (0, 8)
    tokens = rng.integers(1, 97, size=(2, L)).astype(np.int32)
    tokens[1, :pads[1]] = 0
    method = SyncKV(budget=0.5, block=16, num_representatives=1, static_ratio=0.5, reanchor=reanchor,
                    question_window=window, lookahead=lookahead)

    def prefilled(m, art):
        cache = new_cache(m, tiny.config, 2, L, 8, tiny.dtype, artifact=art).replace(pad=jnp.asarray(pads, jnp.int32))
        _, cache = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens), cache)
        return compress(cache)

    cache, full = prefilled(method, sk_artifact(tiny)), prefilled(FullCache(block=16), None)
    st0, st1 = cache.layers
    D = np.asarray(full.layers[0].k).shape[-1]
    q, k, v = (jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in [(2, 3, 4, D), (2, 3, 2, D), (2, 3, 2, D)])
    positions = jnp.asarray([[L - p, L - p + 1, L - p + 2] for p in pads], jnp.int32)
    ctx = AttendContext(start=cache.length, pad=cache.pad, positions=positions, layers=cache.layers, layer=0)
    _, new0 = method.decode_attend(st0, q, k, v, ctx)
    _, new1 = method.decode_attend(st1, q, k, v, ctx.replace(layers=(new0, st1), layer=1))
    for b, pad in enumerate(pads):
        n = L - pad  # the row's real prompt tokens
        kr = np.concatenate([np.asarray(full.layers[0].k)[b, 0, pad:L], np.asarray(k)[b, :, 0]])
        p = np.zeros(n)
        for t in range(3 - window, 3):  # query t of the question sees the prompt and question tokens 0..t
            s = np.asarray(q)[b, t, :2] @ kr[:n + t + 1].T / np.sqrt(D)  # the R-head's (KV head 0) two query heads
            e = np.exp(s - s.max(-1, keepdims=True))
            p += _extend_forward_numpy((e / e.sum(-1, keepdims=True)).max(0), lookahead)[:n]
        n_keep, n_static = int(st0.region_start[b, 0] + st0.region_count[b, 0]), int(st0.region_start[b, 0])
        best = np.argsort(-p, kind="stable")[:n_keep]  # prompt positions; slots are positions + pad
        if reanchor:
            assert np.asarray(new0.tracker.static)[b, 0, :n].nonzero()[0].tolist() == sorted(best[:n_static].tolist())
            for state, head in ((new0, 1), (new1, 0), (new1, 1)):
                host = np.asarray(state.host.k)[state.host.heads.index((b, head))]
                np.testing.assert_array_equal(_held_rows(state, b, head)[:n_keep], host[best + pad])
        else:
            np.testing.assert_array_equal(_held_rows(new0, b, 1)[:n_static], _held_rows(st0, b, 1)[:n_static])
    if reanchor:
        assert int(new0.recalls) == 2 and int(new1.recalls) == 4  # one per follower and row


def _hf_last_query_scores(hf, row, kernel=5):
    """Per layer ``[Hkv, T]``: HF softmax of the last query per query head, average pooling (zeros outside,
    ``/kernel``), max over each KV head's query group."""
    import torch

    with torch.no_grad():
        out = hf(torch.tensor([row]), output_attentions=True)
    scores = []
    for a in out.attentions:  # [1, Hq, T, T]
        last = a[0, :, -1].numpy()  # [Hq, T]
        padded = np.pad(last, ((0, 0), (kernel // 2, kernel // 2)))
        pooled = np.stack([padded[:, i:i + kernel].sum(1) / kernel for i in range(last.shape[1])], axis=1)
        scores.append(pooled.reshape(2, -1, pooled.shape[1]).max(axis=1))
    return scores


@pytest.mark.parametrize("from_pivot", [True, False])
def test_heterocache_prefill_from_pivot_keeps_the_pivots_top_tokens(tiny_pair, from_pivot):
    """``prefill_from_pivot``: after compression each satellite holds the prompt rows of its pivot's top tokens for
    the last prompt query (a same-layer and a cross-layer satellite; a full row and a left-padded one), the
    scores taken from HF's attention; without it, its own top tokens. The anchor keeps its own either way."""
    model, path = tiny_pair
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    rng = np.random.default_rng(14)
    rows = [list(rng.integers(0, 97, size=L)), list(rng.integers(0, 97, size=L - 13))]
    pad = [L - len(r) for r in rows]
    tokens = np.zeros((2, L), np.int32)
    for b, r in enumerate(rows):
        tokens[b, pad[b]:] = r
    method = HeteroCache(budget=0.4, block=16, prefill_from_pivot=from_pivot)
    cache = new_cache(method, model.config, 2, L, 8, model.dtype, artifact=hc_artifact(model))
    _, cache = prefill(model.graphdef, model.params, jnp.asarray(tokens), cache.replace(pad=jnp.asarray(pad, jnp.int32)))
    cache = compress(cache)
    full = FullCache(block=16).init_cache(cache.spec).replace(pad=jnp.asarray(pad, jnp.int32))
    _, full = prefill(model.graphdef, model.params, jnp.asarray(tokens), full)
    whose = {(0, 1): (0, 0) if from_pivot else (0, 1), (1, 0): (0, 0) if from_pivot else (1, 0), (1, 1): (1, 1)}
    differs = False
    for b, row in enumerate(rows):
        ref = _hf_last_query_scores(hf, row)
        for (layer, head), (sl, sh) in whose.items():
            held = _held_rows(cache.layers[layer], b, head)
            top = np.sort(np.argsort(-ref[sl][sh], kind="stable")[:len(held)])  # the top tokens in position order
            assert 0 < len(held) < len(row)
            want = np.asarray(full.layers[layer].k)[b, head, pad[b] + top]
            np.testing.assert_allclose(held, want, atol=1e-5, err_msg=f"row {b}, layer {layer}, head {head}")
            own = np.sort(np.argsort(-ref[layer][head], kind="stable")[:len(held)])
            differs |= not np.array_equal(own, top)
    assert differs == from_pivot  # the option changes what some satellite holds


def test_heterocache_prefill_from_pivot_is_overwritten_by_a_reanchoring_question(tiny):
    """With ``reanchor``, a question asked after compression overwrites every satellite's whole kept set with its
    pivot's choice. Where no satellite sits in a layer before its pivot's (here the pivot is in layer 0), that
    choice does not depend on the satellites' prefill sets, so ``prefill_from_pivot`` generates the same tokens
    there; inside the prompt it generates others (a ragged batch at 40% of the prompt). With a pivot in a later
    layer the rehearsal's choice depends on the earlier satellites' sets: measured, not asserted."""
    rng = np.random.default_rng(15)
    rows = [list(rng.integers(0, 97, size=L)), list(rng.integers(0, 97, size=L - 13))]
    question = [list(rng.integers(0, 97, size=5)) for _ in rows]
    after, inside = {}, {}
    for from_pivot in (False, True):
        method = HeteroCache(budget=0.4, block=16, reanchor=True, prefill_from_pivot=from_pivot)
        after[from_pivot], _, _, _ = generate_tokens(tiny, rows, method=method, max_new_tokens=8, question_rows=question,
                                                     artifact=hc_artifact(tiny))
        inside[from_pivot], _, _, _ = generate_tokens(tiny, [r + q for r, q in zip(rows, question)], method=method,
                                                      max_new_tokens=8, artifact=hc_artifact(tiny))
    np.testing.assert_array_equal(after[True], after[False])
    assert not np.array_equal(inside[True], inside[False])


@pytest.mark.parametrize("schedule", ["whole", "pipelined"])
def test_heterocache_question_rehearsal_reanchors_satellites_before_their_pivot(tiny, schedule):
    """``reanchor``: the pivot sits in layer 1 and leads both heads of layer 0. The question in one pass (the jitted
    call alone) makes the pivot publish its choice for the question even without drift, but layer 0's satellites
    attend with the prefill's tokens; :func:`prefill` rehearses first, so they then hold the host rows of that
    choice. Lengths advance by the question once; without ``reanchor`` there is one pass."""
    roles = (("satellite", "satellite"), ("pivot", "anchor"))
    pivot_of = (((1, 0), (1, 0)), ((-1, -1), (-1, -1)))
    art = Artifact(arrays={}, kind="heterocache", model_id=model_identity(tiny.config),
                   meta=(("roles", roles), ("pivot_of", pivot_of), ("stability", ((0.5, 0.5), (0.9, 0.8))),
                         ("group_layers", 2)))
    # tau 0: the drift test never fires
    method = HeteroCache(budget=0.5, block=16, tau_drift=0.0, reanchor=True, recall_schedule=schedule)
    assert method.question_passes() == 2 and HeteroCache(budget=0.5).question_passes() == 1
    rng = np.random.default_rng(13)
    base = _prefilled(tiny, method, rng.integers(0, 97, size=(1, L)).astype(np.int32), art)
    question = jnp.asarray(rng.integers(0, 97, size=(1, 4)), jnp.int32)
    st = base.layers[0]
    counts = [int(st.region_count[0, i]) for i in range(2)]
    before = [_held_rows(st, 0, h)[:counts[h]] for h in (0, 1)]
    lengths = [np.asarray(s.paged.lengths) for s in base.layers]

    def copy(c):
        return jax.tree_util.tree_map(jnp.copy, c)

    _, one = prefill_jit(tiny.graphdef, tiny.params, question, copy(base))
    _, two = prefill(tiny.graphdef, tiny.params, question, copy(base))
    choice = np.asarray(one.layers[1].picks)[0, 0]  # the pivot's choice for the question (the rehearsal's)
    assert int(one.layers[1].version[0, 0]) == 1 and int(two.layers[1].version[0, 0]) == 2
    for h in (0, 1):
        np.testing.assert_array_equal(_held_rows(one.layers[0], 0, h)[:counts[h]], before[h])
        host = np.asarray(two.layers[0].host.k)[two.layers[0].host.heads.index((0, h))]
        np.testing.assert_array_equal(_held_rows(two.layers[0], 0, h)[:counts[h]], host[choice[:counts[h]]])
    assert not np.array_equal(before[0], _held_rows(two.layers[0], 0, 0)[:counts[0]])
    assert int(two.length) == int(base.length) + 4
    for s, n in zip(two.layers, lengths):
        np.testing.assert_array_equal(np.asarray(s.paged.lengths), n + 4)
    # the recall comes before the question attends: layer 0 with the pivot's choice published (numpy attention
    # of each question query over the chosen host rows and the question tokens it sees)
    st0, D = two.layers[0], np.asarray(two.layers[0].host.k).shape[-1]
    q, k, v = (jnp.asarray(rng.standard_normal(sh).astype(np.float32)) for sh in [(1, 3, 4, D), (1, 3, 2, D), (1, 3, 2, D)])
    ctx = AttendContext(start=base.length, pad=base.pad, positions=jnp.asarray([[L, L + 1, L + 2]]),
                        layers=(base.layers[0], one.layers[1]), layer=0)
    out, _ = method.decode_attend(copy(base.layers[0]), q, k, v, ctx)
    host_k, host_v = (np.asarray(x)[st0.host.heads.index((0, 0))] for x in (st0.host.k, st0.host.v))
    rows = choice[:counts[0]]
    for t in range(3):
        keys = np.concatenate([host_k[rows], np.asarray(k)[0, :t + 1, 0]])
        vals = np.concatenate([host_v[rows], np.asarray(v)[0, :t + 1, 0]])
        np.testing.assert_allclose(np.asarray(out)[0, t, :2], _ref_attention(np.asarray(q)[0, t, :2], keys, vals),
                                   atol=1e-5)


def _r_head_in_layer_1(model):
    """(artifact, prompt [1, L], question [1, 4]): one SyncKV cluster whose R-head, layer 1's head 0, leads both
    heads of layer 0 and layer 1's head 1."""
    lead = (((1, 0), (1, 0)), ((-1, -1), (1, 0)))
    art = Artifact(arrays={}, kind="synckv", model_id=model_identity(model.config),
                   meta=(("clusters", ((1, (("NR", "NR"), ("R", "NR")), lead),)), ("group_layers", 2)))
    rng = np.random.default_rng(12)
    tokens = rng.integers(0, 97, size=(1, L)).astype(np.int32)
    return art, tokens, jnp.asarray(rng.integers(0, 97, size=(1, 4)), jnp.int32)


@pytest.mark.parametrize("schedule", ["whole", "pipelined"])
def test_synckv_question_rehearsal_reanchors_heads_before_their_r_head(tiny, monkeypatch, schedule):
    """The R-head sits in layer 1 and leads both heads of layer 0. A question in one pass leaves layer 0's NR-heads
    holding the prefill's choice while it attends; :func:`prefill` rehearses it first, so they hold the host rows of
    the R-head's question choice (the anchor published in the rehearsal) when it attends. What a layer attended with
    is read from the pass without ``finish_question``; with it, every NR-head ends the call holding the anchor its
    R-head published last (numpy on the host rows). The slot counter and every head's length advance by the question
    only (the rehearsal's tokens are dropped)."""
    art, tokens, question = _r_head_in_layer_1(tiny)
    method = SyncKV(budget=0.5, block=16, num_representatives=1, recall_schedule=schedule)
    assert method.question_passes() == 2 and SyncKV(budget=0.5, reanchor=False).question_passes() == 1
    base = _prefilled(tiny, method, tokens, art)
    st = base.layers[0]
    n_keep = int(st.region_start[0, 0] + st.region_count[0, 0])
    before = [_held_rows(st, 0, h)[:n_keep] for h in (0, 1)]
    lengths = [np.asarray(s.paged.lengths) for s in base.layers]

    def copy(c):
        return jax.tree_util.tree_map(jnp.copy, c)

    def host_rows(cache, h):
        return np.asarray(cache.layers[0].host.k)[cache.layers[0].host.heads.index((0, h))]

    def anchor(cache):
        return np.asarray(cache.layers[1].anchor_picks)[0, 0, :n_keep]

    jax.clear_caches()  # the jitted pass without finish_question
    with monkeypatch.context() as m:
        m.setattr(SyncKV, "finish_question", lambda self, cache: cache)
        _, alone = prefill_jit(tiny.graphdef, tiny.params, question, copy(base))
        rehearsed = rehearse_jit(tiny.graphdef, tiny.params, question, copy(base))
        _, after_rehearsal = prefill_jit(tiny.graphdef, tiny.params, question, copy(rehearsed))
    jax.clear_caches()
    assert int(alone.layers[1].anchor_at[0, 0]) == 1
    for h in (0, 1):
        np.testing.assert_array_equal(_held_rows(alone.layers[0], 0, h)[:n_keep], before[h])
        np.testing.assert_array_equal(_held_rows(rehearsed.layers[0], 0, h)[:n_keep], before[h])
        np.testing.assert_array_equal(_held_rows(after_rehearsal.layers[0], 0, h)[:n_keep],
                                      host_rows(rehearsed, h)[anchor(rehearsed)])
    _, one = prefill_jit(tiny.graphdef, tiny.params, question, copy(base))
    _, two = prefill(tiny.graphdef, tiny.params, question, copy(base))
    for cache in (one, two):
        for h in (0, 1):
            np.testing.assert_array_equal(_held_rows(cache.layers[0], 0, h)[:n_keep], host_rows(cache, h)[anchor(cache)])
    assert not np.array_equal(before[0], _held_rows(two.layers[0], 0, 0)[:n_keep])
    assert int(two.length) == int(base.length) + 4
    for s, n in zip(two.layers, lengths):
        np.testing.assert_array_equal(np.asarray(s.paged.lengths), n + 4)
    assert int(two.layers[1].version[0, 0]) == 2  # published in the rehearsal and again in the call


def test_heterocache_drift_rule_fires_where_the_median_overlap_crosses_the_threshold(tiny):
    """``tau_drift=0.6``, ``window=3``, kernel 1, on hand-built attention: the pivot's keys are ``k_j = (j / 8) u +
    b_j w`` (``u``, ``w`` orthogonal), so a query along ``u`` attends most to the last ``base`` tokens (the reference
    set, set by hand) and one along ``w`` to the ``base`` tokens of largest ``b_j``, built to share exactly half of
    them with the reference (overlap 0.5; along ``u``: 1.0). Queries u, w, u (median 1.0) publish nothing at step 3;
    w, w, u (median 0.5 < 0.6; their mean, 0.67, is not) publish at step 6 and not before; the choice is the last
    query's top prompt tokens."""
    method = HeteroCache(budget=0.6, block=16, window=3, tau_drift=0.6, kernel=1)
    cache = _prefilled(tiny, method, np.random.default_rng(9).integers(0, 97, size=(1, L)).astype(np.int32),
                       hc_artifact(tiny))
    st = cache.layers[0]
    pivot, base = st.plan.leaders[0], st.tracker.base
    D, ps = st.paged.k_pages.shape[-1], st.paged.page_size
    n = int(st.paged.lengths[0, pivot])
    assert n == L and 2 < base < L // 2
    u, w = np.eye(D, dtype=np.float32)[0], np.eye(D, dtype=np.float32)[1]
    ref = np.arange(n - base, n)  # the u-query's top-base set: the last base tokens
    shared = base // 2
    b = np.zeros(n, np.float32)  # the w-query's top-base set: half of ref, then the first tokens
    w_set = np.concatenate([ref[:shared], np.arange(base - shared)])
    b[w_set] = 1.0 + np.arange(base, dtype=np.float32) / base
    keys = (np.arange(n, dtype=np.float32)[:, None] / 8) * u + b[:, None] * w
    pages = np.asarray(st.paged.block_table[0, pivot])
    kp = st.paged.k_pages
    for j in range(n):
        kp = kp.at[pages[j // ps], j % ps].set(jnp.asarray(keys[j]))
    positions = st.tracker.ref.shape[-1]
    ref_mask = np.zeros((1, 1, positions), bool)
    ref_mask[0, 0, ref] = True
    st = st.replace(paged=st.paged.replace(k_pages=kp), tracker=st.tracker.replace(ref=jnp.asarray(ref_mask)))
    Hq = tiny.config.num_heads

    def query(direction):
        return jnp.asarray(np.broadcast_to(4.0 * direction, (1, 1, Hq, D)).copy())

    versions = []
    for step, direction in enumerate([u, w, u, w, w, u], start=1):
        st, = method.lead_one_token([st.replace(steps=jnp.asarray(step, jnp.int32))], [query(direction)], cache.pad,
                                    None)
        versions.append(int(st.version[0, 0]))
    assert versions == [0, 0, 0, 0, 0, 1]
    picks = np.asarray(st.picks)[0, 0]
    want = np.argsort(-np.arange(n), kind="stable")[:len(picks)]  # along u: the latest prompt tokens first
    np.testing.assert_array_equal(picks, want + int(cache.pad[0]))
    np.testing.assert_array_equal(np.asarray(st.tracker.ref)[0, 0], ref_mask[0, 0])  # the u set again
    wider = st.replace(paged=st.paged.replace(block_table=jnp.pad(st.paged.block_table, ((0, 0), (0, 0), (0, 1)))))
    with pytest.raises(ValueError, match="stored positions"):  # leaders side by side need as many positions
        method.lead_one_token([st, wider], [query(u), query(u)], cache.pad, None)


def test_heterocache_drift_overlap_above_chance_hand_computed():
    """Overlaps of a pivot's top-4 sets with its reference set {4..7}, by hand. 8 held tokens: a query whose top set
    is {4..7} overlaps 1, one with {0, 1, 6, 7} 0.5, which is also the overlap of two random 4-sets of 8 (chance
    c = 4 / 8): the paper's overlap 0.5 is not below ``tau_drift`` 0.5, above chance it is 0 and the check fires.
    6 held tokens (top set {0, 1, 4, 5}, c = 4 / 6): overlap 0.5, above chance (0.5 - 2/3) / (1/3) = -0.5. 3 held
    tokens: every held token is in the set (c = 1), 1 as in the paper."""
    from kvjax.methods import get_method, parse_method_spec

    positions = 8
    ref = np.zeros((1, 3, positions), bool)
    ref[0, :, 4:] = True
    scores = np.full((1, 3, 2, positions), -np.inf, np.float32)
    scores[0, 0, 0, 4:] = 1.0                          # held 8: top {4..7}
    scores[0, 0, 1] = [5, 4, 0, 0, 0, 0, 3, 2]         # held 8: top {0, 1, 6, 7}
    scores[0, 1, :, :6] = [4, 3, 0.1, 0.1, 0.5, 0.2]   # held 6: top {0, 1, 4, 5}
    scores[0, 2, :, 5:8] = 1.0                         # held 3
    limits = np.asarray([[[8, 8], [6, 6], [3, 3]]], np.int32)
    paper = HeteroCache(budget=0.5)
    name, options = parse_method_spec("heterocache:budget=0.5:drift_above_chance=true")
    above = get_method(name, **options)
    assert above.drift_above_chance and not paper.drift_above_chance
    _, raw = paper.overlaps(jnp.asarray(scores), jnp.asarray(limits), jnp.asarray(ref), 4)
    _, corrected = above.overlaps(jnp.asarray(scores), jnp.asarray(limits), jnp.asarray(ref), 4)
    np.testing.assert_allclose(np.asarray(raw)[0], [[1.0, 0.5], [0.5, 0.5], [1.0, 1.0]], atol=1e-6)
    np.testing.assert_allclose(np.asarray(corrected)[0], [[1.0, 0.0], [-0.5, -0.5], [1.0, 1.0]], atol=1e-6)
    window = jnp.broadcast_to(jnp.asarray(raw)[..., 1], (5, 1, 3))
    assert not np.asarray(paper.drifted(window, jnp.asarray(5)))[0, 0]
    assert np.asarray(above.drifted(jnp.broadcast_to(jnp.asarray(corrected)[..., 1], (5, 1, 3)), jnp.asarray(5)))[0, 0]


@pytest.mark.parametrize("rehearsals", [0, 2])
def test_synckv_question_rehearsals_count(tiny, rehearsals):
    """``rehearsals=n``: :func:`prefill` runs the question ``n + 1`` times. The R-head (layer 1) re-anchors in each
    pass (its version counts the passes), layer 0's NR-heads end the call holding the host rows of the choice
    published in the last pass, and the tokens are appended once."""
    art, tokens, question = _r_head_in_layer_1(tiny)
    method = SyncKV(budget=0.5, block=16, num_representatives=1, rehearsals=rehearsals)
    assert method.question_passes() == rehearsals + 1
    base = _prefilled(tiny, method, tokens, art)
    st = base.layers[0]
    n_keep = int(st.region_start[0, 0] + st.region_count[0, 0])
    before = _held_rows(st, 0, 0)[:n_keep]
    lengths = [np.asarray(s.paged.lengths) for s in base.layers]
    start = int(base.length)
    _, out = prefill(tiny.graphdef, tiny.params, question, base)  # donates base
    assert int(out.layers[1].version[0, 0]) == rehearsals + 1
    anchor = np.asarray(out.layers[1].anchor_picks)[0, 0, :n_keep]
    host = np.asarray(out.layers[0].host.k)[out.layers[0].host.heads.index((0, 0))]
    np.testing.assert_array_equal(_held_rows(out.layers[0], 0, 0)[:n_keep], host[anchor])
    assert not np.array_equal(_held_rows(out.layers[0], 0, 0)[:n_keep], before)
    assert int(out.length) == start + 4
    for s, n in zip(out.layers, lengths):
        np.testing.assert_array_equal(np.asarray(s.paged.lengths), n + 4)


@pytest.mark.parametrize("which", ["heterocache", "synckv", "synckv-pipelined"])
def test_decode_loop_compiles_once_without_host_callbacks(tiny, which):
    schedule = "pipelined" if which.endswith("pipelined") else "whole"  # pipelined: the loop carries the query
    method, art = ((HeteroCache(budget=0.6, block=16, window=2), hc_artifact(tiny)) if which == "heterocache"
                   else (SyncKV(budget=0.5, block=16, stride=2, num_representatives=1, recall_schedule=schedule),
                         sk_artifact(tiny)))
    tokens = np.random.default_rng(5).integers(0, 97, size=(1, L)).astype(np.int32)
    before = TRACE_COUNTS["decode_loop"]
    for _ in range(2):
        cache = _prefilled(tiny, method, tokens, art, room=6)
        decode_loop(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, -1]), cache, jax.random.PRNGKey(0), max_new_tokens=6)
    assert TRACE_COUNTS["decode_loop"] - before == 1
    cache = _prefilled(tiny, method, tokens, art, room=6)
    text = decode_loop_jit.lower(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, -1]), cache, jax.random.PRNGKey(0),
                                 max_new_tokens=6).as_text()
    assert "callback" not in text.lower()
    assert "_xla_compute_type" in text or "host" in text  # the recall is a host-compute region, not a callback


def test_artifact_and_hyper_parameter_errors(tiny):
    tokens_spec = dict(config=tiny.config, batch=1, prompt_slots=L, room=4, dtype=tiny.dtype)

    def make(method, art):
        return new_cache(method, tokens_spec["config"], 1, L, 4, tiny.dtype, artifact=art)

    with pytest.raises(ValueError, match="made for model"):
        make(HeteroCache(budget=0.5), hc_artifact(tiny, model_id="other-model:123"))
    with pytest.raises(ValueError, match="kind"):
        make(HeteroCache(budget=0.5), sk_artifact(tiny))
    with pytest.raises(ValueError, match="made for model"):
        make(SyncKV(budget=0.5, num_representatives=1), sk_artifact(tiny, model_id="other-model:123"))
    with pytest.raises(ValueError, match="needs budget > 0.250"):
        make(HeteroCache(budget=0.2), hc_artifact(tiny))
    with pytest.raises(ValueError, match="N_r=2 is larger"):
        make(SyncKV(budget=0.5, num_representatives=2), sk_artifact(tiny))
    with pytest.raises(ValueError, match="no heterocache artifact .* none ships with kvjax"):
        make(HeteroCache(budget=0.5), None)
    for bad, match in [(dict(static_ratio=0.0), "static_ratio"), (dict(static_ratio=1.5), "static_ratio"),
                       (dict(num_representatives=0), "N_r"), (dict(stride=0), "stride"),
                       (dict(question_window=0), "question_window"), (dict(rehearsals=-1), "rehearsals"),
                       (dict(recall_schedule="lazy"), "recall_schedule"), (dict(lookahead=-1), "lookahead")]:
        with pytest.raises(ValueError, match=match):
            SyncKV(**bad)
    for bad, match in [(dict(window=0), "window"), (dict(tau_drift=1.5), "tau_drift"), (dict(kernel=4), "kernel"),
                       (dict(rehearsals=-1), "rehearsals"), (dict(recall_schedule="lazy"), "recall_schedule"),
                       (dict(lookahead=2.5), "lookahead")]:
        with pytest.raises(ValueError, match=match):
            HeteroCache(**bad)


def test_few_heads_per_layer_are_detected():
    """2 KV heads per layer with N_r = 2 compresses nothing (reported); cross-layer groups make room."""
    from kvjax.calibration import auto_group_layers, few_heads_warning

    assert "every head is a representative" in few_heads_warning(2, 1, 2)
    assert few_heads_warning(2, auto_group_layers(2), 2) is None
    assert auto_group_layers(2) == 8 and auto_group_layers(3) == 6 and auto_group_layers(8) == 2


def test_method_specs_carry_hyper_parameters():
    from kvjax.methods import get_method, parse_method_spec

    assert parse_method_spec("synckv:stride=10:anticipation=false:static_ratio=0.25") == (
        "synckv", {"stride": 10, "anticipation": False, "static_ratio": 0.25})
    m = get_method("heterocache:retrieval=false:group_layers=1", budget=0.3)
    assert (m.retrieval, m.group_layers, m.budget) == (False, 1, 0.3)
    with pytest.raises(ValueError, match="hyper-parameters are"):
        get_method("synckv:strid=3")
    with pytest.raises(ValueError, match="name:key=value"):
        parse_method_spec("synckv:stride")
