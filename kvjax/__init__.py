"""kvjax: Llama / Qwen in JAX with compressed KV caches behind one jitted ``generate``.

>>> import kvjax
>>> model = kvjax.load("qwen2.5-coder-0.5b")
>>> out = kvjax.generate(model, "Hello", max_new_tokens=16)

This package does not import ``models`` at import time (no import cycle: ``models`` builds on the
cache defined here); :mod:`kvjax.api` imports it inside its functions. The jitted functions live in
the module ``kvjax.generate`` (``from kvjax.generate import decode_loop``); the attribute
``kvjax.generate`` is the high-level function.
"""

from kvjax.cache import AttendContext, Cache
from kvjax.methods import METHODS, FullCache, get_method
from kvjax.api import GenerationResult, generate, load  # after the submodule import: the function wins

__version__ = "0.1.0"


__all__ = ["AttendContext", "Cache", "FullCache", "METHODS", "get_method", "load", "generate", "GenerationResult"]
