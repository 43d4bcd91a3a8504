"""The kernel benchmark end to end on tiny sizes."""

from __future__ import annotations

import jax

ON_CPU = jax.default_backend() == "cpu"


def test_bench_kernels_smoke(tmp_path):
    """The benchmark script runs end to end on tiny sizes and writes Markdown + JSON."""
    import json

    from research.bench_kernels import main

    out = tmp_path / "kernels.md"
    result = main(["--smoke", "--out", str(out)])
    assert out.exists() and (tmp_path / "kernels.json").exists()
    data = json.loads((tmp_path / "kernels.json").read_text())
    impls = {r["impl"] for r in data["paged"]}
    assert {"xla_reference", "dense_xla"} <= impls and any(i.startswith("pallas") for i in impls)
    if ON_CPU:  # every form, interpreted: TPU, Triton, Mosaic GPU
        assert {"pallas_tpu_interpret", "pallas_gpu_interpret", "pallas_mosaic_gpu_interpret"} <= impls
    for r in result["paged"]:
        assert r["max_abs_diff"] < 5e-2  # bf16: every implementation agrees with the first
    assert "| tokens | impl |" in out.read_text()
