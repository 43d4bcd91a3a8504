"""Flax NNX decoder for Llama (incl. Llama-3.1 rope scaling), Qwen2/Qwen2.5 (q/k/v bias) and Qwen3 (q/k norm).

The module is used functionally: ``graphdef, params = nnx.split(model)`` once, then
:func:`forward` (pure, jittable) takes ``params`` and a :class:`kvjax.cache.Cache` and returns
logits and a new cache. The attention layer computes q, k, v, applies RoPE and hands them to the
cache's method (``cache.method.attend``); it never knows which method runs.

Parameters. Projection matrices are stored as HF stores them, ``weight[out, in]`` (``y = x @ weight.T``:
each output is a dot product with one contiguous row, the fastest matrix-vector product on XLA:CPU),
and the names are HF's (without the ``model.`` prefix) except the token embedding and the two fused
projections, which :func:`kvjax.models.weights.build_params` assembles from HF's tensors at load time:

* ``embed_tokens.embedding [V, d]``, ``norm.weight [d]``, ``lm_head.weight [V, d]`` (untied models only)
* ``layers.N.input_layernorm.weight [d]``, ``layers.N.post_attention_layernorm.weight [d]``
* ``layers.N.self_attn.qkv_proj.weight [(Hq + 2 Hkv) D, d]`` (+ ``.bias [(Hq + 2 Hkv) D]`` with q/k/v
  bias): the rows of HF's ``q_proj``, ``k_proj`` and ``v_proj``, in that order
* ``layers.N.self_attn.o_proj.weight [d, Hq D]``; ``layers.N.self_attn.{q,k}_norm.weight [D]`` (Qwen3)
* ``layers.N.mlp.gate_up_proj.weight [2 I, d]``: the rows of HF's ``gate_proj`` then ``up_proj``
* ``layers.N.mlp.down_proj.weight [d, I]``

A decode step is bound by reading these weights once; one product per fused projection instead of
three (two) runs closer to the memory bandwidth.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.cache import AttendContext, Cache
from kvjax.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [D/2] (float32), with Llama-3.1 ("llama3") scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    if config.rope_scaling is None:
        return inv_freq.astype(np.float32)
    kind, factor, low_ff, high_ff, old_ctx = config.rope_scaling
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    low_wavelen = old_ctx / low_ff
    high_wavelen = old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray):
    """cos, sin [B, T, D] (float32) for integer positions [B, T] (HF's half-split layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x[B, T, H, D]`` by RoPE (rotate-half convention, computed in x's dtype as HF does)."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Linear(nnx.Module):
    """``y = x @ weight.T (+ bias)`` with ``weight[out, in]`` (HF's layout)."""

    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (dout, din), dtype) * 0.02)
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.lax.dot_general(x, self.weight[...], (((x.ndim - 1,), (1,)), ((), ())))
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as HF Llama/Qwen)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class Attention(nnx.Module):
    """GQA self-attention whose cache handling is delegated to the cache's method.

    q, k and v come from one fused projection ``qkv_proj``. Its output rows are ``tensor_parallel``
    blocks, each ``q | k | v`` of a contiguous share of the heads (one block, q | k | v, by default;
    :mod:`kvjax.models.sharding` reorders the rows for a mesh), so a device holding one block computes
    its own heads' q, k and v with no communication.
    """

    def __init__(self, config: ModelConfig, layer: int, dtype, rngs: nnx.Rngs, tensor_parallel: int = 1):
        c = config
        self.layer = layer
        self.tensor_parallel = tensor_parallel
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_proj = Linear(
            c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=c.attention_bias, dtype=dtype, rngs=rngs
        )
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dtype, rngs=rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, cos, sin, cache: Cache, ctx: AttendContext):
        B, T, _ = x.shape
        H, Hkv, D, G = self.num_heads, self.num_kv_heads, self.head_dim, self.tensor_parallel
        qkv = self.qkv_proj(x).reshape(B, T, G, (H + 2 * Hkv) // G * D)  # G blocks of q | k | v
        hq, hk = H // G * D, Hkv // G * D
        q = qkv[..., :hq].reshape(B, T, H, D)
        k = qkv[..., hq : hq + hk].reshape(B, T, Hkv, D)
        v = qkv[..., hq + hk :].reshape(B, T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        ctx = ctx.replace(q_pre_rope=q, k_pre_rope=k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, state = cache.attend(q, k, v, ctx.replace(layer=self.layer))
        return self.o_proj(out.reshape(B, T, H * D)), state


class MLP(nnx.Module):
    """SwiGLU feed-forward ``down(silu(gate(x)) * up(x))``, gate and up fused as ``gate_up_proj``.

    ``gate_up_proj``'s rows are ``tensor_parallel`` blocks of ``gate | up`` for a contiguous share of
    the hidden units (as ``Attention``'s q | k | v blocks).
    """

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs, tensor_parallel: int = 1):
        c = config
        self.intermediate_size = c.intermediate_size
        self.tensor_parallel = tensor_parallel
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        G, inner = self.tensor_parallel, self.intermediate_size // self.tensor_parallel
        gate_up = self.gate_up_proj(x).reshape(*x.shape[:-1], G, 2 * inner)  # G blocks of gate | up
        gate = gate_up[..., :inner].reshape(*x.shape[:-1], self.intermediate_size)
        up = gate_up[..., inner:].reshape(*x.shape[:-1], self.intermediate_size)
        return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, layer: int, dtype, rngs: nnx.Rngs, tensor_parallel: int = 1):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer, dtype, rngs, tensor_parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs, tensor_parallel)

    def __call__(self, x, cos, sin, cache, ctx):
        h, state = self.self_attn(self.input_layernorm(x), cos, sin, cache, ctx)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), state


class Embedding(nnx.Module):
    """Token embedding table ``embedding[V, d]``."""

    def __init__(self, vocab: int, dim: int, dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), dtype) * 0.02)

    def __call__(self, tokens):
        return jnp.take(self.embedding[...], tokens, axis=0)


class CausalLM(nnx.Module):
    """Llama / Qwen2 / Qwen3 causal language model.

    ``tensor_parallel``: blocks of the fused projections' rows (:class:`Attention`, :class:`MLP`); 1
    is HF's order, a mesh's ``model`` size is the layout :func:`kvjax.models.sharding.shard_model` makes.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, tensor_parallel: int = 1):
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs, tensor_parallel) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            None if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )

    def __call__(self, tokens, positions, cache: Cache, *, last_only: bool = False):
        """Logits [B, T or 1, V] (float32) and the updated cache; see :func:`forward`."""
        B, T = tokens.shape
        x = self.embed_tokens(tokens)
        inv_freq = jnp.asarray(rope_inv_freq(self.config))
        cos, sin = rope_cos_sin(positions, inv_freq)
        for i, layer in enumerate(self.layers):
            ctx = AttendContext(start=cache.length, pad=cache.pad, positions=positions, rope_inv_freq=inv_freq, layer=i)
            x, state = layer(x, cos, sin, cache, ctx)
            # later layers see this layer's new state (methods whose heads follow another layer's heads)
            cache = cache.replace(layers=cache.layers[:i] + (state,) + cache.layers[i + 1:])
        x = self.norm(x)
        if last_only:
            x = x[:, -1:]
        if self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", x, self.embed_tokens.embedding[...], preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("btd,vd->btv", x, self.lm_head.weight[...], preferred_element_type=jnp.float32)
        new_cache = cache.replace(length=cache.length + T)
        return logits, new_cache


def abstract_model(config: ModelConfig, dtype=jnp.float32, tensor_parallel: int = 1) -> CausalLM:
    """The model with shape-only parameters (nothing allocated): the target of weight loading."""
    return nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0), tensor_parallel=tensor_parallel))


def random_model(config: ModelConfig, dtype=jnp.float32, seed: int = 0) -> CausalLM:
    """A randomly initialised model (tests and benchmarks of tiny configs)."""
    return CausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))


def random_params(config: ModelConfig, dtype=jnp.float32, seed: int = 0):
    """The parameters of :func:`random_model` (same values), made by one jitted program on the default device: an
    8B-shaped model's 16 GB of bf16 weights are created where they are used, with no host copy or transfer."""
    return jax.jit(lambda: nnx.split(random_model(config, dtype, seed))[1])()


def forward(graphdef, params, tokens, positions, cache: Cache, *, last_only: bool = False):
    """Pure forward for prefill, chunked prefill and decode.

    Args:
      graphdef, params: from ``nnx.split(model)``.
      tokens, positions: int32 [B, T]; the tokens occupy cache slots ``cache.length ..+T``.
      cache: the :class:`~kvjax.cache.Cache` (its method decides what is stored and attended).
      last_only: return only the last position's logits (prefill: skips the LM head elsewhere).
    Returns:
      (logits float32 [B, T or 1, V], new cache)
    """
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, cache, last_only=last_only)
