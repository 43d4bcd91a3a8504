"""``kvjax bench --kv-dtype`` and ``kvjax demo --kv-dtype``: the methods' caches stored in the dtype (device bytes
counted by hand: per token and KV head, head_dim int8 values + a float32 scale, for K and for V), the full cache
stored in it as its own row ``full:kv_dtype=D``, the full-cache reference unchanged, and a method that cannot store
the dtype refused before anything is measured."""

from __future__ import annotations

import json

import pytest

import kvjax
from kvjax.cli import demo_groups, demo_methods, main as cli_main
from kvjax.evals import bench_methods
from kvjax.kv_quantization import stored_vector_bytes

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8  # the tiny model
INT8_VECTOR = HEAD_DIM * 1 + 4  # one stored K (or V) vector: int8 values + its float32 scale
F32_VECTOR = HEAD_DIM * 4
L, N, PAGE = 256, 4, 16
EVICTING_H2O = "h2o:evict_during_decode=true"  # decode-time eviction: no quantized layout, refuses int8


def _bench(model, tmp_path, stem, *extra):
    out = tmp_path / f"{stem}.md"
    code = bench_methods.main([
        "--model", model, "--lengths", str(L), "--methods", "full,snapkv", "--new-tokens", str(N), "--budget", "0.25",
        "--chunk-size", "256", "--bandwidth-mib", "16", "--bandwidth-repeats", "1", "--no-plot", "--out", str(out),
        *extra])
    assert code == 0
    return json.loads((tmp_path / f"{stem}.json").read_text()), out.read_text()


@pytest.mark.real_model
def test_bench_kv_dtype_int8_stores_the_methods_and_adds_the_stored_full_row(tiny_chat_model, tmp_path):
    plain, _ = _bench(tiny_chat_model, tmp_path, "plain")
    report, md = _bench(tiny_chat_model, tmp_path, "int8", "--kv-dtype", "int8")
    assert report["args"]["kv_dtype"] == "int8" and plain["args"]["kv_dtype"] is None
    # 'full' listed without --kv-dtype: the reference alone; with it: the stored full cache too, named as eval names it
    assert [r["method"] for r in plain["rows"]] == ["full", "snapkv"]
    assert [r["method"] for r in report["rows"]] == ["full", "full:kv_dtype=int8", "snapkv"]
    assert not [r for r in report["rows"] if "error" in r]
    by = {r["method"]: r for r in report["rows"]}
    before = {r["method"]: r for r in plain["rows"]}
    assert [by[n]["kv_dtype"] for n in ("full", "full:kv_dtype=int8", "snapkv")] == ["float32", "int8", "int8"]
    assert before["snapkv"]["kv_dtype"] == "float32"

    # SnapKV keeps a quarter of the prompt per head, in pages of 16 slots with room for the N new tokens
    kept = L // 4
    assert by["snapkv"]["cache_stats"]["kept_tokens_per_head"] == [[kept] * KV_HEADS] * LAYERS
    slots = LAYERS * KV_HEADS * -(-(kept + N) // PAGE) * PAGE  # pool slots over layers and heads (batch 1)
    assert by["snapkv"]["cache_stats"]["page_pool_bytes"] == 2 * slots * INT8_VECTOR
    assert before["snapkv"]["cache_stats"]["page_pool_bytes"] == 2 * slots * F32_VECTOR
    # the device bytes are the stored ones: the pools as counted, the rest (block tables, lengths) unchanged
    assert by["snapkv"]["device_bytes"] == before["snapkv"]["device_bytes"] - 2 * slots * (F32_VECTOR - INT8_VECTOR)
    # a decode step reads the kept tokens + N/2 per head in int8 with their scales
    assert by["snapkv"]["kv_read_bytes_per_step"] == 2 * INT8_VECTOR * LAYERS * KV_HEADS * (kept + N / 2)

    # the full cache stored in int8: its dense buffer of L + N slots rounded up to 256, in int8 with scales
    stored = by["full:kv_dtype=int8"]
    buffer = 2 * LAYERS * KV_HEADS * 512
    assert buffer * INT8_VECTOR <= stored["device_bytes"] <= buffer * INT8_VECTOR + 64
    assert stored["staging"] == "own prefill" and stored["budget"] is None
    assert stored["kv_read_bytes_per_step"] == 2 * INT8_VECTOR * LAYERS * KV_HEADS * (L + N / 2)

    # the reference: the same row as without --kv-dtype (float32, same bytes, same tokens), every ratio against it
    ref = by["full"]
    for key in ("device_bytes", "host_bytes", "kv_read_bytes_per_step", "generated", "staging", "budget"):
        assert ref[key] == before["full"][key], key
    assert {k: v for k, v in ref["cache_stats"].items()} == before["full"]["cache_stats"]
    assert ref["device_bytes_ratio"] == 1
    for name in ("full:kv_dtype=int8", "snapkv"):
        assert by[name]["device_bytes_ratio"] == pytest.approx(by[name]["device_bytes"] / ref["device_bytes"])
    assert by["full:kv_dtype=int8"]["device_bytes_ratio"] == pytest.approx(INT8_VECTOR / F32_VECTOR, rel=0.01)

    # the report states where the caches are stored
    assert ("- KV stored in **int8** (`--kv-dtype int8`, a float32 scale per token and KV head, counted in the device "
            "bytes; docs/QUANTIZATION.md): `full:kv_dtype=int8`, `snapkv`;") in md
    assert "the reference `full` in the model's dtype (float32)" in md
    assert "| 256 | full:kv_dtype=int8 |" in md
    assert "- full, full:kv_dtype=int8: each its own `FullCache().init_cache` prefill." in md


@pytest.mark.real_model
def test_bench_kv_dtype_refuses_a_method_that_cannot_store_it_before_measuring(tiny_chat_model, tmp_path, monkeypatch,
                                                                                capsys):
    """H2O with decode-time eviction cannot store int8: the run stops with the settings (no bandwidth measured, no
    model loaded), naming it; ``kvjax bench`` prints the error, no traceback."""
    def nothing_measured(*args, **kwargs):
        raise AssertionError("a measurement started before the settings were checked")

    monkeypatch.setattr(bench_methods, "worker_bandwidth", nothing_measured)
    monkeypatch.setattr("kvjax.models.load_model", nothing_measured)
    argv = ["--model", tiny_chat_model, "--lengths", str(L), "--methods", f"snapkv,{EVICTING_H2O}", "--new-tokens", str(N),
            "--budget", "0.25", "--chunk-size", "256", "--kv-dtype", "int8", "--out", str(tmp_path / "x.md")]
    with pytest.raises(ValueError, match=rf"{EVICTING_H2O} at L=256: kv_dtype=int8 is not supported by h2o"):
        bench_methods.main(argv)
    assert cli_main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "kvjax bench: error: infeasible benchmark settings" in err and "not supported by h2o" in err
    assert "Traceback" not in err and "snapkv at" not in err  # SnapKV stores int8
    assert not (tmp_path / "x.json").exists()
    # the throughput mode refuses it too, before anything is compiled
    monkeypatch.undo()
    with pytest.raises(ValueError, match=rf"{EVICTING_H2O} at L=256: kv_dtype=int8 is not supported by h2o"):
        bench_methods.main(argv + ["--memory-budget", "1"])


def test_bench_kv_dtype_values_and_method_rows():
    out = ["--model", "smollm2-135m", "--out", "/nonexistent/x.md"]  # rejected before anything runs
    with pytest.raises(ValueError, match=r"--kv-dtype: kv_dtype='float16' is not supported; allowed: float32, "):
        bench_methods.main(out + ["--kv-dtype", "float16"])
    with pytest.raises(SystemExit):
        bench_methods.main(out + ["--methods", "full:kv_dtype=int8"])  # the stored row comes from --kv-dtype
    rows = bench_methods.method_rows
    assert rows(["snapkv", "full"], "int8") == ["full", "full:kv_dtype=int8", "snapkv"]
    assert rows(["snapkv"], "int8") == ["full", "snapkv"]  # 'full' not listed: the reference alone
    assert rows(["snapkv", "full"], None) == ["full", "snapkv"]
    assert rows(rows(["full", "snapkv"], "int8"), "int8") == ["full", "full:kv_dtype=int8", "snapkv"]
    methods = bench_methods.make_methods(rows(["full", "snapkv"], "int8"), 0.25)
    assert methods["full:kv_dtype=int8"] == methods["full"]
    assert bench_methods.method_budget("full:kv_dtype=int8", 0.1) is None
    assert [bench_methods.storage_dtype(n, "int8") for n in methods] == [None, "int8", "int8"]
    assert stored_vector_bytes(128, "int8") == 128 + 4  # one float32 scale per vector
    assert stored_vector_bytes(128, "float8_e4m3fn") == 128 + 4
    assert stored_vector_bytes(128, "bfloat16") == 256
    assert stored_vector_bytes(128, "float32") == 512


def test_demo_kv_dtype_parses_and_labels_the_stored_full_cache(monkeypatch):
    got = demo_methods(("snapkv",), "int8")
    assert [label for label, _ in got] == ["full", "full:kv_dtype=int8", "snapkv @ 0.1"]
    assert demo_groups(got, "int8") == [(None, got[:1]), ("int8", got[1:])]
    assert demo_groups(got[2:], "int8") == [("int8", got[2:])]  # the question after compression: no full cache
    assert demo_groups(demo_methods(("snapkv",)), None) == [(None, demo_methods(("snapkv",)))]

    seen = {}

    def stop(args):  # the parsed command line, before anything loads
        seen["args"] = args
        return 0

    monkeypatch.setattr("kvjax.cli.cmd_demo", stop)
    assert cli_main(["demo", "--kv-dtype", "int8", "--methods", "snapkv"]) == 0
    assert seen["args"].kv_dtype == "int8" and seen["args"].methods == ("snapkv",)


@pytest.mark.real_model
def test_demo_kv_dtype_runs_the_methods_and_the_stored_full_cache_in_it(tiny_chat_model, monkeypatch, capsys):
    """The demo on the tiny model: every ``kvjax.compare`` call gets the reference in the model's dtype and the rest
    in int8; the table shows both full caches, the stored one with about (8 + 4) / 32 of the reference's bytes."""
    calls, real = [], kvjax.compare

    def compare(model, prompt, methods, **kwargs):
        results = real(model, prompt, methods, **kwargs)
        calls.append((kwargs.get("question") is None, [m.name for m in methods], kwargs.get("kv_dtype"),
                      [r.cache_stats["device_bytes"] for r in results]))
        return results

    monkeypatch.setattr(kvjax, "compare", compare)
    assert cli_main(["demo", "--model", tiny_chat_model, "--kv-dtype", "int8", "--methods", "snapkv:budget=0.25",
                     "--length", "512", "--chunk-size", "256"]) == 0
    assert [c[:3] for c in calls] == [(True, ["full"], None), (True, ["full", "snapkv"], "int8"),
                                      (False, ["snapkv"], "int8")]
    full, stored = calls[0][3][0], calls[1][3][0]
    assert stored == pytest.approx(full * INT8_VECTOR / F32_VECTOR, rel=0.02)
    out = capsys.readouterr().out
    assert "KV stored in int8: every method's compressed cache and full:kv_dtype=int8; the full cache in float32" in out
    lines = out.splitlines()
    assert any(line.split()[3:4] == ["full:kv_dtype=int8"] for line in lines)
    assert any(line.split()[3:4] == ["full"] for line in lines)


@pytest.mark.real_model
def test_demo_kv_dtype_refuses_a_method_before_the_model_loads(tiny_chat_model, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the kv_dtype was checked")

    monkeypatch.setattr(kvjax, "load", refuse)
    assert cli_main(["demo", "--model", tiny_chat_model, "--kv-dtype", "int8", "--methods", f"snapkv,{EVICTING_H2O}",
                     "--length", "512"]) == 2
    err = capsys.readouterr().err
    assert "kvjax demo: error: --kv-dtype int8: not every method can store it" in err
    assert f"{EVICTING_H2O} @ 0.1: kv_dtype=int8 is not supported by h2o" in err and "snapkv" not in err
    assert cli_main(["demo", "--model", tiny_chat_model, "--kv-dtype", "float16"]) == 2
    assert "kv_dtype='float16' is not supported" in capsys.readouterr().err


@pytest.mark.real_model
def test_throughput_mode_kv_dtype_int8(tiny_chat_model, tmp_path):
    """``--memory-budget`` with ``--kv-dtype int8``: a budget of 3 rows of the float32 full cache; the reference still
    fits 3, the full cache stored in int8 costs less per row (on this tiny model the logits, not the cache, dominate a
    row), and every timed cache is the one its memory counted (int8 pools and their scales)."""
    from kvjax.evals import bench_throughput
    from kvjax.evals.bench_machine import GIB
    from kvjax.methods import get_method
    from kvjax.models import load_model

    model = load_model(tiny_chat_model, "float32", tokenizer=False)
    room = bench_throughput.room_tokens(N, 1)
    three = bench_throughput.decode_memory(model, get_method("full"), L, room, 3, N)
    stored = bench_throughput.decode_memory(model, get_method("full"), L, room, 3, N, kv_dtype="int8")
    buffer = 3 * 2 * LAYERS * KV_HEADS * 512  # K and V vectors of the dense buffer (L + room rounded up to 256)
    assert buffer * INT8_VECTOR <= stored["cache_device_bytes"] <= buffer * INT8_VECTOR + 64
    out = tmp_path / "t.md"
    assert bench_methods.main([
        "--model", tiny_chat_model, "--lengths", str(L), "--methods", "full,snapkv", "--new-tokens", str(N),
        "--budget", "0.25", "--memory-budget", repr((three["device_bytes"] + 0.5) / GIB), "--kv-dtype", "int8",
        "--no-plot", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["args"]["kv_dtype"] == "int8"
    by = {r["method"]: r for r in report["rows"]}
    assert list(by) == ["full", "full:kv_dtype=int8", "snapkv"]
    assert [by[n]["kv_dtype"] for n in by] == ["float32", "int8", "int8"]
    assert by["full"]["max_batch"] == 3 and by["full"]["memory_bytes"] == three["device_bytes"]
    assert by["full:kv_dtype=int8"]["per_row_bytes"] < by["full"]["per_row_bytes"]
    assert by["snapkv"]["max_batch"] >= by["full:kv_dtype=int8"]["max_batch"] >= 3
    for r in by.values():
        assert r["built_device_bytes"] == r["cache_device_bytes"]
        assert r["memory_bytes"] <= report["memory_budget_bytes"]
    # at 3 rows the int8 full cache is the one measured above, against the float32 one's
    assert by["full:kv_dtype=int8"]["probed_batches"]["3"] == stored["device_bytes"] < three["device_bytes"]
    assert "- KV stored in **int8**" in out.read_text()
