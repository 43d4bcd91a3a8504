"""kvjax logits == HF transformers logits (PyTorch CPU, f32) for tiny random configs of every architecture."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kvjax.methods import FullCache
from models import load_model
from models.llama import forward
from tests.tiny import CONFIGS, save_tiny
from kvjax.cache import new_cache


def kvjax_logits(model, tokens: np.ndarray) -> np.ndarray:
    B, T = tokens.shape
    cache = new_cache(FullCache(block=16), model.config, B, T, 0, model.dtype)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits, _ = jax.jit(forward, static_argnums=0)(model.graphdef, model.params, jnp.asarray(tokens), positions, cache)
    return np.asarray(logits)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    hf = save_tiny(kind, str(tmp_path))
    model = load_model(str(tmp_path), "float32", tokenizer=False)
    tokens = np.random.default_rng(0).integers(0, 97, size=(2, 70)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got = kvjax_logits(model, tokens)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_config_read_from_hf(tmp_path):
    save_tiny("llama3_rope", str(tmp_path))
    config = load_model(str(tmp_path), tokenizer=False).config
    assert config.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 64)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)


def test_bf16_logits_close_to_f32(tmp_path):
    save_tiny("qwen2", str(tmp_path))
    f32 = load_model(str(tmp_path), "float32", tokenizer=False)
    bf16 = load_model(str(tmp_path), "bfloat16", tokenizer=False)
    assert jax.tree_util.tree_leaves(bf16.params)[0].dtype == jnp.bfloat16
    tokens = np.arange(40, dtype=np.int32)[None] % 97
    a, b = kvjax_logits(f32, tokens), kvjax_logits(bf16, tokens)
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
