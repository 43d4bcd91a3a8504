"""The evaluation report's plain-language shortfall list and tables, on hand-made summaries."""

from __future__ import annotations


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


def test_a_full_cache_stored_in_another_dtype_is_named_without_a_budget():
    rows = [_row("full", "full", {"a@4096": 100.0}), _row("full:kv_dtype=int8", "full", {"a@4096": 75.0})]
    assert shortfalls({"rows": rows}) == ["full:kv_dtype=int8: 75.0% vs full 100.0% (worst: a@4096 75.0% vs 100.0%)"]


def test_no_full_cache_row_means_no_shortfalls():
    assert shortfalls({"rows": [_row("x", "0.1", {"a@4096": 0.0})]}) == []


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
    assert "Measured with" not in text  # these records do not say what measured them
    recs[0]["jax"], recs[0]["device"] = "0.10.2", "cpu: some CPU, 2 cores"
    assert ("Measured with jax 0.10.2 on cpu: some CPU, 2 cores (1 record); 5 records written before the records "
            "named their jax version and device.") in render_markdown(summarize(recs, [], config), config)
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


def test_a_sample_recorded_twice_counts_once_with_its_last_record():
    """Two records of one sample under one configuration (a resumed batch written again): the mean uses the later one
    alone, hand-computed; the same sample under another budget is another record."""
    from kvjax.evals.report import summarize

    config = {"run_name": "r", "methods": ["snapkv"], "budgets": [0.1, 0.5], "tasks": ["a"], "lengths": [128],
              "samples": 2}
    base = dict(task="a", length=128, depth=0.0, host_bytes=0)
    recs = [dict(base, index=i, method="full", budget="full", score=1.0, device_bytes=100) for i in range(2)]
    recs += [dict(base, index=0, method="snapkv", budget="0.1", score=0.0, device_bytes=10),
             dict(base, index=1, method="snapkv", budget="0.1", score=1.0, device_bytes=10),
             dict(base, index=0, method="snapkv", budget="0.5", score=1.0, device_bytes=50),
             dict(base, index=1, method="snapkv", budget="0.5", score=1.0, device_bytes=50),
             dict(base, index=0, method="snapkv", budget="0.1", score=1.0, device_bytes=10)]  # sample 0 again
    means = {(r["method"], r["budget"]): r["mean_accuracy"] for r in summarize(recs, [], config)["rows"]}
    assert means == {("full", "full"): 100.0, ("snapkv", "0.1"): 100.0, ("snapkv", "0.5"): 100.0}  # not 66.7
    twice_wrong = recs[:-1] + [dict(recs[-1], score=0.0), dict(recs[2], score=0.0)]
    means = {(r["method"], r["budget"]): r["mean_accuracy"] for r in summarize(twice_wrong, [], config)["rows"]}
    assert means[("snapkv", "0.1")] == 50.0  # samples 0 (last: 0.0) and 1 (1.0); three records would give 33.3


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
