"""Compare two evaluation runs record by record: ``python -m research.compare OLD_DIR NEW_DIR [--same-method NEW OLD] [--out FILE]``.

Matches ``samples.jsonl`` records by (task, length, sample index, method, budget) and writes a
Markdown report: per (method, budget) the mean accuracy of both runs over the records they share and how many
answers are identical, every shared record whose answer changed (old and new output, score and device bytes), and,
for methods that record value rows per decode call (HCAttention), the rows selected and the rows summed or moved in
either run (means over the shared records).
``--same-method NEW OLD`` (repeatable) matches the new run's method ``NEW`` with the old run's ``OLD``
(the same method under other options, e.g. ``locret:positions=contiguous`` against ``locret``).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Sequence

from kvjax.reports import table, write_report

ROW_FIELDS = ("value_rows_per_head_per_call", "value_rows_fetched_per_head_per_call")


def _key(r: dict, rename: dict | None = None) -> tuple:
    method = (rename or {}).get(r["method"], r["method"])
    return (r["task"], r["length"], r["index"], method, r["budget"])


def compare_runs(old_dir: str, new_dir: str, same_method: Sequence[tuple[str, str]] = ()) -> str:
    """The Markdown comparison of two run directories (see module docstring).

    ``same_method``: ``(new run's method, old run's method)`` pairs matched as one method (shown by the old name).
    """
    from kvjax.evals.records import read_jsonl

    rename = dict(same_method)
    old = {_key(r): r for r in read_jsonl(os.path.join(old_dir, "samples.jsonl"))}
    new = {_key(r, rename): r for r in read_jsonl(os.path.join(new_dir, "samples.jsonl"))}
    shared = [k for k in new if k in old]
    acc = collections.defaultdict(lambda: [0.0, 0.0, 0, 0])
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    for k in shared:
        cell = acc[(k[3], k[4])]
        cell[0] += old[k]["score"]
        cell[1] += new[k]["score"]
        cell[2] += 1
        cell[3] += old[k]["output"] == new[k]["output"]
        for run, r in (("old", old[k]), ("new", new[k])):
            for field in ROW_FIELDS:
                if field in r:
                    rows[(k[3], k[4])][(run, field)].append(float(r[field]))
    lines = [f"# `{os.path.basename(os.path.normpath(new_dir))}` vs `{os.path.basename(os.path.normpath(old_dir))}`", "",
             f"{len(shared)} shared records ({len(new)} in the new run, {len(old)} in the old one).", "",
             *[f"Matched as one method: `{n}` (new run) with `{o}` (old run), shown as `{o}`." for n, o in same_method],
             *([""] if same_method else [])]
    lines += table(["method", "budget", "records", "old accuracy %", "new accuracy %", "identical answers"],
                   [[m, b, c, f"{100 * o / c:.1f}", f"{100 * n / c:.1f}", same]
                    for (m, b), (o, n, c, same) in sorted(acc.items(), key=lambda x: (x[0][0] != "full", x[0]))],
                   align="llrrrr")
    if rows:
        lines += ["", "## Value rows per (row, KV head) and decode call", "",
                  "Selected: the union of the call's selections; fetched: the rows summed on the host or moved to the "
                  "device. Means over the shared records (each a batch's mean over its calls).", ""]

        def cells(cell, run):
            """Mean rows selected, fetched and their ratio in ``run`` (empty where its records lack the field)."""
            sel, got = cell.get((run, ROW_FIELDS[0]), []), cell.get((run, ROW_FIELDS[1]), [])
            mean = [f"{sum(v) / len(v):.1f}" if v else "" for v in (sel, got)]
            ratio = f"{sum(got) / sum(sel):.2f}" if sel and got and sum(sel) else ""
            return [*mean, ratio]

        lines += table(["method", "budget", "old selected", "old fetched", "old ÷ selected", "new selected", "new fetched",
                        "new ÷ selected"], [[m, b, *cells(cell, "old"), *cells(cell, "new")]
                                            for (m, b), cell in sorted(rows.items())], align="ll" + "r" * 6)
    changed = [k for k in shared if old[k]["output"] != new[k]["output"]]
    lines += ["", f"## Changed answers ({len(changed)})", ""]
    if changed:
        lines += table(["task", "index", "method", "budget", "old score", "new score", "old output", "new output",
                        "old / new device bytes"],
                       [[k[0], k[2], k[3], k[4], f"{old[k]['score']:g}", f"{new[k]['score']:g}", f"`{old[k]['output'][:40]!r}`",
                         f"`{new[k]['output'][:40]!r}`", f"{old[k]['device_bytes']} / {new[k]['device_bytes']}"]
                        for k in sorted(changed)], align="lrllrrlll")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: print (or write with ``--out``) the comparison."""
    p = argparse.ArgumentParser(prog="python -m research.compare", description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--same-method", nargs=2, action="append", default=[], metavar=("NEW", "OLD"),
                   help="match the new run's method NEW with the old run's method OLD (repeatable)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    text = compare_runs(args.old, args.new, [tuple(pair) for pair in args.same_method])
    if args.out:
        write_report(args.out, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
