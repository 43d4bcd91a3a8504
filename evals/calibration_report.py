"""``kvjax calibrate heterocache|synckv``: record attended sets, build the artifact, write plots and a summary.

One recording (prefill + greedy decode of the calibration samples) serves every group size in
``--group-layers``. Per group size: the artifact JSON (default: the shipped location
``kvjax/data/<kind>/<model>-g<G>.json``; ``--out-dir`` elsewhere), and in
``<report-dir>/<kind>-<model>-g<G>/`` (default report dir ``docs/results/calibration``): ``summary.md``
(settings, command, roles, the smallest feasible budget, warnings), ``stats.json`` and PNG plots —
head roles per layer (HeteroCache) or R-heads per layer (SyncKV), stability per head, the overlap
matrices of a few groups.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

KINDS = ("heterocache", "synckv")


def build_parser() -> argparse.ArgumentParser:
    """Options of ``kvjax calibrate``."""
    from models import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="kvjax calibrate", description="offline head calibration for HeteroCache / SyncKV")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--samples", type=int, default=4, help="calibration samples (slices of stdlib docstrings)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    p.add_argument("--decode-steps", type=int, default=64, help="greedy decode steps per sample")
    p.add_argument("--topk-fraction", type=float, default=0.2,
                   help="attended-set size as a fraction of the sample (reference: 1024 of ~5000 tokens)")
    p.add_argument("--group-layers", default="1,auto",
                   help="comma list of group sizes (adjacent layers clustered together), one artifact each from one "
                        "recording: 1 = the papers' per-layer version; auto = ceil(16 / KV heads), the shipped default")
    p.add_argument("--tau-sim", type=float, default=0.5, help="HeteroCache similarity threshold")
    p.add_argument("--tau-stable", type=float, default=0.5, help="HeteroCache stability threshold")
    p.add_argument("--seed", type=int, default=0, help="SyncKV k-means seed")
    p.add_argument("--out-dir", default=None, help="artifact directory (default: the shipped location)")
    p.add_argument("--report-dir", default="docs/results/calibration",
                   help="plots and summaries go to <report-dir>/<kind>-<model>-g<G>/")
    return p


def main(argv=None) -> int:
    """Run a calibration (see module docstring)."""
    import kvjax
    from kvjax.artifacts import model_identity, save_artifact, shipped_artifact_path
    from kvjax.calibration import auto_group_layers, calibration_rows, head_statistics, record_sets

    args = build_parser().parse_args(argv)
    if not 0 < args.topk_fraction < 1:
        raise ValueError(f"--topk-fraction must be in (0, 1), got {args.topk_fraction}")
    model = kvjax.load(args.model, "float32", progress=True)
    cfg = model.config
    groups = []
    for g in args.group_layers.split(","):
        g = auto_group_layers(cfg.num_kv_heads) if g.strip() == "auto" else int(g)
        if g < 1 or g > cfg.num_layers:
            raise ValueError(f"--group-layers must be in [1, {cfg.num_layers}] or auto, got {g}")
        if g not in groups:
            groups.append(g)
    topk = max(1, int(args.topk_fraction * (args.tokens - 1)))
    t0 = time.perf_counter()
    rows = calibration_rows(model.tokenizer, args.samples, args.tokens)
    gqa = "mean" if args.kind == "heterocache" else "max"  # reference code: group mean; SyncKV B.1: group max-pooling
    records = record_sets(model, rows, decode_steps=args.decode_steps, topk=topk, gqa=gqa, progress=True)
    record_s = time.perf_counter() - t0
    mid = model_identity(cfg)
    name = mid.split(":")[0]
    command = "kvjax calibrate " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[2:]))
    for group in groups:
        t1 = time.perf_counter()
        stats = head_statistics(records, topk=topk, group_layers=group, tokens=args.tokens)
        if args.kind == "heterocache":
            from kvjax.methods.heterocache import heterocache_artifact

            art = heterocache_artifact(stats, mid, tau_sim=args.tau_sim, tau_stable=args.tau_stable)
        else:
            from kvjax.methods.synckv import synckv_artifact

            art = synckv_artifact(stats, mid, seed=args.seed, default_representatives=paper_representatives(cfg))
        wall = record_s + time.perf_counter() - t1
        out = (Path(args.out_dir) / f"{name}-g{group}.json" if args.out_dir
               else shipped_artifact_path(args.kind, mid, f"g{group}"))
        out.parent.mkdir(parents=True, exist_ok=True)
        save_artifact(art, out)
        report = Path(args.report_dir) / f"{args.kind}-{name}-g{group}"
        report.mkdir(parents=True, exist_ok=True)
        lines = write_report(report, args.kind, stats, art, cfg, command=command, wall_s=wall)
        print("\n".join(lines))
        print(f"artifact: {out}\nreport: {report}\n")
    return 0


def paper_representatives(cfg) -> int:
    """SyncKV's N_r as its paper sets it per model family: 1 for Qwen, 2 for Llama."""
    return 1 if "qwen" in cfg.architecture.lower() else 2


def feasibility(kind: str, art, cfg) -> list[str]:
    """Head counts and the smallest budget the artifact allows (rho N > F)."""
    meta = art.meta_dict()
    N = cfg.num_layers * cfg.num_kv_heads
    out = []
    if kind == "heterocache":
        roles = meta["roles"]
        counts = {r: sum(row.count(r) for row in roles) for r in ("pivot", "satellite", "anchor", "volatile")}
        F = counts["pivot"] + counts["volatile"]
        out.append(f"roles over {N} KV heads: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        out.append(f"full heads F = {F}: budgets must exceed F / N = {F / N:.3f}")
    else:
        for n_r, roles, _ in meta["clusters"]:
            F = sum(row.count("R") for row in roles)
            out.append(f"N_r = {n_r}: {F} R-heads of {N}; budgets must exceed {F / N:.3f}")
    return out


def write_report(report: Path, kind: str, stats, art, cfg, *, command: str, wall_s: float) -> list[str]:
    """summary.md, stats.json and the plots; returns the summary lines."""
    from kvjax.calibration import few_heads_warning

    group = stats.group_layers
    lines = [f"# {kind} calibration: {cfg.name}, groups of {group} layer(s)", "",
             f"Command: `{command}`", "",
             f"{stats.samples} samples x {stats.tokens} tokens of stdlib docstrings, {stats.decode_steps} greedy decode "
             f"steps, attended sets of {stats.topk} tokens; {wall_s:.0f} s on this machine (2-core CPU).", ""]
    lines += [f"- {x}" for x in feasibility(kind, art, cfg)]
    for n_r in ((1, 2) if kind == "synckv" else ()):
        w = few_heads_warning(cfg.num_kv_heads, group, n_r)
        if w:
            lines.append(f"- WARNING: {w}")
    if kind == "heterocache" and group == 1:
        lines.append(f"- per-layer clustering on {cfg.num_kv_heads} KV heads per layer (the papers' models have 8)")
    lines += ["", f"Stability (median overlap with the prefill set): mean {stats.stability.mean():.3f}, "
              f"min {stats.stability.min():.3f}, max {stats.stability.max():.3f}.",
              f"Similarity score S_sim: mean {stats.similarity.mean():.3f}.", ""]
    (report / "summary.md").write_text("\n".join(lines) + "\n")
    (report / "stats.json").write_text(json.dumps({
        "stability": np.round(stats.stability, 4).tolist(), "similarity": np.round(stats.similarity, 4).tolist(),
        "stability_curve_mean": np.round(stats.stability_curve.mean(axis=(1, 2)), 4).tolist(),
        "group_layers": group, "topk": stats.topk, "samples": stats.samples, "decode_steps": stats.decode_steps,
    }, indent=1) + "\n")
    plot(report, kind, stats, art)
    return lines


def plot(report: Path, kind: str, stats, art) -> None:
    """roles.png (per-layer classes), stability.png (per head), similarity.png (a few groups)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    L, H = stats.stability.shape
    meta = art.meta_dict()
    fig = Figure(figsize=(10, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if kind == "heterocache":
        classes = ("pivot", "satellite", "anchor", "volatile")
        roles = meta["roles"]
    else:
        classes = ("R", "NR")
        roles = dict((c[0], c[1]) for c in meta["clusters"]).get(2) or meta["clusters"][0][1]
    bottom = np.zeros(L)
    for c in classes:
        n = np.array([row.count(c) for row in roles], float)
        ax.bar(np.arange(L), n, bottom=bottom, label=c)
        bottom += n
    ax.set_xlabel("layer")
    ax.set_ylabel("KV heads")
    ax.set_title(f"{kind}: head roles per layer (groups of {stats.group_layers} layer(s))")
    ax.legend(loc="upper right", fontsize=8)
    fig.savefig(report / "roles.png", dpi=110, bbox_inches="tight")

    fig = Figure(figsize=(10, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    im = ax.imshow(stats.stability.T, aspect="auto", vmin=0, vmax=1, cmap="viridis")
    ax.set_xlabel("layer")
    ax.set_ylabel("KV head")
    ax.set_yticks(range(H))
    ax.set_title("stability per head")
    fig.colorbar(im, ax=ax)
    ax = fig.add_subplot(1, 2, 2)
    curve = stats.stability_curve.reshape(stats.stability_curve.shape[0], -1)
    ax.plot(curve.mean(axis=1), label="mean over heads")
    ax.plot(curve.min(axis=1), label="least stable head", linestyle="--")
    ax.set_xlabel("decode step")
    ax.set_ylabel("overlap with prefill set")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.savefig(report / "stability.png", dpi=110, bbox_inches="tight")

    groups = stats.groups()
    pick = sorted({0, len(groups) // 2, len(groups) - 1})
    fig = Figure(figsize=(4 * len(pick), 3.6))
    FigureCanvasAgg(fig)
    for i, gi in enumerate(pick):
        ax = fig.add_subplot(1, len(pick), i + 1)
        im = ax.imshow(stats.sim_mean[gi], vmin=0, vmax=1, cmap="magma")
        labels = [f"{l}.{h}" for l, h in groups[gi]]
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"group {gi}: mean overlap", fontsize=9)
    fig.colorbar(im, ax=fig.axes)
    fig.savefig(report / "similarity.png", dpi=110, bbox_inches="tight")
