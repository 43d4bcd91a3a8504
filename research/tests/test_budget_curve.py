"""research.budget_curve on two hand-made runs: the common prompts, % of the full cache, bytes ÷ full, the 95% rule."""

from __future__ import annotations

import json

import pytest

# scores per prompt (task, index); the common prompts are (t1, 0), (t1, 1), (t2, 0):
# (t2, 1) is missing from run b, (t1, 2) has only run b's full cache (its other configuration not yet written)
A_SCORES = {  # run a: (method, budget) -> {prompt: score}, device bytes, artifact bytes
    ("full", "full"): ({("t1", 0): 1.0, ("t1", 1): 1.0, ("t2", 0): 0.4, ("t2", 1): 0.0, ("t1", 2): 0.0}, 1000, 0),
    ("m1", "0.1"): ({("t1", 0): 1.0, ("t1", 1): 0.5, ("t2", 0): 0.6, ("t2", 1): 1.0, ("t1", 2): 1.0}, 100, 0),
    ("m1", "0.25"): ({("t1", 0): 1.0, ("t1", 1): 1.0, ("t2", 0): 0.4, ("t2", 1): 0.0, ("t1", 2): 1.0}, 250, 0),
    ("m2", "0.1"): ({("t1", 0): 1.0, ("t1", 1): 1.0, ("t2", 0): 0.28, ("t2", 1): 0.0, ("t1", 2): 0.0}, 120, 20),
    ("m2", "0.25"): ({("t1", 0): 1.0, ("t1", 1): 0.0, ("t2", 0): 0.0, ("t2", 1): 1.0, ("t1", 2): 1.0}, 270, 20),
}
B_SCORES = {
    ("full", "full"): ({("t1", 0): 1.0, ("t1", 1): 1.0, ("t2", 0): 0.4, ("t1", 2): 0.0}, 1000, 0),
    ("m3", "0.1"): ({("t1", 0): 0.0, ("t1", 1): 1.0, ("t2", 0): 0.0}, 500, 0),
}


def _run(tmp_path, name, scores, stale=()):
    d = tmp_path / name
    d.mkdir()
    cfg = {"model": "m", "dtype": "float32", "seed": 42, "tasks": ["t1", "t2"], "lengths": [4096], "samples": 3,
           "protocol": "query-agnostic", "split": "test", "methods": sorted({m for m, _ in scores if m != "full"}),
           "budgets": [0.1, 0.25]}
    recs = [{"task": t, "length": 4096, "index": i, "depth": 0.5, "method": m, "budget": b, "score": s,
             "device_bytes": dev, "artifact_device_bytes": art, "host_bytes": 0}
            for (m, b), (per_prompt, dev, art) in scores.items() for (t, i), s in per_prompt.items()]
    recs = [dict(r, score=1.0 - r["score"]) for r in recs if (r["method"], r["budget"], r["task"], r["index"]) in stale] + recs
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"task": "t1", "len')  # a cut line
    return str(d)


def test_budget_curve_common_prompts_percent_of_full_and_95_rule(tmp_path):
    from research.budget_curve import main
    from research.side_by_side import load_runs

    # m1 at 0.1 on (t1, 1) written twice: the last record counts
    a = _run(tmp_path, "a", A_SCORES, stale={("m1", "0.1", "t1", 1)})
    b = _run(tmp_path, "b", B_SCORES)
    assert load_runs([a, b])[0]["common"] == 4  # side_by_side's default: the prompts each run has any record of
    out = tmp_path / "curve.md"
    assert main([a, b, "--out", str(out)]) == 0
    text = out.read_text()
    data = json.loads((tmp_path / "curve.json").read_text())
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert data["prompts"] == 3 and "the 3 (task, length, sample) prompts" in text
    # by hand, over (t1, 0), (t1, 1), (t2, 0): full (1 + 1 + 0.4) / 3 = 80
    assert data["full_mean"] == pytest.approx(80.0)
    got = {(p["method"], p["budget"]): p for p in data["points"]}
    expect = {  # mean, % of full (mean / 80), device bytes less artifact bytes over the full cache's 1000
        ("m1", "0.1"): (70.0, 87.5, 0.1),  # (1 + 0.5 + 0.6) / 3; with (t2, 1) or (t1, 2) it would pass 95%
        ("m1", "0.25"): (80.0, 100.0, 0.25),
        ("m2", "0.1"): (76.0, 95.0, 0.1),  # (1 + 1 + 0.28) / 3: exactly 95%
        ("m2", "0.25"): (100 / 3, 100 / 3 / 80 * 100, 0.25),
        ("m3", "0.1"): (100 / 3, 100 / 3 / 80 * 100, 0.5),
    }
    assert set(got) == set(expect)
    for key, (mean, pct, ratio) in expect.items():
        assert got[key]["mean"] == pytest.approx(mean), key
        assert got[key]["percent_of_full"] == pytest.approx(pct), key
        assert got[key]["device_bytes_vs_full"] == pytest.approx(ratio), key
    # the smallest budget reaching 95% (m2's larger budget falls below: still 0.1); m3 is a single point
    assert data["first_reaching"] == {"m1": "0.25", "m2": "0.1", "m3": "not reached up to 0.1"}
    assert "| m1 | 0.1 | 70.0 | 87.5 | 0.100 |" in text
    assert "| m2 | 0.1 | 76.0 | 95.0 | 0.100 |" in text
    assert "| m3 | not reached up to 0.1 |" in text and "| m1 | 0.25 |" in text
    assert "python -m research.budget_curve " in text and f"`{a}`: `m1`, `m2`" in text and f"`{b}`: `m3`" in text
    assert "Warning" not in text and "| full |" not in text


def test_budget_curve_refuses_other_protocols(tmp_path):
    from research.budget_curve import main

    a = _run(tmp_path, "a", A_SCORES)
    b = _run(tmp_path, "b", B_SCORES)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    (tmp_path / "b" / "config.json").write_text(json.dumps(dict(cfg, protocol="query-aware")))
    with pytest.raises(SystemExit, match="protocol"):
        main([a, b, "--out", str(tmp_path / "x.md")])
