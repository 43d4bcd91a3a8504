"""kvjax: Llama / Qwen in JAX with compressed KV caches behind one jitted ``generate``.

>>> import kvjax
>>> model = kvjax.load("qwen2.5-coder-0.5b")
>>> out = kvjax.generate(model, "Hello", max_new_tokens=16)

No module of the core (cache, methods, attention, ``kvjax.decoding``) imports ``models``: the
jitted functions take the forward from the loaded model (``nnx.merge(graphdef, params)``), and
:mod:`kvjax.api` imports ``models`` only inside ``load``/``generate``, so ``models`` builds on the
core with no import cycle. The jitted functions (prefill, compress, decode) live in
:mod:`kvjax.decoding`; ``kvjax.generate`` is the high-level function of :mod:`kvjax.api`.
"""

from kvjax.cache import AttendContext, Cache, CacheSpec
from kvjax.methods import METHODS, FullCache, get_method
from kvjax.api import GenerationResult, ask, compare, generate, load

__version__ = "0.1.0"

__all__ = ["AttendContext", "Cache", "CacheSpec", "FullCache", "METHODS", "get_method", "load", "generate", "compare", "ask", "GenerationResult"]
