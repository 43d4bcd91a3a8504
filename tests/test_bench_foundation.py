"""Structure of the foundation benchmark's report (kvjax vs transformers) on a 2-layer random model with SmolLM2's tokenizer."""

from __future__ import annotations

import json

import pytest

from kvjax.evals import bench_foundation, bench_machine

pytestmark = pytest.mark.real_model


def test_bench_report_has_a_row_per_dtype_and_length_with_both_frameworks(tiny_chat_model, tmp_path):
    """The report's structure on the 2-layer tiny chat model (HF safetensors: transformers loads it in a moment,
    where loading SmolLM2's GGUF took a minute)."""
    pytest.importorskip("torch")
    out = tmp_path / "b.md"
    code = bench_foundation.main([
        "--model", tiny_chat_model, "--lengths", "64", "--dtypes", "float32", "--new-tokens", "4",
        "--repeats", "1", "--bandwidth-mib", "64", "--bandwidth-repeats", "2", "--torch-threads", "1",
        "--out", str(out),
    ])
    assert code == 0
    md = out.read_text()
    report = json.loads((tmp_path / "b.json").read_text())

    header = next(line for line in md.splitlines() if line.startswith("| dtype |"))
    for column in ("kvjax prefill tok/s", "transformers prefill tok/s", "kvjax decode ms/tok",
                   "transformers decode ms/tok", "limit ms/tok", "kvjax ÷ limit", "kvjax compile s"):
        assert column in header
    rows = [line for line in md.splitlines() if line.startswith("| float32 | 64 |")]
    assert len(rows) == 1 and "error" not in rows[0]
    assert len(rows[0].split("|")) == len(header.split("|"))

    assert report["machine"]["cpu"] and report["versions"]["jax"] and report["versions"]["transformers"]
    assert report["command"].startswith(f"kvjax bench foundation --model {tiny_chat_model}")
    assert report["bandwidth"]["machine"] > 0
    assert [(r["dtype"], r["prompt_tokens"]) for r in report["rows"]] == [("float32", 64)]
    row = report["rows"][0]
    for fw in ("kvjax", "transformers"):
        r = row[fw]
        assert "error" not in r
        assert r["prefill_tok_s"] > 0 and r["decode_ms_per_token"] > 0
        assert r["memory"]["peak_overall_kib"] >= r["memory"]["rss_after_load_kib"] > 0
        assert len(r["generated"]) == 4
    assert row["kvjax"]["compile_s"] > 0 and row["transformers"]["compile_s"] is None
    assert row["same_prompt"]
    # the model ties its embeddings: the whole table is read by the LM head every step
    assert row["kvjax"]["tied_embeddings"] and row["kvjax"]["weights_read_bytes"] == row["kvjax"]["param_bytes"]
    assert row["limit_ms_per_token"] > 0 and row["kvjax_over_limit"] > 0 and row["transformers_over_limit"] > 0


def test_prompt_length_must_be_a_multiple_of_the_chunk():
    assert bench_machine.effective_chunk(64, 1024) == 64
    assert bench_machine.effective_chunk(4096, 1024) == 1024
    assert bench_machine.effective_chunk(1000, 0) == 1000
    with pytest.raises(ValueError, match="multiple"):
        bench_machine.effective_chunk(1500, 1024)


def test_target_lines_flag_each_missed_target():
    rows = [
        {"dtype": "float32", "prompt_tokens": 1024, "kvjax_over_limit": 1.29, "prefill_speedup": 1.2},
        {"dtype": "bfloat16", "prompt_tokens": 4096, "kvjax_over_limit": 3.1, "prefill_speedup": 0.8},
        {"dtype": "float32", "prompt_tokens": 8192, "kvjax_over_limit": None, "prefill_speedup": None},
    ]
    met, missed, absent = bench_foundation.target_lines(rows)
    assert met.startswith("- float32 L=1024:") and "MISSED" not in met and "1.29× limit (met" in met
    assert "3.10× limit (MISSED" in missed and "0.80× transformers (MISSED" in missed
    assert "decode: not measured" in absent and "prefill: not measured" in absent
