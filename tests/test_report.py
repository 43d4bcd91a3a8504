"""The evaluation report's plain-language shortfall list and the side-by-side table, on hand-made summaries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.evals.report import shortfalls


def _row(method, budget, acc):
    return {"method": method, "budget": budget, "accuracy": acc, "mean_accuracy": sum(acc.values()) / len(acc)}


def test_shortfalls_flag_a_low_mean_and_a_single_low_task_but_not_small_gaps():
    full = _row("full", "full", {"a@4096": 100.0, "b@4096": 87.5})
    rows = [
        full,
        _row("x", "0.1", {"a@4096": 100.0, "b@4096": 75.0}),    # mean 4 points lower; task b 12.5 lower -> flagged
        _row("y", "0.1", {"a@4096": 50.0, "b@4096": 87.5}),     # mean 25 lower -> flagged, worst a
        _row("z", "0.1", {"a@4096": 96.0, "b@4096": 87.5}),     # 4 points on one task -> not flagged
        _row("w", "0.1", {"a@4096": 100.0, "b@4096": 93.75}),   # above the full cache -> not flagged
    ]
    out = shortfalls({"rows": rows})
    assert len(out) == 2
    assert out[0].startswith("x at budget 0.1: 87.5% vs full 93.8%") and "worst: b@4096 75.0% vs 87.5%" in out[0]
    assert out[1].startswith("y at budget 0.1: 68.8% vs full 93.8%") and "worst: a@4096 50.0% vs 100.0%" in out[1]


def test_no_full_cache_row_means_no_shortfalls():
    assert shortfalls({"rows": [_row("x", "0.1", {"a@4096": 0.0})]}) == []


def test_compare_runs_hand_made(tmp_path):
    import json

    from kvjax.evals.compare import compare_runs

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

    from kvjax.evals.side_by_side import main

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


def test_hcattention_ablation_table_hand_computed(tmp_path):
    """Rows per (method spec, budget): tau from the spec (default 0.9), accuracy per task, mean selection ratio and
    per-layer ratios averaged over records; the full cache first."""
    from kvjax.evals.hcattention_ablation import main, rows

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


def test_report_of_a_run_with_budgets_inside_specs_and_recall_stats_hand_made():
    from kvjax.evals.report import expected_records, render_markdown, summarize

    config = {"run_name": "r", "methods": ["synckv:budget=0.25:stride=1", "snapkv", "synckv:budget=0.25"],
              "budgets": [0.1, 0.5], "tasks": ["passkey"], "lengths": [128], "samples": 2}
    # per sample: full + synckv:stride=1 @0.25 + snapkv @0.1, @0.5 + synckv @0.25 = 5 records
    assert expected_records(config) == 1 * 1 * 2 * 5
    base = dict(task="passkey", length=128, depth=0.0, host_bytes=0)
    recs = [dict(base, index=i, method="full", budget="full", score=1.0, device_bytes=100) for i in range(2)]
    recs += [dict(base, index=i, method="snapkv", budget="0.1", score=float(i), device_bytes=10) for i in range(2)]
    recs += [dict(base, index=i, method="synckv:stride=1", budget="0.25", score=1.0, device_bytes=30, host_bytes=2**20,
                  recall_trigger_rate=r, bytes_recalled=2**20 * m) for i, (r, m) in enumerate(((1.0, 4), (0.5, 2)))]
    summary = summarize(recs, [], config)
    assert [(r["method"], r["budget"]) for r in summary["rows"]] == [("full", "full"), ("synckv:stride=1", "0.25"),
                                                                    ("snapkv", "0.1")]  # the order given
    row = summary["rows"][1]
    assert row["recall_trigger_rate"] == pytest.approx(0.75) and row["bytes_recalled"] == pytest.approx(3 * 2**20)
    assert "recall_trigger_rate" not in summary["rows"][2]
    text = render_markdown(summary, config)
    assert "6 of 10 task records written" in text
    assert "| synckv:stride=1 | 0.25 | 0.750 | 3.0 | 1.0 |" in text


def test_an_unfinished_run_averages_every_row_over_the_tasks_all_rows_have():
    """The full cache has finished tasks a and b, the method only a: both means are over a (hand-computed), and the
    report says which columns the mean covers. A task the method has for fewer samples is left out as well."""
    from kvjax.evals.report import render_markdown, summarize

    config = {"run_name": "r", "methods": ["snapkv"], "budgets": [0.1], "tasks": ["a", "b"], "lengths": [128],
              "samples": 2}
    base = dict(length=128, depth=0.0, host_bytes=0)
    recs = [dict(base, task="a", index=i, method="full", budget="full", score=s, device_bytes=100)
            for i, s in enumerate((1.0, 0.5))]
    recs += [dict(base, task="b", index=i, method="full", budget="full", score=0.0, device_bytes=100) for i in range(2)]
    recs += [dict(base, task="a", index=i, method="snapkv", budget="0.1", score=s, device_bytes=10)
             for i, s in enumerate((0.0, 0.5))]
    summary = summarize(recs, [], config)
    assert summary["mean_over"] == ["a@128"]
    means = {r["method"]: r["mean_accuracy"] for r in summary["rows"]}
    assert means == {"full": 75.0, "snapkv": 25.0}  # not full's 37.5 over a and b
    assert summary["rows"][0]["accuracy"] == {"a@128": 75.0, "b@128": 0.0}  # the table still shows every task
    assert "Mean over the 1 of 2 task columns every row has for the same samples: a @ 128." in render_markdown(summary, config)
    part = summarize(recs + [dict(base, task="b", index=0, method="snapkv", budget="0.1", score=1.0, device_bytes=10)],
                     [], config)  # b: the full cache has samples 0 and 1, the method only 0
    assert part["mean_over"] == ["a@128"]
    assert {r["method"]: r["mean_accuracy"] for r in part["rows"]} == {"full": 75.0, "snapkv": 25.0}
    recs += [dict(base, task="b", index=i, method="snapkv", budget="0.1", score=1.0, device_bytes=10) for i in range(2)]
    finished = summarize(recs, [], config)
    assert {r["method"]: r["mean_accuracy"] for r in finished["rows"]} == {"full": 37.5, "snapkv": 62.5}
    assert "task columns every row has" not in render_markdown(finished, config)


def test_a_run_with_no_record_yet_claims_no_comparison_and_links_no_plot():
    """Before its first record a run's README says how many are pending, not that no method falls short."""
    from kvjax.evals.report import render_markdown, summarize

    config = {"run_name": "r", "methods": ["snapkv"], "budgets": [0.1], "tasks": ["a"], "lengths": [128], "samples": 2}
    text = render_markdown(summarize([], [], config), config)
    assert "0 of 4 task records written" in text
    assert "fall short" not in text and "no method is" not in text and ".png" not in text


def test_an_artifact_counts_as_weights_once_not_in_each_cache():
    """Locret's heads travel with its cache; the report's KV bytes are the cache's own (hand-made: 100 for the full
    cache, 12 - 2 = 10 for Locret), and the heads are stated once, as weights."""
    from kvjax.evals.report import render_markdown, summarize

    config = {"run_name": "r", "methods": ["locret"], "budgets": [0.1], "tasks": ["passkey"], "lengths": [128], "samples": 2}
    base = dict(task="passkey", length=128, depth=0.0, host_bytes=0)
    recs = [dict(base, index=i, method="full", budget="full", score=1.0, device_bytes=100, artifact_device_bytes=0)
            for i in range(2)]
    recs += [dict(base, index=i, method="locret", budget="0.1", score=1.0, device_bytes=12 * 2**20,
                  artifact_device_bytes=2 * 2**20) for i in range(2)]
    recs[0]["device_bytes"] = recs[1]["device_bytes"] = 100 * 2**20
    summary = summarize(recs, [], config)
    row = summary["rows"][1]
    assert row["device_bytes"] == {"128": 10 * 2**20} and row["device_bytes_vs_full"] == pytest.approx(0.1)
    assert row["weights_device_bytes"] == 2 * 2**20
    assert "locret: 2.0 MiB" in render_markdown(summary, config)
