"""``research.trace_summary`` on a hand-built trace: busy time, top operations and overlaps computed by hand."""

from __future__ import annotations

import gzip
import json

import pytest

from research.trace_summary import find_traces, main, overlap_length, summarise, union_length


def _trace():
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "compute"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "MemcpyH2D"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    x = lambda pid, tid, ts, dur, name: {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}
    return meta + [
        x(1, 7, 0, 10, "dot"), x(1, 7, 5, 10, "fusion"),  # nested / overlapping: busy 0..15
        x(1, 7, 20, 5, "dot"),                            # busy 20..25
        x(1, 8, 12, 10, "copy"),                          # 12..22: overlaps compute 12..15 and 20..22
        x(2, 3, 0, 100, "host op"), x(2, 3, 0, 1000, "$python.py:1 f"),  # the Python tracer's event is left out
    ]


def test_intervals_by_hand():
    assert union_length([(0, 10), (5, 15), (20, 25)]) == 20
    assert union_length([]) == 0
    assert overlap_length([(0, 10), (5, 15), (20, 25)], [(12, 22)]) == 5
    assert overlap_length([(0, 1)], [(1, 2)]) == 0


def test_summary_by_hand():
    s = summarise(_trace(), top=1)
    by = {(r["process"], r["thread"]): r for r in s["threads"]}
    compute, copy, host = by["/device:GPU:0", "compute"], by["/device:GPU:0", "MemcpyH2D"], by["/host:CPU", "3"]
    assert (compute["events"], compute["busy_us"], compute["top"]) == (3, 20, [("dot", 15)])
    assert (copy["busy_us"], host["busy_us"], host["events"]) == (10, 100, 1)
    # pairs only within a process
    assert s["overlaps"] == [{"process": "/device:GPU:0", "threads": ("compute", "MemcpyH2D"), "both_busy_us": 5}]


def test_command_line_reads_gz_folders_and_refuses_missing(tmp_path, capsys):
    (tmp_path / "m" / "run").mkdir(parents=True)
    with gzip.open(tmp_path / "m" / "run" / "vm.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert main([str(tmp_path / "m"), "--out", str(tmp_path / "s.md")]) == 0
    text = (tmp_path / "s.md").read_text()
    assert "| /device:GPU:0 | compute | MemcpyH2D | 0.01 |" in text and text in capsys.readouterr().out
    assert text.startswith("## run/vm.trace.json.gz")  # named relative to the folder given
    with pytest.raises(FileNotFoundError, match="no such trace"):
        find_traces([str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.trace"):
        find_traces([str(tmp_path / "empty")])


def test_step_anatomy_counts_gpu_work_during_the_host_calls():
    """``research.step_anatomy`` on a hand-built step: the GPU work that runs while a host-offloaded call runs (the
    recall's overlap with decoding), computed by hand."""
    from research import step_anatomy as module

    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute,MemcpyH2D)"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "tid": 3, "name": "thread_name", "args": {"name": "tf_host-offloading-device-id-0/1"}},
            {"ph": "M", "pid": 2, "tid": 4, "name": "thread_name", "args": {"name": "python3"}}]
    x = lambda pid, tid, ts, dur, name: {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}
    call = "HostExecuteStartThunk::ExecuteOnStream::execute (host_callback)"
    events = meta + [
        x(1, 7, 0, 1000, "fusion"), x(1, 7, 1500, 1000, "dot"), x(1, 7, 3000, 500, "MemcpyH2D"),  # GPU busy 2.5 ms
        x(2, 3, 800, 2000, call),  # the host call spans 0.8..2.8 ms: GPU busy 0.2 + 1.0 ms of it
        x(2, 3, 900, 400, "HostExecuteStartThunk::ExecuteOnStream::execute BlockUntilReady"),
        x(2, 4, 0, 3600, "XLA GPU module jit__decode_loop"), x(2, 4, 100, 10, "MemcpyD2H"),
    ]
    row = module.anatomy(events)
    assert row["GPU busy ms"] == pytest.approx(2.5)
    assert (row["host-offload calls"], row["host-call ms"], row["waiting ms"]) == (1, pytest.approx(2.0), pytest.approx(0.4))
    assert row["GPU busy during host calls ms"] == pytest.approx(1.2)
    assert (row["loop ms"], row["D2H on launcher"]) == (pytest.approx(3.6), 1)


def test_step_anatomy_of_the_committed_h100_traces_is_the_committed_table(tmp_path):
    """The default traces (``docs/results/profile_recall_synckv_h100/profile_traces.tgz``) give the table of
    ``step_anatomy.md`` beside them, row for row."""
    import pathlib

    from research.step_anatomy import DEFAULT_TRACES, main

    assert main(["--out", str(tmp_path / "a.md")]) == 0
    committed = (pathlib.Path(DEFAULT_TRACES).parent / "step_anatomy.md").read_text().splitlines()
    assert (tmp_path / "a.md").read_text().splitlines() == [line for line in committed if line.startswith("|")]
