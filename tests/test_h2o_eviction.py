"""H2O with decode-time eviction: a plain-numpy simulation of the policy, full-cache parity while a head has room,
fixed state shapes under ``decode_loop``, errors. The default (append) policy is covered by test_methods_e2e."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kvjax.api import generate_tokens
from kvjax.decoding import TRACE_COUNTS, compress, decode_step, prefill
from kvjax.methods import H2O, FullCache
from kvjax.methods.h2o import H2OKV, h2o_decode_step
from kvjax.paged import PagedKV, build_paged
from kvjax.shared_prefill import cache_for, init_shared_cache
from kvjax.models import load_model
from tests.tiny import save_tiny
from kvjax.cache import CacheSpec, new_cache

L, CHUNK, STEPS, PAD = 24, 8, 9, 6

RECORD: dict = {}
VICTIMS: list = []  # (victim, newest token outside the window) of every simulated eviction
SHARPEN = 15.0  # q and k projections scaled: peaky attention, heavy hitters that are not simply the oldest tokens


@dataclasses.dataclass(frozen=True)
class RecordingH2O(H2O):
    """H2O that copies every attend call's inputs (post-RoPE q, k, v) and output to ``RECORD`` on the host."""

    def prefill_chunk(self, state, q, k, v, ctx):
        out, new = super().prefill_chunk(state, q, k, v, ctx)
        return self.record("prefill", ctx, q, k, v, out), new

    def decode_attend(self, state, q, k, v, ctx):
        out, new = super().decode_attend(state, q, k, v, ctx)
        return self.record("decode", ctx, q, k, v, out), new

    @staticmethod
    def record(phase, ctx, q, k, v, out):
        key = (ctx.layer, phase)

        def save(start, q, k, v, out):
            RECORD[key + (int(start),)] = tuple(np.asarray(x) for x in (q, k, v, out))

        jax.debug.callback(save, ctx.start, q, k, v, out)
        return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random Llama with q and k scaled up: peaky attention makes heavy hitters that are not simply the oldest."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch_model = save_tiny("llama", str(path), seed=11)
    with torch.no_grad():
        for layer in torch_model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    torch_model.save_pretrained(str(path), safe_serialization=True)
    return load_model(str(path), "float32", tokenizer=False)


def batch_tokens(seed):
    tokens = np.random.default_rng(seed).integers(1, 97, size=(2, L + STEPS)).astype(np.int32)
    tokens[1, :PAD] = 0  # row 1 is left-padded
    return tokens, np.asarray([0, PAD], np.int32)


def run(model, method, tokens, pad, steps=STEPS):
    """Chunked prefill, compress, teacher-forced decode; returns (logits [steps, B, V], caches after each step)."""
    cache = new_cache(method, model.config, tokens.shape[0], L, steps, model.dtype).replace(pad=jnp.asarray(pad))
    for i in range(0, L, CHUNK):
        first, cache = prefill(model.graphdef, model.params, jnp.asarray(tokens[:, i:i + CHUNK]), cache)
    cache = compress(cache)
    logits, states = [np.asarray(first)], [jax.tree_util.tree_map(np.asarray, cache.layers)]
    for t in range(L, L + steps - 1):
        _, lg, cache = decode_step(model.graphdef, model.params, jnp.asarray(tokens[:, t]), cache, jax.random.PRNGKey(0))
        logits.append(np.asarray(lg))
        states.append(jax.tree_util.tree_map(np.asarray, cache.layers))  # host copies: the cache is donated next step
    return np.stack(logits), states, cache


# ------------------------------------------------------------------ one step, by hand
def hand_state(pos, acc):
    """One row, one KV head, 4 slots on pages of 2; slot j holds key K[j] and value j * (1, 1)."""
    keys = jnp.asarray([[0.0, 1.0], [1.0, 0.0], [0.0, -1.0], [0.0, 0.5]])
    vals = jnp.arange(4.0)[:, None] * jnp.ones((1, 2))
    paged = build_paged(keys[None, None], vals[None, None], jnp.arange(4, dtype=jnp.int32)[None, None],
                        jnp.asarray([[4]], jnp.int32), (4,), 0, 2)
    pos = jnp.asarray([pos], jnp.int32)
    return H2OKV(paged.replace(lengths=(pos >= 0).sum(-1).astype(jnp.int32)), jnp.asarray([acc], jnp.float32), pos,
                 recent=(2,))


@pytest.mark.parametrize("how, victim, new_acc", [("mean", 1, 0.1), ("max", 2, 0.2)])
def test_one_step_by_hand(how, victim, new_acc):
    """Held slots 0, 5, 7, 8, new token at slot 9, recent window 2 = {8, 9}. Query head 0 is zero (uniform 1/5 over
    the 4 held + new); query head 1 points at slot 5's key (logit 30 / sqrt(2): probability ~1).
    mean: acc + [.1, .6, .1, .1] = [3.1, .8, .9, .1] -> slot 8 (lightest) is recent; evict logical 1 (slot 5).
    max:  acc + [.2, 1., .2, .2] = [3.2, 1.2, 1., .2] -> evict logical 2 (slot 7)."""
    st = hand_state([[0, 5, 7, 8]], [[3.0, 0.2, 0.8, 0.0]])
    q = jnp.asarray([[[0.0, 0.0], [30.0, 0.0]]])
    k_new, v_new = jnp.asarray([[[0.0, 0.0]]]), jnp.asarray([[[7.0, 7.0]]])
    out, new = h2o_decode_step(st, q, k_new, v_new, jnp.int32(9), how)
    # attention before eviction: head 0 averages values 0, 1, 2, 3, 7; head 1 reads slot 5's value (1)
    np.testing.assert_allclose(np.asarray(out)[0], [[2.6, 2.6], [1.0, 1.0]], atol=1e-6)
    want_pos = [0, 5, 7, 8]
    want_pos[victim] = 9
    assert np.asarray(new.pos).tolist() == [[want_pos]]
    added = {"mean": [0.1, 0.6, 0.1, 0.1], "max": [0.2, 1.0, 0.2, 0.2]}[how]
    want_acc = [a + d for a, d in zip([3.0, 0.2, 0.8, 0.0], added)]
    want_acc[victim] = new_acc
    np.testing.assert_allclose(np.asarray(new.acc)[0, 0], want_acc, atol=1e-6)
    k_flat = np.asarray(new.paged.k_pages).reshape(-1, 2)
    v_flat = np.asarray(new.paged.v_pages).reshape(-1, 2)
    np.testing.assert_array_equal(k_flat[victim], [0.0, 0.0])  # overwritten in place (pages 0, 1 hold slots 0..3)
    np.testing.assert_array_equal(v_flat[victim], [7.0, 7.0])
    untouched = [j for j in range(4) if j != victim]
    np.testing.assert_array_equal(v_flat[untouched, 0], untouched)
    assert np.asarray(new.paged.lengths).tolist() == [[4]]


def test_one_step_fills_an_empty_slot_first():
    st = hand_state([[0, -1, 7, 8]], [[0.0, 0.0, 0.5, 0.5]])  # logical slot 1 empty (never attended)
    q = jnp.asarray([[[0.0, 0.0], [0.0, 0.0]]])
    out, new = h2o_decode_step(st, q, jnp.zeros((1, 1, 2)), jnp.full((1, 1, 2), 7.0), jnp.int32(9), "mean")
    np.testing.assert_allclose(np.asarray(out)[0], np.full((2, 2), (0 + 2 + 3 + 7) / 4), atol=1e-6)
    assert np.asarray(new.pos).tolist() == [[[0, 9, 7, 8]]]  # slot 0 (score .25, outside the window) survives
    np.testing.assert_allclose(np.asarray(new.acc)[0, 0], [0.25, 0.25, 0.75, 0.75], atol=1e-6)
    assert np.asarray(new.paged.lengths).tolist() == [[4]]


# ------------------------------------------------------------------ the numpy reference
def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def group(p, hkv, how):
    g = p.reshape(hkv, -1, p.shape[-1])
    return g.mean(1) if how == "mean" else g.max(1)


def simulate(q_pre, k_pre, v_pre, decode, pad, cap, ratio, how):
    """H2O on one row and layer, token by token, in plain numpy.

    q_pre [L, Hq, D], k_pre / v_pre [L, Hkv, D]: the prompt's post-RoPE projections (slots, padding first);
    decode: [(slot, q [Hq, D], k [Hkv, D], v [Hkv, D])] per step. Returns per step (after it) a list over KV heads
    of {slot: accumulated score} of the kept tokens, and the attention outputs [Hq, D] of each step.
    """
    Hq, D = q_pre.shape[1], q_pre.shape[2]
    Hkv = k_pre.shape[1]
    G = Hq // Hkv
    r = int(cap * ratio)
    real = np.arange(pad, L)
    kept, kv = [], []
    for h in range(Hkv):
        col = np.zeros((Hq, L))
        for hq in range(h * G, (h + 1) * G):
            s = q_pre[real, hq] @ k_pre[real, h].T / np.sqrt(D)
            s[np.triu_indices(len(real), 1)] = -np.inf  # causal
            col[hq, real] = softmax(s).sum(0)
        score = group(col[h * G:(h + 1) * G], 1, how)[0]
        forced = [s for s in real if s >= L - r]
        cands = sorted((s for s in real if s < L - r), key=lambda s: (-score[s], s))
        chosen = forced + cands[: cap - len(forced)]
        kept.append({int(s): float(score[s]) for s in chosen})
        kv.append({int(s): (k_pre[s, h], v_pre[s, h]) for s in real})
    history, outs = [{h: dict(kept[h]) for h in range(Hkv)}], []
    for slot, q, k, v in decode:
        out = np.zeros((Hq, D))
        for h in range(Hkv):
            order = sorted(kept[h])
            keys = np.stack([kv[h][s][0] for s in order] + [k[h]])
            vals = np.stack([kv[h][s][1] for s in order] + [v[h]])
            p = softmax(q[h * G:(h + 1) * G] @ keys.T / np.sqrt(D))  # [G, n + 1]
            out[h * G:(h + 1) * G] = p @ vals
            agg = group(p, 1, how)[0]
            for i, s in enumerate(order):
                kept[h][s] += agg[i]
            if len(kept[h]) >= cap:  # full: evict the lightest token outside the recent window
                window = set(sorted(order + [slot])[len(order) + 1 - r:]) if r else set()
                outside = [s for s in order if s not in window]
                victim = min(outside, key=lambda s: kept[h][s])
                VICTIMS.append((victim, max(outside)))
                del kept[h][victim]
            kept[h][slot] = float(agg[-1])
            kv[h][slot] = (k[h], v[h])
        history.append({h: dict(kept[h]) for h in range(Hkv)})
        outs.append(out)
    return history, outs, kv


def recorded(layer, phase, starts):
    return [RECORD[(layer, phase, s)] for s in starts]


@pytest.mark.parametrize("how", ["mean", "max"])
def test_eviction_matches_numpy_simulation(tiny, how):
    cap, ratio = 16, 0.2  # recent window 3, 13 heavy hitters
    method = RecordingH2O(budget=cap, recent_ratio=ratio, gqa=how, block=8, page_size=4, evict_during_decode=True)
    tokens, pad = batch_tokens(0)
    RECORD.clear()
    VICTIMS.clear()
    _, states, cache = run(tiny, method, tokens, pad)
    cfg = tiny.config
    # layer 0's projections do not depend on the cache: they must be the full cache's K/V (independent source)
    full = new_cache(FullCache(block=8), cfg, 2, L, STEPS, tiny.dtype).replace(pad=jnp.asarray(pad))
    _, full = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, :L]), full)
    full = compress(full)
    for t in range(L, L + STEPS - 1):
        _, _, full = decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, t]), full, jax.random.PRNGKey(0))
    k0 = np.concatenate([r[1] for r in recorded(0, "prefill", range(0, L, CHUNK))]
                        + [r[1] for r in recorded(0, "decode", range(L, L + STEPS - 1))], axis=1)
    np.testing.assert_allclose(k0.transpose(0, 2, 1, 3), np.asarray(full.layers[0].k)[:, :, : L + STEPS - 1], atol=1e-5)

    r = int(cap * ratio)
    for layer in range(cfg.num_layers):
        pre = recorded(layer, "prefill", range(0, L, CHUNK))
        q_pre, k_pre, v_pre = (np.concatenate([x[i] for x in pre], axis=1) for i in range(3))
        dec = recorded(layer, "decode", range(L, L + STEPS - 1))
        for b in range(2):
            f64 = lambda x: np.asarray(x, np.float64)
            steps = [(L + i, f64(d[0][b, 0]), f64(d[1][b, 0]), f64(d[2][b, 0])) for i, d in enumerate(dec)]
            history, outs, kv = simulate(f64(q_pre[b]), f64(k_pre[b]), f64(v_pre[b]), steps, pad[b], cap, ratio, how)
            for i, out in enumerate(outs):  # attention over the pre-eviction set + the new token
                np.testing.assert_allclose(dec[i][3][b, 0], out, atol=2e-5, err_msg=f"layer {layer} row {b} step {i}")
            for i, layers in enumerate(states):
                st = layers[layer]
                slot_now = L + i - 1  # newest token after this state (the prompt's last slot after compress)
                for h in range(cfg.num_kv_heads):
                    pos = st.pos[b, h]
                    held = pos >= 0
                    assert held.sum() == cap == st.paged.lengths[b, h], (layer, b, i, h)  # budget stays fixed
                    assert set(range(slot_now - r + 1, slot_now + 1)) <= set(pos[held].tolist())  # recent window kept
                    want = history[i][h]
                    assert sorted(pos[held].tolist()) == sorted(want), (layer, b, i, h)
                    np.testing.assert_allclose(st.acc[b, h][held], [want[s] for s in pos[held]], rtol=1e-4, atol=1e-6)
                    # the stored K/V of each slot is the token it claims to hold (in-place overwrite)
                    ps = st.paged.page_size
                    j = np.flatnonzero(held)
                    flat = st.paged.block_table[b, h, j // ps] * ps + j % ps
                    D = st.paged.k_pages.shape[-1]
                    np.testing.assert_allclose(st.paged.k_pages.reshape(-1, D)[flat], [kv[h][s][0] for s in pos[held]], atol=1e-6)
                    np.testing.assert_allclose(st.paged.v_pages.reshape(-1, D)[flat], [kv[h][s][1] for s in pos[held]], atol=1e-6)
    # the policy is not a sliding window here: some victims are older than the token that just left the window
    assert sum(v != newest for v, newest in VICTIMS) >= 5, VICTIMS
    stats = cache.stats()
    assert stats["evicts_during_decode"] is True and stats["kept_tokens_per_head"] == [[cap, cap]] * cfg.num_layers


def test_logits_equal_full_cache_while_a_head_has_room(tiny):
    """budget 1.0 = 24 slots per head: row 1 (18 real tokens) appends into empty slots for 6 steps -> full cache logits.

    Row 0 is full from the start: its first decode step still attends to every prompt token plus the new one
    (full-cache logits), after which a token is evicted and the logits part from the full cache's.
    """
    tokens, pad = batch_tokens(1)
    steps = PAD + 1
    method = H2O(budget=1.0, block=8, page_size=4, evict_during_decode=True)
    got, states, _ = run(tiny, method, tokens, pad, steps=steps)
    ref, _, _ = run(tiny, FullCache(block=8), tokens, pad, steps=steps)
    np.testing.assert_allclose(got[:, 1], ref[:, 1], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got[:2, 0], ref[:2, 0], atol=2e-5, rtol=1e-5)
    assert np.abs(got[2:, 0] - ref[2:, 0]).max() > 1e-4
    for i, layers in enumerate(states):
        for st in layers:
            assert isinstance(st, H2OKV)
            assert st.paged.lengths[0].tolist() == [L, L]
            assert st.paged.lengths[1].tolist() == [L - PAD + i] * 2
            assert ((st.pos[1] >= 0).sum(-1) == L - PAD + i).all()


def test_default_policy_appends(tiny):
    tokens, pad = batch_tokens(2)
    _, states, cache = run(tiny, H2O(budget=10, block=8, page_size=4), tokens, pad, steps=3)
    assert all(isinstance(st, PagedKV) for st in cache.layers)
    assert states[-1][0].lengths.tolist() == [[12, 12], [12, 12]]  # 10 kept + 2 decoded
    assert not cache.stats().get("evicts_during_decode", False)


def test_decode_loop_one_compilation_fixed_shapes_and_bytes(tiny):
    method = H2O(budget=12, recent_ratio=0.25, block=8, page_size=4, evict_during_decode=True)
    rows = [list(np.random.default_rng(s).integers(1, 97, size=n)) for s, n in [(3, 30), (4, 26)]]
    before = TRACE_COUNTS["decode_loop"]
    out, count, cache, _ = generate_tokens(tiny, rows, method=method, max_new_tokens=10)
    other = [list(np.random.default_rng(s).integers(1, 97, size=n)) for s, n in [(5, 30), (6, 26)]]
    generate_tokens(tiny, other, method=method, max_new_tokens=10)
    assert TRACE_COUNTS["decode_loop"] == before + 1
    streamed, _, cache_steps, _ = generate_tokens(tiny, rows, method=method, max_new_tokens=10, on_token=lambda t: None)
    np.testing.assert_array_equal(out, streamed)  # while_loop == per-step decode
    for a, b in zip(cache.layers, cache_steps.layers):
        np.testing.assert_array_equal(np.asarray(a.pos), np.asarray(b.pos))
        assert (np.asarray(a.pos) >= 0).sum(-1).tolist() == [[12, 12], [12, 12]]
    # device bytes: capacity only, independent of max_new_tokens
    _, _, short, _ = generate_tokens(tiny, rows, method=method, max_new_tokens=2)
    assert short.device_bytes() == cache.device_bytes()
    stats = cache.stats()
    cfg = tiny.config
    assert stats["page_pool_bytes"] == cfg.num_layers * 2 * 2 * 12 * 2 * cfg.head_dim * 4  # layers, rows, heads, slots, K+V
    assert stats["evicts_during_decode"] is True


def test_shared_prefill_derives_the_same_eviction_cache(tiny):
    method = H2O(budget=12, block=8, page_size=4, evict_during_decode=True)
    tokens, pad = batch_tokens(7)
    staged = init_shared_cache([method, FullCache(block=8)], CacheSpec.for_model(tiny.config, 2, L, 1, tiny.dtype))
    staged = staged.replace(pad=jnp.asarray(pad))
    _, staged = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, :L]), staged)
    derived = compress(cache_for(staged, method))
    _, _, own = run(tiny, method, tokens, pad, steps=1)
    assert jax.tree_util.tree_structure(derived) == jax.tree_util.tree_structure(own)
    for a, b in zip(jax.tree_util.tree_leaves(derived), jax.tree_util.tree_leaves(own)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="recent_ratio < 1.*leaves no heavy-hitter slot"):
        H2O(budget=8, recent_ratio=1.0, evict_during_decode=True)
    H2O(budget=8, recent_ratio=1.0)  # fine without eviction
    with pytest.raises(ValueError, match=r"recent_ratio must be in \[0, 1\]"):
        H2O(recent_ratio=1.5, evict_during_decode=True)
