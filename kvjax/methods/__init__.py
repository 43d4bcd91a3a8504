"""KV-cache methods, one module each, and the name -> class registry used by the API and CLI."""

from __future__ import annotations

from kvjax.methods.base import CompressionMethod
from kvjax.methods.full import FullCache

METHODS: dict[str, type] = {
    "full": FullCache,
}


def get_method(name: str, **kwargs) -> CompressionMethod:
    """Instantiate the method registered under ``name`` with its hyper-parameters."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name](**kwargs)


__all__ = ["CompressionMethod", "FullCache", "METHODS", "get_method"]
