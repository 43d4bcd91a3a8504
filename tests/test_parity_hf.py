"""kvjax logits == HF transformers logits (PyTorch CPU, f32) for tiny random configs of every architecture."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kvjax.methods import FullCache
from kvjax.models import load_model
from kvjax.models.llama import forward
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


def test_random_weights_need_only_the_architecture(tmp_path, monkeypatch):
    """``random_weights``: an HF directory without its safetensors, and a ready model without its packages,
    give a model of the trained one's shapes and identity (timing on machines without the weight files)."""
    import os

    from kvjax.artifacts import model_identity
    from kvjax.models import READY_MODELS, model_architecture
    from kvjax.models import registry

    save_tiny("qwen2", str(tmp_path))
    trained = load_model(str(tmp_path), tokenizer=False)
    for f in os.listdir(tmp_path):
        if f.endswith(".safetensors"):
            os.remove(tmp_path / f)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), tokenizer=False)
    rand = load_model(str(tmp_path), tokenizer=False, random_weights=True)
    assert rand.config == trained.config and rand.path.startswith("random:")
    rand_leaves, trained_leaves = jax.tree_util.tree_leaves(rand.params), jax.tree_util.tree_leaves(trained.params)
    assert [(x.shape, x.dtype) for x in rand_leaves] == [(x.shape, x.dtype) for x in trained_leaves]
    assert jax.tree_util.tree_structure(rand.params) == jax.tree_util.tree_structure(trained.params)
    assert not np.allclose(np.asarray(rand_leaves[0]), np.asarray(trained_leaves[0]))
    tokens = np.array([[1, 5, 7, 9]], np.int32)
    assert np.isfinite(kvjax_logits(rand, tokens)).all()

    monkeypatch.setattr(registry, "_package_file", lambda *a: None)  # no ready model's package installed
    for name in READY_MODELS:
        with pytest.raises(ModuleNotFoundError, match="install with"):
            load_model(name, tokenizer=False)
        config, path = model_architecture(name)
        assert config.name == name and path == f"random:{name}"
        assert model_identity(config) == model_identity(registry.ready_model_config(name))
