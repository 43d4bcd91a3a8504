"""kvjax's SnapKV and StreamingLLM against NVIDIA kvpress' ``SnapKVPress`` and ``StreamingLLMPress`` on HF
``transformers``' own Qwen2 forward.

kvpress (Apache-2.0; v0.5.5, ``kvpress/presses/snapkv_press.py`` ``score`` and ``scorer_press.py`` ``compress``)
scores each prefix token by the attention of the prompt's last ``window_size`` queries (f32 softmax over every key,
mean over the window), average-pools it over ``kernel_size`` neighbours with zero padding, averages over each KV
head's query group, gives the window the highest score, and keeps the top ``int(k_len * (1 - compression_ratio))``
keys per KV head. Its scoring is reproduced below line for line in torch (the package pins ``transformers < 5.3`` and
pulls ``datasets``, ``peft`` and ``accelerate``, so it is not a test dependency). Applied to the post-RoPE queries and
keys of HF's own forward, the keys it keeps must be the keys kvjax's SnapKV keeps with the same settings
(``window``, ``kernel``, ``pooling="avg"``, ``gqa="mean"``, ``budget`` = kvpress's kept count). ``StreamingLLMPress``
keeps its ``n_sink`` first keys and the most recent ones (``streaming_llm_press.py`` ``score``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kvjax.cache import new_cache
from kvjax.decoding import compress, prefill_prompt
from kvjax.methods import SnapKV, StreamingLLM
from kvjax.models import load_model
from tests.test_locret_train import hf_projections
from tests.tiny import PEAKED, save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_kvpress")
    hf = save_tiny("qwen2", str(path), seed=3, scale=PEAKED)
    return load_model(str(path), "float32", tokenizer=False), hf


def kvpress_snapkv_scores(query_states, keys, window_size: int, kernel_size: int):
    """kvpress' ``SnapKVPress.score`` from the post-RoPE queries ``[1, Hq, T, D]`` and keys ``[1, Hkv, T, D]``."""
    bsz, num_key_value_heads, k_len, head_dim = keys.shape
    num_key_value_groups = query_states.shape[1] // num_key_value_heads
    query_states = query_states[:, :, -window_size:]
    key_states = keys.repeat_interleave(num_key_value_groups, dim=1)  # transformers' repeat_kv
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    attention_mask = torch.ones_like(attn_weights) * float("-inf")
    attention_mask = torch.triu(attention_mask, diagonal=k_len - window_size + 1)
    attn_weights += attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_weights = attn_weights[..., :-window_size]
    scores = attn_weights.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    scores = scores.view(bsz, num_key_value_heads, num_key_value_groups, k_len - window_size)
    scores = scores.mean(2)
    return F.pad(scores, (0, window_size), value=scores.max().item() + 1)


def kvjax_kept_keys(paged, h: int) -> np.ndarray:
    """The keys KV head ``h`` of row 0 holds in its pages, in slot order ``[n, D]``."""
    pages = np.asarray(paged.k_pages)[np.asarray(paged.block_table)[0, h]]  # [pages, page_size, D]
    return pages.reshape(-1, pages.shape[-1])[: int(paged.lengths[0, h])]


def kvpress_streaming_llm_scores(keys, compression_ratio: float, n_sink: int):
    """kvpress' ``StreamingLLMPress.score`` for keys ``[1, Hkv, T, D]``."""
    k_len = keys.shape[2]
    n_pruned = k_len - int(k_len * (1 - compression_ratio))
    scores = torch.ones_like(keys[..., 0])
    scores[:, :, n_sink: n_sink + n_pruned] = 0
    return scores


def kept_by_kvpress(method, tiny, T: int, compression_ratio: float, scores_of):
    """Compare every layer's and KV head's kept keys of kvjax's ``method`` with the keys kvpress' ``compress``
    keeps (the top ``compute_n_kept`` of ``scores_of(queries, keys)``)."""
    model, hf = tiny
    tokens = np.random.default_rng(T).integers(0, 97, size=(1, T)).astype(np.int32)
    n_kept = max(1, int(T * (1 - compression_ratio)))  # kvpress' compute_n_kept
    cache = new_cache(method(n_kept), model.config, 1, T, 2, model.dtype)
    _, cache = prefill_prompt(model.graphdef, model.params, tokens, cache)
    cache = compress(cache)
    checked = 0
    for layer, (_, _, _, qr, kr) in enumerate(hf_projections(hf, list(tokens[0]))):
        with torch.no_grad():
            scores = scores_of(torch.as_tensor(qr)[None], torch.as_tensor(kr)[None])
            indices = scores.topk(n_kept, dim=-1).indices[0].numpy()  # [Hkv, n_kept], kvpress' compress
        paged = cache.layers[layer]
        for h in range(model.config.num_kv_heads):
            want = kr[h][np.sort(indices[h])]  # kvpress keeps them in score order; kvjax in position order
            got = kvjax_kept_keys(paged, h)
            assert got.shape == want.shape, (layer, h)
            np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"layer {layer}, KV head {h}")
            checked += 1
    assert checked == model.config.num_layers * model.config.num_kv_heads


@pytest.mark.parametrize("T,window,kernel,compression_ratio", [
    (150, 64, 5, 0.5),  # kvpress' defaults (window 64, kernel 5)
    (97, 16, 7, 0.7),
    (61, 8, 3, 0.25),
])
def test_snapkv_keeps_the_keys_kvpress_keeps(tiny, T, window, kernel, compression_ratio):
    kept_by_kvpress(lambda n: SnapKV(budget=n, window=window, kernel=kernel, pooling="avg", gqa="mean", block=16),
                    tiny, T, compression_ratio, lambda q, k: kvpress_snapkv_scores(q, k, window, kernel))


@pytest.mark.parametrize("T,compression_ratio", [(150, 0.5), (61, 0.8)])
def test_streaming_llm_keeps_the_keys_kvpress_keeps(tiny, T, compression_ratio):
    kept_by_kvpress(lambda n: StreamingLLM(budget=n, sinks=4, block=16), tiny, T, compression_ratio,
                    lambda q, k: kvpress_streaming_llm_scores(k, compression_ratio, 4))
