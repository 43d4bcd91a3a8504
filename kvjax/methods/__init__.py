"""KV-cache methods, one module each, and the name -> class registry used by the API and CLI."""

from __future__ import annotations

from kvjax.methods.base import Method, PromptCompression
from kvjax.methods.full import FullCache
from kvjax.methods.h2o import H2O
from kvjax.methods.hbw import HBW
from kvjax.methods.heterocache import HeteroCache
from kvjax.methods.pyramidkv import PyramidKV
from kvjax.methods.quest import Quest
from kvjax.methods.snapkv import SnapKV
from kvjax.methods.streaming_llm import StreamingLLM
from kvjax.methods.synckv import SyncKV

METHODS: dict[str, type] = {
    "full": FullCache,
    "snapkv": SnapKV,
    "streaming_llm": StreamingLLM,
    "h2o": H2O,
    "pyramidkv": PyramidKV,
    "hbw": HBW,
    "quest": Quest,
    "heterocache": HeteroCache,
    "synckv": SyncKV,
}


def get_method(name: str, **kwargs) -> Method:
    """Instantiate the method registered under ``name`` with its hyper-parameters."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name](**kwargs)


__all__ = ["Method", "PromptCompression", "FullCache", "SnapKV", "StreamingLLM", "H2O", "PyramidKV", "HBW", "Quest", "HeteroCache", "SyncKV",
           "METHODS", "get_method"]
