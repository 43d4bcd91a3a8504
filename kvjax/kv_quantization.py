"""Quantized storage of the compressed KV page pools (the cache spec's ``kv_dtype``).

Scheme: symmetric absmax quantization with one float32 scale per stored token vector, i.e. per
(token, KV head): the ``D`` values of one key (or value) share a scale ``s = absmax / qmax``.

* ``"int8"``: ``s = absmax / 127``, ``q = clip(round(x / s), -127, 127)``; ``|x - q s| <= s / 2``
  per element.
* ``"float8_e4m3fn"``: ``s = absmax / 448`` (the format's largest finite value),
  ``q = (x / s).astype(float8_e4m3fn)``: 3 mantissa bits, a relative error of at most 2^-4 per
  element in the format's normal range (``|x| >= 2^-6 s``).
* ``"bfloat16"``: a cast, no scales.

A row of zeros gets ``s = 0`` and stores zeros (division by a safe 1), so it dequantizes to zeros,
never NaN. Dequantization is ``q * s`` in float32, cast to the attention's dtype.

Why per token: an evicted cache keeps tokens of every part of the prompt side by side in one page
(and appends decoded tokens after them), so a page mixes tokens whose ranges differ by orders of
magnitude (attention sinks, outlier tokens). A scale per token follows each token's own range and
does not depend on which tokens share its page, which makes quantize-then-evict the same as
evict-then-quantize. A per-page scale would make every stored token's error depend on the
page's largest neighbour.

What is quantized: the page pools the compressed cache keeps (:func:`kvjax.paged.build_paged`
at compression, :func:`kvjax.paged.append` for later tokens; Quest's page bounds are then taken over
the dequantized stored keys, :mod:`kvjax.methods.quest`) and the full cache's contiguous buffer
(:mod:`kvjax.methods.full`), and HCAttention's host values (:mod:`kvjax.methods.hcattention`, its scales in
host memory beside them). The prefill (staging, working buffers) stays in the model's dtype, so
prompt-time selection scores are computed on unquantized prefill keys (decode-time selection
reads the stored keys dequantized: Quest's page bounds, HeteroCache's and SyncKV's leaders); the
other methods whose compressed layout is not the paged pool reject a ``kv_dtype`` other than the
model's (:func:`reject_kv_dtype`).
"""

from __future__ import annotations

import jax.numpy as jnp

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}  # largest stored magnitude of each quantized dtype
SCALE_DTYPE = jnp.float32  # one scale per stored vector
KV_DTYPES = ("bfloat16", "int8", "float8_e4m3fn")  # besides the model's dtype


def check_kv_dtype(kv_dtype, model_dtype) -> str:
    """The name of ``kv_dtype`` (None: the model's dtype); ValueError naming the allowed values otherwise."""
    model = jnp.dtype(model_dtype).name
    if kv_dtype is None:
        return model
    try:
        name = jnp.dtype(kv_dtype).name
    except TypeError:
        name = str(kv_dtype)
    allowed = (model,) + tuple(d for d in KV_DTYPES if d != model)
    if name not in allowed:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not supported; allowed: {', '.join(allowed)} "
                         f"(the model's dtype is {model})")
    return name


def is_quantized(kv_dtype) -> bool:
    """True for a dtype stored with per-token scales (int8, float8_e4m3fn)."""
    return kv_dtype in QMAX


def stored_vector_bytes(head_dim: int, kv_dtype) -> int:
    """Bytes of one stored key (or value) vector of ``head_dim`` values in ``kv_dtype``, its scale included when
    quantized."""
    name = jnp.dtype(kv_dtype).name
    return head_dim * jnp.dtype(name).itemsize + (jnp.dtype(SCALE_DTYPE).itemsize if is_quantized(name) else 0)


def quantize(x, kv_dtype: str):
    """``(q, scales)`` of ``x[..., D]`` for ``kv_dtype``: ``q`` in that dtype, ``scales[...]`` float32 (one per
    vector of ``D`` values); ``scales`` is None for an unquantized dtype (a cast)."""
    if not is_quantized(kv_dtype):
        return x.astype(kv_dtype), None
    x = x.astype(jnp.float32)
    qmax = QMAX[kv_dtype]
    scales = (jnp.max(jnp.abs(x), axis=-1) / qmax).astype(SCALE_DTYPE)
    y = x / jnp.where(scales > 0, scales, 1.0)[..., None]
    if kv_dtype == "int8":
        y = jnp.round(y)
    return jnp.clip(y, -qmax, qmax).astype(kv_dtype), scales


def dequantize(q, scales, dtype):
    """``q * scales`` in ``dtype`` (``scales`` None: a cast)."""
    if scales is None:
        return q.astype(dtype)
    return (q.astype(jnp.float32) * scales[..., None]).astype(dtype)


def reject_kv_dtype(spec, method: str, why: str) -> None:
    """ValueError when ``spec.kv_dtype`` is not the model's dtype: ``method`` keeps its cache outside the paged pools
    (``why``), in the model's dtype."""
    if spec.kv_dtype != spec.dtype:
        raise ValueError(f"kv_dtype={spec.kv_dtype} is not supported by {method}: {why}; another kv_dtype than the "
                         f"model's ({spec.dtype}) is stored only in the paged pools of the evict-after-prefill and "
                         "bounded-prefill methods and Quest, the full cache, HeteroCache and SyncKV (pools and host "
                         "copy) and in HCAttention's host values")
