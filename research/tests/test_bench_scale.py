"""The decode-at-scale benchmark (:mod:`research.bench_scale`) end to end on a tiny model: the plan's largest batch is
the one timed, every ratio is the row's own numbers, and the prefill comparison runs both caches."""

import json

import pytest

from research.bench_scale import main, plan_rows
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    save_tiny("qwen2", str(path), seed=1)
    return str(path)


def test_scale_rows_follow_the_plan(model_dir, tmp_path):
    """Batch 1 and the plan's largest batch (3) are timed; tokens/s = batch / step; the ratios to the full cache and to
    the plan are those of the rows' own numbers; a method without a plan row reports why it has no largest batch."""
    plan = tmp_path / "plan.json"
    rows = [{"method": "full", "budget": None, "length": 128, "max_batch": 3, "step_s_b1": 0.001, "step_s_max": 0.002,
             "traffic_b1": 1e6, "traffic_max": 2e6},
            {"method": "snapkv", "budget": 0.5, "length": 128, "max_batch": 3, "step_s_b1": 0.001,
             "step_s_max": 0.002, "traffic_b1": 1e6, "traffic_max": 2e6}]
    plan.write_text(json.dumps({"targets": {"h100": rows}}))
    assert set(plan_rows(str(plan))) == {("full", None, 128), ("snapkv", 0.5, 128)}
    out = tmp_path / "scale.md"
    assert main(["--model", model_dir, "--dtype", "float32", "--methods", "snapkv,hbw", "--budgets", "0.5",
                 "--lengths", "128", "--plan", str(plan), "--steps", "2", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "scale.json").read_text())
    got = {(r["method"], r["batch_kind"]): r for r in report["rows"]}
    assert {k: r.get("batch") for k, r in got.items()} == {("full", "1"): 1, ("full", "max"): 3, ("snapkv", "1"): 1,
                                                           ("snapkv", "max"): 3, ("hbw", "1"): 1, ("hbw", "max"): 0}
    assert "no largest batch" in got[("hbw", "max")]["error"]
    for key in [("full", "1"), ("full", "max"), ("snapkv", "max")]:
        r = got[key]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (r["step_ms"] / 1e3))
        assert r["plan_step_ms"] == pytest.approx(1.0 if key[1] == "1" else 2.0)
    text = out.read_text()
    ratio = got[("full", "max")]["step_ms"] / got[("snapkv", "max")]["step_ms"]
    assert f"| snapkv | 0.5 | 128 | 3 | {got[('snapkv', 'max')]['step_ms']:.2f} |" in text
    assert f"{ratio:.2f}×" in text


def test_compare_prefill_times_both_caches(model_dir, tmp_path):
    """``--compare-prefill``: one row per method with both step times, rendered with their ratio."""
    out = tmp_path / "cmp.md"
    assert main(["--model", model_dir, "--dtype", "float32", "--methods", "snapkv", "--budgets", "0.5", "--lengths",
                 "128", "--steps", "2", "--repeats", "1", "--compare-prefill", "--out", str(out)]) == 0
    rows = json.loads((tmp_path / "cmp.json").read_text())["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [("full", None), ("snapkv", 0.5)]
    assert all(r["prefill_step_ms"] > 0 and r["synthetic_step_ms"] > 0 for r in rows)
    r = rows[1]
    assert f"{r['synthetic_step_ms'] / r['prefill_step_ms']:.2f} |" in out.read_text()
