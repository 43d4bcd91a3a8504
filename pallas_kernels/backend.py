"""What the kernels share: the implementation and backend tables, their common argument checks, and
which form of a kernel to build (the TPU form, Mosaic; the GPU form, Triton; or, asked for by name, the paged
kernel's Mosaic GPU form)."""

from __future__ import annotations

import jax
import numpy as np

# The custom calls a Pallas kernel's GPU forms (Triton, Mosaic GPU) lower to; ``jax.export`` must be told to allow them.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CUSTOM_CALL = "mosaic_gpu_v2"

# Logit of a masked position: finite, so a row with nothing valid gives no NaN.
MASK_VALUE = 0.7 * float(np.finfo(np.float32).min)

IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret")
# None: the running platform's; "gpu": Triton; "mosaic_gpu": Mosaic GPU (H100 / H200; the paged kernel only).
BACKENDS = (None, "tpu", "gpu", "mosaic_gpu")


def check_call(implementation: str, backend: str | None, q) -> None:
    """``ValueError`` unless ``implementation`` and ``backend`` are known and ``q`` is ``[B, H_q, D]``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; allowed: {IMPLEMENTATIONS}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H_q, D], got shape {q.shape}")


def check_group(num_q_heads: int, num_kv_heads: int, source: str) -> None:
    """``ValueError`` unless ``H_q`` is a positive multiple of ``H_kv`` (read from ``source``)."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"H_q={num_q_heads} (from q) must be a positive multiple of H_kv={num_kv_heads} "
            f"(from {source})"
        )


def check_sizes(**sizes) -> None:
    """``ValueError`` unless every value is a positive int or None (block sizes, split counts: None
    picks a default)."""
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name}={value!r}; must be a positive int or None")


def check_lengths_shape(lengths, batch: int, num_kv_heads: int) -> None:
    """``ValueError`` unless ``lengths`` is ``[B, H_kv]``."""
    if lengths.shape != (batch, num_kv_heads):
        raise ValueError(
            f"lengths must have shape [B, H_kv] = {(batch, num_kv_heads)}, got {lengths.shape}"
        )


def resolve_backend(implementation: str, backend: str | None) -> str:
    """``backend`` if given, else the running platform's form (``"tpu"`` or ``"gpu"``).

    On CPU, ``implementation="pallas"`` cannot run and is a ``ValueError``; interpret mode
    (``"pallas_interpret"``) interprets the GPU form, which needs no host callbacks.
    """
    if backend is not None:
        return backend
    platform = jax.default_backend()
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if implementation == "pallas":
        raise ValueError(
            f"implementation='pallas' needs a TPU or GPU, but jax.default_backend() is "
            f"{platform!r}; use implementation='xla' or 'pallas_interpret' on CPU"
        )
    return "gpu"
