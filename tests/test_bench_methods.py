"""Structure of the methods benchmark's report (latency / memory vs context length per KV-cache method)."""

from __future__ import annotations

import json
import os
import re

import pytest

from kvjax.evals import bench_methods

pytestmark = pytest.mark.real_model


def test_bench_methods_report_has_a_row_per_length_and_method(tiny_chat_model, tmp_path):
    """The report's structure on a 2-layer model (2 KV heads of 8; the bench's mechanics do not depend on the
    model, and a 30-layer one compiled every method for two minutes); Locret runs random heads from a file."""
    from kvjax.artifacts import model_identity, save_artifact
    from kvjax.retaining_heads import random_heads_artifact
    from kvjax.models import load_model

    config = load_model(tiny_chat_model, "float32", tokenizer=False).config
    heads = tmp_path / "heads.npz"
    save_artifact(random_heads_artifact(model_identity(config), config.num_layers, config.num_heads,
                                        config.num_kv_heads, config.head_dim, 16), heads)
    quest, locret = "quest:dense_layers=1", f"locret:local=16:chunk=128:heads={heads}"
    out = tmp_path / "x.md"
    code = bench_methods.main([
        "--model", tiny_chat_model, "--lengths", "256", "--methods", f"snapkv,{quest},{locret}", "--new-tokens", "4",
        "--budget", "0.25", "--chunk-size", "256", "--bandwidth-mib", "64", "--bandwidth-repeats", "2",
        "--out", str(out), "--profile", str(tmp_path / "profile"),
        "--compiler-option", "xla_gpu_enable_latency_hiding_scheduler=false",
    ])
    assert code == 0
    traces = [tmp_path / "profile" / p for p in sorted(os.listdir(tmp_path / "profile"))]  # --profile
    assert [p.name for p in traces] == sorted(["full-256", "snapkv-256", "quest_dense_layers_1-256",
                                               "locret_local_16_chunk_128_heads_" + re.sub(r"[^\w.-]", "_", str(heads)) + "-256"])
    assert all(list(p.rglob("*.xplane.pb")) for p in traces)
    md = out.read_text()
    report = json.loads((tmp_path / "x.json").read_text())
    assert (tmp_path / "x.png").stat().st_size > 0

    assert report["command"].startswith(f"kvjax bench --model {tiny_chat_model}")
    assert f"`kvjax bench --model {tiny_chat_model}" in md
    assert report["machine"]["cpu"] and report["versions"]["jax"]
    assert report["bandwidth"]["machine"] > 0
    assert report["args"]["methods"] == ["full", "snapkv", quest, locret]
    # --compiler-option over kvjax's own (none on CPU), recorded with the run
    assert report["decode_compiler_options"] == {"xla_gpu_enable_latency_hiding_scheduler": False}
    assert "- decode loop compiled with XLA options `xla_gpu_enable_latency_hiding_scheduler=False`" in md

    rows = report["rows"]
    assert [(r["prompt_tokens"], r["method"]) for r in rows] == [
        (L, m) for L in (256,) for m in ("full", "snapkv", quest, locret)]
    assert not [r for r in rows if "error" in r]
    by = {(r["prompt_tokens"], r["method"]): r for r in rows}
    header = next(line for line in md.splitlines() if line.startswith("| L | method |"))
    for column in ("prefill s", "compress s", "decode ms/tok", "decode speed-up vs full", "limit ms/tok", "÷ limit",
                   "device KV MiB", "÷ full bytes", "host KV MiB", "peak RSS GiB", "compile s"):
        assert column in header
    table = [line for line in md.splitlines() if line.startswith("| 256 |")]
    assert len(table) == 4 and all(len(line.split("|")) == len(header.split("|")) for line in table)

    kv_per_token = 2 * 2 * 2 * 8 * 4  # 2 layers, 2 KV heads of 8, float32
    for L in (256,):
        full, snap, qst = by[L, "full"], by[L, "snapkv"], by[L, quest]
        assert full["decode_speedup"] == 1 and full["device_bytes_ratio"] == 1 and full["prefill_ratio"] == 1
        for r in (full, snap, qst):
            assert r["prefill_s"] >= r["compress_s"] > 0 and r["decode_ms_per_token"] > 0
            assert r["limit_ms_per_token"] > 0 and r["over_limit"] > 0
            assert r["compile_s"]["prefill"] > 0 and r["compile_s"]["decode"] > 0
            assert r["decode_memory"]["peak_kib"] >= r["decode_memory"]["rss_base_kib"] > 0
            assert r["host_bytes"] == 0 and len(r["generated"]) == 4
        assert full["device_bytes"] >= kv_per_token * (L + 4)
        # SnapKV evicts: a quarter of the prompt (+ room for the new tokens) per head
        assert snap["device_bytes"] < full["device_bytes"]
        assert snap["cache_stats"]["kept_tokens_per_head"] == [[L // 4] * 2] * 2
        assert snap["kv_read_bytes_per_step"] < full["kv_read_bytes_per_step"]
        # Quest keeps every prompt token on the device (its pools hold at least the prompt's K/V; the full cache is
        # larger here only because its buffer is rounded up to 256 slots) and saves reads, not memory
        assert qst["cache_stats"]["page_pool_bytes"] >= kv_per_token * (L + 4)
        assert qst["device_bytes"] > snap["device_bytes"]
        assert snap["kv_read_bytes_per_step"] < qst["kv_read_bytes_per_step"] < full["kv_read_bytes_per_step"]
        assert qst["staging"]["shared_by"] == [quest] and snap["staging"]["window"] == 32
        # Locret prefills on its own, evicting while it goes: the budget's tokens per head, no host tier
        loc = by[L, locret]
        assert loc["staging"] == "own prefill" and loc["host_bytes"] == 0 and loc["decode_ms_per_token"] > 0
        assert loc["cache_stats"]["kept_tokens_per_head"] == [[L // 4] * 2] * 2
    assert f"- its own prefill (evicting while prefilling): {locret}" in md


@pytest.mark.parametrize("argv, match", [
    (["--methods", "snapkv,nope"], "unknown method"),
    (["--lengths", "128,0"], "lengths"),
    (["--budget", "1.5"], "budget"),
    (["--budget", "abc"], "budget"),
    (["--compiler-option", "xla_gpu_enable_latency_hiding_scheduler"], "KEY=VALUE"),
])
def test_bad_options_are_argparse_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        bench_methods.main(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_compiler_option_values_are_typed():
    """``--compiler-option KEY=VALUE``: booleans, then numbers, else the string."""
    parse = bench_methods.parse_compiler_option
    assert parse("a=true") == ("a", True) and parse("a=False") == ("a", False)
    assert parse("a=3") == ("a", 3) and parse("a=0.5") == ("a", 0.5) and parse("a=x=y") == ("a", "x=y")


def test_bad_values_are_value_errors(tmp_path):
    out = ["--model", "smollm2-135m", "--out", str(tmp_path / "x.md")]  # rejected before anything runs
    with pytest.raises(ValueError, match="--new-tokens must be >= 2"):
        bench_methods.main(out + ["--new-tokens", "1"])
    with pytest.raises(ValueError, match="not a multiple of --chunk-size"):
        bench_methods.main(out + ["--lengths", "1500", "--chunk-size", "1024"])
    with pytest.raises(ValueError, match="unknown method"):
        bench_methods.make_methods(["full", "nope"], 0.1)
    with pytest.raises(ValueError, match="budget"):
        bench_methods.make_methods(["full", "snapkv"], 0)
    assert bench_methods.parse_methods("quest,snapkv,quest") == ["full", "quest", "snapkv"]
    assert bench_methods.parse_budget("64") == 64 and bench_methods.parse_budget("0.1") == 0.1
