"""Flax NNX Llama / Qwen models, weight loading (HF safetensors, GGUF), tokenizers and ready models."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp

from kvjax.models.config import ModelConfig
from kvjax.models.registry import DEFAULT_MODEL, READY_MODELS, SHAPE_MODELS, is_installed, ready_model_path

DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
    """A model ready for the functional API: config, ``nnx`` graphdef + params, tokenizer, source path,
    and the device mesh its parameters are split over (None: one device; see :mod:`kvjax.models.sharding`)."""

    config: ModelConfig
    graphdef: Any
    params: Any
    tokenizer: Any
    path: str
    dtype: Any
    mesh: Any = None


def resolve_dtype(dtype) -> Any:
    """``"float32" | "bfloat16"`` (or f32 / bf16 / a jnp dtype) -> jnp dtype."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"unsupported dtype {dtype}; allowed: float32, bfloat16")
    return dtype


def resolve_model_path(name_or_path: str) -> str:
    """A ready model's GGUF path, or a local HF directory / ``.gguf`` file as given."""
    if name_or_path in READY_MODELS:
        return ready_model_path(name_or_path)
    if name_or_path in SHAPE_MODELS:
        raise ValueError(f"{name_or_path!r} is known by its shapes only (its weights are not shipped): load it with "
                         "random weights (load_model(..., random_weights=True), `kvjax bench --random-weights`)")
    if os.path.isdir(name_or_path) or (os.path.isfile(name_or_path) and name_or_path.endswith(".gguf")):
        return name_or_path
    raise ValueError(
        f"unknown model {name_or_path!r}; ready models: {', '.join(READY_MODELS)}, shape-only models (random "
        f"weights): {', '.join(SHAPE_MODELS)}, or a local HF directory (config.json + *.safetensors) or .gguf file"
    )


def load_model(name_or_path: str = DEFAULT_MODEL, dtype="float32", *, tokenizer: bool = True, mesh=None,
               random_weights: bool = False) -> LoadedModel:
    """Load weights (and tokenizer) of a ready model, an HF directory or a GGUF file.

    ``mesh``: a ``(data, model)`` :class:`jax.sharding.Mesh` or ``"data=2,model=4"``: the weights are
    split over it, tensor parallel on ``model`` (:func:`kvjax.models.sharding.shard_model`).
    ``random_weights``: the model's architecture with randomly initialised weights (seed 0) instead of
    its trained ones, for timing and memory measurements where the weight files are absent: a ready
    model then needs none of its packages (unless ``tokenizer``), an HF directory only its
    ``config.json``. Its outputs are meaningless; its identity (:func:`kvjax.artifacts.model_identity`)
    is the trained model's, so the shipped artifacts load for it.
    """
    from kvjax.models.tokenizer import load_tokenizer
    from kvjax.models.weights import load_gguf, load_hf_directory

    dtype = resolve_dtype(dtype)
    if random_weights:
        config, path = model_architecture(name_or_path)
        from flax import nnx

        from kvjax.models.llama import abstract_model, random_params

        graphdef, _ = nnx.split(abstract_model(config, dtype))
        params = random_params(config, dtype)
        tok = load_tokenizer(resolve_model_path(name_or_path)) if tokenizer else None
    else:
        path = resolve_model_path(name_or_path)
        if os.path.isdir(path):
            config, graphdef, params = load_hf_directory(path, dtype)
        else:
            config, graphdef, params = load_gguf(path, dtype)
        if name_or_path in READY_MODELS:
            config = dataclasses.replace(config, name=name_or_path)
        tok = load_tokenizer(path) if tokenizer else None
    model = LoadedModel(config=config, graphdef=graphdef, params=params, tokenizer=tok, path=path, dtype=dtype)
    if mesh is not None:
        from kvjax.models.sharding import shard_model

        model = shard_model(model, mesh)
    return model


def model_architecture(name_or_path: str) -> tuple[ModelConfig, str]:
    """(config, a ``random:`` path label) of a ready model, HF directory or GGUF file, reading no weights."""
    from kvjax.models.config import load_hf_config
    from kvjax.models.registry import ready_model_config, shape_model_config
    from kvjax.models.weights import gguf_config, open_gguf

    if name_or_path in READY_MODELS:
        return ready_model_config(name_or_path), f"random:{name_or_path}"
    if name_or_path in SHAPE_MODELS:
        return shape_model_config(name_or_path), f"random:{name_or_path}"
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        return load_hf_config(path), f"random:{path}"
    return gguf_config(open_gguf(path), os.path.splitext(os.path.basename(path))[0]), f"random:{path}"


__all__ = ["ModelConfig", "LoadedModel", "load_model", "model_architecture", "READY_MODELS", "SHAPE_MODELS", "DEFAULT_MODEL",
           "is_installed",
           "resolve_dtype"]
