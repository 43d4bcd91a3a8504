"""HCAttention's ablations from ``kvjax eval`` runs: accuracy and the fraction of prompt tokens selected, per
(method spec, budget) — the paper's Table 3 / Fig. 3 (``tau``) and Table 4 (codebook size and group count at
``tau = 1``).

``python -m research.hcattention_ablation RUN_DIR [RUN_DIR ...] --out FILE.md [--plot FILE.png]``

Every HCAttention configuration of every run becomes a row: its ``tau`` (from the method spec, e.g.
``hcattention:tau=0.5``; the method's default otherwise), its key representation (recorded by the run), the
accuracy per task and the mean, the mean fraction of the prompt's tokens the top-p selection keeps per query
(averaged over layers, and per layer in the plot) and the device bytes per prompt. Each run's full cache on
the same prompts is listed first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvjax.methods import HCAttention, parse_method_spec
from kvjax.reports import figure, number, save_figure, write_report
from kvjax.reports import table as markdown_table

DEFAULT_TAU = {f.name: f.default for f in dataclasses.fields(HCAttention)}["tau"]


def _records(run_dir: Path) -> tuple[dict, list[dict]]:
    cfg_path, rec_path = run_dir / "config.json", run_dir / "samples.jsonl"
    if not cfg_path.exists() or not rec_path.exists():
        raise SystemExit(f"{run_dir} has no config.json / samples.jsonl (not a kvjax eval run directory)")
    records = [json.loads(line) for line in rec_path.read_text().splitlines() if line.strip()]
    return json.loads(cfg_path.read_text()), records


def rows(run_dirs) -> list[dict]:
    """One row per (run, method, budget): the full cache and every HCAttention configuration."""
    out = []
    for d in map(Path, run_dirs):
        cfg, records = _records(d)
        groups = defaultdict(list)
        for r in records:
            base, _ = parse_method_spec(r["method"])
            if base in ("full", "hcattention"):
                groups[(r["method"], r["budget"])].append(r)
        for (method, budget), recs in groups.items():
            base, kwargs = parse_method_spec(method)
            per_task = {t: 100 * float(np.mean([r["score"] for r in recs if r["task"] == t]))
                        for t in cfg["tasks"] if any(r["task"] == t for r in recs)}
            layers = [json.loads(r["selection_ratio_per_layer"]) if isinstance(r.get("selection_ratio_per_layer"), str)
                      else r.get("selection_ratio_per_layer") for r in recs]
            layers = [x for x in layers if x]
            out.append({
                "run": d.name, "method": method, "budget": budget,
                "tau": None if base == "full" else float(kwargs.get("tau", DEFAULT_TAU)),
                "keys": "exact (full cache)" if base == "full" else
                        (recs[0].get("key_representation") or f"budget {budget}") + (
                            f" (centroids={kwargs['centroids']})" if "centroids" in kwargs and
                            not recs[0].get("key_representation") else ""),
                "prompts": len(recs), "per_task": per_task, "mean": float(np.mean(list(per_task.values()))),
                "selection_ratio": float(np.mean([r["selection_ratio"] for r in recs])) if base != "full" else 1.0,
                "selection_per_layer": np.mean(np.asarray(layers, float), axis=0).tolist() if layers else None,
                "device_mib": float(np.mean([r["device_bytes"] for r in recs])) / 2**20,
            })
    return out


def table(all_rows, tasks) -> list[str]:
    """Markdown table lines, full caches first, then by run, key representation and tau."""
    head = ["run", "method", "budget", "keys", "tau", "prompts"] + list(tasks) + ["mean", "tokens selected", "device MiB"]
    order = sorted(all_rows, key=lambda r: (r["tau"] is not None, r["run"], r["keys"], r["tau"] or 0))
    rows = []
    for r in order:
        cells = [r["run"], f"`{r['method']}`", r["budget"], r["keys"], number(r["tau"], "{:g}", missing="–"), r["prompts"]]
        cells += [f"{r['per_task'][t]:.1f}" if t in r["per_task"] else "–" for t in tasks]
        cells += [f"**{r['mean']:.1f}**", f"{100 * r['selection_ratio']:.1f}%", f"{r['device_mib']:.1f}"]
        rows.append(cells)
    return markdown_table(head, rows, align="l" * 6 + "r" * (len(tasks) + 3))


def plot(all_rows, path: Path) -> None:
    """Fraction of prompt tokens selected per layer, one line per HCAttention configuration (the paper's Fig. 3)."""
    fig = figure((8, 4.5))
    ax = fig.subplots()
    for r in all_rows:
        if r["selection_per_layer"]:
            ax.plot(100 * np.asarray(r["selection_per_layer"]), marker=".",
                    label=f"tau={r['tau']:g}, {r['keys']}")
    ax.set_xlabel("layer")
    ax.set_ylabel("prompt tokens selected per query (%)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120, tight=False)


def main(argv=None) -> int:
    """Write the ablation table (and plot) for the given run directories."""
    p = argparse.ArgumentParser(prog="python -m research.hcattention_ablation", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="kvjax eval run directories")
    p.add_argument("--out", required=True, help="markdown file to write")
    p.add_argument("--plot", help="PNG of the per-layer selection ratios")
    p.add_argument("--title", default="HCAttention ablations")
    args = p.parse_args(argv)
    all_rows = rows(args.runs)
    if not any(r["tau"] is not None for r in all_rows):
        raise SystemExit("no HCAttention records in these runs")
    tasks = []
    for d in args.runs:
        tasks += [t for t in _records(Path(d))[0]["tasks"] if t not in tasks]
    cmd = "python -m research.hcattention_ablation " + " ".join(args.runs) + f" --out {args.out}" + (
        f" --plot {args.plot}" if args.plot else "")
    lines = [f"# {args.title}", "", f"Made with `{cmd}` from the runs' `samples.jsonl` (each run's `config.json` "
             "and `README.md` give its command).", "",
             "Accuracy in % (exact match of every expected string); *tokens selected* = mean fraction of the prompt's "
             "tokens in a query's top-p set (over layers, query heads and decode calls); device MiB per prompt.", ""]
    lines += table(all_rows, tasks)
    if args.plot:
        plot(all_rows, Path(args.plot))
        lines += ["", f"![selection ratio per layer]({Path(args.plot).name})"]
    write_report(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
