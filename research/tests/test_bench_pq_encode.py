"""`python -m research.bench_pq_encode`: both forms of ``encode_keys`` against a numpy nearest-centroid search, and the
report."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from research import bench_pq_encode
from kvjax.pq_codebooks import encode_keys


def test_both_forms_give_numpys_nearest_centroids():
    """Keys and centroids on a grid of 1/8 (every distance exact in f32, no near-ties): both forms, at a block that
    splits the tokens and at one that does not, pick numpy's nearest centroid (the first of equals)."""
    rng = np.random.default_rng(0)
    B, H, S, D, g, c = 2, 2, 40, 8, 4, 16
    k = rng.integers(-16, 16, (B, H, S, D)).astype(np.float32) / 8
    cb = rng.integers(-16, 16, (H, g, c, D // g)).astype(np.float32) / 8
    d2 = ((k.reshape(B, H, S, g, 1, D // g) - cb[None, :, None]) ** 2).sum(-1)  # [B, H, S, g, c]
    want = d2.argmin(-1)
    for block in (4 * B * H * 8 * g * c, 2**20):  # 8 tokens per block, or all of them
        for products in ("sum", "dot"):
            np.testing.assert_array_equal(np.asarray(encode_keys(k, cb, block_bytes=block, products=products)), want)


def test_an_unknown_product_form_is_refused():
    with pytest.raises(ValueError, match="products must be one of sum, dot, got 'matmul'"):
        encode_keys(np.zeros((1, 1, 4, 4), np.float32), np.zeros((1, 2, 4, 2), np.float32), products="matmul")


def test_report_rows(tmp_path):
    out = tmp_path / "e.md"
    assert bench_pq_encode.main(["--tokens", "32", "--groups", "16", "--centroids", "64", "--block-mib", "1,4",
                                 "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "e.json").read_text())
    assert [(r["form"], r["block_mib"]) for r in report["rows"]] == [("dot", 4), ("dot", 1), ("sum", 4), ("sum", 1)]
    assert report["rows"][0]["codes_differing"] == 0 and all(r["codes"] == 4 * 2 * 32 * 16 for r in report["rows"])
    assert report["jax"] == jax.__version__
    assert out.read_text().count("\n| ") == 5  # the header and four rows
