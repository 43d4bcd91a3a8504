"""Imports point one way (docs/ARCHITECTURE.md): pallas_kernels <- kvjax's core <- models <- kvjax's API (``api``,
``make_artifacts`` and the package facade) <- train <- evals <- the command line (``kvjax.cli``), the folders imported as ``kvjax.<folder>`` (what the
wheel installs, tests/test_wheel.py). Every import statement of every module counts, those inside functions too."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# layers from the bottom up; the repository's top-level folders install as kvjax.<folder>
KERNELS, CORE, MODELS, API, TRAIN, EVALS, CLI = range(7)
FOLDERS = {"pallas_kernels": KERNELS, "models": MODELS, "train": TRAIN, "evals": EVALS}
ENTRY = {"api": API, "make_artifacts": API, "cli": CLI}  # kvjax's modules above the models


def imported_modules(source: str) -> set[str]:
    """Absolute module names a source imports (``import a.b``, ``from a.b import c``), at any depth."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def layer_of_module(name: str) -> int | None:
    """The layer of an imported kvjax module (None: not kvjax's); the bare package is its facade (the API's layer)."""
    parts = name.split(".")
    if parts[0] != "kvjax":
        return None
    if len(parts) == 1:
        return API
    return FOLDERS.get(parts[1], ENTRY.get(parts[1], CORE))


def layer_of_file(path: str) -> int:
    """The layer of a library file (relative to the repository)."""
    folder, rest = path.split("/", 1)
    if folder == "kvjax":
        return API if rest == "__init__.py" else ENTRY.get(rest.removesuffix(".py"), CORE)
    return FOLDERS[folder]


def upward(module_path: str, name: str) -> bool:
    """Whether the module at ``module_path`` importing ``name`` points up a layer, or imports one of the repository's
    folders by its bare, generic name (they install as ``kvjax.<folder>`` only)."""
    if name.split(".")[0] in FOLDERS:
        return True
    layer = layer_of_module(name)
    return layer is not None and layer > layer_of_file(module_path)


def library_modules():
    for pkg in ("pallas_kernels", "kvjax", "models", "train", "evals"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")


def test_no_module_imports_a_layer_above_its_own():
    found = []
    for path in library_modules():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            names = imported_modules(f.read())
        found += [f"{path} imports {n}" for n in sorted(names) if upward(path, n)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path, source", [
    ("kvjax/methods/example.py", "def f():\n    from kvjax.models import load_model\n"),
    ("kvjax/cache.py", "import kvjax.evals.runner\n"),
    ("kvjax/decoding.py", "from kvjax import api\n"),
    ("models/llama.py", "from kvjax.api import load\n"),
    ("evals/runner.py", "from kvjax.cli import main\n"),
    ("train/data.py", "from kvjax.evals.tasks import TASKS\n"),
    ("pallas_kernels/x.py", "from kvjax.attention import MASK_VALUE\n"),
])
def test_the_check_sees_an_upward_import(path, source):
    assert any(upward(path, n) for n in imported_modules(source))


def test_layers_may_import_below_themselves():
    assert not any(upward("kvjax/api.py", n) for n in imported_modules("from kvjax.models import load_model\n"))
    assert not any(upward("evals/runner.py", n) for n in imported_modules("from kvjax.train.data import qa_samples\n"))
    assert not any(upward("kvjax/cli.py", n) for n in imported_modules("from kvjax.evals.runner import main\n"))
    assert not any(upward("pallas_kernels/a.py", n) for n in imported_modules("from kvjax.pallas_kernels.b import c\n"))
    assert not any(upward("kvjax/methods/kvzip.py", n) for n in imported_modules("from kvjax.cache import Cache\n"))
