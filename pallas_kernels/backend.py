"""Which form of a kernel to build: the TPU form (Mosaic) or the GPU form (Triton)."""

from __future__ import annotations

import jax

# The custom call a Pallas kernel's GPU form (Triton) lowers to; ``jax.export`` must be told to allow it.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


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
