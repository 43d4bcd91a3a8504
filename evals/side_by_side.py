"""Several evaluation runs of the same prompts in one table, ordered by device bytes.

``python -m evals.side_by_side RUN_DIR [RUN_DIR ...] [--out FILE.md] [--title TEXT]``

Each run directory holds a ``summary.json`` written by ``kvjax eval``. The runs must share model,
seed, tasks, lengths and samples (checked), so their prompts are the same; the full cache of every
run is listed and must agree. Rows: every (method, budget) of every run with its accuracy per task,
the mean, the device and host bytes per prompt and the device bytes over the full cache's, sorted by
device bytes: methods at equal device memory sit next to each other.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SAME = ("model", "dtype", "seed", "tasks", "lengths", "samples")


def load_runs(dirs) -> list[dict]:
    """The ``summary.json`` of each run directory, checked to describe the same prompts."""
    runs = []
    for d in dirs:
        path = Path(d) / "summary.json"
        if not path.exists():
            raise SystemExit(f"{path} does not exist (is the run finished?)")
        runs.append(json.loads(path.read_text()) | {"dir": str(d)})
    ref = runs[0]["config"]
    for r in runs[1:]:
        diff = [k for k in SAME if r["config"].get(k) != ref.get(k)]
        if diff:
            raise SystemExit(f"{r['dir']} differs from {runs[0]['dir']} in {', '.join(diff)}: not the same prompts")
    return runs


def table(runs) -> list[str]:
    """Markdown lines: one row per (run, method, budget), sorted by device bytes."""
    cfg = runs[0]["config"]
    cells = [f"{t}@{n}" for t in cfg["tasks"] for n in cfg["lengths"]]
    rows = []
    for run in runs:
        for row in run["rows"]:
            dev = sum(row["device_bytes"].values()) / max(len(row["device_bytes"]), 1)
            host = sum(row["host_bytes"].values()) / max(len(row["host_bytes"]), 1)
            rows.append((dev, run, row, host))
    rows.sort(key=lambda r: (r[0], r[2]["method"]))
    lines = ["| method | budget | run | " + " | ".join(cells) + " | mean | device MiB | ÷ full | host MiB |",
             "|---|---|---|" + "---:|" * (len(cells) + 4)]
    for dev, run, row, host in rows:
        acc = [f"{row['accuracy'].get(c, float('nan')):.1f}" for c in cells]
        lines.append(f"| {row['method']} | {row['budget']} | {Path(run['dir']).name} | " + " | ".join(acc)
                     + f" | **{row['mean_accuracy']:.1f}** | {dev / 2**20:.1f} | {row['device_bytes_vs_full']:.3f} | {host / 2**20:.1f} |")
    return lines


def main(argv=None) -> int:
    """Print (or write) the side-by-side table of the given runs."""
    p = argparse.ArgumentParser(prog="python -m evals.side_by_side", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories (docs/results/<run>)")
    p.add_argument("--out", default=None, help="write the Markdown here (default: print)")
    p.add_argument("--title", default="Evaluation runs side by side")
    args = p.parse_args(argv)
    runs = load_runs(args.runs)
    fulls = {json.dumps(r["accuracy"], sort_keys=True) for run in runs for r in run["rows"] if r["method"] == "full"}
    cfg = runs[0]["config"]
    lines = [f"# {args.title}", "", "Made with `python -m evals.side_by_side " + " ".join(args.runs) + "`.", "",
             f"Model `{cfg['model']}` ({cfg['dtype']}), seed {cfg['seed']}, {cfg['samples']} samples per task and length, "
             f"protocol(s): {', '.join(sorted({run['config'].get('protocol', 'query-aware') for run in runs}))}. Device / host MiB per prompt "
             "(a batch's shared arrays, e.g. codebooks, divided among its rows); ÷ full = device bytes over the full "
             "cache's. Sorted by device bytes.", ""]
    if len(fulls) > 1:
        lines += ["**Warning**: the full cache scored differently across the runs (not the same prompts or code).", ""]
    lines += table(runs)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
