"""Summarise ``jax.profiler`` traces (``*.trace.json.gz``, Chrome trace format) as text: where the time went, per stream.

``kvjax bench --profile DIR`` writes one trace per method and length (the ``profile`` stage of
``scripts/gpu_checks.sh`` packs the traces of a GPU run). This prints, for every trace under the given
paths and every thread of every process (on a GPU: one per CUDA stream, e.g. compute and the host <-> device
copies; on a CPU: the XLA worker threads), the number of events, the **busy time** (the union of the events'
intervals, so nested events count once) and the operations that took the most time; then, for each pair of
threads of one process, the time both were busy at once. Whether host recall overlaps decoding is that last
figure for a copy stream against the compute stream: near 0 means the copies ran serialised with the compute.

Python-level events (names starting with ``$``, recorded by the Python tracer) are left out.

Usage::

    python -m research.trace_summary /tmp/kvjax-profile            # every trace under the folder
    python -m research.trace_summary a.trace.json.gz --top 5 --out summary.md
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import itertools
import json
import os

from kvjax.reports import table, write_report


def load_events(path: str) -> list[dict]:
    """The trace's events (``traceEvents``) from a ``.json`` or ``.json.gz`` file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def merge(intervals) -> list[tuple[float, float]]:
    """The disjoint, sorted union of ``(start, end)`` intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_length(intervals) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once."""
    return sum(b - a for a, b in merge(intervals))


def overlap_length(xs, ys) -> float:
    """Time covered by both interval sets (each merged first)."""
    xs, ys = merge(xs), merge(ys)
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarise(events: list[dict], top: int = 8) -> dict:
    """Per ``(process, thread)`` name: events, busy µs, top operations by total µs; and pairwise overlaps per process."""
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[e["pid"], e["tid"]] = e["args"]["name"]
    spans = collections.defaultdict(list)
    ops = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") != "X" or str(e.get("name", "")).startswith("$"):
            continue
        key = (e["pid"], e["tid"])
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        spans[key].append((start, start + dur))
        ops[key][e["name"]] += dur
    rows = []
    for key in sorted(spans):
        rows.append({"process": processes.get(key[0], str(key[0])), "thread": threads.get(key, str(key[1])),
                     "events": len(spans[key]), "busy_us": union_length(spans[key]),
                     "top": ops[key].most_common(top)})
    pairs = []
    for (ka, kb) in itertools.combinations(sorted(spans), 2):
        if ka[0] != kb[0]:
            continue
        pairs.append({"process": processes.get(ka[0], str(ka[0])),
                      "threads": (threads.get(ka, str(ka[1])), threads.get(kb, str(kb[1]))),
                      "both_busy_us": overlap_length(spans[ka], spans[kb])})
    return {"threads": rows, "overlaps": pairs}


def render(name: str, summary: dict) -> str:
    """Markdown for one trace's summary."""
    lines = [f"## {name}", ""]
    lines += table(["process", "thread", "events", "busy ms", "top operations (ms)"],
                   [[r["process"], r["thread"], r["events"], f"{r['busy_us'] / 1e3:.2f}",
                     "; ".join(f"`{op}` {us / 1e3:.2f}" for op, us in r["top"])] for r in summary["threads"]],
                   align="llrrl")
    if summary["overlaps"]:
        lines += [""] + table(["process", "thread A", "thread B", "both busy ms"],
                              [[p["process"], *p["threads"], f"{p['both_busy_us'] / 1e3:.2f}"] for p in summary["overlaps"]],
                              align="lllr")
    return "\n".join(lines) + "\n"


def find_traces(paths) -> list[tuple[str, str]]:
    """``(name, path)`` of the trace files named by ``paths``: files as given, folders searched for
    ``*.trace.json[.gz]`` (named relative to the folder)."""
    found = []
    for p in paths:
        if os.path.isdir(p):
            found += [(os.path.relpath(f, p), f)
                      for f in sorted(glob.glob(os.path.join(p, "**", "*.trace.json*"), recursive=True))]
        elif os.path.isfile(p):
            found.append((os.path.basename(p), p))
        else:
            raise FileNotFoundError(f"no such trace file or folder: {p}")
    if not found:
        raise FileNotFoundError(f"no *.trace.json(.gz) file under {', '.join(paths)}")
    return found


def main(argv=None) -> int:
    """Command line: print (and optionally write) the summary of every trace found."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="trace files or folders holding them")
    p.add_argument("--top", type=int, default=8, help="operations listed per thread (default 8)")
    p.add_argument("--out", default=None, help="also write the Markdown here")
    args = p.parse_args(argv)
    text = "\n".join(render(name, summarise(load_events(path), args.top)) for name, path in find_traces(args.paths))
    print(text)
    if args.out:
        write_report(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
