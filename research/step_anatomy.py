"""Where a traced decode step's time goes: one row per trace of ``profile_traces.tgz`` (``scripts/gpu_checks.sh profile``).

Run: ``python -m research.step_anatomy [--traces DIR_OR_TGZ] [--out FILE]`` (default: the H100 traces of
``docs/results/profile_recall_synckv_h100/``).

Columns, per traced decode loop (the bench's untimed profiled run; tracing slows launches, so compare the
columns between methods, not with the bench's ms/token):

* ``loop ms``: the ``XLA GPU module`` span of the decode loop on the launching thread;
* ``GPU busy ms``: union of the kernels and copies on the compute stream(s);
* ``host-offload calls`` / ``waiting ms`` / ``computing ms``: XLA host-offloaded computations (the recall's
  ``compute_on("device_host")`` gather, ``HostExecuteStartThunk``): how many, how long their thread waited for
  the device inputs (``BlockUntilReady``), and how long the CPU gather ran (``HostOffloadingNanoRtExecutable``);
* ``host-call ms`` / ``GPU busy during host calls ms``: the host-offloaded calls' span (from the thunk's start to
  its result published) and the GPU work that ran within it: the overlap of the recall with the step's compute;
* ``graph launches``: ``command_buffer::execute`` on the launching thread (CUDA graphs: the full cache's loop
  body is one per step; anything XLA cannot capture splits a step into more);
* ``D2H on launcher``: device-to-host copies issued by the launching thread (a data-dependent conditional's
  predicate is one: a host synchronisation).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import tarfile
import tempfile

from kvjax.reports import table, write_report
from research.trace_summary import find_traces, load_events, overlap_length, union_length

DEFAULT_TRACES = pathlib.Path(__file__).parents[1] / "docs/results/profile_recall_synckv_h100/profile_traces.tgz"


def anatomy(events: list[dict]) -> dict:
    """The columns above for one Chrome trace's events."""
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e["tid"])] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X"]

    def where(e):
        return process.get(e["pid"], ""), thread.get((e["pid"], e["tid"]), "")

    def iv(pred):
        return [(e["ts"], e["ts"] + e["dur"]) for e in spans if pred(e)]

    launcher = [e for e in spans if where(e) == ("/host:CPU", "python3")]
    counts = collections.Counter(e["name"].split("(")[0].strip() for e in launcher)
    gpu = iv(lambda e: "GPU" in where(e)[0] and "Compute" in where(e)[1])
    host_calls = iv(lambda e: "host_callback" in e["name"])
    return {
        "loop ms": union_length(iv(lambda e: "XLA GPU module" in e["name"])) / 1e3,
        "GPU busy ms": union_length(gpu) / 1e3,
        "host-offload calls": len(host_calls),
        "waiting ms": union_length(iv(lambda e: "HostExecute" in e["name"] and "BlockUntilReady" in e["name"])) / 1e3,
        "computing ms": union_length(iv(lambda e: e["name"] == "HostOffloadingNanoRtExecutable::Execute")) / 1e3,
        "host-call ms": union_length(host_calls) / 1e3,
        "GPU busy during host calls ms": overlap_length(gpu, host_calls) / 1e3,
        "graph launches": counts["command_buffer::execute"],
        "D2H on launcher": counts["MemcpyD2H"],
    }


def traces(source: pathlib.Path, scratch: str):
    """``(name, events)`` of every trace under a directory or in a ``.tgz`` (unpacked into ``scratch``)."""
    if not source.is_dir():
        with tarfile.open(source) as tar:
            tar.extractall(scratch, filter="data")
        source = pathlib.Path(scratch)
    for name, path in find_traces([str(source)]):
        yield name.split("/")[0], load_events(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.step_anatomy", description=__doc__.splitlines()[0])
    p.add_argument("--traces", default=str(DEFAULT_TRACES), help="a folder of traces or a .tgz of them")
    p.add_argument("--out", default=None, help="also write the Markdown table here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        rows = [(name, anatomy(events)) for name, events in traces(pathlib.Path(args.traces), scratch)]
    cols = list(rows[0][1])
    text = "\n".join(table(["trace", *cols], [[name, *(f"{v:.2f}" if isinstance(v, float) else v for v in r.values())]
                                              for name, r in rows], align="l" + "r" * len(cols))) + "\n"
    print(text, end="")
    if args.out:
        write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
