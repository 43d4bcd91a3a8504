"""`python -m research.step_bytes` at SmolLM2's shapes compiled for an H100 on the CPU (needs jax's CUDA plugin in
``.aot-gpu``, or ``KVJAX_AOT_GPU``): the listed operations' shares add up to at most the whole."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_step_bytes_lists_the_largest_operations():
    plugin = os.environ.get("KVJAX_AOT_GPU") or os.path.join(ROOT, ".aot-gpu")
    if not os.path.isdir(os.path.join(plugin, "jax_plugins")):
        pytest.skip("jax's CUDA plugin is not in .aot-gpu/ (scripts/setup_env.sh installs it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([plugin, ROOT]), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "research.step_bytes", "snapkv", "0.5", "256", "4", "--model",
                           "smollm2-135m"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("device traffic GiB ") and len(lines) == 5
    shares = [float(line.split("GiB")[1].split("%")[0]) for line in lines[1:]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 100.05
    assert any("dot_general" in line for line in lines[1:])
