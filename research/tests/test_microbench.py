"""The microbenchmarks (`research.host_gather`, `research.recall_step`, `research.gemm_jax_vs_torch`) end to end at
small sizes: every variant runs and is reported once."""

from __future__ import annotations

import pytest


def test_host_gather_times_rows_and_pages(capsys):
    from research.host_gather import main

    assert main([]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3072") or line.startswith("| 6144")]
    assert [r.split(" | ")[1] for r in rows] == ["token rows", "16-token pages"] * 2


def test_recall_step_reports_every_variant_and_scheduler(tmp_path):
    from research.recall_step import main

    variants = ["none", "cond", "spread", "prefetch", "dep-pipelined"]
    out = tmp_path / "recall.md"
    assert main(["--layers", "2", "--length", "256", "--rows", "32", "--steps", "2", "--repeats", "1", "--hidden", "64",
                 "--ffn", "128", "--variants", ",".join(variants), "--out", str(out)]) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and "variant" not in line]
    assert [(r[0][2:], r[1]) for r in rows[:-2]] == [(v, s) for s in ("kvjax", "xla-default") for v in variants]
    assert all(r[3] == "0.000" for r in rows if r[0] == "| none")  # the baseline's extra over itself
    assert rows[-2][0] == "| gather-alone (one layer, outside the loop)" and rows[-2][4] == "64"  # 2 heads x 32 rows


def test_gemm_jax_vs_torch_prints_each_shape(capsys):
    pytest.importorskip("torch")
    from research.gemm_jax_vs_torch import SHAPES, main

    assert main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[1:]] == [f"{i}->{o}" for i, o in SHAPES]
