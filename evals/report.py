"""Summaries, Markdown tables and PNG plots of an evaluation run, rebuilt from its JSONL records.

:func:`write_report` (also ``python -m kvjax.evals.report RUN_DIR``, e.g. for a partial run) reads
``config.json``, ``samples.jsonl`` and ``fidelity.jsonl`` of a run directory and writes
``summary.json``, ``README.md``, ``accuracy_vs_budget.png``, ``accuracy_vs_bytes.png`` and ``depth_heatmap.png``. Accuracy is
the mean exact-match score (RULER's ``string_match_all``: the fraction of expected strings found in
the answer), in percent.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

from kvjax.reports import MISSING, figure, number, save_figure, table
from kvjax.reports import write_report as write_files

DEPTH_BINS = 5
SHORTFALL_POINTS = 5.0  # a method "falls short" when its mean, or any one task, is this many points below the full cache


def _budget_key(label: str):
    return (0, 0.0) if label == "full" else (1, float(label))


def _config_key(method: str, budget: str, methods_order: list[str]):
    return (0 if method == "full" else 1, methods_order.index(method) if method in methods_order else 99, _budget_key(budget))


def method_names(config: dict) -> list[str]:
    """The run's method names as its records carry them, in the order given (a spec's ``budget=`` removed; ``full``
    with a ``kv_dtype``: the stored full cache's row, :func:`kvjax.evals.records.stored_full_name`)."""
    from kvjax.evals.records import method_budgets

    pairs = method_budgets(config.get("methods", []), config.get("budgets", []), config.get("kv_dtype"))
    return list(dict.fromkeys(name for name, _ in pairs))


def expected_records(config: dict) -> int:
    """Task records a complete run writes: per sample, the full cache and every (method, budget) of its grid."""
    from kvjax.evals.records import method_budgets

    configs = len(method_budgets(config.get("methods", []), config.get("budgets", []), config.get("kv_dtype")))
    return len(config.get("tasks", [])) * len(config.get("lengths", [])) * int(config.get("samples", 0)) * (1 + configs)


def summarize(records: list[dict], fidelity: list[dict], config: dict) -> dict:
    """Aggregate per-sample records into accuracy and byte tables (plain dicts, JSON-ready); a sample recorded twice
    under one configuration counts once, with its last record (:func:`kvjax.evals.records.latest_records`)."""
    from kvjax.evals.records import latest_records

    records = latest_records(records)
    methods_order = method_names(config)
    cells = collections.defaultdict(list)  # (method, budget, task, length) -> scores
    indices = collections.defaultdict(set)  # (method, budget, task, length) -> sample indices
    by_config = collections.defaultdict(list)
    bytes_ = collections.defaultdict(list)  # (method, budget, length) -> device bytes per sample
    host = collections.defaultdict(list)
    weights = collections.defaultdict(list)  # (method, budget) -> artifact device bytes (held once per model)
    depth = collections.defaultdict(list)  # (method, budget, length, depth bin) -> scores
    recall = collections.defaultdict(list)  # (method, budget) -> (trigger rate, bytes recalled) of recalling methods
    for r in records:
        key = (r["method"], r["budget"])
        if "recall_trigger_rate" in r:
            recall[key].append((r["recall_trigger_rate"], r["bytes_recalled"]))
        cells[key + (r["task"], r["length"])].append(r["score"])
        indices[key + (r["task"], r["length"])].add(r["index"])
        by_config[key].append(r["score"])
        # the cache's own bytes: an artifact (Locret's heads, HCAttention's codebooks) is weights, held once per model
        bytes_[key + (r["length"],)].append(r["device_bytes"] - r.get("artifact_device_bytes", 0))
        weights[key].append(r.get("artifact_device_bytes", 0))
        host[key + (r["length"],)].append(r["host_bytes"])
        b = min(int(r["depth"] * DEPTH_BINS), DEPTH_BINS - 1)
        depth[key + (r["length"], b)].append(r["score"])
    configs = sorted(by_config, key=lambda k: _config_key(k[0], k[1], methods_order))
    tasks = sorted({k[2] for k in cells}, key=lambda t: list(config.get("tasks", [])).index(t) if t in config.get("tasks", []) else 99)
    lengths = sorted({k[3] for k in cells})
    # the mean of each row is over the (task, length) cells every row has with the same samples, so the rows of an
    # unfinished run compare (a batch stopped part-way leaves some rows with samples that others lack)
    def same_samples(t, n):
        first = indices[configs[0] + (t, n)]
        return bool(first) and all(indices[(m, b, t, n)] == first for m, b in configs)

    common = [(t, n) for t in tasks for n in lengths if same_samples(t, n)]
    rows = []
    for m, b in configs:
        scores = [s for t, n in common for s in cells[(m, b, t, n)]] or by_config[(m, b)]  # no common cell: its own
        full_bytes = [np.mean(bytes_[("full", "full", n)]) for n in lengths if bytes_.get(("full", "full", n))]
        my_bytes = [np.mean(bytes_[(m, b, n)]) for n in lengths if bytes_.get((m, b, n))]
        row = {
            "method": m, "budget": b,
            "accuracy": {f"{t}@{n}": 100 * float(np.mean(cells[(m, b, t, n)])) for t in tasks for n in lengths if cells.get((m, b, t, n))},
            "samples": {f"{t}@{n}": len(cells[(m, b, t, n)]) for t in tasks for n in lengths if cells.get((m, b, t, n))},
            "mean_accuracy": 100 * float(np.mean(scores)),
            "device_bytes": {str(n): float(np.mean(bytes_[(m, b, n)])) for n in lengths if bytes_.get((m, b, n))},
            "host_bytes": {str(n): float(np.mean(host[(m, b, n)])) for n in lengths if host.get((m, b, n))},
            "device_bytes_vs_full": float(np.mean(my_bytes) / np.mean(full_bytes)) if my_bytes and full_bytes and len(my_bytes) == len(full_bytes) else None,
            "weights_device_bytes": float(max(weights[(m, b)], default=0)),
        }
        if recall.get((m, b)):
            rates, moved = zip(*recall[(m, b)])
            row.update(recall_trigger_rate=float(np.mean(rates)), bytes_recalled=float(np.mean(moved)))
        rows.append(row)
    heat = {}
    for m, b in configs:
        grid = np.full((DEPTH_BINS, len(lengths)), np.nan)
        for j, n in enumerate(lengths):
            for i in range(DEPTH_BINS):
                s = depth.get((m, b, n, i))
                if s:
                    grid[i, j] = 100 * float(np.mean(s))
        heat[f"{m}@{b}"] = grid.tolist()
    fid = sorted(fidelity, key=lambda r: (r["prefix_tokens"], _config_key(r["method"], r["budget"], methods_order)))
    measured = collections.Counter((r.get("jax"), r.get("device")) for r in records)
    return {"tasks": tasks, "lengths": lengths, "mean_over": [f"{t}@{n}" for t, n in common], "rows": rows,
            "depth_heatmap": heat, "depth_bins": DEPTH_BINS,
            "fidelity": fid, "num_records": len(records),
            "measured_with": [{"jax": j, "device": d, "records": n} for (j, d), n in sorted(measured.items(), key=str)]}


def shortfalls(summary: dict) -> list[str]:
    """Plain-language list of configurations clearly below the full cache: on mean accuracy or on any one task."""
    full = next((r for r in summary["rows"] if r["method"] == "full"), None)
    if full is None:
        return []
    out = []
    for r in summary["rows"]:
        if r["method"] == "full":
            continue
        gaps = {cell: full["accuracy"][cell] - acc for cell, acc in r["accuracy"].items() if cell in full["accuracy"]}
        worst = max(gaps, key=gaps.get, default=None)
        mean_gap = full["mean_accuracy"] - r["mean_accuracy"]
        if mean_gap >= SHORTFALL_POINTS or (worst is not None and gaps[worst] >= SHORTFALL_POINTS):
            where = "" if r["budget"] == "full" else f" at budget {r['budget']}"  # the full cache in another kv_dtype
            out.append(f"{r['method']}{where}: {r['mean_accuracy']:.1f}% vs full {full['mean_accuracy']:.1f}% "
                       f"(worst: {worst} {r['accuracy'][worst]:.1f}% vs {full['accuracy'][worst]:.1f}%)")
    return out


def render_markdown(summary: dict, config: dict) -> str:
    """The run's README.md: settings, accuracy table, bytes, fidelity, shortfalls, plots."""
    from kvjax.evals.records import run_split
    from kvjax.evals.suites import get_suite

    mib = 1024 ** 2
    suite = get_suite(config.get("suite", "kvjax"))
    split = run_split(config) or "none"
    lines = [f"# Evaluation run `{config.get('run_name', '')}`", ""]
    if config.get("command"):
        lines += ["Produced by:", "", "```", config["command"], "```", ""]
    known = [m for m in summary.get("measured_with", []) if m["jax"]]
    if known:
        older = sum(m["records"] for m in summary["measured_with"] if not m["jax"])
        count = lambda n: f"{n} record" + ("s" if n != 1 else "")  # noqa: E731
        lines += ["Measured with "
                  + "; ".join(f"jax {m['jax']} on {m['device']} ({count(m['records'])})" for m in known)
                  + (f"; {count(older)} written before the records named their jax version and device." if older
                     else "."), ""]
    lines += [
        f"Suite **{suite.name}**, split **{split}** (seed {config.get('seed')}). "
        f"Model `{config.get('model')}` ({config.get('dtype')}), greedy decoding, "
        f"{config.get('samples')} samples per (task, length), batches of "
        f"{config.get('batch_size')} sharing one prefill (the full cache and every method are derived from it). "
        f"Budget = fraction of each prompt's KV kept on the device (of the prompt's own length, never of its padding). "
        + suite.metric,
        "",
        f"Protocol: **{config.get('protocol', 'query-aware')}** — "
        + ("the question and the answer prefix are inside the compressed prompt." if config.get("protocol", "query-aware") == "query-aware"
           else "the context alone is compressed; the question and the answer prefix are then prefilled onto the "
                "compressed cache, uncompressed (what a method that does not know the question can keep)."),
        "",
    ]
    if config.get("kv_dtype"):
        from kvjax.evals.records import stored_full_name

        stored_full = (f"; the row `{stored_full_name(config['kv_dtype'])}`: the full cache stored in "
                       f"{config['kv_dtype']}" if "full" in config.get("methods", []) else "")
        lines += [f"KV storage: every method's compressed page pools in **{config['kv_dtype']}** (per-token scales for "
                  "int8 / float8, counted in the device bytes: docs/QUANTIZATION.md)" + stored_full + "; the full "
                  f"cache `full`, the reference, in the model's {config.get('dtype')}.", ""]
    expected = expected_records(config)
    pending = []
    if summary["num_records"] < expected:
        pending.append(f"{summary['num_records']} of {expected} task records written")
    if config.get("fidelity_texts", 0) > 0 and not summary["fidelity"]:
        pending.append("the fidelity check not run yet")
    if pending:
        lines += [f"**Incomplete run**: {'; '.join(pending)}. Running the command again resumes it "
                  "(records already written are kept).", ""]
    if summary["rows"]:
        cols = list(summary["rows"][0]["accuracy"].keys())
        for r in summary["rows"][1:]:
            cols += [c for c in r["accuracy"] if c not in cols]
        lens = summary["lengths"]
        lines += ["## Accuracy (%)", ""]
        head = ["method", "budget"] + [c.replace("@", " @ ") for c in cols] + ["mean"] + [f"KV MiB @ {n}" for n in lens] + ["KV ÷ full"]
        rows = []
        for r in summary["rows"]:
            cells = [r["method"], r["budget"]] + [f"{r['accuracy'][c]:.1f}" if c in r["accuracy"] else MISSING for c in cols]
            cells += [f"**{r['mean_accuracy']:.1f}**"]
            cells += [f"{r['device_bytes'][str(n)] / mib:.1f}" if str(n) in r["device_bytes"] else MISSING for n in lens]
            cells += [number(r["device_bytes_vs_full"], "{:.3f}")]
            rows.append(cells)
        lines += table(head, rows, align="ll" + "r" * (len(head) - 2))
        if len(summary["mean_over"]) < len(cols):
            lines += ["", (f"Mean over the {len(summary['mean_over'])} of {len(cols)} task columns every row has for the same samples: "
                           + ", ".join(c.replace("@", " @ ") for c in summary["mean_over"]) + "."
                           if summary["mean_over"] else "No task column is in every row for the same samples: each mean is over its row's own.")]
        n_per = sorted({v for r in summary["rows"] for v in r["samples"].values()})
        with_weights = sorted({(r["method"], r["weights_device_bytes"]) for r in summary["rows"] if r["weights_device_bytes"]})
        lines += ["", f"Samples per cell: {', '.join(map(str, n_per))}. KV MiB = device bytes of one sample's cache after "
                  "compression (including the pre-allocated room for the answer), without a method's trained or "
                  "calibrated arrays, which are weights held once per model whatever the batch"
                  + (" (" + ", ".join(f"{m}: {w / mib:.1f} MiB" if w >= mib / 10 else f"{m}: {w / 1024:.1f} KiB"
                                   for m, w in with_weights) + ")" if with_weights else "")
                  + ". Quest keeps the whole prompt on the "
                  "device plus per-page key bounds (it saves bandwidth, not memory); its bytes differ from the full "
                  "cache's by those bounds and by the full cache's rounding of its buffer to 256-slot blocks.", ""]
    recalling = [r for r in summary["rows"] if "recall_trigger_rate" in r]
    if recalling:
        lines += ["## Recall from host memory", ""]
        rows = []
        for r in recalling:
            host_mib = np.mean(list(r["host_bytes"].values())) / mib if r["host_bytes"] else 0.0
            rows.append([r["method"], r["budget"], f"{r['recall_trigger_rate']:.3f}", f"{r['bytes_recalled'] / mib:.1f}",
                         f"{host_mib:.1f}"])
        lines += table(["method", "budget", "recall events per follower head and decode step", "MiB recalled per sample",
                        "host MiB per sample"], rows, align="llrrr")
        lines += ["", "Averaged over the run's batches. A recall refreshes a follower head's region from its host copy; a "
                  "question prefilled onto the compressed cache may add one beyond the decode steps (rates above 1).", ""]
    if summary["fidelity"]:
        lines += ["## Fidelity vs the full cache (teacher forcing on real prose)", ""]
        lines += table(["method", "budget", "prefix tokens", "continuation", "KL(full ‖ method) nats/token",
                        "top-1 agreement", "NLL nats/token", "KV MiB"],
                       [[r["method"], r["budget"], r["prefix_tokens"], r["continuation_tokens"], f"{r['kl']:.4f}",
                         f"{100 * r['top1']:.1f}%", f"{r['nll']:.3f}", f"{r['device_bytes'] / r['texts'] / mib:.1f}"]
                        for r in summary["fidelity"]], align="llrrrrrr")
        lines += ["", "KL and top-1 compare each step's next-token distribution with the full cache's; NLL is the "
                  "method's loss on the true next token (the full cache's row is the reference). KV MiB includes the room "
                  "for the teacher-forced continuation, so a budget's bytes exceed the task table's. Averaged over "
                  f"{summary['fidelity'][0]['texts']} texts.", ""]
    if not summary["rows"]:  # no record yet: nothing to compare or plot
        return "\n".join(lines + [""])
    short = shortfalls(summary)
    lines += ["## Where methods fall short of the full cache", ""]
    if short:
        lines += [f"Configurations whose mean, or any one task, is {SHORTFALL_POINTS:.0f}+ points below the full cache "
                  "(worst: the task furthest below it):", ""]
    lines += [f"- {s}" for s in short] if short else [f"- no method is {SHORTFALL_POINTS:.0f}+ points below the full cache on mean accuracy or on any task."]
    lines += ["", "## Plots", ""]
    for name, caption in (("accuracy_vs_budget.png", "accuracy vs budget per method"),
                          ("accuracy_vs_bytes.png", "accuracy vs device bytes per method"),
                          ("depth_heatmap.png", "accuracy by needle depth x length per method and budget")):
        lines.append(f"![{caption}]({name})")
    lines.append("")
    return "\n".join(lines)


def plot_accuracy_vs_bytes(points: dict, full_accuracy, path: str, title: str) -> None:
    """Mean accuracy against device bytes ÷ the full cache's (log): one line per label over its ``(ratio, accuracy)``
    points, the full cache as a star at 1."""
    fig = figure((7.5, 5.6))
    ax = fig.subplots()
    markers = "osD^vP<>Xh*p"
    for i, (label, pts) in enumerate(p for p in points.items() if p[1]):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], label=label)
    if full_accuracy is not None:
        ax.plot([1.0], [full_accuracy], marker="*", markersize=14, color="black", linestyle="", label="full cache")
    ax.set_xscale("log")
    ax.set_xlabel("device bytes of the KV cache ÷ the full cache's (log)")
    ax.set_ylabel("mean accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.tight_layout()
    save_figure(fig, path, dpi=110, tight=False)


def plot(summary: dict, out_dir: str) -> list[str]:
    """Write ``accuracy_vs_budget.png``, ``accuracy_vs_bytes.png`` and ``depth_heatmap.png``; returns the paths."""
    paths = []
    rows = summary["rows"]
    if not rows:
        return paths
    full = next((r for r in rows if r["method"] == "full"), None)
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "full"]
    # every token kept, without a budget: the full cache stored in another dtype (evals.records.stored_full_name)
    whole = [r for r in rows if r["method"] != "full" and r["budget"] == "full"]
    fig = figure((6.5, 4.2))
    ax = fig.subplots()
    for m in methods:
        pts = sorted((float(r["budget"]), r["mean_accuracy"]) for r in rows if r["method"] == m and r["budget"] != "full")
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    for r in whole:
        ax.axhline(r["mean_accuracy"], color="gray", linestyle=":", label=r["method"])
    if full is not None:
        ax.axhline(full["mean_accuracy"], color="black", linestyle="--", label="full cache")
    ax.set_xlabel("budget (fraction of the prompt's KV kept)")
    ax.set_ylabel("mean accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"accuracy vs budget ({', '.join(summary['tasks'])} @ {', '.join(map(str, summary['lengths']))})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(save_figure(fig, os.path.join(out_dir, "accuracy_vs_budget.png"), dpi=110, tight=False))

    points = {m: [(r["device_bytes_vs_full"], r["mean_accuracy"]) for r in rows
                  if r["method"] == m and r["device_bytes_vs_full"] is not None] for m in methods}
    paths.append(os.path.join(out_dir, "accuracy_vs_bytes.png"))
    plot_accuracy_vs_bytes(points, full["mean_accuracy"] if full is not None else None, paths[-1],
                           f"accuracy vs device memory ({', '.join(map(str, summary['lengths']))} tokens)")

    budgets = sorted({r["budget"] for r in rows if r["method"] != "full" and r["budget"] != "full"}, key=_budget_key)
    whole_names = {r["method"] for r in whole}
    names = (["full"] if full is not None else []) + [m for m in methods if m in whole_names] + \
        [m for m in methods if m not in whole_names]
    ncols = max(len(budgets), 1)
    fig = figure((2.4 * ncols + 1.2, 1.9 * len(names) + 0.6), layout="constrained")
    axes = fig.subplots(len(names), ncols, squeeze=False)
    lens = summary["lengths"]
    image = None
    for i, m in enumerate(names):
        for j in range(ncols):
            ax = axes[i][j]
            one = m == "full" or m in whole_names  # one cell: every token kept
            key = f"{m}@full" if one else f"{m}@{budgets[j]}" if budgets else None
            grid = np.asarray(summary["depth_heatmap"].get(key, np.full((DEPTH_BINS, len(lens)), np.nan)), float)
            if one and j > 0:
                ax.axis("off")
                continue
            image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="upper")
            ax.set_xticks(range(len(lens)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lens], fontsize=7)
            ax.set_yticks(range(DEPTH_BINS), [f"{k / DEPTH_BINS:.1f}-{(k + 1) / DEPTH_BINS:.1f}" for k in range(DEPTH_BINS)], fontsize=6)
            ax.set_title(m if one else f"{m} @ {budgets[j]}", fontsize=8)
            if j == 0:
                ax.set_ylabel("depth", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="accuracy (%)")
    paths.append(save_figure(fig, os.path.join(out_dir, "depth_heatmap.png"), dpi=100, tight=False))
    return paths


def write_report(out_dir: str) -> dict:
    """Rebuild ``summary.json``, ``README.md`` and the plots of the run in ``out_dir``; returns the summary."""
    from kvjax.evals.records import read_jsonl

    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    records = read_jsonl(os.path.join(out_dir, "samples.jsonl"))
    fidelity = read_jsonl(os.path.join(out_dir, "fidelity.jsonl"))
    summary = summarize(records, fidelity, config)
    plot(summary, out_dir)
    write_files(os.path.join(out_dir, "README.md"), render_markdown(summary, config), {"config": config, **summary},
                json_path=os.path.join(out_dir, "summary.json"))
    return summary


def main(argv=None) -> int:
    """``python -m kvjax.evals.report RUN_DIR [RUN_DIR ...]``: rebuild each run's report (also of a partial run)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvjax.evals.report",
                                description="rebuild README.md, summary.json and the plots of kvjax eval runs from their records")
    p.add_argument("runs", nargs="+", help="run directories (docs/results/<run>)")
    args = p.parse_args(argv)
    for d in args.runs:
        if not os.path.exists(os.path.join(d, "config.json")):
            raise SystemExit(f"{d} has no config.json (not a kvjax eval run directory)")
        write_report(d)
        print(os.path.join(d, "README.md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
