"""kvjax: Llama / Qwen in JAX with compressed KV caches behind one jitted ``generate``.

>>> import kvjax
>>> model = kvjax.load("qwen2.5-coder-0.5b")
>>> out = kvjax.generate(model, "Hello", max_new_tokens=16)

No module of the core (cache, methods, attention, ``kvjax.generate``) imports ``models``: the
jitted functions take the forward from the loaded model (``nnx.merge(graphdef, params)``), and
:mod:`kvjax.api` imports ``models`` only inside ``load``/``generate``, so ``models`` builds on the
core with no import cycle. The jitted functions live in the module ``kvjax.generate``
(``from kvjax.generate import decode_loop``); the attribute ``kvjax.generate`` is the high-level
function (imported last, so it wins over the submodule of the same name).
"""

from kvjax.cache import AttendContext, Cache, CacheSpec
from kvjax.methods import METHODS, FullCache, get_method
from kvjax.api import GenerationResult, ask, generate, load  # noqa: E402  (after the submodule import: the function wins)

__version__ = "0.1.0"

__all__ = ["AttendContext", "Cache", "CacheSpec", "FullCache", "METHODS", "get_method", "load", "generate", "ask", "GenerationResult"]
