"""Moving cached RoPE keys to other positions (Locret's contiguous positions).

RoPE rotates each pair ``(x[i], x[i + D/2])`` (the rotate-half layout of ``kvjax.models.llama.apply_rope``
and HF) by the angle ``position * inv_freq[i]``. Rotations compose, so a key already rotated to
position ``p`` is moved to ``p + delta`` by a rotation of ``delta * inv_freq``: no pre-RoPE copy is
needed.
"""

from __future__ import annotations

import jax.numpy as jnp


def shift_rope(x, delta, inv_freq):
    """``x[..., D]`` (RoPE'd at some positions) rotated by ``delta[...]`` further positions.

    ``inv_freq[D/2]``: the model's inverse frequencies (scaling included). Computed in float32 and
    returned in ``x``'s dtype; entries with ``delta == 0`` come back unchanged.
    """
    if inv_freq is None:
        raise ValueError("shift_rope needs the model's RoPE inverse frequencies (AttendContext.rope_inv_freq); "
                         "the model did not provide them")
    half = x.shape[-1] // 2
    if inv_freq.shape != (half,):
        raise ValueError(f"inv_freq has shape {inv_freq.shape}, expected ({half},) for head_dim {x.shape[-1]}")
    angle = delta.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xf = x.astype(jnp.float32)
    lo, hi = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)
    return jnp.where((delta == 0)[..., None], x, out.astype(x.dtype))


__all__ = ["shift_rope"]
