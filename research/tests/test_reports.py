"""The study scripts' tables (run comparison, side-by-side, HCAttention ablation) on hand-made records."""

from __future__ import annotations

import json

import numpy as np
import pytest


def test_compare_runs_hand_made(tmp_path):
    import json

    from research.compare import compare_runs

    def write(d, recs):
        d.mkdir()
        (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    base = dict(task="passkey", length=128, device_bytes=10)
    write(tmp_path / "old", [dict(base, index=0, method="snapkv", budget="0.1", score=1.0, output="123"),
                             dict(base, index=1, method="snapkv", budget="0.1", score=0.0, output="9")])
    write(tmp_path / "new", [dict(base, index=0, method="snapkv", budget="0.1", score=0.0, output="12"),
                             dict(base, index=1, method="snapkv", budget="0.1", score=0.0, output="9"),
                             dict(base, index=2, method="snapkv", budget="0.1", score=1.0, output="5")])
    md = compare_runs(str(tmp_path / "old"), str(tmp_path / "new"))
    assert "2 shared records (3 in the new run, 2 in the old one)" in md
    assert "| snapkv | 0.1 | 2 | 50.0 | 0.0 | 1 |" in md
    assert "## Changed answers (1)" in md and "'123'" in md and "'12'" in md
    assert "Value rows" not in md  # no method here records them
    # the same method under other options in the new run: unmatched unless named, then matched by the old name
    write(tmp_path / "renamed", [dict(base, index=0, method="snapkv:window=8", budget="0.1", score=1.0, output="123"),
                                 dict(base, index=1, method="snapkv:window=8", budget="0.1", score=1.0, output="7")])
    assert "0 shared records" in compare_runs(str(tmp_path / "old"), str(tmp_path / "renamed"))
    md = compare_runs(str(tmp_path / "old"), str(tmp_path / "renamed"), [("snapkv:window=8", "snapkv")])
    assert "2 shared records (2 in the new run, 2 in the old one)" in md
    assert "Matched as one method: `snapkv:window=8` (new run) with `snapkv` (old run)" in md
    assert "| snapkv | 0.1 | 2 | 50.0 | 100.0 | 1 |" in md
    assert "## Changed answers (1)" in md and "'9'" in md and "'7'" in md
    # value rows: means over the shared records, fetched / selected as a ratio of the means; the old run lacks fetched
    rows = dict(base, method="hcattention", budget="0.1", score=1.0, output="1")
    write(tmp_path / "hc_old", [dict(rows, index=i, value_rows_per_head_per_call=v) for i, v in ((0, 100.0), (1, 300.0))])
    write(tmp_path / "hc_new", [dict(rows, index=i, value_rows_per_head_per_call=v, value_rows_fetched_per_head_per_call=f)
                                for i, v, f in ((0, 100.0, 181.0), (1, 300.0, 362.0))])
    md = compare_runs(str(tmp_path / "hc_old"), str(tmp_path / "hc_new"))
    assert "| hcattention | 0.1 | 2 | 100.0 | 100.0 | 2 |" in md
    assert "| hcattention | 0.1 | 200.0 |  |  | 200.0 | 271.5 | 1.36 |" in md


def test_side_by_side_orders_by_device_bytes_counts_common_samples_and_refuses_other_prompts(tmp_path):
    import json

    from research.side_by_side import main

    def run(name, rows, seed=0, indices=(0, 1)):
        d = tmp_path / name
        d.mkdir()
        cfg = {"model": "m", "dtype": "float32", "seed": seed, "tasks": ["t"], "lengths": [8], "samples": 2,
               "protocol": "query-aware", "methods": [m for m, *_ in rows]}
        recs = [{"task": "t", "length": 8, "index": i, "depth": 0.5, "method": m, "budget": b, "score": score[i],
                 "device_bytes": dev, "host_bytes": 0}
                for i in indices for m, b, score, dev in [("full", "full", (1.0, 1.0), 1000)] + rows]
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return str(d)

    a = run("a", [("snapkv", "0.1", (1.0, 0.0), 100)])
    b = run("b", [("hcattention", "0.05", (1.0, 1.0), 60)], indices=(0,))  # unfinished: sample 0 only
    out = tmp_path / "side.md"
    assert main([a, b, "--out", str(out)]) == 0
    text = out.read_text()
    lines = [line for line in text.splitlines() if line.startswith("| ") and "method" not in line]
    assert [line.split(" | ")[0][2:] for line in lines] == ["hcattention", "snapkv", "full"]
    assert "the 1 (task, length, sample) prompts present in every run" in text
    assert "| snapkv | 0.1 | a | 100.0 |" in text  # sample 1 (where SnapKV fails) is not counted
    assert "Warning" not in text
    with pytest.raises(SystemExit, match="seed"):
        main([a, run("c", [], seed=1)])


def test_side_by_side_plot_keeps_a_method_of_two_runs_as_two_lines(tmp_path, monkeypatch):
    """The same method at the same budgets in two runs (e.g. Locret with other heads) is two lines, not one line
    through both runs' points: the later run's named after its directory, less the part its name shares with the
    first run's. A run that adds another budget of a method (SnapKV at 50%) extends its line."""
    import research.side_by_side as side
    import kvjax.evals.report as report

    def run(name, rows):
        return {"dir": str(tmp_path / name), "rows": [{"method": m, "budget": b, "device_bytes_vs_full": x,
                                                       "mean_accuracy": y} for m, b, x, y in rows]}

    runs = [run("ruler-4k", [("full", "full", 1.0, 70.0), ("locret", "0.1", 0.12, 17.0), ("locret", "0.25", 0.25, 48.0),
                      ("snapkv", "0.1", 0.12, 4.0)]),
            run("ruler-4k-locret", [("full", "full", 1.0, 70.0), ("locret", "0.1", 0.12, 43.0), ("locret", "0.25", 0.25, 61.0)]),
            run("ruler-4k-half", [("full", "full", 1.0, 70.0), ("snapkv", "0.5", 0.5, 20.0)])]
    seen = {}
    monkeypatch.setattr(report, "plot_accuracy_vs_bytes", lambda points, full, path, title: seen.update(points, full=full))
    side.plot(runs, str(tmp_path / "p.png"), "t")
    assert seen == {"locret": [(0.12, 17.0), (0.25, 48.0)], "snapkv": [(0.12, 4.0), (0.5, 20.0)],
                    "locret (…-locret)": [(0.12, 43.0), (0.25, 61.0)], "full": 70.0}


def test_hcattention_ablation_table_hand_computed(tmp_path):
    """Rows per (method spec, budget): tau from the spec (default 0.9), accuracy per task, mean selection ratio and
    per-layer ratios averaged over records; the full cache first."""
    from research.hcattention_ablation import main, rows

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"tasks": ["a", "b"]}))

    def rec(method, task, score, ratio=None, layers=None):
        r = {"method": method, "budget": "0.1" if method != "full" else "full", "task": task, "score": score,
             "device_bytes": 2**20}
        if ratio is not None:
            r.update(selection_ratio=ratio, selection_ratio_per_layer=json.dumps(layers), key_representation="pq g=32 c=256")
        return r

    records = [rec("full", "a", 1.0), rec("full", "b", 0.0),
               rec("hcattention:tau=0.5", "a", 1.0, 0.02, [0.01, 0.03]), rec("hcattention:tau=0.5", "a", 0.0, 0.04, [0.03, 0.05]),
               rec("hcattention:tau=0.5", "b", 1.0, 0.03, [0.02, 0.04]), rec("hcattention", "a", 1.0, 0.1, [0.1, 0.1]),
               rec("snapkv", "a", 1.0)]
    (run / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    got = {r["method"]: r for r in rows([run])}
    assert set(got) == {"full", "hcattention:tau=0.5", "hcattention"}  # other methods are left out
    half = got["hcattention:tau=0.5"]
    assert half["tau"] == 0.5 and half["keys"] == "pq g=32 c=256" and half["prompts"] == 3
    assert half["per_task"] == {"a": 50.0, "b": 100.0} and half["mean"] == 75.0
    assert abs(half["selection_ratio"] - 0.03) < 1e-12
    np.testing.assert_allclose(half["selection_per_layer"], [0.02, 0.04])
    assert got["hcattention"]["tau"] == 0.9 and got["full"]["tau"] is None and got["full"]["mean"] == 50.0
    assert main([str(run), "--out", str(tmp_path / "t.md")]) == 0
    data = [l for l in (tmp_path / "t.md").read_text().splitlines() if l.startswith("| ") and "`" in l]
    assert len(data) == 3 and "`full`" in data[0]
    half_line = [l for l in data if "tau=0.5" in l][0]
    assert "| 0.5 | 3 | 50.0 | 100.0 | **75.0** | 3.0% | 1.0 |" in half_line
