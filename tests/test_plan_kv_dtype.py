"""The capacity planner (:mod:`kvjax.evals.plan`) plans caches stored in a quantized ``kv_dtype``: ``--kv-dtype int8``
reaches every cache it compiles, whose page pools (and the full cache's buffer) are then int8 with float32 scales,
and the memory per row shrinks by the ratio of the stored KV bytes.

The plan compiles for an H100 with jax's CUDA plugin (a compiler only, no GPU), which only a worker process puts on
its path, as in ``tests/test_accelerator_compile.py``: this file is that worker too
(``python -m tests.test_plan_kv_dtype OUT_DIR``, ``PYTHONPATH`` holding ``.aot-gpu``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, ROOM, BUDGET = 4032, 64, 0.5  # prompt + room: 4096 slots, a whole number of attention blocks
METHODS = "full,snapkv"
MODEL = "tiny-mesh-d16"  # tests.mesh_worker.CONFIG_D16 (the paged kernel's GPU form needs D >= 16)


def worker(out_dir: str) -> None:
    """Plans the tiny model on an H100 twice, KV in the model's dtype (bfloat16) and ``--kv-dtype int8``, through
    :func:`kvjax.evals.plan.main`; prints both reports and the dtypes of every cache compiled (JSON, last line)."""
    from kvjax.evals.gpu_schedule import compile_only_cuda

    compile_only_cuda()
    import jax

    import kvjax.models
    from kvjax.evals import plan, synthetic
    from tests.mesh_worker import CONFIG_D16

    real_architecture = kvjax.models.model_architecture
    kvjax.models.model_architecture = lambda name: (CONFIG_D16, None) if name == MODEL else real_architecture(name)
    real_abstract = synthetic.abstract_compressed_cache
    leaves: list = []

    def recording(method, spec, mesh, artifact=None):
        cache = real_abstract(method, spec, mesh, artifact)
        found = [(jax.tree_util.keystr(p).rsplit(".", 1)[-1], x) for p, x in
                 jax.tree_util.tree_leaves_with_path(cache.layers)]
        nbytes = {}
        for name, x in found:
            nbytes[name] = nbytes.get(name, 0) + x.size * x.dtype.itemsize
        leaves.append({"method": method.name, "kv_dtype": spec.kv_dtype, "batch": spec.batch, "bytes": nbytes,
                       "dtypes": sorted({(name, str(x.dtype)) for name, x in found})})
        return cache

    synthetic.abstract_compressed_cache = recording
    reports = {}
    for kv in (None, "int8"):
        out = os.path.join(out_dir, f"plan_{kv}.md")
        argv = ["--model", MODEL, "--targets", "h100", "--methods", METHODS, "--budgets", str(BUDGET),
                "--lengths", str(PROMPT), "--room", str(ROOM), "--dtype", "bfloat16", "--no-verify", "--out", out]
        plan.main(argv + (["--kv-dtype", kv] if kv else []))
        with open(os.path.splitext(out)[0] + ".json") as f:
            reports[str(kv)] = json.load(f)
        with open(out) as f:
            reports[str(kv)]["markdown"] = f.read()
    print(json.dumps({"reports": reports, "leaves": leaves}))


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    gpu = os.environ.get("KVJAX_AOT_GPU") or os.path.join(ROOT, ".aot-gpu")
    if not os.path.isdir(os.path.join(gpu, "jax_plugins")):
        if os.environ.get("KVJAX_AOT_GPU"):
            pytest.fail(f"KVJAX_AOT_GPU={gpu} holds no jax CUDA plugin (scripts/setup_env.sh installs it)")
        pytest.skip("jax's CUDA plugin is not in .aot-gpu/ (scripts/setup_env.sh installs it)")
    out = tmp_path_factory.mktemp("plan")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([gpu, ROOT]), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.test_plan_kv_dtype", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kv_bytes(leaf: dict) -> int:
    """Bytes of a cache's stored keys and values and their scales (every layer; no page tables or lengths)."""
    return sum(n for name, n in leaf["bytes"].items() if name in KV_LEAVES)


KV_LEAVES = ("k", "v", "k_pages", "v_pages", "k_scales", "v_scales")


def test_int8_plan_rows_shrink_by_the_stored_kv_bytes(planned):
    """Per token and KV head an int8 cache stores ``D`` bytes + a 4-byte scale, for K and for V, where the bfloat16
    cache stores ``2 D``: with ``D = 16``, 20 / 32 = 0.625 of the KV bytes (the full cache's bfloat16 KV counted by
    hand: layers x KV heads x (prompt + room) x D x 2 bytes x 2). The planned memory per row (compiled: the cache plus
    the step's per-row temporaries) shrinks by the KV bytes saved, within 5 % of the bfloat16 KV bytes (temporaries);
    the int8 plan fits more rows; the report records the dtype and says so in its header."""
    from tests.mesh_worker import CONFIG_D16 as c

    D = c.head_dim
    ratio = (D + 4) / (D * 2)
    base, int8 = planned["reports"]["None"], planned["reports"]["int8"]
    assert base["args"]["kv_dtype"] is None and int8["args"]["kv_dtype"] == "int8"
    assert "KV stored in int8" in int8["markdown"] and "KV stored in int8" not in base["markdown"]
    caches = {(leaf["method"], leaf["kv_dtype"]): kv_bytes(leaf) for leaf in planned["leaves"] if leaf["batch"] == 1}
    assert caches[("full", "bfloat16")] == c.num_layers * c.num_kv_heads * (PROMPT + ROOM) * D * 2 * 2
    rows = {r["method"]: r for r in base["targets"]["h100"]}
    checked = 0
    for r in int8["targets"]["h100"]:
        b = rows[r["method"]]
        assert "error" not in r and "error" not in b, (r, b)
        bf16_kv, int8_kv = caches[(r["method"], "bfloat16")], caches[(r["method"], "int8")]
        assert int8_kv == bf16_kv * ratio, (r["method"], int8_kv, bf16_kv)
        saved = b["per_row_bytes"] - r["per_row_bytes"]
        assert saved == pytest.approx(bf16_kv - int8_kv, abs=0.05 * bf16_kv), (r["method"], saved, bf16_kv - int8_kv)
        assert r["per_row_bytes"] / b["per_row_bytes"] < 1 - 0.9 * (1 - ratio) * bf16_kv / b["per_row_bytes"]
        assert r["max_batch"] > b["max_batch"]
        checked += 1
    assert checked == len(METHODS.split(","))


def test_every_cache_the_int8_plan_compiles_is_int8(planned):
    """Every cache compiled for the int8 plan (its ``CacheSpec.kv_dtype``: main's and compile_step's) holds int8 keys
    and values with float32 per-token scales; the default plan's hold bfloat16 and no scales."""
    by_kv: dict = {}
    for leaf in planned["leaves"]:
        by_kv.setdefault(leaf["kv_dtype"], []).append(leaf)
    assert set(by_kv) == {"bfloat16", "int8"}, [leaf["kv_dtype"] for leaf in planned["leaves"]]
    for leaf in by_kv["int8"]:
        dtypes = dict(leaf["dtypes"])
        kv = {k: v for k, v in dtypes.items() if k in KV_LEAVES[:4]}
        assert len(kv) == 2 and set(kv.values()) == {"int8"}, leaf
        assert dtypes["k_scales"] == dtypes["v_scales"] == "float32", leaf
    for leaf in by_kv["bfloat16"]:
        dtypes = dict(leaf["dtypes"])
        assert "k_scales" not in dtypes and {v for k, v in dtypes.items() if k in KV_LEAVES[:4]} \
            == {"bfloat16"}, leaf


if __name__ == "__main__":
    worker(sys.argv[1])
