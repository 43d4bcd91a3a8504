"""Score against device memory per method and budget, over evaluation runs of one length and protocol.

``python -m research.budget_curve RUN_DIR [RUN_DIR ...] [--out FILE.md]``

The runs are read and merged as in ``research.side_by_side`` (same model, dtype, seed, tasks, lengths and samples,
checked), on the prompts that every (method, budget) of every run has recorded: a running evaluation's latest prompts,
or a prompt a run lacks, drop out of every method's mean. Per (method, budget): the mean RULER score over those
prompts, that mean as a percentage of the full cache's on the same prompts (from the first run that has it), and its
device bytes per prompt ÷ the full cache's (the cache's own bytes: trained or calibrated artifacts, held once per
model, are left out, as in every run's report). Per method: the smallest budget measured whose score reaches 95% of
the full cache's. Writes the Markdown (default ``docs/results/budget_curve_ruler_<len>_<protocol>_<split>.md``), its
JSON beside it and a PNG of the curves (% of the full cache's score against device bytes ÷ the full cache's).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvjax.evals.records import run_split
from kvjax.reports import figure, save_figure, table, write_report
from research.side_by_side import line_names, load_runs

THRESHOLD = 95.0  # % of the full cache's mean score


def _budget_value(label: str) -> float:
    """A budget label as a fraction; ``full`` (the full cache in another ``kv_dtype``, every token kept) is 1."""
    return 1.0 if label == "full" else float(label)


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def curve(runs) -> dict:
    """The full cache's mean and one point per (method, budget) of the loaded runs (``side_by_side.load_runs`` with
    ``every_config``): mean score, % of the full cache's, device bytes ÷ the full cache's, the run it comes from.

    A method measured by an earlier run at one of the same budgets is its own curve, named as in the overview plots
    (``side_by_side.line_names``: ``method (…run)``)."""
    full = next((row for run in runs for row in run["rows"] if row["method"] == "full"), None)
    if full is None:
        raise SystemExit("no run has the full cache's records on the common prompts: nothing to compare with")
    full_mean = full["mean_accuracy"]
    fulls = {round(row["mean_accuracy"], 9) for run in runs for row in run["rows"] if row["method"] == "full"}
    names, points = line_names(runs), []
    for run in runs:
        for row in run["rows"]:
            if row["method"] == "full":
                continue
            points.append({"method": names[(run["dir"], row["method"])], "budget": row["budget"], "run": Path(run["dir"]).name,
                           "mean": row["mean_accuracy"],
                           "percent_of_full": 100 * row["mean_accuracy"] / full_mean if full_mean else None,
                           "device_bytes_vs_full": row["device_bytes_vs_full"]})
    methods = list(dict.fromkeys(p["method"] for p in points))
    points.sort(key=lambda p: (methods.index(p["method"]), _budget_value(p["budget"])))
    return {"full_mean": full_mean, "full_scores_differ": len(fulls) > 1, "points": points, "methods": methods,
            "first_reaching": {m: first_reaching([p for p in points if p["method"] == m]) for m in methods}}


def first_reaching(points, threshold: float = THRESHOLD) -> str:
    """The smallest budget among ``points`` (one method's) whose score is at least ``threshold`` % of the full
    cache's, else ``not reached up to <largest budget measured>``."""
    ordered = sorted(points, key=lambda p: _budget_value(p["budget"]))
    for p in ordered:
        if p["percent_of_full"] is not None and p["percent_of_full"] >= threshold - 1e-9:
            return p["budget"]
    return f"not reached up to {ordered[-1]['budget']}"


def plot(result: dict, path: str, title: str) -> str:
    """% of the full cache's score against device bytes ÷ the full cache's: one line per method over its budgets
    (a point labelled with its budget), the full cache as a star at (1, 100), a dashed line at 95%."""
    fig = figure((7.5, 5.6))
    ax = fig.subplots()
    markers = "osD^vP<>Xhp"
    for i, m in enumerate(result["methods"]):
        pts = [p for p in result["points"] if p["method"] == m
               and p["device_bytes_vs_full"] is not None and p["percent_of_full"] is not None]
        if not pts:
            continue
        line, = ax.plot([p["device_bytes_vs_full"] for p in pts], [p["percent_of_full"] for p in pts],
                        marker=markers[i % len(markers)], label=m)
        labels = {}  # budgets at one point (a method whose memory does not follow the budget) share one label
        for p in pts:
            labels.setdefault((p["device_bytes_vs_full"], p["percent_of_full"]), []).append(p["budget"])
        for xy, budgets in labels.items():
            ax.annotate(", ".join(budgets), xy, textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=line.get_color())
    ax.plot([1.0], [100.0], marker="*", markersize=14, color="black", linestyle="", label="full cache")
    ax.axhline(THRESHOLD, color="gray", linestyle="--", linewidth=1, label=f"{THRESHOLD:g}% of the full cache")
    ax.set_xlim(0, 1.05)
    ax.set_xlabel("device bytes of the KV cache ÷ the full cache's")
    ax.set_ylabel("mean score, % of the full cache's")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110, tight=False)


def _number(x, fmt: str) -> str:
    return "–" if x is None else fmt.format(x)


def report(runs, result: dict, command: str, png_name: str | None) -> str:
    """The Markdown: the command, the runs and prompt count, the table, the 95% budget per method."""
    cfg = runs[0]["config"]
    by_run = {}
    for p in result["points"]:
        by_run.setdefault(p["run"], []).append(p["method"])
    lines = [f"# Score vs device memory, RULER {_length_label(cfg['lengths'][0])} {cfg.get('protocol', 'query-aware')} "
             f"({run_split(cfg)} split)", "",
             f"Made with `{command}`.", "",
             f"Model `{cfg['model']}` ({cfg['dtype']}), seed {cfg['seed']}; the {runs[0]['common']} (task, length, sample) "
             f"prompts that every (method, budget) of every run has recorded (of {len(cfg['tasks'])} tasks × "
             f"{cfg['samples']} samples configured). Runs:", ""]
    for run in runs:
        name = Path(run["dir"]).name
        methods = list(dict.fromkeys(by_run.get(name, [])))
        lines.append(f"- `{run['dir']}`: {', '.join(f'`{m}`' for m in methods) or 'no method but the full cache'}")
    lines += ["", f"The full cache's mean score: **{result['full_mean']:.1f}** (from the first run). Mean = the mean "
              "RULER score (%) over those prompts; % of full = that mean over the full cache's; bytes ÷ full = device "
              "bytes per prompt over the full cache's (the cache alone: trained or calibrated artifacts, held once "
              "per model, left out).", ""]
    if result["full_scores_differ"]:
        lines += ["**Warning**: the full cache scored differently across the runs (not the same prompts or code).", ""]
    lines += table(["method", "budget", "mean", "% of full", "bytes ÷ full"],
                   [[p["method"], p["budget"], f"{p['mean']:.1f}", _number(p["percent_of_full"], "{:.1f}"),
                     _number(p["device_bytes_vs_full"], "{:.3f}")] for p in result["points"]], align="llrrr")
    lines += ["", f"## First budget reaching {THRESHOLD:g}% of the full cache", ""]
    lines += table(["method", "budget"], [[m, result["first_reaching"][m]] for m in result["methods"]])
    if png_name:
        lines += ["", f"![% of the full cache's score against device bytes ÷ the full cache's]({png_name})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Write the budget curve of the given runs (Markdown, JSON, PNG)."""
    p = argparse.ArgumentParser(prog="python -m research.budget_curve", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories (docs/results/<run>) of one length and protocol")
    p.add_argument("--out", default=None,
                   help="the Markdown (default docs/results/budget_curve_ruler_<len>_<protocol>_<split>.md); "
                        "the JSON and PNG beside it")
    args = p.parse_args(argv)
    runs = load_runs(args.runs, every_config=True)
    cfgs = [r["config"] for r in runs]
    if len(cfgs[0]["lengths"]) != 1:
        raise SystemExit(f"{runs[0]['dir']} has lengths {cfgs[0]['lengths']}: one length per curve")
    for key, of in (("protocol", lambda c: c.get("protocol", "query-aware")), ("split", run_split)):
        values = {of(c) for c in cfgs}
        if len(values) > 1:
            raise SystemExit(f"the runs differ in {key} ({', '.join(sorted(map(str, values)))}): one per curve")
    if not runs[0]["common"]:
        raise SystemExit("no prompt is recorded by every (method, budget) of every run")
    cfg = cfgs[0]
    out = args.out or os.path.join(
        "docs", "results",
        f"budget_curve_ruler_{_length_label(cfg['lengths'][0])}_{cfg.get('protocol', 'query-aware')}_{run_split(cfg)}.md")
    png = os.path.splitext(out)[0] + ".png"
    result = curve(runs)
    command = "python -m research.budget_curve " + " ".join(args.runs) + (f" --out {args.out}" if args.out else "")
    title = (f"{cfg['model']}, RULER {_length_label(cfg['lengths'][0])} {cfg.get('protocol', 'query-aware')}, "
             f"{runs[0]['common']} prompts")
    plot(result, png, title)
    data = {"command": command, "runs": [r["dir"] for r in runs], "prompts": runs[0]["common"],
            "threshold_percent": THRESHOLD, **result}
    for path in write_report(out, report(runs, result, command, os.path.basename(png)), data) + [png]:
        print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
