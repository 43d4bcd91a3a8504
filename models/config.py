"""Model configuration shared by Llama, Qwen2/2.5 and Qwen3, read from HF `config.json` or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only Llama-family model (hashable, usable as a static jit argument)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) or None
    rope_scaling: tuple | None = None
    name: str = "model"

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token over all layers and KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, tuple | None]:
    """Rope theta and scaling from an HF config (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    merged = {**params, **scaling}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "llama3":
        return theta, (
            "llama3",
            float(merged["factor"]),
            float(merged["low_freq_factor"]),
            float(merged["high_freq_factor"]),
            int(merged["original_max_position_embeddings"]),
        )
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")


def config_from_hf(cfg: dict[str, Any], name: str = "model") -> ModelConfig:
    """Build a ModelConfig from a HF `config.json` dictionary."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    theta, scaling = _rope_from_hf(cfg)
    num_heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        rope_scaling=scaling,
        name=name,
    )


def load_hf_config(path: str) -> ModelConfig:
    """Read `config.json` from an HF model directory; a ``ValueError`` naming the file when it is malformed (not
    JSON, not an object, a required field missing or of the wrong type)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} has no config.json; expected an HF model directory")
    with open(file) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(cfg).__name__}")
    try:
        return config_from_hf(cfg, name=os.path.basename(os.path.normpath(path)))
    except KeyError as e:
        raise ValueError(f"{file} lacks the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: {e}") from None
