"""Several evaluation runs of the same prompts in one table, ordered by device bytes.

``python -m research.side_by_side RUN_DIR [RUN_DIR ...] [--out FILE.md] [--title TEXT] [--plot FILE.png]``

Each run directory holds the ``config.json`` and ``samples.jsonl`` of ``kvjax eval``. The runs must
share model, dtype, seed, tasks, lengths and samples (checked), so their prompts are the same. Only
the samples present in **every** run are counted (an unfinished, resumable run restricts the others
to the samples it has), and the table says how many. The full cache is listed once (from the first
run); a warning says when the runs' full caches disagree on those samples. Rows: every (method,
budget) of every run with its accuracy per task, the mean, the device and host bytes per prompt and
the device bytes over the full cache's, sorted by device bytes: methods at equal device memory sit
next to each other. ``--plot`` draws mean accuracy against device bytes ÷ the full cache's, one line per method.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvjax.reports import table as markdown_table
from kvjax.reports import write_report

SAME = ("model", "dtype", "seed", "lengths", "samples")  # and the same set of tasks, in any order


def prompt(record: dict) -> tuple:
    """A record's prompt: (task, length, sample index)."""
    return record["task"], record["length"], record["index"]


def read_runs(dirs) -> list[dict]:
    """Each run directory's ``config`` and ``records`` (a line cut by a running evaluation's write is skipped),
    refused unless every run has the first one's prompts (:data:`SAME` and its tasks)."""
    from kvjax.evals.records import read_jsonl

    runs = []
    for d in dirs:
        cfg_path, rec_path = Path(d) / "config.json", Path(d) / "samples.jsonl"
        if not cfg_path.exists() or not rec_path.exists():
            raise SystemExit(f"{d} has no config.json / samples.jsonl (not a kvjax eval run directory)")
        runs.append({"dir": str(d), "config": json.loads(cfg_path.read_text()), "records": read_jsonl(str(rec_path))})
    ref = runs[0]["config"]
    for r in runs[1:]:
        diff = [k for k in SAME if r["config"].get(k) != ref.get(k)]
        diff += ["tasks"] if sorted(r["config"].get("tasks", [])) != sorted(ref.get("tasks", [])) else []
        if diff:
            raise SystemExit(f"{r['dir']} differs from {runs[0]['dir']} in {', '.join(diff)}: not the same prompts")
    return runs


def common_prompts(runs, every_config: bool = False) -> set:
    """The prompts present in every run; with ``every_config``, only those that every (method, budget) recorded in
    every run has (a running evaluation writes a prompt's full cache before its other configurations)."""
    if not every_config:
        return set.intersection(*({prompt(x) for x in r["records"]} for r in runs))
    per_config = {}
    for i, r in enumerate(runs):
        for x in r["records"]:
            per_config.setdefault((i, x["method"], x["budget"]), set()).add(prompt(x))
    return set.intersection(*per_config.values()) if per_config else set()


def load_runs(dirs, every_config: bool = False) -> list[dict]:
    """Each run's config and summary over the samples common to all runs (:func:`common_prompts`,
    ``kvjax.evals.report.summarize``)."""
    from kvjax.evals.report import summarize

    runs = read_runs(dirs)
    common = common_prompts(runs, every_config)
    for r in runs:
        kept = [x for x in r["records"] if prompt(x) in common]
        r.update(summarize(kept, [], r["config"]), common=len(common))
    return runs


def table(runs) -> list[str]:
    """Markdown lines: one row per (run, method, budget), sorted by device bytes."""
    cfg = runs[0]["config"]
    cells = [f"{t}@{n}" for t in cfg["tasks"] for n in cfg["lengths"]]
    rows = []
    for i, run in enumerate(runs):
        for row in run["rows"]:
            if row["method"] == "full" and i:
                continue
            dev = sum(row["device_bytes"].values()) / max(len(row["device_bytes"]), 1)
            host = sum(row["host_bytes"].values()) / max(len(row["host_bytes"]), 1)
            rows.append((dev, run, row, host))
    rows.sort(key=lambda r: (r[0], r[2]["method"]))
    head = ["method", "budget", "run", *cells, "mean", "device MiB", "÷ full", "host MiB"]
    return markdown_table(head, [
        [row["method"], row["budget"], Path(run["dir"]).name]
        + [f"{row['accuracy'][c]:.1f}" if c in row["accuracy"] else "–" for c in cells]
        + [f"**{row['mean_accuracy']:.1f}**", f"{dev / 2**20:.1f}", f"{row['device_bytes_vs_full']:.3f}", f"{host / 2**20:.1f}"]
        for dev, run, row, host in rows], align="lll" + "r" * (len(cells) + 4))


def short_name(spec: str) -> str:
    """A method spec named by its preset when its options are exactly a preset's (``synckv:preset=tuned``)."""
    from kvjax.methods import PRESETS, parse_method_spec

    base, options = parse_method_spec(spec)
    for preset, preset_options in PRESETS.get(base, {}).items():
        if options == preset_options:
            return f"{base}:preset={preset}"
    return spec


def run_label(run_dir: str, first_dir: str) -> str:
    """A run directory's name short enough for a legend: without the part it shares with the first run's name
    (``…-locret`` for ``qwen2.5-coder-0.5b-ruler-4k-test-query-agnostic-locret`` beside ``…-query-agnostic``)."""
    name, first = Path(run_dir).name, Path(first_dir).name
    common = os.path.commonprefix([name, first])
    return f"…{name[len(common):]}" if common and name[len(common):] else name


def line_names(runs) -> dict[tuple[str, str], str]:
    """``(run directory, method)`` -> the name of its line in a plot over several runs: the method's own name (its
    preset's where it is one), unless an earlier run measured the same method at one of the same budgets (e.g. Locret
    with other heads); then ``method (run_label)``, a line of its own. A run that adds other budgets of a method joins
    its line."""
    names, seen = {}, set()  # seen: (name, budget) of the lines so far
    for run in runs:
        own = {}
        for row in run["rows"]:
            if row["method"] != "full":
                own.setdefault(row["method"], []).append(row["budget"])
        for method, budgets in own.items():
            name = short_name(method)
            if any((name, b) in seen for b in budgets):
                name = f"{name} ({run_label(run['dir'], runs[0]['dir'])})"
            names[(run["dir"], method)] = name
            seen.update((name, b) for b in budgets)
    return names


def plot(runs, path: str, title: str) -> None:
    """Mean accuracy against device bytes ÷ the full cache's: one line per method over its budgets (``line_names``)."""
    from kvjax.evals.report import plot_accuracy_vs_bytes

    names, points, full = line_names(runs), {}, None
    for run in runs:
        for row in run["rows"]:
            if row["method"] == "full":
                full = full or row
            elif row["device_bytes_vs_full"] is not None:
                points.setdefault(names[(run["dir"], row["method"])], []).append(
                    (row["device_bytes_vs_full"], row["mean_accuracy"]))
    plot_accuracy_vs_bytes(points, full["mean_accuracy"] if full is not None else None, path, title)


def main(argv=None) -> int:
    """Print (or write) the side-by-side table of the given runs."""
    p = argparse.ArgumentParser(prog="python -m research.side_by_side", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories (docs/results/<run>)")
    p.add_argument("--out", default=None, help="write the Markdown here (default: print)")
    p.add_argument("--title", default="Evaluation runs side by side")
    p.add_argument("--plot", default=None, help="also draw accuracy vs device bytes per method (PNG)")
    args = p.parse_args(argv)
    runs = load_runs(args.runs)
    if args.plot:
        plot(runs, args.plot, args.title)
    fulls = {json.dumps(r["accuracy"], sort_keys=True) for run in runs for r in run["rows"] if r["method"] == "full"}
    cfg = runs[0]["config"]
    lines = [f"# {args.title}", "", "Made with `python -m research.side_by_side " + " ".join(args.runs) + "`.", "",
             f"Model `{cfg['model']}` ({cfg['dtype']}), seed {cfg['seed']}; the {runs[0]['common']} (task, length, sample) "
             f"prompts present in every run (of {cfg['samples']} per task and length configured), "
             f"protocol(s): {', '.join(sorted({run['config'].get('protocol', 'query-aware') for run in runs}))}. Device / host MiB per prompt "
             "(a batch's shared arrays, e.g. codebooks, divided among its rows); ÷ full = device bytes over the full "
             "cache's. Sorted by device bytes.", ""]
    if len(fulls) > 1:
        lines += ["**Warning**: the full cache scored differently across the runs (not the same prompts or code).", ""]
    lines += table(runs)
    text = "\n".join(lines) + "\n"
    if args.out:
        write_report(args.out, text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
