"""`kvjax bench matvec` on one layer of SmolLM2's shapes: report structure and the product variants' values."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.evals import bench_matvec
from tests.conftest import ready_model_or_skip


def test_variants_compute_the_same_product_as_numpy():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 32)).astype(np.float32)
    x = rng.standard_normal(32).astype(np.float32)
    for name, (dtype, product) in bench_matvec._variants().items():
        wq = np.asarray(jnp.asarray(w).astype(dtype), np.float32)  # the weights as the variant sees them
        xq = np.asarray(jnp.asarray(x).astype(dtype), np.float32)
        got = np.asarray(jax.jit(product)(jnp.asarray(x).astype(dtype), jnp.asarray(w).astype(dtype)), np.float32)
        tol = 1e-5 if dtype == jnp.float32 else 5e-2
        np.testing.assert_allclose(got, wq @ xq, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.real_model
def test_report_has_every_variant(tmp_path):
    ready_model_or_skip("smollm2-135m")
    out = tmp_path / "m.md"
    assert bench_matvec.main(["--model", "smollm2-135m", "--layers", "1", "--steps", "1", "--repeats", "1",
                              "--bandwidth-mib", "8", "--bandwidth-repeats", "1", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "m.json").read_text())
    assert [r["variant"] for r in report["rows"]] == list(bench_matvec._variants())
    f32, bf16 = report["rows"][0], report["rows"][1]
    assert bf16["weight_bytes"] * 2 == f32["weight_bytes"]  # bf16 reads half the bytes
    # SmolLM2-135M: hidden 576, 9 q heads + 2x3 kv heads of 64, intermediate 1536
    assert report["shapes"] == [["qkv_proj", 960, 576], ["o_proj", 576, 576], ["gate_up_proj", 3072, 576],
                                ["down_proj", 576, 1536]]
    assert "| bf16 dot |" in out.read_text()


def test_bad_counts_are_rejected():
    with pytest.raises(ValueError, match="--steps"):
        bench_matvec.main(["--steps", "0"])
