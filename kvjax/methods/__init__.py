"""KV-cache methods, one module each, and the name -> class registry used by the API and CLI."""

from __future__ import annotations

import dataclasses

from kvjax.methods.base import Method, PromptCompression
from kvjax.methods.chunked_eviction import ChunkedEviction
from kvjax.methods.full import FullCache
from kvjax.methods.h2o import H2O
from kvjax.methods.hbw import HBW
from kvjax.methods.hcattention import HCAttention
from kvjax.methods.hcattention import PRESETS as HCATTENTION_PRESETS
from kvjax.methods.kvzip import KVzip
from kvjax.methods.locret import Locret
from kvjax.methods.recall import HeteroCache, SyncKV
from kvjax.methods.recall.heterocache import PRESETS as HETEROCACHE_PRESETS
from kvjax.methods.recall.synckv import PRESETS as SYNCKV_PRESETS
from kvjax.methods.pyramidkv import PyramidKV
from kvjax.methods.quest import Quest
from kvjax.methods.snapkv import SnapKV
from kvjax.methods.streaming_llm import StreamingLLM

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
    "hcattention": HCAttention,
    "locret": Locret,
    "chunked_eviction": ChunkedEviction,
    "kvzip": KVzip,
}

# Named configurations per method (``name:preset=P``): hyper-parameters chosen on the dev split. The defaults
# without a preset are the papers'.
PRESETS: dict[str, dict[str, dict]] = {
    "heterocache": HETEROCACHE_PRESETS,
    "synckv": SYNCKV_PRESETS,
    "hcattention": HCATTENTION_PRESETS,
}


def preset_options(name: str, preset: str) -> dict:
    """The hyper-parameters of ``name``'s preset ``preset``; ValueError naming the presets it has."""
    have = PRESETS.get(name, {})
    if preset not in have:
        listed = ", ".join(have) if have else "none"
        raise ValueError(f"{name} has no preset {preset!r}; its presets: {listed}")
    return dict(have[preset])


def get_method(name: str, **kwargs) -> Method:
    """Instantiate the method registered under ``name`` with its hyper-parameters.

    ``name`` may carry hyper-parameters as a spec, ``"synckv:stride=10:num_representatives=1"``
    (:func:`parse_method_spec`); keyword arguments win over the spec's. ``preset=P`` (in the spec or as a
    keyword) starts from the method's preset ``P`` (:data:`PRESETS`); hyper-parameters given beside it win.
    """
    base, spec_kwargs = parse_method_spec(name)
    if base not in METHODS:
        raise ValueError(f"unknown method {base!r}; available: {', '.join(sorted(METHODS))}")
    given = {**spec_kwargs, **kwargs}
    preset = given.pop("preset", None)
    options = {**(preset_options(base, str(preset)) if preset is not None else {}), **given}
    try:
        return METHODS[base](**options)
    except TypeError as e:  # an unknown hyper-parameter name
        fields = [f.name for f in dataclasses.fields(METHODS[base])]
        raise ValueError(f"{base}: {e}; its hyper-parameters are {', '.join(fields)}") from None


def parse_value(text: str):
    """A spec's value: ``true``/``false`` -> bool, ``none`` -> None, then int, float, else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_method_spec(spec: str) -> tuple[str, dict]:
    """``"name:key=value:key=value"`` -> ``(name, {key: value})``; values are int, float, true/false, none or text."""
    name, *parts = spec.strip().split(":")
    kwargs = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad method spec {spec!r}: expected name:key=value[:key=value...]")
        kwargs[key.strip()] = parse_value(value.strip())
    return name.strip(), kwargs


__all__ = ["Method", "PromptCompression", "FullCache", "SnapKV", "StreamingLLM", "H2O", "PyramidKV", "HBW", "Quest", "HeteroCache", "SyncKV", "HCAttention", "Locret", "ChunkedEviction", "KVzip",
           "METHODS", "PRESETS", "get_method", "parse_method_spec", "parse_value", "preset_options"]
