"""Where XLA:GPU schedules the decode step's host recalls, in the program compiled for an H100 without one
(:mod:`kvjax.evals.gpu_schedule`).

XLA:GPU's latency-hiding scheduler is off by default (jax 0.10.2 and 0.11.2): a host-offloaded computation's start and
done are then scheduled back to back and the recall's host gather overlaps nothing. kvjax compiles the decode programs
on a GPU with it (:data:`kvjax.decoding.GPU_DECODE_COMPILER_OPTIONS`). The compiled check needs jax's CUDA plugin
(compiler only, no GPU): ``scripts/setup_env.sh`` installs its wheels into ``.aot-gpu/``, which only the worker process
puts on its path, and ``scripts/test.sh`` sets ``KVJAX_AOT_GPU`` so that a missing plugin fails there instead of skipping.
"""

import json
import os
import subprocess
import sys

import pytest

from kvjax.evals.gpu_schedule import command_buffers, host_call_windows, loop_conditionals, render, summarize
from kvjax.evals.hlo import shape_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A scheduled module by hand: the loop body runs one fusion, starts the host call, runs a fusion and a copy, waits,
# runs one more fusion; the conditional's branch waits at once.
HLO = """HloModule m, is_scheduled=true

%branch (p: s32[4]) -> f32[2,3] {
  %p = s32[4]{0} parameter(0)
  %s = ((s32[4]{0}), f32[2,3]{1,0}, u32[]) custom-call-start(%p), async_execution_thread="host", custom_call_target="HostExecute", called_computations={%host}
  ROOT %d = f32[2,3]{1,0} custom-call-done(%s)
}

%body (c: (s32[], s32[4], f32[2,3])) -> (s32[], s32[4], f32[2,3]) {
  %c = (s32[], s32[4]{0}, f32[2,3]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %ids = s32[4]{0} get-tuple-element(%c), index=1
  %a = f32[2,3]{1,0} fusion(%ids), kind=kLoop, calls=%fa
  %start = ((s32[4]{0}), (f32[2,3]{1,0}, bf16[4]{0}), u32[]) custom-call-start(%ids), async_execution_thread="host", custom_call_target="HostExecute", called_computations={%host}
  %b = f32[2,3]{1,0} fusion(%a), kind=kLoop, calls=%fb
  %k = f32[2,3]{1,0} copy(%b)
  %done = (f32[2,3]{1,0}, bf16[4]{0}) custom-call-done(%start)
  %rows = f32[2,3]{1,0} get-tuple-element(%done), index=0
  %e = f32[2,3]{1,0} fusion(%k, %rows), kind=kLoop, calls=%fe
  ROOT %t = (s32[], s32[4]{0}, f32[2,3]{1,0}) tuple(%i, %ids, %e)
}

ENTRY %main (x: s32[4]) -> f32[2,3] {
  %x = s32[4]{0} parameter(0)
  %w = (s32[], s32[4]{0}, f32[2,3]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[2,3]{1,0} conditional(%pred, %x, %x), branch_computations={%branch, %branch}
}
"""


def test_host_call_windows_of_a_hand_written_schedule():
    """Counts of a schedule written by hand: device operations before, between and after each HostExecute pair, the
    pair's computation kind and the bytes it returns."""
    body, branch = sorted(host_call_windows(HLO), key=lambda w: w["computation"])
    assert body == {"computation": "body", "loop_body": True, "in_branch": False, "before": 1, "between": 2, "after": 1,
                    "total": 4, "bytes": 2 * 3 * 4 + 4 * 2}
    assert branch == {"computation": "branch", "loop_body": False, "in_branch": True, "before": 0, "between": 0,
                      "after": 0, "total": 0, "bytes": 24}
    assert shape_bytes("((s32[4]{0}), f32[2,3]{1,0}, u32[])") == 16 + 24 + 4


def test_loop_conditionals_count_the_step_only():
    """Conditionals in a loop body count (one per step, each a host synchronisation on a GPU); the entry's does not."""
    assert loop_conditionals(HLO) == 0
    twice = HLO.replace("  ROOT %t = (s32[]", "  %q = f32[2,3]{1,0} conditional(%i, %ids, %ids), "
                                               "branch_computations={%branch, %branch}\n"
                                               "  %q2 = (f32[2,3]{1,0}, s32[]) conditional(%i, %ids, %ids), "
                                               "branch_computations={%branch, %branch}\n  ROOT %t = (s32[]")
    assert loop_conditionals(twice) == 2


# A thunk sequence as XLA:GPU dumps it (after its thunk passes), by hand: a graph of two kernels, the host call's start,
# a graph holding a kernel and a loop of two kernels, the wait, a kernel and a copy launched one by one.
THUNKS = """000: kCommandBuffer    [source       | next=000 (1)] 
    001: kCustomKernel [source       | next=002 (1)] loop_add_fusion grid: [1, 1, 1] threads: [2, 1, 1]
    002: kCustomKernel [prev=001 (1) | sink        ] input_reduce_fusion grid: [8, 1, 1] threads: [128, 1, 1]
003: kHostExecuteStart [source       | sink        ] (no description)
004: kCommandBuffer    [prev=000 (1) | next=000 (1)] 
    005: kCustomKernel [source       | next=006 (1)] paged_decode_attention_gpu grid: [1, 2, 4] threads: [128, 1, 1]
    006: kWhile        [prev=005 (1) | sink        ] 
        007: kCustomKernel [source       | next=008 (1)] loop_multiply_fusion grid: [1, 1, 1] threads: [1, 1, 1]
        008: kCopy         [prev=007 (1) | sink        ] kCopy
009: kHostExecuteDone  [source       | sink        ] (no description)
010: kCustomKernel     [source       | sink        ] row_write grid: [4, 1, 1] threads: [128, 1, 1]
011: kCopy             [prev=010 (1) | sink        ] kCopy
"""


def test_command_buffers_of_a_hand_written_thunk_sequence():
    """Top-level thunks in order, the graphs among them, the innermost operations recorded in graphs (a loop counts by
    its body) and the thunks launched outside any graph."""
    assert command_buffers(THUNKS) == {
        "top": ["kCommandBuffer", "kHostExecuteStart", "kCommandBuffer", "kHostExecuteDone", "kCustomKernel", "kCopy"],
        "graphs": 2, "in_graphs": 2 + 3, "outside": 4}
    assert command_buffers("") == {"top": [], "graphs": 0, "in_graphs": 0, "outside": 0}


def test_report_rows():
    """The report has one table row per (method, options): the loop body's calls, one with none, and a failure."""
    windows = host_call_windows(HLO)
    assert summarize(windows) == {"calls": 1, "before": [1], "between": [2], "after": [1], "total": 4,
                                  "mib": 32 / 2**20}
    args = {"target": "h100", "model": "m", "dtype": "bfloat16", "length": 64, "budget": 0.25, "new_tokens": 3}
    report = {"args": args, "command": "python -m kvjax.evals.gpu_schedule", "jax": "0", "plugin": "0", "date": "d",
              "kvjax_options": "`k=True`", "rows": [
                  {"method": "a", "options": "kvjax", "compile_s": 1.0, "summary": summarize(windows), "in_branches": 1,
                   "conditionals": 3},
                  {"method": "b", "options": "kvjax", "compile_s": 2.0, "summary": {"calls": 0}, "in_branches": 0,
                   "conditionals": 0},
                  {"method": "c", "options": "kvjax", "error": "ValueError: x"}]}
    rows = [line for line in render(report).splitlines() if line.startswith("| ") and "method" not in line]
    assert rows == ["| a | kvjax | 1 | 1 | 2 | 1 | 4 | 0.00 | 1 | 3 | 1.0 |", "| b | kvjax | 0 |  |  |  |  |  | 0 | 0 | 2.0 |",
                    "| c | kvjax | error: ValueError: x |  |  |  |  |  |  |  |  |"]
    report["graphs"] = [{"method": "a", **command_buffers(THUNKS), "kernels": 6}, {"method": "c", "error": "ValueError: x"}]
    text = render(report)
    graph_rows = [line for line in text.split("## CUDA graphs per decode step")[1].splitlines()
                  if line.startswith("| ") and "method" not in line]
    assert graph_rows == ["| a | 6 | 2 | 5 | 1 × kHostExecuteStart, 1 × kHostExecuteDone, 1 × kCustomKernel, 1 × kCopy "
                          "| 6 |",
                          "| c | error: ValueError: x |  |  |  |  |"]


def _plugin_dir():
    path = os.environ.get("KVJAX_AOT_GPU") or os.path.join(ROOT, ".aot-gpu")
    if not os.path.isdir(os.path.join(path, "jax_plugins")):
        if os.environ.get("KVJAX_AOT_GPU"):
            pytest.fail(f"KVJAX_AOT_GPU={path} holds no jax CUDA plugin (scripts/setup_env.sh installs it)")
        pytest.skip("jax's CUDA plugin is not in .aot-gpu/ (scripts/setup_env.sh installs it)")
    return path


def test_pipelined_recall_overlaps_the_step_in_the_h100_schedule():
    """The tiny model's decode loop compiled for an H100 (XLA:GPU's own compiler, no GPU); also the paged kernel's
    Mosaic GPU form. With kvjax's options the
    pipelined schedule's one host call per step (both layers' gathers, merged by XLA) starts before most of the step
    and is waited for at its end: at least half of the step's device operations lie between. ``spread`` gathers in
    each layer for that layer's own write, so fewer do. With XLA's defaults none do, for every schedule: the check can fail."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_plugin_dir(), ROOT]), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.gpu_schedule_worker"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    found = result["windows"]

    def step_call(name):
        calls = [w for w in found[name] if w["loop_body"] and not w["in_branch"]]
        assert len(calls) == 1, calls
        return calls[0]

    for method in ("heterocache-pipelined", "synckv-pipelined"):
        call = step_call(f"{method}/kvjax")
        assert call["between"] >= call["total"] / 2, call
    pipelined = step_call("synckv-pipelined/kvjax")
    spread = [w for w in found["synckv-spread/kvjax"] if w["loop_body"] and not w["in_branch"]]
    assert spread and all(w["between"] < pipelined["between"] for w in spread), (spread, pipelined)
    for name, windows in found.items():
        if name.endswith("/xla-default"):
            assert windows and all(w["between"] == 0 for w in windows), (name, windows)
    # what the runtime launches per step: the full cache's step is one CUDA graph holding every kernel the cost model
    # counts in the HLO (two counts made independently: XLA's thunks and kvjax.evals.plan.kernel_launches); a
    # pipelined recall's host call starts before a graph of the step's work and is waited for after it, and at most
    # one kernel of the step is launched outside a graph
    graphs = result["graphs"]
    assert graphs["full"]["top"] == ["kCommandBuffer"], graphs["full"]
    assert graphs["full"]["in_graphs"] == graphs["full"]["kernels"] > 0, graphs["full"]
    for method in ("heterocache-pipelined", "synckv-pipelined"):
        top = graphs[method]["top"]
        start, done = top.index("kHostExecuteStart"), top.index("kHostExecuteDone")
        assert "kCommandBuffer" in top[start + 1:done], top
        assert sum(k not in ("kCommandBuffer", "kHostExecuteStart", "kHostExecuteDone") for k in top) <= 1, top
    # no conditional in the compiled step (each would be a host synchronisation per step on a GPU), as in the
    # lowered program (tests/test_gpu_host_syncs.py)
    assert result["conditionals"] and set(result["conditionals"].values()) == {0}, result["conditionals"]
    # the one-token step updates each layer's recall state in place: it copies scalars at most (the old code copied
    # every layer's page lengths, followers' applied versions and leaders' versions, a kernel each)
    assert set(result["step_copies"]) == {"heterocache-pipelined", "synckv-pipelined", "synckv-spread"}
    for name, copied in result["step_copies"].items():
        assert all(shape.startswith("s32[]") for shape in copied), (name, copied)
    # the paged kernel's Mosaic GPU form at Llama-3.1-8B's decode shape compiles for the H100 as its own custom call;
    # over int8 / fp8 pools it takes the pools as stored (1 byte per element) and the scales gathered per head, and the
    # program holds no float copy of a pool (temporaries: the gathered scales and the splits' partials)
    mosaic = result["mosaic_paged"]
    for kv_dtype, name in (("bfloat16", "bf16"), ("int8", "s8"), ("float8_e4m3fn", "f8e4m3fn")):
        case = mosaic[kv_dtype]
        assert "mosaic_gpu_v2" in case["calls"], case["calls"]
        assert case["operands"].count(f"{name}[131072,16,128]") == 2, case["operands"]
        if kv_dtype != "bfloat16":
            assert case["operands"].count("f32[8,8,32768]") == 2, case["operands"]
            assert case["temp_bytes"] < case["pool_bytes"] / 8, case  # a float copy: 2x or 4x a pool
