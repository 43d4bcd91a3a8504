"""`kvjax eval` end to end on a tiny random model with a real tokenizer; fidelity metrics; report files."""

from __future__ import annotations

import json


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.evals.fidelity import compare_logprobs, teacher_forced_logprobs
from kvjax.cli import main as cli_main
from kvjax.decoding import compress, decode_step, prefill
from kvjax.methods import FullCache, SnapKV
from kvjax.cache import new_cache


def _lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def test_kvjax_eval_writes_every_output_and_resumes(tiny_chat_model, tmp_path):
    argv = ["eval", "--model", tiny_chat_model, "--methods", "snapkv,quest", "--budgets", "0.25,0.5",
            "--tasks", "passkey,niah_multikey", "--lengths", "384", "--samples", "3", "--batch-size", "2",
            "--chunk-size", "128", "--out-root", str(tmp_path), "--run-name", "t", "--fidelity-texts", "2",
            "--fidelity-prefix", "128", "--fidelity-tokens", "8", "--no-progress"]
    assert cli_main(argv) == 0
    run = tmp_path / "t"
    for name in ("config.json", "samples.jsonl", "fidelity.jsonl", "summary.json", "README.md",
                 "accuracy_vs_budget.png", "accuracy_vs_bytes.png", "depth_heatmap.png"):
        assert (run / name).stat().st_size > 0, name
    records = _lines(run / "samples.jsonl")
    keys = {(r["task"], r["index"], r["method"], r["budget"]) for r in records}
    assert len(records) == len(keys) == 2 * 3 * (1 + 2 * 2)  # tasks x samples x (full + methods x budgets)
    assert all(0.0 <= r["score"] <= 1.0 and r["answers"] for r in records)
    full_bytes = {r["index"]: r["device_bytes"] for r in records if r["method"] == "full"}
    snap = [r for r in records if r["method"] == "snapkv"]
    assert all(r["device_bytes"] < full_bytes[r["index"]] for r in snap)
    assert all(r["artifact_device_bytes"] == 0 for r in records)  # no method here carries an artifact
    fid = {(r["method"], r["budget"]): r for r in _lines(run / "fidelity.jsonl")}
    assert len(fid) == 5 and fid[("full", "full")]["kl"] == 0.0 and fid[("full", "full")]["top1"] == 1.0
    summary = json.loads((run / "summary.json").read_text())
    assert [(r["method"], r["budget"]) for r in summary["rows"]][:3] == [("full", "full"), ("snapkv", "0.25"), ("snapkv", "0.5")]
    md = (run / "README.md").read_text()
    assert "kvjax eval --model" in md and "| snapkv | 0.25 |" in md and "Fidelity" in md and "Incomplete" not in md
    # each record names what measured it, and the README says so
    assert {(r["jax"], r["device"].split(":")[0]) for r in records} == {(jax.__version__, jax.devices()[0].platform)}
    assert f"Measured with jax {jax.__version__} on {records[0]['device']} ({len(records)} records)." in md

    # resume: nothing is recomputed; a lost record (interrupted run) is recomputed alone
    assert cli_main(argv) == 0
    assert len(_lines(run / "samples.jsonl")) == len(records)
    kept = (run / "samples.jsonl").read_text().splitlines()[:-3]
    (run / "samples.jsonl").write_text("\n".join(kept) + "\n")
    assert cli_main(argv) == 0
    again = _lines(run / "samples.jsonl")
    assert len(again) == len(records)
    assert {(r["task"], r["index"], r["method"], r["budget"]) for r in again} == keys
    # greedy + same prompts: recomputed records equal the originals
    by_key = {(r["task"], r["index"], r["method"], r["budget"]): r["output"] for r in records}
    assert all(by_key[(r["task"], r["index"], r["method"], r["budget"])] == r["output"] for r in again)


def test_a_resumed_run_keeps_every_configuration_of_its_directory_in_config_json(tmp_path):
    """A second run into one directory (other methods at other budgets, another task) leaves ``config.json`` naming
    every configuration of either run and no other: the old grid, the new method at the old budgets as a plain spec and
    at its extra budget as ``name:budget=b``, both tasks, both commands; the report's expected record count follows.
    A run of other settings (seed, protocol) is refused."""
    from kvjax.evals.report import expected_records
    from kvjax.evals.runner import EvalConfig, prepare_out_dir

    def config(**kw):
        return EvalConfig(**{"out_root": str(tmp_path), "run_name": "r", "samples": 2, "lengths": (512,), **kw})

    prepare_out_dir(config(methods=("snapkv", "hbw"), budgets=(0.1, 0.25), tasks=("passkey",), command="c1"))
    prepare_out_dir(config(methods=("heterocache", "snapkv:budget=0.5", "hbw"), budgets=(0.1, 0.25, 0.5),
                           tasks=("niah_single",), command="c2"))
    prepare_out_dir(config(methods=("hbw",), budgets=(0.25,), tasks=("passkey",), command="c2"))  # nothing new
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["methods"] == ["snapkv", "hbw", "heterocache", "heterocache:budget=0.5", "snapkv:budget=0.5",
                                "hbw:budget=0.5"]
    assert saved["budgets"] == [0.1, 0.25] and saved["tasks"] == ["passkey", "niah_single"]
    assert saved["command"] == "c1 && c2"
    assert expected_records(saved) == 2 * 1 * 2 * (1 + 9)  # tasks x lengths x samples x (full + 3 x 3 configurations)
    with pytest.raises(ValueError, match="different settings"):
        prepare_out_dir(config(methods=("snapkv",), protocol="query-agnostic"))


def test_processes_starting_together_on_one_run_directory_all_land_in_config_json(tmp_path):
    """Eight writers released at once (threads: each holds its own lock on the directory, as processes do) each add
    a length; the file stays valid JSON and names all eight lengths (without the lock writers overwrite each other's
    additions, and a reader can meet a half-written file)."""
    import threading

    from kvjax.evals.runner import EvalConfig, prepare_out_dir

    barrier = threading.Barrier(8)
    errors = []

    def writer(i):
        cfg = EvalConfig(out_root=str(tmp_path), run_name="r", methods=("snapkv",), tasks=("passkey",),
                         lengths=(256 * (i + 1),), command=f"c{i}")
        barrier.wait()
        try:
            for _ in range(5):
                prepare_out_dir(cfg)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert sorted(saved["lengths"]) == [256 * (i + 1) for i in range(8)]
    assert sorted(saved["command"].split(" && ")) == sorted(f"c{i}" for i in range(8))
    assert not [p.name for p in (tmp_path / "r").iterdir() if p.name != "config.json"]  # no temporary file left


def test_a_run_interrupted_inside_a_batch_keeps_its_finished_configurations(tiny_chat_model, tmp_path, monkeypatch):
    """Records are flushed per method and budget: a run stopped while decoding a batch's second configuration keeps
    the first one's records, and resuming computes only the rest."""
    import kvjax.decoding

    argv = ["eval", "--model", tiny_chat_model, "--methods", "snapkv", "--budgets", "0.5", "--tasks", "passkey",
            "--lengths", "384", "--samples", "2", "--batch-size", "2", "--chunk-size", "128", "--out-root",
            str(tmp_path), "--run-name", "t", "--fidelity-texts", "0", "--no-progress"]
    real, calls = kvjax.decoding.decode_loop, []

    def stopped_on_the_second_configuration(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(kvjax.decoding, "decode_loop", stopped_on_the_second_configuration)
    with pytest.raises(KeyboardInterrupt):
        cli_main(argv)
    first = _lines(tmp_path / "t" / "samples.jsonl")
    assert sorted((r["method"], r["index"]) for r in first) == [("full", 0), ("full", 1)]
    monkeypatch.setattr(kvjax.decoding, "decode_loop", real)
    assert cli_main(argv) == 0
    records = _lines(tmp_path / "t" / "samples.jsonl")
    assert sorted((r["method"], r["index"]) for r in records) == [("full", 0), ("full", 1), ("snapkv", 0), ("snapkv", 1)]
    assert records[:2] == first


def test_eval_bad_input(tiny_chat_model, tmp_path):
    assert cli_main(["eval", "--model", tiny_chat_model, "--methods", "nope", "--out-root", str(tmp_path)]) == 2
    assert cli_main(["eval", "--model", tiny_chat_model, "--tasks", "sudoku", "--out-root", str(tmp_path)]) == 2
    assert cli_main(["eval", "--model", tiny_chat_model, "--budgets", "1.5", "--out-root", str(tmp_path)]) == 2
    assert cli_main(["eval", "--model", tiny_chat_model, "--tasks", "", "--out-root", str(tmp_path)]) == 2


def test_compare_logprobs_hand_computed():
    p = np.log(np.array([[[0.5, 0.5], [0.9, 0.1]]]))
    q = np.log(np.array([[[0.25, 0.75], [0.9, 0.1]]]))
    got = compare_logprobs(p, q, np.array([[1, 0]]))
    kl0 = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
    assert got["kl"] == pytest.approx(kl0 / 2)
    assert got["top1"] == 0.5  # step 0: argmax 0 vs 1; step 1: same
    assert got["nll"] == pytest.approx((-np.log(0.75) - np.log(0.9)) / 2)
    with pytest.raises(ValueError, match="shape mismatch"):
        compare_logprobs(p, q[:, :1], np.array([[1, 0]]))


def test_teacher_forced_full_cache_matches_step_by_step_decode(tmp_path):
    """Independent reference: the scan's full-cache log-probs equal per-step decode_step logits."""
    from kvjax.models import load_model
    from tests.tiny import save_tiny

    save_tiny("qwen2", str(tmp_path), seed=2)
    model = load_model(str(tmp_path), "float32", tokenizer=False)
    tokens = np.random.default_rng(0).integers(0, 97, size=(1, 40)).astype(np.int32)

    def run(method):
        cache = new_cache(method, model.config, 1, 32, 8, model.dtype)
        _, cache = prefill(model.graphdef, model.params, jnp.asarray(tokens[:, :32]), cache)
        return compress(cache)

    lp, _ = teacher_forced_logprobs(model.graphdef, model.params, run(FullCache()), jnp.asarray(tokens[:, 32:40]))
    cache, ref = run(FullCache()), []
    for t in range(32, 40):
        _, logits, cache = decode_step(model.graphdef, model.params, jnp.asarray(tokens[:, t]), cache, jax.random.PRNGKey(0))
        ref.append(np.asarray(jax.nn.log_softmax(logits, axis=-1)))
    ref = np.stack(ref, axis=1)
    np.testing.assert_allclose(np.asarray(lp), ref, atol=1e-5)
    same = compare_logprobs(ref, np.asarray(lp), tokens[:, 33:41] if tokens.shape[1] > 40 else np.zeros((1, 8), int))
    assert same["kl"] < 1e-6 and same["top1"] == 1.0
    small, _ = teacher_forced_logprobs(model.graphdef, model.params, run(SnapKV(budget=6, window=2, block=16)),
                                       jnp.asarray(tokens[:, 32:40]))
    assert compare_logprobs(ref, np.asarray(small), np.zeros((1, 8), int))["kl"] > 1e-4  # the metric can fail


def test_query_agnostic_protocol_equals_query_aware_when_nothing_is_evicted(tiny_chat_model, tmp_path):
    """Same prompt tokens in both protocols: at budget 1.0 (and for the full cache) the answers are identical;
    the question is never inside the compressed part."""
    common = ["eval", "--model", tiny_chat_model, "--methods", "snapkv,hbw", "--budgets", "1.0", "--tasks", "niah_single",
              "--lengths", "300", "--samples", "3", "--batch-size", "2", "--chunk-size", "128", "--out-root", str(tmp_path),
              "--no-progress"]
    assert cli_main(common + ["--run-name", "aware"]) == 0
    assert cli_main(common + ["--run-name", "agnostic", "--protocol", "query-agnostic"]) == 0
    aware = {(r["index"], r["method"]): r for r in _lines(tmp_path / "aware" / "samples.jsonl")}
    agnostic = _lines(tmp_path / "agnostic" / "samples.jsonl")
    assert len(agnostic) == len(aware) == 3 * 3
    for r in agnostic:
        assert r["protocol"] == "query-agnostic" and r["question_tokens"] > 10
        assert r["output"] == aware[(r["index"], "full")]["output"], (r["method"], r["index"])
    assert "Protocol: **query-agnostic**" in (tmp_path / "agnostic" / "README.md").read_text()
    # a run directory keeps its protocol
    assert cli_main(common + ["--run-name", "aware", "--protocol", "query-agnostic"]) == 2


def test_query_agnostic_batches_share_a_question_length():
    from kvjax.evals.runner import batches

    class S:
        def __init__(self, n, q):
            self.prompt_ids, self.question_start = tuple(range(n)), n - q

    samples = [S(100, 20), S(99, 21), S(98, 20), S(97, 20), S(96, 21)]
    got = [[(len(s.prompt_ids), len(s.prompt_ids) - s.question_start) for s in b] for b in batches(samples, 2, "query-agnostic")]
    assert got == [[(100, 20), (98, 20)], [(97, 20)], [(99, 21), (96, 21)]]
    assert [len(b) for b in batches(samples, 2, "query-aware")] == [2, 2, 1]


def test_method_grid_budget_inside_a_spec_runs_that_budget_alone():
    from kvjax.evals.runner import EvalConfig, method_grid

    cfg = EvalConfig(methods=("snapkv", "hcattention:budget=0.05", "hcattention:budget=0.5", "synckv:budget=64:stride=1"),
                     budgets=(0.1, 0.25))
    grid = method_grid(cfg)
    assert [(n, b) for n, b, _ in grid] == [("full", "full"), ("snapkv", "0.1"), ("snapkv", "0.25"),
                                            ("hcattention", "0.05"), ("hcattention", "0.5"), ("synckv:stride=1", "64")]
    assert grid[3][2].budget == 0.05 and grid[5][2].budget == 64 and grid[5][2].stride == 1
    with pytest.raises(ValueError, match="listed twice"):
        method_grid(EvalConfig(methods=("snapkv", "snapkv:budget=0.1"), budgets=(0.1,)))
    for bad in ("snapkv:budget=1.5", "snapkv:budget=0", "snapkv:budget=full"):
        with pytest.raises(ValueError, match="budget in method spec"):
            EvalConfig(methods=(bad,))
    for bad in (1.5, 0.0, 0, -3, True, "0.1"):
        with pytest.raises(ValueError, match="budgets: .*budget"):
            EvalConfig(budgets=(bad,))


def test_kvjax_generate_cli_prints_the_answer_and_cache_bytes(tiny_chat_model, capsys):
    assert cli_main(["generate", "--model", tiny_chat_model, "--prompt", "Hello there, " * 30, "--max-new-tokens", "3",
                     "--method", "snapkv", "--budget", "40"]) == 0
    err = capsys.readouterr().err
    assert "generated" in err and "cache snapkv: device " in err and "host 0 B]" in err


def test_kvzip_in_an_eval_reconstructs_once_per_batch_for_every_budget(tiny_chat_model, tmp_path):
    """KVzip's reconstruction runs once per batch and serves each budget (its time is in both records); at budget
    1.0 it answers as the full cache does; at 0.5 its records hold about half the full cache's device bytes."""
    argv = ["eval", "--model", tiny_chat_model, "--methods", "kvzip:chunk=64", "--budgets", "1.0,0.5",
            "--tasks", "niah_single", "--lengths", "300", "--samples", "2", "--batch-size", "2", "--chunk-size", "128",
            "--protocol", "query-agnostic", "--out-root", str(tmp_path), "--run-name", "kvzip", "--no-progress"]
    assert cli_main(argv) == 0
    records = _lines(tmp_path / "kvzip" / "samples.jsonl")
    by = {(r["index"], r["method"], r["budget"]): r for r in records}
    assert len(records) == 2 * 3
    for i in (0, 1):
        whole, half, full = by[(i, "kvzip:chunk=64", "1")], by[(i, "kvzip:chunk=64", "0.5")], by[(i, "full", "full")]
        assert whole["output"] == full["output"]
        assert whole["reconstruct_s"] == half["reconstruct_s"] > 0
        assert half["device_bytes"] < 0.75 * whole["device_bytes"]


def test_kv_dtype_stores_the_methods_pools_quantized_and_keeps_the_full_cache(tiny_chat_model, tmp_path, capsys):
    """``--kv-dtype int8``: the full cache (the reference) is the same as in a run without it, SnapKV's and KVzip's pools
    hold int8 with per-token scales (fewer device bytes), every record names its dtype, a method without page pools
    refuses, and a run directory keeps its kv_dtype."""
    common = ["eval", "--model", tiny_chat_model, "--methods", "snapkv,kvzip", "--budgets", "0.5", "--tasks",
              "niah_single", "--lengths", "300", "--samples", "2", "--batch-size", "2", "--chunk-size", "128",
              "--out-root", str(tmp_path), "--no-progress"]
    assert cli_main(common + ["--run-name", "f32"]) == 0
    assert cli_main(common + ["--run-name", "int8", "--kv-dtype", "int8"]) == 0
    f32 = {(r["index"], r["method"]): r for r in _lines(tmp_path / "f32" / "samples.jsonl")}
    int8 = {(r["index"], r["method"]): r for r in _lines(tmp_path / "int8" / "samples.jsonl")}
    assert f32.keys() == int8.keys() and len(int8) == 2 * 3
    for (i, m), r in int8.items():
        assert r["kv_dtype"] == ("float32" if m == "full" else "int8") and f32[i, m]["kv_dtype"] == "float32"
        if m == "full":
            assert (r["output"], r["device_bytes"]) == (f32[i, m]["output"], f32[i, m]["device_bytes"])
        else:  # K and V: D bytes + a 4-byte scale per token instead of 4 D bytes, besides the block table and lengths
            assert r["device_bytes"] < 0.5 * f32[i, m]["device_bytes"], m
    assert "KV storage: every method's compressed page pools in **int8**" in (tmp_path / "int8" / "README.md").read_text()
    assert json.loads((tmp_path / "int8" / "config.json").read_text())["kv_dtype"] == "int8"
    # the model's own dtype is no quantization: the run is the float32 one
    assert cli_main(common + ["--run-name", "f32", "--kv-dtype", "float32"]) == 0
    assert cli_main(common + ["--run-name", "f32", "--kv-dtype", "int8"]) == 2  # another kv_dtype in that directory
    capsys.readouterr()
    evicting_h2o = "h2o:budget=0.5:evict_during_decode=true"  # its decode-time eviction keeps no quantized layout
    assert cli_main(["eval", "--model", tiny_chat_model, "--methods", evicting_h2o, "--tasks", "niah_single",
                     "--lengths", "300", "--samples", "1", "--out-root", str(tmp_path), "--no-progress", "--run-name",
                     "sk", "--kv-dtype", "int8"]) == 2
    assert "kv_dtype=int8 is not supported by h2o" in capsys.readouterr().err
    assert not (tmp_path / "sk" / "samples.jsonl").exists() or not _lines(tmp_path / "sk" / "samples.jsonl")
    assert cli_main(common + ["--run-name", "bad", "--kv-dtype", "int4"]) == 2
    assert "kv_dtype='int4' is not supported" in capsys.readouterr().err
