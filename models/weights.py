"""Weight loading: HF safetensors directories and GGUF files, straight into the model's parameter state.

No random model is materialised first: the target is the shape-only state of
:func:`kvjax.models.llama.abstract_model`; each tensor is read, converted to the requested dtype and put
on the device one at a time.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.models.config import ModelConfig, config_from_hf, load_hf_config
from kvjax.models.llama import abstract_model

GGUF_MAGIC = b"GGUF"
# GGML tensor types kvjax dequantizes (through the `gguf` package).
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def param_name(path) -> str:
    """The dotted parameter name of a pytree key path (``layers.0.attn.q_proj.weight``; a trailing ``value`` dropped)."""
    parts = [str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path]
    if parts and parts[-1] == "value":
        parts = parts[:-1]
    return ".".join(parts)


def hf_to_param_name(hf_name: str) -> tuple[str, bool] | None:
    """Map an HF tensor name to (per-tensor parameter name, needs transpose); None for tensors kvjax ignores.

    kvjax keeps HF's ``[out, in]`` layout, so nothing is transposed. The per-tensor name of a fused
    projection's part (``layers.0.self_attn.q_proj.weight``) is mapped to its rows of the fused
    parameter by :func:`fused_param_part`.
    """
    if "rotary_emb" in hf_name:
        return None
    name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    if name == "embed_tokens.weight":
        return "embed_tokens.embedding", False
    return name, False


# HF projections stored as row blocks of one fused kvjax parameter: part -> (fused, index in order)
_FUSED_PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _fused_widths(config: ModelConfig, fused: str) -> list[int]:
    """Output widths (rows) of the parts of a fused projection, in order."""
    if fused.endswith("qkv_proj"):
        return [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2
    return [config.intermediate_size] * 2


def _fused_parts_of(name: str) -> set[str]:
    """Per-tensor names of the parts of fused parameter ``name`` (empty if it is not fused)."""
    parts = name.split(".")
    if len(parts) != 5 or parts[0] != "layers":
        return set()
    fused = f"{parts[2]}.{parts[3]}"
    return {f"layers.{parts[1]}.{part}.{parts[4]}" for part, (f, _) in _FUSED_PARTS.items() if f == fused}


def fused_param_part(config: ModelConfig, name: str) -> tuple[str, int, int] | None:
    """``layers.3.mlp.up_proj.weight`` -> (``layers.3.mlp.gate_up_proj.weight``, first row, rows); None if unfused."""
    parts = name.split(".")
    if len(parts) != 5 or parts[0] != "layers":
        return None
    key = f"{parts[2]}.{parts[3]}"
    if key not in _FUSED_PARTS:
        return None
    fused, index = _FUSED_PARTS[key]
    widths = _fused_widths(config, fused)
    return f"layers.{parts[1]}.{fused}.{parts[4]}", sum(widths[:index]), widths[index]


def build_params(config: ModelConfig, tensors: Iterator[tuple[str, Callable[[], np.ndarray]]], dtype, source: str):
    """Fill the abstract model's parameters from ``(hf_name, load_fn)`` pairs; returns (graphdef, params).

    HF's q/k/v and gate/up projections (weights and biases) are written into row blocks of the fused
    ``qkv_proj`` and ``gate_up_proj`` parameters (see :mod:`kvjax.models.llama`). Raises ValueError naming the tensor on a
    missing, unexpected or mis-shaped weight.
    """
    graphdef, abstract_state = nnx.split(abstract_model(config, dtype))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    wanted = {param_name(path): leaf for path, leaf in leaves}
    loaded: dict[str, jax.Array] = {}
    fused_buffers: dict[str, np.ndarray] = {}  # fused name -> float32 host buffer being filled
    fused_filled: dict[str, set[str]] = {}  # fused name -> part names written so far
    fused_expected = {n: parts for n in wanted if (parts := _fused_parts_of(n))}  # fused name -> its part names
    for hf_name, load in tensors:
        mapped = hf_to_param_name(hf_name)
        if mapped is None:
            continue
        name, transpose = mapped
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        fused = fused_param_part(config, name)
        target = fused[0] if fused else name
        if target not in wanted:
            raise ValueError(f"{source}: unexpected tensor {hf_name!r} for a {config.architecture} model")
        expected = tuple(wanted[target].shape)
        if fused:
            expected = (fused[2],) + expected[1:]
        array = load()
        if transpose:
            array = array.T
        if tuple(array.shape) != expected:
            raise ValueError(f"{source}: tensor {hf_name!r} has shape {array.shape}, expected {expected}")
        if fused:
            buf = fused_buffers.get(target)
            if buf is None:
                buf = fused_buffers[target] = np.empty(wanted[target].shape, np.float32)
            buf[fused[1] : fused[1] + fused[2]] = array
            fused_filled.setdefault(target, set()).add(name)
            if fused_filled[target] == fused_expected[target]:
                loaded[target] = jnp.asarray(fused_buffers.pop(target), dtype=dtype)
            continue
        loaded[name] = jnp.asarray(np.asarray(array, dtype=np.float32) if array.dtype != np.float32 else array, dtype=dtype)
    missing = sorted(
        set(n for n in wanted if n not in loaded and n not in fused_expected)
        | set(p for n in fused_expected if n not in loaded for p in fused_expected[n] - fused_filled.get(n, set()))
    )
    if missing:
        raise ValueError(f"{source}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    params = jax.tree_util.tree_unflatten(treedef, [loaded[param_name(path)] for path, _ in leaves])
    return graphdef, params


# ---------------------------------------------------------------- HF safetensors directory
def load_hf_directory(path: str, dtype=jnp.float32):
    """Load ``config.json`` and single or sharded ``*.safetensors`` from an HF directory.

    Returns (config, graphdef, params).
    """
    from safetensors import safe_open

    config = load_hf_config(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, f) for f in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path!r} has no *.safetensors weights")

    def tensors():
        for file in files:
            with safe_open(file, framework="numpy") as f:
                for key in f.keys():
                    yield key, (lambda f=f, key=key: f.get_tensor(key))

    graphdef, params = build_params(config, tensors(), dtype, source=path)
    return config, graphdef, params


# ---------------------------------------------------------------- GGUF
def open_gguf(path: str):
    """A ``gguf.GGUFReader`` of ``path``; clear errors for a missing, foreign, truncated or corrupt file."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path!r} is not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on truncated or corrupt files
        raise ValueError(f"{path!r} is a truncated or corrupt GGUF file: {e}") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path!r} is truncated: tensor {t.name!r} ends past the end of the file ({size} bytes)")
    return reader


def _gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader, name: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (``{arch}.block_count``, ``{arch}.attention.head_count``, ...)."""
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with a rope_freqs tensor (Llama-3.1 rope scaling) are not supported; use the HF directory")
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(_gguf_field(reader, f"{arch}.embedding_length"))
    heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    return config_from_hf(
        {
            "model_type": _GGUF_ARCHS[arch],
            "vocab_size": int(emb.shape[1]),
            "hidden_size": hidden,
            "intermediate_size": int(_gguf_field(reader, f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(_gguf_field(reader, f"{arch}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
            "head_dim": int(_gguf_field(reader, f"{arch}.attention.key_length", hidden // heads)),
            "rope_theta": float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            "rms_norm_eps": float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(_gguf_field(reader, f"{arch}.context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in names,
        },
        name=name,
    )


_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK_TO_HF:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK_TO_HF[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def unpermute_llama_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF half-split rotary -> GGUF interleaved), per head."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_gguf_tensor(tensor) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in HF layout ``[out, in]``; clear error on unsupported types."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_GGUF_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has unsupported type {kind}; supported: {', '.join(SUPPORTED_GGUF_TYPES)}"
        )
    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def load_gguf(path: str, dtype=jnp.float32):
    """Load a GGUF file (Llama / Qwen2 / Qwen3), dequantized to ``dtype``. Returns (config, graphdef, params)."""
    reader = open_gguf(path)
    config = gguf_config(reader, name=os.path.splitext(os.path.basename(path))[0])
    for t in reader.tensors:  # fail before any work on a file we cannot read whole
        if t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
            raise ValueError(
                f"{path!r}: tensor {t.name!r} has unsupported GGUF type {t.tensor_type.name}; "
                f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}"
            )

    def tensors():
        for t in reader.tensors:
            hf_name = gguf_to_hf_name(t.name)

            def load(t=t, hf_name=hf_name):
                w = dequantize_gguf_tensor(t)
                if config.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
                    w = unpermute_llama_qk(w, heads)
                return w

            yield hf_name, load

    graphdef, params = build_params(config, tensors(), dtype, source=path)
    return config, graphdef, params
