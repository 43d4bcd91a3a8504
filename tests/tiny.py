"""Tiny random HF models saved as safetensors: the independent reference for parity tests."""

from __future__ import annotations

import torch
import transformers

BASE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
)

CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True, rope_theta=500.0)),
    "llama3_rope": (
        transformers.LlamaConfig, transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=2048,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=64)),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen3": (
        transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
        dict(tie_word_embeddings=False, head_dim=24, rope_theta=10000.0),
    ),
}


PEAKED = 10.0  # scale of the layers' matrices that makes greedy tokens depend on the prompt (see save_tiny)


def scale_layer_matrices(model, scale: float) -> None:
    """Multiply a HF causal LM's decoder-layer weight matrices by ``scale`` in place (norms and biases unchanged)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.layers.") and p.ndim == 2:
                p.mul_(scale)


def save_tiny(kind: str, path: str, seed: int = 0, scale: float = 1.0):
    """Create a random tiny HF model of ``kind``, save it to ``path`` and return the torch model.

    ``scale`` multiplies the decoder layers' weight matrices. At HF's default initialisation (1.0) a tied-embedding
    model's greedy token hardly depends on the context (every compressed cache generates the full cache's tokens),
    so tests that compare generated tokens use ``PEAKED``: attention is peaked and dropping context changes tokens.
    """
    config_cls, model_cls, extra = CONFIGS[kind]
    torch.manual_seed(seed)
    config = config_cls(**{**BASE, **extra})
    model = model_cls(config).eval()
    with torch.no_grad():  # HF init leaves biases at zero: randomise them so q/k/v bias are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    scale_layer_matrices(model, scale)
    model.save_pretrained(path, safe_serialization=True)
    return model
