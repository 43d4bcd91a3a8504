"""The wheel built from the repository installs its packages under the kvjax name only: `models`, `evals`, `train`
and `pallas_kernels` become kvjax.models, ... (pyproject's package-dir), so nothing generic lands in site-packages
beside a user's own packages, and the installed copy imports and carries its data without the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_wheel_installs_kvjax_alone_and_imports_from_anywhere(tmp_path):
    dist, target = tmp_path / "dist", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    ROOT], check=True, capture_output=True)
    (wheel,) = dist.glob("kvjax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"kvjax"}
    for folder in ("models", "evals", "train", "pallas_kernels"):
        assert any(n.startswith(f"kvjax/{folder}/") for n in names), folder
    assert any(n.startswith("kvjax/data/locret/") for n in names)  # shipped artifacts
    assert any(n.startswith("kvjax/evals/data/nltk/") for n in names)  # RULER's sentence model
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    installed = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert installed - {"bin"} == {"kvjax"}, installed  # bin: the `kvjax` console script
    check = ("import importlib.util, kvjax, kvjax.models, kvjax.evals.runner, kvjax.train.locret, kvjax.pallas_kernels\n"
             f"assert kvjax.__file__.startswith({str(target)!r}), kvjax.__file__\n"
             f"assert kvjax.models.__file__.startswith({str(target)!r}), kvjax.models.__file__\n"
             "assert all(importlib.util.find_spec(n) is None for n in ('models', 'evals', 'train', 'pallas_kernels'))\n")
    env = {**os.environ, "PYTHONPATH": str(target)}
    subprocess.run([sys.executable, "-c", check], check=True, cwd=tmp_path, env=env, capture_output=True)
