"""``kvjax bench --batch`` (every cell at several batches) and the throughput mode (``--memory-budget``): bytes that
scale with the batch as counted by hand, tokens/s recomputed from the measured times, the largest batch of a budget
checked against the compiled memory, and bad values refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.evals import bench_methods, bench_throughput
from kvjax.evals.bench_machine import GIB, prompt_tokens
from kvjax.evals.bench_methods_report import render_markdown

KV_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # the tiny model: 2 layers, K and V, 2 KV heads of 8, float32
BATCH1_HEADER = ("| L | method | prefill s | prefill ÷ full | compress s | decode ms/tok | decode speed-up vs full | "
                 "limit ms/tok | ÷ limit | device KV MiB | ÷ full bytes | host KV MiB | peak RSS GiB (prefill / decode) | "
                 "compile s (prefill / decode) |")


def test_batch_prompts_differ_per_row_and_row_0_is_the_batch_1_prompt():
    tokens = bench_methods.batch_prompt_tokens(1000, 64, 3, 4)
    assert tokens.shape == (4, 64) and tokens.dtype == np.int32
    assert (tokens[:1] == prompt_tokens(1000, 64, 3)).all()
    assert len({row.tobytes() for row in tokens}) == 4


@pytest.mark.real_model
def test_batch_cells_scale_with_the_batch(tiny_chat_model, tmp_path):
    """Two batches of one length: every (length, batch) cell measured against the full cache of the same cell; bytes
    by hand; tokens/s = batch x timed steps / the best decode time (recomputed from the JSON); the batch-1 rows read as
    a batch-1 run's (same table header, same values)."""
    out = tmp_path / "b.md"
    N, L = 4, 256
    code = bench_methods.main([
        "--model", tiny_chat_model, "--lengths", str(L), "--batch", "1,2", "--methods", "snapkv", "--new-tokens", str(N),
        "--budget", "0.25", "--chunk-size", "128", "--bandwidth-mib", "16", "--bandwidth-repeats", "1", "--out", str(out),
    ])
    assert code == 0
    report = json.loads((tmp_path / "b.json").read_text())
    md = out.read_text()
    assert (tmp_path / "b.png").stat().st_size > 0
    assert report["args"]["batch"] == [1, 2] and report["command"].startswith("kvjax bench --model")
    rows = report["rows"]
    assert [(r["prompt_tokens"], r["batch"], r["method"]) for r in rows] == [
        (L, 1, "full"), (L, 1, "snapkv"), (L, 2, "full"), (L, 2, "snapkv")]
    by = {(r["batch"], r["method"]): r for r in rows}
    slots = 512  # the full cache's dense buffer: L + N rounded up to 256 slots
    for B in (1, 2):
        full, snap = by[B, "full"], by[B, "snapkv"]
        # the full cache: K and V of every slot of every row, plus the slot counter and one pad per row
        assert KV_PER_TOKEN * slots * B <= full["device_bytes"] <= KV_PER_TOKEN * slots * B + 64
        # SnapKV keeps a quarter of each row's prompt per head, with room for the new tokens, in page pools
        assert snap["cache_stats"]["kept_tokens_per_head"] == [[L // 4] * 2] * 2
        assert KV_PER_TOKEN * (L // 4 + N) * B <= snap["device_bytes"] < full["device_bytes"]
        assert snap["kv_read_bytes_per_step"] < full["kv_read_bytes_per_step"]
        assert full["kv_read_bytes_per_step"] == B * KV_PER_TOKEN * (L + N / 2)
        for r in (full, snap):
            best = min(r["decode_times_s"])
            assert r["tokens_per_s"] == pytest.approx(B * (N - 1) / best)
            assert r["decode_ms_per_token"] == pytest.approx(1000 * best / (N - 1))
            assert r["tokens_per_s_ratio"] == pytest.approx(r["tokens_per_s"] / full["tokens_per_s"])
            assert r["decode_speedup"] == pytest.approx(r["tokens_per_s_ratio"])
            assert r["device_bytes_ratio"] == pytest.approx(r["device_bytes"] / full["device_bytes"])
    for name in ("full", "snapkv"):  # two rows hold twice the bytes of one (up to the per-row lengths and pads)
        one, two = by[1, name]["device_bytes"], by[2, name]["device_bytes"]
        assert 2 * one - 64 <= two <= 2 * one + 64
    header = next(line for line in md.splitlines() if line.startswith("| L | B | method |"))
    for column in ("decode ms/step", "tokens/s", "tokens/s ÷ full", "device KV MiB", "÷ full bytes"):
        assert column in header
    assert len([line for line in md.splitlines() if line.startswith(f"| {L} | ")]) == 4
    assert "batches 1, 2 (B rows of different random prompts" in md

    # the batch-1 rows alone are a batch-1 report: the same header as before --batch, the decode column = ms/token
    one = dict(report, rows=[r for r in rows if r["batch"] == 1], args=dict(report["args"], batch=[1]))
    batch1 = render_markdown(one)
    assert BATCH1_HEADER in batch1.splitlines() and "| L | B |" not in batch1 and ", batch 1, random" in batch1
    cells = next(line for line in batch1.splitlines() if line.startswith(f"| {L} | snapkv |")).split(" | ")
    assert cells[5] == f"{by[1, 'snapkv']['decode_ms_per_token']:.2f}"
    assert 1000 / by[1, "snapkv"]["decode_ms_per_token"] == pytest.approx(by[1, "snapkv"]["tokens_per_s"])


def test_a_method_spec_budget_wins_over_budget():
    methods = bench_methods.make_methods(["full", "snapkv", "snapkv:budget=0.25"], 0.1)
    assert methods["snapkv"].budget == 0.1 and methods["snapkv:budget=0.25"].budget == 0.25
    assert bench_methods.method_budget("snapkv:budget=0.25", 0.1) == 0.25
    assert bench_methods.method_budget("full", 0.1) is None


def test_largest_batch_is_the_last_that_fits():
    """The search on hand-made memory curves: linear, with a jump, and under the linear estimate."""
    linear = lambda b: 100 + 10 * b  # noqa: E731
    assert bench_throughput.largest_batch(linear, 109)[0] == 0
    assert bench_throughput.largest_batch(linear, 110)[0] == 1
    assert bench_throughput.largest_batch(linear, 129)[0] == 2
    batch, probes = bench_throughput.largest_batch(linear, 1000)
    assert batch == 90 and sorted(probes) == [1, 2, 90, 91]  # the estimate, checked with one row more
    jump = lambda b: 100 + 10 * b + (50 if b >= 7 else 0)  # noqa: E731 - temporaries that grow at 7 rows
    assert [bench_throughput.largest_batch(jump, m)[0] for m in (169, 219, 220, 230)] == [6, 6, 7, 8]
    cheaper = lambda b: 100 + 10 * b - (5 if b >= 2 else 0)  # noqa: E731 - the estimate is low: searched upwards
    assert bench_throughput.largest_batch(cheaper, 200)[0] == 10
    assert bench_throughput.largest_batch(cheaper, 10**6)[0] == (10**6 - 95) // 10


def test_tokens_per_second_is_rows_times_steps_over_seconds():
    assert bench_methods.tokens_per_second(16, 63, 2.0) == 16 * 63 / 2.0


@pytest.mark.real_model
def test_throughput_mode_largest_batch_in_a_budget(tiny_chat_model, tmp_path):
    """A budget of exactly the compiled memory of 3 rows of the full cache: the full cache's largest batch is 3, the
    compiled memory holds the weights, the cache counted by hand and one row of logits per row; SnapKV fits more rows;
    tokens/s recomputed from the timed runs."""
    from kvjax.methods import get_method
    from kvjax.models import load_model

    N, L = 4, 256
    model = load_model(tiny_chat_model, "float32", tokenizer=False)
    weights = bench_throughput.param_bytes(model.params)
    room = bench_throughput.room_tokens(N, 1)
    slots = 512  # L + room rounded up to 256
    full = {b: bench_throughput.decode_memory(model, get_method("full"), L, room, b, N) for b in (3, 4)}
    for b, m in full.items():
        assert KV_PER_TOKEN * slots * b <= m["cache_device_bytes"] <= KV_PER_TOKEN * slots * b + 64
        assert m["device_bytes"] >= weights + m["cache_device_bytes"] + b * model.config.vocab_size * 4
    assert full[4]["device_bytes"] > full[3]["device_bytes"] + 1
    budget_gib = (full[3]["device_bytes"] + 0.5) / GIB

    out = tmp_path / "t.md"
    code = bench_methods.main([
        "--model", tiny_chat_model, "--lengths", str(L), "--methods", "snapkv", "--new-tokens", str(N),
        "--budget", "0.25", "--memory-budget", repr(budget_gib), "--out", str(out),
    ])
    assert code == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert (tmp_path / "t.png").stat().st_size > 0
    assert report["mode"] == "throughput" and report["weights_bytes"] == weights
    by = {r["method"]: r for r in report["rows"]}
    f, s = by["full"], by["snapkv"]
    assert f["max_batch"] == 3 and f["memory_bytes"] == full[3]["device_bytes"]
    assert f["probed_batches"]["4"] == full[4]["device_bytes"] > report["memory_budget_bytes"]
    assert s["max_batch"] > 3 and s["memory_bytes"] <= report["memory_budget_bytes"]
    assert s["probed_batches"][str(s["max_batch"] + 1)] > report["memory_budget_bytes"]
    for r in (f, s):
        assert r["built_device_bytes"] == r["cache_device_bytes"]  # the timed cache is the one the memory counted
        assert r["tokens_per_s"] == pytest.approx(r["max_batch"] * (N - 1) / min(r["decode_times_s"]))
        assert r["tokens_per_s_ratio"] == pytest.approx(r["tokens_per_s"] / f["tokens_per_s"])
        assert r["batch_ratio"] == pytest.approx(r["max_batch"] / 3)
    md = out.read_text()
    assert f"`kvjax bench --model {tiny_chat_model}" in md
    assert next(line for line in md.splitlines() if line.startswith(f"| {L} | full |")).split(" | ")[2] == "3"


def test_bad_batch_and_memory_values_are_value_errors(tmp_path):
    out = ["--model", "smollm2-135m", "--out", str(tmp_path / "x.md")]  # rejected before anything runs
    for batch in ("0", "1,0", "a", ""):
        with pytest.raises(ValueError, match="--batch: expected comma-separated integers >= 1"):
            bench_methods.main(out + ["--batch", batch])
    with pytest.raises(ValueError, match="--memory-budget must be > 0"):
        bench_methods.main(out + ["--memory-budget", "0"])
    with pytest.raises(ValueError, match=r"not more than the model's weights \(0.250 GiB\)"):
        bench_throughput.check_budget(GIB // 8, GIB // 4)


@pytest.mark.real_model
def test_a_memory_budget_below_the_weights_is_refused(tiny_chat_model, tmp_path):
    with pytest.raises(ValueError, match="not more than the model's weights"):
        bench_methods.main(["--model", tiny_chat_model, "--lengths", "256", "--methods", "snapkv",
                            "--memory-budget", "0.001", "--out", str(tmp_path / "x.md")])


@pytest.mark.real_model
def test_an_interrupted_run_keeps_its_finished_cells(tiny_chat_model, tmp_path, monkeypatch):
    """The report is rewritten after each (length, batch) cell: a run stopped in its second cell leaves the first."""
    def measure(model, L, methods, args, bar=None, artifacts=None, batch=1):
        if batch == 2:
            raise KeyboardInterrupt
        return [{"prompt_tokens": L, "batch": batch, "method": n, "error": "stand-in"} for n in methods]

    monkeypatch.setattr(bench_methods, "measure_length", measure)
    out = tmp_path / "p.md"
    with pytest.raises(KeyboardInterrupt):
        bench_methods.main(["--model", tiny_chat_model, "--lengths", "256", "--batch", "1,2", "--methods", "snapkv",
                            "--budget", "0.25", "--new-tokens", "4", "--chunk-size", "256", "--bandwidth-mib", "16", "--bandwidth-repeats", "1", "--out", str(out)])
    report = json.loads((tmp_path / "p.json").read_text())
    assert [(r["batch"], r["method"]) for r in report["rows"]] == [(1, "full"), (1, "snapkv")]
    assert (report["cells_done"], report["cells"]) == (1, 2)
    assert "- **partial**: 1 of 2 (length, batch) cells measured" in out.read_text()


@pytest.mark.real_model
def test_no_prefill_cells_time_fixed_batches_from_built_caches(tiny_chat_model, tmp_path):
    """``--no-prefill --batch 1,2``: every (length, batch) cell built without a prefill; the caches' bytes counted by
    hand (room for the warm-up and the timed runs), two rows twice one, tokens/s recomputed from the timed runs and
    ratios against the full cache of the same cell; the compiled memory holds the weights and the cache."""
    from kvjax.models import load_model

    out = tmp_path / "n.md"
    N, L, repeats = 4, 256, 2
    code = bench_methods.main([
        "--model", tiny_chat_model, "--lengths", str(L), "--batch", "1,2", "--methods", "snapkv", "--no-prefill",
        "--new-tokens", str(N), "--repeats", str(repeats), "--budget", "0.25", "--out", str(out),
    ])
    assert code == 0
    report = json.loads((tmp_path / "n.json").read_text())
    assert (tmp_path / "n.png").stat().st_size > 0
    assert report["mode"] == "batches" and (report["cells_done"], report["cells"]) == (2, 2)
    rows = report["rows"]
    assert [(r["prompt_tokens"], r["batch"], r["method"]) for r in rows] == [
        (L, 1, "full"), (L, 1, "snapkv"), (L, 2, "full"), (L, 2, "snapkv")]
    weights = bench_throughput.param_bytes(load_model(tiny_chat_model, "float32", tokenizer=False).params)
    room = (repeats + 1) * N
    slots = 512  # the full cache's dense buffer: L + room rounded up to 256 slots
    by = {(r["batch"], r["method"]): r for r in rows}
    for B in (1, 2):
        full, snap = by[B, "full"], by[B, "snapkv"]
        assert KV_PER_TOKEN * slots * B <= full["cache_device_bytes"] <= KV_PER_TOKEN * slots * B + 64
        # a quarter of the prompt per head plus the room, in 16-token pages; block tables and lengths beside them
        kept = -(-(L // 4 + room) // 16) * 16
        assert KV_PER_TOKEN * kept * B <= snap["cache_device_bytes"] <= KV_PER_TOKEN * kept * B + 128 * B
        for r in (full, snap):
            assert len(r["decode_times_s"]) == repeats and r["cache_host_bytes"] == 0
            assert r["tokens_per_s"] == pytest.approx(B * (N - 1) / min(r["decode_times_s"]))
            assert r["ms_per_step"] == pytest.approx(1000 * min(r["decode_times_s"]) / (N - 1))
            assert r["tokens_per_s_ratio"] == pytest.approx(r["tokens_per_s"] / full["tokens_per_s"])
            assert r["cache_device_bytes_ratio"] == pytest.approx(r["cache_device_bytes"] / full["cache_device_bytes"])
            assert r["memory_bytes"] >= weights + r["cache_device_bytes"]
    for name in ("full", "snapkv"):
        one, two = by[1, name]["cache_device_bytes"], by[2, name]["cache_device_bytes"]
        assert 2 * one - 64 <= two <= 2 * one + 64
    md = out.read_text()
    assert "| L | B | method | cache device MiB | ÷ full bytes |" in md and "partial" not in md
    assert len([line for line in md.splitlines() if line.startswith(f"| {L} | 2 | ")]) == 2


def test_no_prefill_refuses_a_profile(tmp_path):
    with pytest.raises(ValueError, match="--no-prefill and --memory-budget have none"):
        bench_methods.main(["--model", "smollm2-135m", "--no-prefill", "--profile", str(tmp_path / "p"),
                            "--out", str(tmp_path / "x.md")])
