"""Locret's retaining heads: one small MLP per layer scoring each token's causal importance per KV head.

Paper (Locret, Sec. 3.3) and its public code: for layer ``i`` the head maps the token's own
**pre-RoPE** ``[Q, K, V]`` (all query heads, then the KV heads' keys and values, concatenated:
``F = (H_q + 2 H_kv) * head_dim`` features) to one score per KV head:
``S = SiLU([Q, K, V] @ W1) @ W2`` with ``W1[F, d_R]``, ``W2[d_R, H_kv]``, no biases.

The heads of all layers are stacked into one pytree ``{"w1": [L, F, d_R], "w2": [L, d_R, H_kv]}``
(float32 while training; shipped as a float16 ``.npz`` artifact of kind ``"locret"`` stamped with the
model's identity, loaded back as float32). Training lives in the ``train`` package; the inference
method is :class:`kvjax.methods.locret.Locret`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.artifacts import Artifact, frozen_meta

KIND = "locret"


def feature_size(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Input width of a retaining head: ``(H_q + 2 H_kv) * head_dim``."""
    return (num_heads + 2 * num_kv_heads) * head_dim


def head_features(q_pre_rope, k_pre_rope, v):
    """``[B, T, F]`` inputs of a retaining head from ``q[B, T, Hq, D]``, ``k, v[B, T, Hkv, D]`` (pre-RoPE q, k)."""
    B, T = q_pre_rope.shape[:2]
    return jnp.concatenate([x.reshape(B, T, -1) for x in (q_pre_rope, k_pre_rope, v)], axis=-1)


def apply_head(w1, w2, features):
    """One layer's scores ``[..., H_kv]`` (float32) from ``features[..., F]``: ``SiLU(x W1) W2``."""
    x = features.astype(jnp.float32)
    h = jax.nn.silu(jnp.einsum("...f,fr->...r", x, w1.astype(jnp.float32), precision=lax.Precision.HIGHEST))
    return jnp.einsum("...r,rh->...h", h, w2.astype(jnp.float32), precision=lax.Precision.HIGHEST)


def init_heads(num_layers: int, features: int, num_kv_heads: int, hidden: int, seed: int = 0) -> dict:
    """Randomly initialised heads ``{"w1": [L, F, d_R], "w2": [L, d_R, H_kv]}`` (float32), ``F = features``.

    PyTorch's ``nn.Linear`` default (the reference code's): uniform in ``+-1/sqrt(fan_in)``.
    """
    if hidden <= 0:
        raise ValueError(f"the retaining head's hidden size d_R must be > 0, got {hidden}")
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    w1 = jax.random.uniform(k1, (num_layers, features, hidden), jnp.float32, -1.0, 1.0) / np.sqrt(features)
    w2 = jax.random.uniform(k2, (num_layers, hidden, num_kv_heads), jnp.float32, -1.0, 1.0) / np.sqrt(hidden)
    return {"w1": w1, "w2": w2}


def check_heads(heads: dict, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Raise ValueError unless ``heads`` fit the model's shape; returns ``d_R``."""
    F = feature_size(num_heads, num_kv_heads, head_dim)
    if set(heads) != {"w1", "w2"}:
        raise ValueError(f"retaining heads must have arrays 'w1' and 'w2', got {sorted(heads)}")
    w1, w2 = heads["w1"], heads["w2"]
    if w1.ndim != 3 or w2.ndim != 3 or w1.shape[2] != w2.shape[1]:
        raise ValueError(f"retaining heads must be w1 [L, F, d_R] and w2 [L, d_R, H_kv], got {w1.shape} and {w2.shape}")
    want = (num_layers, F, num_kv_heads)
    got = (w1.shape[0], w1.shape[1], w2.shape[2])
    if got != want or w2.shape[0] != num_layers:
        raise ValueError(f"retaining heads are for (layers, features, KV heads) = {got}; this model needs {want}")
    return int(w1.shape[2])


def heads_artifact(heads: dict, model_id: str, *, storage_dtype: str = "float16", **facts) -> Artifact:
    """The ``"locret"`` artifact of trained (or random) heads; ``facts`` (training settings, metrics) go to ``meta``."""
    arrays = {name: jnp.asarray(heads[name], jnp.float32) for name in ("w1", "w2")}
    meta = (("hidden", int(arrays["w1"].shape[2])), ("storage_dtype", storage_dtype),
            *sorted((k, frozen_meta(v, digits=6)) for k, v in facts.items()))
    return Artifact(arrays=arrays, kind=KIND, model_id=model_id, meta=meta)


def random_heads_artifact(model_id: str, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                          hidden: int, seed: int = 0) -> Artifact:
    """Untrained heads (the paper's Table 6 control) as an artifact."""
    heads = init_heads(num_layers, feature_size(num_heads, num_kv_heads, head_dim), num_kv_heads, hidden, seed)
    return heads_artifact(heads, model_id, trained=False, seed=seed)


__all__ = ["KIND", "feature_size", "head_features", "apply_head", "init_heads", "check_heads", "heads_artifact",
           "random_heads_artifact"]
