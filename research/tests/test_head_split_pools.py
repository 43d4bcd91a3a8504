"""`python -m research.head_split_pools`: the recall methods' abstract caches on one device (SmolLM2's shapes) and,
where libtpu is in ``.aot-tpu`` (or ``KVJAX_AOT_TPU``), HeteroCache's page pool on a v5e-8 (Llama-3.1-8B's shapes):
one full-length head per chip, as ``docs/results/plan/head_split_pools/README.md`` records."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_leaves_on_one_device(capsys):
    from research.head_split_pools import main

    assert main(["leaves", "full,heterocache,synckv", "0.25", "512", "--model", "smollm2-135m"]) == 0
    lines = capsys.readouterr().out.splitlines()
    totals = {line.split(" ", 1)[0]: ast.literal_eval(line.split(" ", 1)[1]) for line in lines if " {" in line}
    assert set(totals) == {"full", "heterocache", "synckv"} and set(totals["full"]) == {"device"}
    for name in ("heterocache", "synckv"):  # the followers' prompt KV in host memory, less on the device than full
        assert totals[name]["pinned_host"] > 0 and totals[name]["device"] < totals["full"]["device"]
        assert any(line.startswith(f"{name} .layers[0].paged.k_pages ") for line in lines)


def test_mesh_leaves_hold_a_full_head_per_chip_on_a_v5e8():
    plugin = os.environ.get("KVJAX_AOT_TPU") or os.path.join(ROOT, ".aot-tpu")
    if not os.path.isdir(plugin) or not any(n.startswith("libtpu") for n in os.listdir(plugin)):
        pytest.skip("libtpu is not in .aot-tpu/ (scripts/setup_env.sh installs it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([plugin, ROOT]), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "research.head_split_pools", "mesh-leaves", "heterocache", "0.25",
                           "16384"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pool = next(line for line in proc.stdout.splitlines() if ".layers[0].paged.k_pages " in line)
    assert "(8224, 16, 128)" in pool and "'model': 8" in pool  # 8 chips x 1,028 pages = a 16,448-slot head each
