"""Imports point one way (docs/ARCHITECTURE.md): pallas_kernels <- kvjax's core <- models <- the top layer (kvjax's
api, cli, artifact making and package facade) <- train <- evals. Every import statement of every module counts,
those inside functions too."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_LAYER = {"kvjax/__init__.py", "kvjax/api.py", "kvjax/cli.py", "kvjax/make_artifacts.py"}
TOP_MODULES = {"kvjax.api", "kvjax.cli", "kvjax.make_artifacts"}


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


def upward(module_path: str, name: str) -> bool:
    """Whether the module at ``module_path`` (relative to the repository) importing ``name`` points up a layer."""
    first = name.split(".")[0]
    if module_path.startswith("pallas_kernels/"):
        return first in ("kvjax", "models", "train", "evals")
    if module_path.startswith("kvjax/") and module_path not in TOP_LAYER:
        return first in ("models", "train", "evals") or name == "kvjax" or any(
            name == m or name.startswith(m + ".") for m in TOP_MODULES)
    if module_path.startswith("models/"):
        return first in ("train", "evals") or any(name == m or name.startswith(m + ".") for m in TOP_MODULES)
    if module_path.startswith("train/"):
        return first == "evals"
    return False


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
    ("kvjax/methods/example.py", "def f():\n    from models import load_model\n"),
    ("kvjax/cache.py", "import evals.runner\n"),
    ("kvjax/decoding.py", "from kvjax import api\n"),
    ("models/llama.py", "from kvjax.cli import main\n"),
    ("train/data.py", "from evals.tasks import TASKS\n"),
    ("pallas_kernels/x.py", "from kvjax.attention import MASK_VALUE\n"),
])
def test_the_check_sees_an_upward_import(path, source):
    assert any(upward(path, n) for n in imported_modules(source))


def test_the_top_layer_and_the_layers_above_may_import_below():
    assert not any(upward("kvjax/api.py", n) for n in imported_modules("from models import load_model\n"))
    assert not any(upward("evals/runner.py", n) for n in imported_modules("from train.data import qa_samples\n"))
    assert not any(upward("kvjax/methods/kvzip.py", n) for n in imported_modules("from kvjax.cache import Cache\n"))
