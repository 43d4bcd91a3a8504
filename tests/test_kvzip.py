"""KVzip against NVIDIA kvpress' ``KVzipPress`` on HF ``transformers``' own Qwen2 forward, a hand-made
reconstruction, and the edges: budgets summing to the budget, budget 1.0 = the full cache, ragged batches,
compress-once-ask-many.

kvpress (Apache-2.0; ``kvpress/presses/kvzip_press.py`` at commit 00dd63a3, the published press with
``compression_ratio``, ``layerwise`` and ``n_sink``) prefills the context, then runs one reconstruction pass per
chunk of the context (request + chat suffix + chunk) over the cache with a forward hook on every attention module
that scores the chunk's keys and truncates the cache back to the context. Its scoring and its selection
(``score_kvzip``, ``prepare``, ``compress_post``) are reproduced below line for line in torch on HF's own modules
(kvpress pins ``transformers < 5.3`` and pulls ``datasets`` and ``peft``, so it is not a test dependency).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

from kvjax.cache import new_cache
from kvjax.decoding import compress, decode_loop, prefill, prefill_prompt
from kvjax.methods import FullCache, KVzip, get_method
from kvjax.methods.kvzip import (ReconstructionPrompt, reconstruction_attention, reconstruction_passes,
                                 score_context, select)
from kvjax.models import load_model
from tests.tiny import PEAKED, save_tiny

# the HF forward's cache argument: ``past_key_values`` before transformers 5.x renamed it ``cache``
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.Qwen2ForCausalLM.forward).parameters else "past_key_values"
PROMPT = ReconstructionPrompt(prefix=3, first=(11, 12, 13, 14, 15), later=(21, 22, 23), suffix=(31, 32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_kvzip")
    hf = save_tiny("qwen2", str(path), seed=5, scale=PEAKED)
    return load_model(str(path), "float32", tokenizer=False), hf


# ------------------------------------------------------------------------------------- kvpress, reproduced
def kvpress_kvzip_kept(hf, context_ids, prompt: ReconstructionPrompt, compression_ratio: float, *, layerwise=False,
                       n_sink=4, chunk_size=2048, prev_postfix_size=8, aggregate="max", scores_only=False):
    """The keep mask ``[layers, Hkv, len(context_ids)]`` of kvpress' ``KVzipPress`` for one context (batch 1).

    ``aggregate="mean"`` replaces the max over the query group and the queries by a mean: the mutation the parity
    test must catch."""
    cfg = hf.config
    L, Hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    ids = torch.as_tensor([context_ids])
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        hf(input_ids=ids, **{CACHE_ARG: cache}, use_cache=True)
    context_length = ids.shape[1]
    prefix_length = prompt.prefix
    score_val = torch.zeros((L, 1, Hkv, context_length), dtype=torch.float32)
    score_val[..., :n_sink] = 1.0
    # prepare(): chunks of the context after the prefix, each with its request and the chat suffix
    ctx_ids = ids[:, prefix_length:]
    if ctx_ids.shape[1] > chunk_size:
        chunked = [ctx_ids[:, i * chunk_size:(i + 1) * chunk_size] for i in range((ctx_ids.shape[1] - 1) // chunk_size + 1)]
    else:
        chunked = [ctx_ids]
    suffix_ids = torch.as_tensor([prompt.suffix])
    pairs = []
    for i, a_ids in enumerate(chunked):
        if i == 0:
            q_ids = torch.as_tensor([prompt.first])
        else:
            q_ids = torch.cat([torch.as_tensor([prompt.later]), chunked[i - 1][:, -prev_postfix_size:]], dim=1)
        pairs.append((a_ids, torch.cat([q_ids, suffix_ids, a_ids], dim=1)))
    span = {"start": prefix_length, "end": 0}

    def forward_hook(module, inputs, kwargs, output):  # forward_hook + score_kvzip
        hidden_states = kwargs["hidden_states"]
        c = kwargs["cache"] if "cache" in kwargs else kwargs["past_key_values"]  # renamed in transformers 5.x
        keys, values = c.layers[module.layer_idx].keys, c.layers[module.layer_idx].values
        bsz, q_len, _ = hidden_states.shape
        num_heads, head_dim = cfg.num_attention_heads, module.head_dim
        groups = num_heads // Hkv
        queries = module.q_proj(hidden_states).view(bsz, q_len, num_heads, head_dim).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        queries = (queries * cos.unsqueeze(1)) + (rotate_half(queries) * sin.unsqueeze(1))
        queries = queries.view(bsz, Hkv, groups, q_len, head_dim)
        start, end = span["start"], span["end"]
        sink = min(n_sink, start)
        ctx_len = end - start
        sub = torch.cat([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, -q_len:]], dim=2)
        sub = sub.unsqueeze(2).transpose(-2, -1).contiguous()
        w = torch.matmul(queries, sub) / math.sqrt(head_dim)
        mask = torch.full((q_len, q_len), torch.finfo(w.dtype).min)
        cond = torch.arange(q_len)
        mask.masked_fill_(cond < (cond + 1).view(q_len, 1), 0)
        w[..., -q_len:, -q_len:] += mask[None, None, None]
        w = nn.functional.softmax(w, dim=-1)[..., sink:sink + ctx_len]
        scores = w.amax(dim=(-3, -2)) if aggregate == "max" else w.mean(dim=(-3, -2))
        score_val[module.layer_idx][..., start:end] = scores
        c.layers[module.layer_idx].keys = keys[:, :, :context_length]
        c.layers[module.layer_idx].values = values[:, :, :context_length]
        return output

    hooks = [layer.self_attn.register_forward_hook(forward_hook, with_kwargs=True) for layer in hf.model.layers]
    try:
        with torch.no_grad():
            for prefill_ids, repeat_ids in pairs:
                span["end"] = span["start"] + prefill_ids.shape[1]
                hf(input_ids=repeat_ids, **{CACHE_ARG: cache})
                span["start"] = span["end"]
    finally:
        for h in hooks:
            h.remove()
    if scores_only:
        return score_val[:, 0].numpy()  # [layers, Hkv, context]
    # compress_post()
    n_layer, bsz, _, ctx_len = score_val.shape
    if layerwise:
        nl = int(Hkv * ctx_len * compression_ratio)
        n_pruned_layers = nl * torch.ones(n_layer, dtype=torch.int)
    else:
        score_sort = torch.sort(score_val.reshape(-1)).values
        n = max(int(len(score_sort) * compression_ratio) - 1, 0)
        thres = score_sort[n].item()
        n_pruned_layers = (score_val.reshape(n_layer, -1) <= thres).sum(-1)
    keep = np.ones((L, Hkv, ctx_len), bool)
    for layer in range(L):
        n_pruned = int(n_pruned_layers[layer])
        indices = torch.topk(-score_val[layer].reshape(bsz, -1), n_pruned, dim=1).indices.flatten().numpy()
        keep[layer, indices // ctx_len, indices % ctx_len] = False
    return keep


def kvjax_keep(model, tokens, method, prompt=PROMPT, *, pad=None, room=4):
    """(keep masks [layers, B, Hkv, P] after :func:`score_context`, the scored cache) for left-padded ``tokens``."""
    tokens = np.asarray(tokens, np.int32)
    B, P = tokens.shape
    pad = np.zeros((B,), np.int32) if pad is None else np.asarray(pad, np.int32)
    cache = new_cache(method, model.config, B, P, room, model.dtype, longest_row=int(P - pad.min()))
    cache = cache.replace(pad=jnp.asarray(pad))
    _, cache = prefill_prompt(model.graphdef, model.params, jnp.asarray(tokens), cache)
    cache = score_context(model.graphdef, model.params, cache, tokens, prompt)
    keep = select(jnp.stack([st.scores for st in cache.layers]), cache.pad, P, cache.layers[0].pruned,
                  method.allocation if method.allocation == "global" else "head" if method.allocation == "head" else "layer")
    return np.asarray(keep), cache


@pytest.mark.parametrize("T,ratio,layerwise,chunk", [
    (120, 0.75, False, 2048),  # one chunk, kvpress' default allocation
    (120, 0.5, True, 2048),  # kvpress' layerwise allocation
    (150, 0.75, False, 40),  # four chunks: later requests quote the previous chunk
    (90, 0.3, True, 32),
])
def test_kept_pairs_equal_kvpress_kvzip(tiny, T, ratio, layerwise, chunk):
    model, hf = tiny
    ids = [int(x) for x in np.random.default_rng(T + chunk).integers(40, 97, size=T)]
    want = kvpress_kvzip_kept(hf, ids, PROMPT, ratio, layerwise=layerwise, chunk_size=chunk)
    method = KVzip(budget=1.0 - ratio, allocation="layer" if layerwise else "global", chunk=chunk, block=16)
    keep, cache = kvjax_keep(model, [ids], method)
    for layer in range(model.config.num_layers):
        for h in range(model.config.num_kv_heads):
            np.testing.assert_array_equal(keep[layer, 0, h], want[layer, h], err_msg=f"layer {layer}, KV head {h}")
    # the page pools hold exactly the kept keys (allocation = the kept counts)
    cache = compress(cache)
    assert cache.method.allocated == tuple(tuple(int(c) for c in want[i].sum(-1)) for i in range(want.shape[0]))
    for layer, st in enumerate(cache.layers):
        np.testing.assert_array_equal(np.asarray(st.lengths)[0], want[layer].sum(-1))


def test_parity_fails_when_the_score_or_the_aggregation_changes(tiny):
    """The comparison above can fail: kvpress with the group/query mean instead of the max, or kvjax without its
    sinks, keeps other pairs."""
    model, hf = tiny
    ids = [int(x) for x in np.random.default_rng(7).integers(40, 97, size=120)]
    keep, _ = kvjax_keep(model, [ids], KVzip(budget=0.25, block=16))
    assert (keep[:, 0] != kvpress_kvzip_kept(hf, ids, PROMPT, 0.75, aggregate="mean")).any()
    assert (keep[:, 0] != kvpress_kvzip_kept(hf, ids, PROMPT, 0.75, n_sink=0)).any()


# ----------------------------------------------------------------------------------------------- hand-made
def test_locret_reconstruction_labels_are_the_log_of_kvpress_scores(tiny):
    """``kvjax train-locret --target reconstruction``: each prompt token's label is log(KVzip score), laid out at the
    sample's padding, against the torch reproduction of kvpress' scores."""
    from kvjax.train.labels import RECONSTRUCTION_FLOOR, reconstruction_labels

    model, hf = tiny
    ids = [int(x) for x in np.random.default_rng(7).integers(40, 97, size=70)]
    want = np.log(np.maximum(kvpress_kvzip_kept(hf, ids, PROMPT, 0.0, scores_only=True), RECONSTRUCTION_FLOOR))
    got = reconstruction_labels(model, ids, length=90, pad=12, reconstruction=PROMPT)
    assert got.shape == (model.config.num_layers, model.config.num_kv_heads, 90)
    assert not got[:, :, :12].any() and not got[:, :, 82:].any()
    np.testing.assert_allclose(got[:, :, 12:82], want, rtol=1e-4, atol=1e-4)
    assert (got[:, :, 12:15] == 0).all()  # the chat prefix (3 tokens, within the 4 sinks) scores 1: log 1 = 0
    with pytest.raises(ValueError, match="does not fit"):
        reconstruction_labels(model, ids, length=60, pad=0, reconstruction=PROMPT)


def test_reconstruction_attention_on_a_hand_made_case():
    """One KV head, two query heads, a 6-slot prompt (one padding slot), a 3-token pass whose last token is
    padding: the output and the scores against float64 numpy written from the definition."""
    from kvjax.methods.kvzip import KVzipPrefill
    from kvjax.staging import StagedKV

    rng = np.random.default_rng(0)
    B, S, T, Hkv, G, D = 1, 6, 3, 1, 2, 4
    k_ctx = rng.normal(size=(B, Hkv, S, D)).astype(np.float32)
    v_ctx = rng.normal(size=(B, Hkv, S, D)).astype(np.float32)
    q = rng.normal(size=(B, T, Hkv * G, D)).astype(np.float32)
    k = rng.normal(size=(B, T, Hkv, D)).astype(np.float32)
    v = rng.normal(size=(B, T, Hkv, D)).astype(np.float32)
    pad, call_len, span, sinks, chunk = 1, 2, (4, 6), 2, 3  # real slots 1..5; sinks 1, 2; the span scores 4, 5
    state = KVzipPrefill(StagedKV(jnp.asarray(k_ctx), jnp.asarray(v_ctx), None, None), jnp.zeros((B, Hkv, S)),
                         jnp.asarray([span], jnp.int32), jnp.asarray([call_len], jnp.int32), jnp.zeros((B, Hkv, S), bool))
    out, scores = reconstruction_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), state, pad=jnp.asarray([pad]),
                                           sinks=sinks, chunk=chunk, query_block=2, block=4)
    out, scores = np.asarray(out), np.asarray(scores)
    want_scores = np.zeros((Hkv, chunk))
    for t in range(call_len):  # real queries only
        for g in range(G):
            qv = q[0, t, g].astype(np.float64)
            ctx_keys, call_keys = list(range(pad, S)), list(range(t + 1))
            logits = [qv @ k_ctx[0, 0, s] / 2.0 for s in ctx_keys] + [qv @ k[0, j, 0] / 2.0 for j in call_keys]
            p = np.exp(np.array(logits) - max(logits))
            p /= p.sum()
            values = [v_ctx[0, 0, s] for s in ctx_keys] + [v[0, j, 0] for j in call_keys]
            np.testing.assert_allclose(out[0, t, g], (p[:, None] * np.array(values)).sum(0), atol=1e-5)
            scored = [pad, pad + 1, 4, 5]  # the sinks and the span
            logits = [qv @ k_ctx[0, 0, s] / 2.0 for s in scored] + [qv @ k[0, j, 0] / 2.0 for j in call_keys]
            p = np.exp(np.array(logits) - max(logits))
            p /= p.sum()
            for j, ps in enumerate(p[2:4]):
                want_scores[0, j] = max(want_scores[0, j], ps)
    np.testing.assert_allclose(scores[0], want_scores, atol=1e-6)  # the span's third entry (past hi) is 0


def test_selection_by_hand():
    """Global: one threshold over every layer and head, ties at it evicted too; padding never kept; -1 keeps the row;
    head: the same count per head."""
    scores = jnp.asarray([[[[0.7, 1.0, 0.0, 0.1, 0.9, 0.1]]], [[[0.7, 1.0, 0.0, 0.8, 0.05, 0.6]]]])  # [L=2, B=1, H=1, 6]
    pad = jnp.asarray([1])
    keep = np.asarray(select(scores, pad, 6, [3], "global"))  # 10 real pairs; the 3rd smallest is 0.05: 0, 0, .05 go
    assert keep[0, 0, 0].tolist() == [False, True, False, True, True, True]
    assert keep[1, 0, 0].tolist() == [False, True, False, True, False, True]
    keep = np.asarray(select(scores, pad, 6, [4], "global"))  # the 4th smallest is 0.1, tied: both 0.1 go (5 evicted)
    assert keep.sum() == 5 and not keep[0, 0, 0, 3] and not keep[0, 0, 0, 5]
    assert np.asarray(select(scores, pad, 6, [-1], "global")).sum() == 10
    head = np.asarray(select(scores, pad, 6, [2], "head"))
    assert head.sum(-1).ravel().tolist() == [3, 3]


def test_lookahead_keeps_a_values_tail_by_hand():
    """``lookahead=2``: each score raised to the largest of the two before it, so the pairs after a high one stay.
    Scores ``[5, .1, .2, .3, 1, .4, .6, .7]``, 2 pruned: without it the 2nd smallest is .2 and 0, 3-7 stay; with it the
    scores are ``[5, 5, 5, .3, 1, 1, 1, .7]``, the 2nd smallest is .7 and 0-2, 4-6 stay (the value after slot 0)."""
    scores = jnp.asarray([0.5, 0.01, 0.02, 0.03, 0.1, 0.04, 0.06, 0.07]).reshape(1, 1, 1, 8) * 10
    pad = jnp.asarray([0])
    assert np.flatnonzero(np.asarray(select(scores, pad, 8, [2], "global"))).tolist() == [0, 3, 4, 5, 6, 7]
    assert np.flatnonzero(np.asarray(select(scores, pad, 8, [2], "global", 2))).tolist() == [0, 1, 2, 4, 5, 6]
    with pytest.raises(ValueError, match="lookahead must be an int >= 0"):
        KVzip(lookahead=-1)


def test_lookahead_allocates_and_keeps_what_the_extended_scores_choose(tiny):
    """With ``lookahead=3`` on the tiny model (global allocation): each (layer, KV head)'s allocated capacity is the
    count of its extended scores above the threshold (numpy, from the recorded scores), the compressed pages hold those
    pairs' keys in order, and the choice differs from the one without the look-ahead."""
    model, _ = tiny
    ids = [int(x) for x in np.random.default_rng(5).integers(40, 97, size=120)]
    method = KVzip(budget=0.25, block=16, page_size=8, lookahead=3)
    _, cache = kvjax_keep(model, [ids], method, room=0)
    scores = np.stack([np.asarray(st.scores) for st in cache.layers])[:, 0]  # [L, Hkv, S]
    ext = np.stack([scores[..., max(0, j - 3):j + 1].max(-1) for j in range(scores.shape[-1])], -1)
    L, Hkv, S = scores.shape
    pruned = int(L * Hkv * S * 0.75)
    keep = ext > np.sort(ext.ravel())[pruned - 1]
    plain = scores > np.sort(scores.ravel())[pruned - 1]
    assert cache.method.allocated == tuple(tuple(int(c) for c in layer) for layer in keep.sum(-1))
    assert (keep != plain).any()
    staged_k = [np.asarray(st.staged.k)[0] for st in cache.layers]
    done = compress(cache)
    for layer in (0, L - 1):
        paged = done.layers[layer]
        for h in range(Hkv):
            n = int(paged.lengths[0, h])
            rows = np.asarray(paged.k_pages)[np.asarray(paged.block_table)[0, h]].reshape(-1, staged_k[0].shape[-1])
            np.testing.assert_array_equal(rows[:n], staged_k[layer][h, np.flatnonzero(keep[layer, h])])


# --------------------------------------------------------------------------------------------------- edges
def test_budgets_sum_to_the_budget_and_device_bytes_follow(tiny):
    model, _ = tiny
    ids = [int(x) for x in np.random.default_rng(3).integers(40, 97, size=200)]
    L, Hkv, D = model.config.num_layers, model.config.num_kv_heads, model.config.head_dim
    for budget, allocation in ((0.25, "global"), (0.25, "layer"), (0.25, "head"), (30, "head")):
        keep, cache = kvjax_keep(model, [ids], KVzip(budget=budget, allocation=allocation, block=16, page_size=8), room=0)
        pruned = int(L * Hkv * 200 * 0.75) if budget == 0.25 else L * Hkv * (200 - 30)
        if allocation == "global":
            assert keep.sum() <= L * Hkv * 200 - pruned  # ties at the threshold go too
            assert keep.sum() >= L * Hkv * 200 - pruned - 2
        elif allocation == "layer":
            assert keep.sum() == L * (Hkv * 200 - int(Hkv * 200 * 0.75))
        else:
            assert (keep.sum(-1) == (50 if budget == 0.25 else 30)).all()
        cache = compress(cache)
        pages = sum(sum(-(-int(c) // 8) for c in layer) for layer in cache.method.allocated)
        assert cache.stats()["page_pool_bytes"] == 2 * pages * 8 * D * 4  # K and V pages, float32


def test_budget_one_equals_the_full_cache_with_chunk_padding_and_a_ragged_batch(tiny):
    model, _ = tiny
    rng = np.random.default_rng(11)
    rows = [list(rng.integers(40, 97, size=n)) for n in (77, 50)]
    P = 96  # chunk padding: both rows are left-padded
    tokens = np.zeros((2, P), np.int32)
    pad = np.asarray([P - len(r) for r in rows], np.int32)
    for b, r in enumerate(rows):
        tokens[b, pad[b]:] = r
    question = np.asarray([[41, 42, 43], [44, 45, 46]], np.int32)
    outs = []
    for method in (FullCache(block=16), KVzip(budget=1.0, chunk=32, block=16)):
        cache = new_cache(method, model.config, 2, P, 3 + 6, model.dtype, longest_row=77).replace(pad=jnp.asarray(pad))
        _, cache = prefill_prompt(model.graphdef, model.params, jnp.asarray(tokens), cache, chunk_size=32)
        if method.rereads_context():
            cache = score_context(model.graphdef, model.params, cache, tokens, PROMPT)
        cache = compress(cache)
        logits, cache = prefill(model.graphdef, model.params, jnp.asarray(question), cache)
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        out, _, _ = decode_loop(model.graphdef, model.params, first, cache, jax.random.PRNGKey(0), max_new_tokens=6)
        outs.append((np.asarray(logits), np.asarray(out)))
    np.testing.assert_allclose(outs[1][0], outs[0][0], atol=1e-4)
    np.testing.assert_array_equal(outs[1][1], outs[0][1])


def test_a_ragged_batch_keeps_what_each_row_keeps_alone(tiny):
    model, _ = tiny
    rng = np.random.default_rng(12)
    rows = [list(rng.integers(40, 97, size=n)) for n in (90, 61)]
    method = KVzip(budget=0.3, chunk=32, block=16)
    P = 90
    tokens = np.zeros((2, P), np.int32)
    pad = np.asarray([P - len(r) for r in rows], np.int32)
    for b, r in enumerate(rows):
        tokens[b, pad[b]:] = r
    batch, _ = kvjax_keep(model, tokens, method, pad=pad)
    for b, r in enumerate(rows):
        alone, _ = kvjax_keep(model, [r], method)
        np.testing.assert_array_equal(batch[:, b, :, pad[b]:], alone[:, 0], err_msg=f"row {b}")
        assert not batch[:, b, :, :pad[b]].any()


def test_passes_quote_the_previous_chunk_and_pad_short_rows():
    tokens = np.arange(100, 100 + 2 * 12).reshape(2, 12).astype(np.int32)
    pad = np.asarray([0, 5], np.int32)
    passes = reconstruction_passes(tokens, pad, PROMPT, chunk=4, carry=2)
    assert len(passes) == 3  # row 0: 9 context tokens after the 3-token prefix = 3 chunks; row 1: 4 = 1 chunk
    rows, span, call_len = passes[1]
    assert rows[0, :call_len[0]].tolist() == [21, 22, 23, 105, 106, 31, 32, 107, 108, 109, 110]
    assert span[0].tolist() == [7, 11] and call_len[1] == 0 and span[1].tolist() == [0, 0]
    rows, span, call_len = passes[0]
    assert rows[1, :call_len[1]].tolist() == [11, 12, 13, 14, 15, 31, 32, 120, 121, 122, 123]
    assert span[1].tolist() == [8, 12] and rows.shape[1] == 5 + 2 + 4  # the longest request + suffix + chunk


def test_errors(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="allocation"):
        KVzip(allocation="per-token")
    with pytest.raises(ValueError, match="reconstruction before compression"):
        cache = new_cache(KVzip(block=16), model.config, 1, 40, 2, model.dtype)
        _, cache = prefill_prompt(model.graphdef, model.params, jnp.ones((1, 40), jnp.int32), cache)
        compress(cache)
    with pytest.raises(ValueError, match="needs a KVzip cache"):
        cache = new_cache(FullCache(block=16), model.config, 1, 40, 2, model.dtype)
        _, cache = prefill_prompt(model.graphdef, model.params, jnp.ones((1, 40), jnp.int32), cache)
        score_context(model.graphdef, model.params, cache, np.ones((1, 40), np.int32), PROMPT)
    with pytest.raises(ValueError, match="context after the template"):
        tokens = np.ones((1, 40), np.int32)
        cache = new_cache(KVzip(block=16), model.config, 1, 40, 2, model.dtype)
        _, cache = prefill_prompt(model.graphdef, model.params, jnp.asarray(tokens), cache)
        score_context(model.graphdef, model.params, cache, tokens, dataclasses.replace(PROMPT, prefix=40))
    assert get_method("kvzip:budget=0.1:allocation=head") == KVzip(budget=0.1, allocation="head")
