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

import os as _os

# The repository's top-level folders (models/, evals/, train/, pallas_kernels/) are kvjax's subpackages: an install
# maps them (pyproject's package-dir); a source checkout used without installing (PYTHONPATH=., as on a lent GPU
# machine) finds them beside this package.
_REPOSITORY = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "models")) and _os.path.isfile(
        _os.path.join(_REPOSITORY, "models", "__init__.py")):
    __path__.append(_REPOSITORY)

from kvjax.cache import AttendContext, Cache, CacheSpec  # noqa: E402
from kvjax.methods import METHODS, FullCache, get_method  # noqa: E402
from kvjax.api import GenerationResult, ask, compare, generate, load  # noqa: E402

__version__ = "0.1.0"

__all__ = ["AttendContext", "Cache", "CacheSpec", "FullCache", "METHODS", "get_method", "load", "generate", "compare", "ask", "GenerationResult"]
