"""``kvjax calibrate heterocache|synckv|hcattention``: calibrate, build the artifact, write plots and a summary.

``hcattention`` (PQ key codebooks) has its own options and flow, see :func:`main_hcattention`.

One recording (prefill + greedy decode of the calibration samples) serves every group size in
``--group-layers``. Per group size: the artifact JSON (default: this machine's artifacts,
``$KVJAX_CACHE/artifacts/<kind>/<model>-g<G>.json``, where the methods find it; ``--ship``: the shipped location
``kvjax/data/<kind>/``; ``--out-dir`` elsewhere), and in
``<report-dir>/<kind>-<model>-g<G>/`` (default report dir ``docs/results/calibration``): ``summary.md``
(settings, command, roles, the smallest feasible budget, warnings), ``stats.json`` and PNG plots —
head roles per layer (HeteroCache) or R-heads per layer (SyncKV), stability per head, the overlap
matrices of a few groups.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from kvjax.reports import figure, save_figure, table
from kvjax.reports import write_report as write_files


def add_output_args(p: argparse.ArgumentParser) -> None:
    """Where the artifact goes: this machine's artifacts (default), the shipped location, or a directory."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out-dir", default=None, help="artifact directory (default: this machine's artifacts, "
                       "$KVJAX_CACHE/artifacts/<kind>/, where the methods look after the shipped ones)")
    where.add_argument("--ship", action="store_true", help="write to the shipped location, kvjax/data/<kind>/ "
                       "(for artifacts that ship with kvjax)")


def artifact_out(args, kind: str, model_id: str, variant: str, suffix: str) -> Path:
    """The artifact's file: ``--out-dir``, ``--ship`` (kvjax/data) or this machine's artifacts."""
    from kvjax.artifacts import artifact_stem, shipped_artifact_path, user_artifact_path

    if args.out_dir:
        return Path(args.out_dir) / f"{artifact_stem(model_id, variant)}{suffix}"
    if args.ship:
        return shipped_artifact_path(kind, model_id, variant, suffix=suffix)
    return user_artifact_path(kind, model_id, variant, suffix=suffix)


def shadow_note(out: Path, kind: str, model_id: str, variant: str) -> str:
    """A line when a shipped artifact of the same name exists beside one written elsewhere (the shipped one wins)."""
    from kvjax.artifacts import shipped_artifact_path

    shipped = shipped_artifact_path(kind, model_id, variant)
    if shipped.exists() and shipped.resolve() != out.resolve():
        return (f"note: {shipped} ships with kvjax and is the one the method loads by default; pass this artifact "
                f"explicitly (artifact=load_artifact(...)) to use it")
    return ""


def build_parser() -> argparse.ArgumentParser:
    """Options of ``kvjax calibrate``."""
    from kvjax.calibration.registry import CALIBRATORS
    from kvjax.models import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="kvjax calibrate", description="offline head calibration for HeteroCache / SyncKV "
                                "(`kvjax calibrate hcattention --help`: PQ key codebooks for HCAttention)")
    p.add_argument("kind", choices=[*CALIBRATORS, "hcattention"])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--samples", type=int, default=4, help="calibration samples (slices of stdlib docstrings)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    p.add_argument("--decode-steps", type=int, default=64, help="greedy decode steps per sample")
    p.add_argument("--topk-fraction", type=float, default=0.2,
                   help="attended-set size as a fraction of the sample (reference: 1024 of ~5000 tokens)")
    p.add_argument("--group-layers", default="1,auto",
                   help="comma list of group sizes (adjacent layers clustered together), one artifact each from one "
                        "recording: 1 = the papers' per-layer version; auto = ceil(16 / KV heads), the shipped default")
    for calibrator in CALIBRATORS.values():
        calibrator.add_options(p)
    add_output_args(p)
    p.add_argument("--report-dir", default="docs/results/calibration",
                   help="plots and summaries go to <report-dir>/<kind>-<model>-g<G>/")
    return p


def main(argv=None) -> int:
    """Run a calibration (see module docstring)."""
    import kvjax
    from kvjax.artifacts import model_identity, save_artifact
    from kvjax.calibration import auto_group_layers, calibration_rows, head_statistics, record_sets
    from kvjax.calibration.registry import CALIBRATORS

    if argv is None:
        argv = sys.argv[2:] if sys.argv[1:2] == ["calibrate"] else sys.argv[1:]
    argv = list(argv)
    if argv[:1] == ["hcattention"]:
        return main_hcattention(argv[1:])
    args = build_parser().parse_args(argv)
    if args.kind == "hcattention":  # options before the kind
        raise ValueError("give the kind first: `kvjax calibrate hcattention [options]`")
    calibrator = CALIBRATORS[args.kind]
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
    records = record_sets(model, rows, decode_steps=args.decode_steps, topk=topk, gqa=calibrator.gqa, progress=True)
    record_s = time.perf_counter() - t0
    mid = model_identity(cfg)
    name = mid.split(":")[0]
    command = "kvjax calibrate " + " ".join(shlex.quote(a) for a in argv)
    for group in groups:
        t1 = time.perf_counter()
        stats = head_statistics(records, topk=topk, group_layers=group, tokens=args.tokens)
        art = calibrator.build(stats, mid, args, cfg)
        wall = record_s + time.perf_counter() - t1
        out = artifact_out(args, args.kind, mid, f"g{group}", ".json")
        out.parent.mkdir(parents=True, exist_ok=True)
        save_artifact(art, out)
        report = Path(args.report_dir) / f"{args.kind}-{name}-g{group}"
        report.mkdir(parents=True, exist_ok=True)
        lines = write_report(report, calibrator, stats, art, cfg, command=command, wall_s=wall)
        print("\n".join(lines))
        print(f"artifact: {out}\nreport: {report}")
        print(shadow_note(out, args.kind, mid, f"g{group}"))
    return 0


def write_report(report: Path, calibrator, stats, art, cfg, *, command: str, wall_s: float) -> list[str]:
    """summary.md, stats.json and the plots; returns the summary lines."""
    kind, group = calibrator.kind, stats.group_layers
    lines = [f"# {kind} calibration: {cfg.name}, groups of {group} layer(s)", "",
             f"Command: `{command}`", "",
             f"{stats.samples} samples x {stats.tokens} tokens of stdlib docstrings, {stats.decode_steps} greedy decode "
             f"steps, attended sets of {stats.topk} tokens; {wall_s:.0f} s on this machine (2-core CPU).", ""]
    lines += [f"- {x}" for x in calibrator.feasibility(art, cfg)]
    lines += [f"- WARNING: {w}" for w in calibrator.warnings(cfg, group)]
    lines += ["", f"Stability (median overlap with the prefill set): mean {stats.stability.mean():.3f}, "
              f"min {stats.stability.min():.3f}, max {stats.stability.max():.3f}.",
              f"Similarity score S_sim: mean {stats.similarity.mean():.3f}.", ""]
    write_files(report / "summary.md", "\n".join(lines) + "\n", {
        "stability": np.round(stats.stability, 4).tolist(), "similarity": np.round(stats.similarity, 4).tolist(),
        "stability_curve_mean": np.round(stats.stability_curve.mean(axis=(1, 2)), 4).tolist(),
        "group_layers": group, "topk": stats.topk, "samples": stats.samples, "decode_steps": stats.decode_steps,
    }, json_path=report / "stats.json")
    plot(report, calibrator, stats, art)
    return lines


def plot(report: Path, calibrator, stats, art) -> None:
    """roles.png (per-layer classes), stability.png (per head), similarity.png (a few groups)."""
    L, H = stats.stability.shape
    kind = calibrator.kind
    fig = figure((10, 3.5))
    ax = fig.add_subplot(1, 1, 1)
    classes, roles = calibrator.layer_roles(art)
    bottom = np.zeros(L)
    for c in classes:
        n = np.array([row.count(c) for row in roles], float)
        ax.bar(np.arange(L), n, bottom=bottom, label=c)
        bottom += n
    ax.set_xlabel("layer")
    ax.set_ylabel("KV heads")
    ax.set_title(f"{kind}: head roles per layer (groups of {stats.group_layers} layer(s))")
    ax.legend(loc="upper right", fontsize=8)
    save_figure(fig, report / "roles.png", dpi=110)

    fig = figure((10, 3.5))
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
    save_figure(fig, report / "stability.png", dpi=110)

    groups = stats.groups()
    pick = sorted({0, len(groups) // 2, len(groups) - 1})
    fig = figure((4 * len(pick), 3.6))
    for i, gi in enumerate(pick):
        ax = fig.add_subplot(1, len(pick), i + 1)
        im = ax.imshow(stats.sim_mean[gi], vmin=0, vmax=1, cmap="magma")
        labels = [f"{l}.{h}" for l, h in groups[gi]]
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"group {gi}: mean overlap", fontsize=9)
    fig.colorbar(im, ax=fig.axes)
    save_figure(fig, report / "similarity.png", dpi=110)


# ------------------------------------------------------------------------------------- hcattention
HC_QUERY_WINDOW = 64  # held-out queries (last tokens of the first held-out sample) for the attention checks
HC_TAU = 0.9  # HCAttention's top-p threshold (its experiments)
HC_FIG_KEYS = 300  # Fig. 4: the query at this position of the held-out sample over the keys before it


def build_hcattention_parser() -> argparse.ArgumentParser:
    """Options of ``kvjax calibrate hcattention``."""
    from kvjax.models import DEFAULT_MODEL

    p = argparse.ArgumentParser(
        prog="kvjax calibrate hcattention",
        description="PQ key codebooks for HCAttention: post-RoPE keys of stdlib-docstring samples, one mini-batch "
                    "K-means per (layer, KV head, group); one artifact per (groups, centroids)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--groups", default=None,
                   help="comma list of group counts g (D/g dims per group); default D/2,D/4 (the paper's two key "
                        "configurations: 2 and 4 dims per group)")
    p.add_argument("--centroids", default="256", help="comma list of codebook sizes c (<= 256: uint8 codes)")
    p.add_argument("--samples", type=int, default=3, help="training samples (the paper: 3)")
    p.add_argument("--heldout", type=int, default=1, help="extra samples held out for the error report")
    p.add_argument("--train-error-samples", type=int, default=None,
                   help="training samples the training error is measured on (default: all); encoding costs "
                        "tokens x g x c x D/g per layer, minutes per sample and layer on a CPU at c = 8192")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per sample")
    p.add_argument("--iterations", type=int, default=100,
                   help="mini-batch K-means steps (the paper: scikit-learn max_iter=200 passes with early stopping)")
    p.add_argument("--batch", type=int, default=4096, help="points per mini-batch step (the paper: 10,000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage-dtype", default="float16", choices=["float16", "float32"],
                   help="dtype of the codebooks in the .npz file (loaded as float32)")
    add_output_args(p)
    p.add_argument("--report-dir", default="docs/results/calibration",
                   help="plots and summaries go to <report-dir>/hcattention-<model>-g<g>-c<c>/")
    return p


def _int_list(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be a comma list of integers, got {text!r}") from None
    if not out:
        raise ValueError(f"--{what} is empty")
    return list(dict.fromkeys(out))


def main_hcattention(argv) -> int:
    """``kvjax calibrate hcattention``: collect keys once, fit and report one artifact per (g, c).

    Keys of ``samples + heldout`` consecutive slices of the calibration corpus are collected with one
    full-cache prefill each; the first ``samples`` train the codebooks, the rest measure them (key
    error, and for the first held-out slice the attention of its last 64 queries). Fitting time
    scales as ``layers * iterations * batch * H_kv * g * c`` (:mod:`kvjax.pq_codebooks`).
    """
    import kvjax
    from kvjax.artifacts import load_artifact, model_identity, save_artifact
    from kvjax.calibration import calibration_rows
    from kvjax.pq_codebooks import (codebook_variant, code_dtype, collect_keys, fit_codebooks, hcattention_artifact,
                                    quantization_error)

    args = build_hcattention_parser().parse_args(argv)
    if args.samples < 1 or args.heldout < 0 or args.tokens < HC_QUERY_WINDOW:
        raise ValueError(f"need --samples >= 1, --heldout >= 0, --tokens >= {HC_QUERY_WINDOW}; got "
                         f"{args.samples}, {args.heldout}, {args.tokens}")
    centroids = _int_list(args.centroids, "centroids")
    if args.train_error_samples is None:
        args.train_error_samples = args.samples
    if not 1 <= args.train_error_samples <= args.samples:
        raise ValueError(f"--train-error-samples must be between 1 and --samples ({args.samples}), "
                         f"got {args.train_error_samples}")
    for c in centroids:
        code_dtype(c)
        if c > args.samples * args.tokens:
            raise ValueError(f"--centroids {c} needs at least as many training keys, got {args.samples * args.tokens}")
    t0 = time.perf_counter()
    model = kvjax.load(args.model, "float32", progress=True)
    cfg = model.config
    D = cfg.head_dim
    groups = _int_list(args.groups, "groups") if args.groups else [D // 2, D // 4]
    for g in groups:
        if g < 1 or D % g:
            raise ValueError(f"--groups {g} must divide the head dim D={D}")
    rows = calibration_rows(model.tokenizer, args.samples + args.heldout, args.tokens)
    t1 = time.perf_counter()
    if args.heldout:
        keys, queries = collect_keys(model, rows, progress=True, query_window=HC_QUERY_WINDOW)
    else:
        keys, queries = collect_keys(model, rows, progress=True), None
    collect_s = time.perf_counter() - t1
    n_train = args.samples * args.tokens
    train, held = keys[:, :, :n_train], keys[:, :, n_train:]
    first_held = held[:, :, :args.tokens]
    w = HC_QUERY_WINDOW
    held_q = queries[:, :, args.samples * w:(args.samples + 1) * w] if args.heldout else None
    fig_keys, fig_q = None, None
    if args.heldout:  # HCAttention Fig. 4: one query over the first few hundred keys (prefix of the held-out sample)
        prefix = rows[args.samples][:min(HC_FIG_KEYS, args.tokens)]
        fig_keys, fig_q = collect_keys(model, [prefix], query_window=1)
    mid = model_identity(cfg)
    name = mid.split(":")[0]
    command = "kvjax calibrate hcattention " + " ".join(shlex.quote(a) for a in argv)
    for g in groups:
        for c in centroids:
            variant = codebook_variant(g, c)
            out = artifact_out(args, "hcattention", mid, variant, ".npz")
            out.parent.mkdir(parents=True, exist_ok=True)
            checkpoint = out.with_name(out.stem + ".partial.npz")  # finished layers; a killed fit resumes there
            cbs = fit_codebooks(train, groups=g, centroids=c, iterations=args.iterations, batch=args.batch,
                                seed=args.seed, progress=True, checkpoint=checkpoint)
            with np.load(checkpoint) as saved:
                fit_s = float(saved["seconds"])  # over every run of a resumed fit
            stored = cbs.astype(args.storage_dtype).astype(np.float32)
            train_err = quantization_error(train[:, :, :args.train_error_samples * args.tokens], stored,
                                           progress="error on the training keys")
            held_err = (quantization_error(first_held, stored, queries=held_q, tau=HC_TAU,
                                           progress="error and attention on held-out keys") if args.heldout else None)
            held_all = ((held_err if args.heldout == 1 else quantization_error(held, stored, progress="error on held-out keys"))
                        if args.heldout else None)
            f32_err = quantization_error(held if args.heldout else train, cbs, progress="error of the float32 codebooks")["mean"]
            art = hcattention_artifact(
                cbs, mid, samples=args.samples, tokens=args.tokens, iterations=args.iterations, batch=args.batch,
                seed=args.seed, relative_error=(held_all or train_err)["relative_error"],
                relative_error_on="held-out samples" if args.heldout else "training samples",
                heldout=args.heldout, storage_dtype=args.storage_dtype)
            save_artifact(art, out)
            back = load_artifact(out)
            back.check("hcattention", mid)
            if not np.array_equal(np.asarray(back.arrays["codebooks"]), stored):
                raise RuntimeError(f"{out} does not read back as the codebooks that were measured")
            checkpoint.unlink(missing_ok=True)
            report = Path(args.report_dir) / f"hcattention-{name}-{variant}"
            report.mkdir(parents=True, exist_ok=True)
            lines = write_hcattention_report(
                report, cfg, args, g=g, c=c, command=command, artifact_path=out,
                times={"load_s": t1 - t0, "collect_s": collect_s, "fit_s": fit_s},
                train_err=train_err, held_err=held_err, held_all=held_all, f32_err=f32_err,
                fig_keys=fig_keys, fig_queries=fig_q, codebooks=stored)
            print("\n".join(lines))
            print(f"artifact: {out} ({out.stat().st_size} bytes)\nreport: {report}")
            print(shadow_note(out, "hcattention", mid, variant))
    return 0


def write_hcattention_report(report: Path, cfg, args, *, g: int, c: int, command: str, artifact_path: Path, times,
                             train_err, held_err, held_all, f32_err, fig_keys, fig_queries, codebooks) -> list[str]:
    """summary.md, stats.json, error.png and attention.png of one (g, c) artifact; returns the summary lines."""
    from kvjax.cache import format_bytes
    from kvjax.pq_codebooks import code_dtype

    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    d = D // g
    code_b = g * np.dtype(code_dtype(c)).itemsize
    book_b = L * H * g * c * d * 4
    wall = times["load_s"] + times["collect_s"] + times["fit_s"]
    ref = held_all or train_err
    on = "held-out" if held_all else "training"
    shown = artifact_path.as_posix()
    shown = "kvjax/data/" + shown.split("kvjax/data/")[-1] if "kvjax/data/" in shown else shown
    held_text = (f"; {args.heldout} further sample(s) held out for the errors below." if args.heldout
                 else "; no held-out samples (errors are on the training keys).")
    dtype = np.dtype(code_dtype(c)).name
    lines = [f"# hcattention PQ codebooks: {cfg.name}, g = {g} groups of {d} dims, c = {c} centroids", "",
             f"Command: `{command}`", "",
             f"Keys: post-RoPE keys of every layer and KV head over {args.samples} training samples x {args.tokens} "
             "tokens of stdlib docstrings (`kvjax.calibration.calibration_corpus`, not the evaluation haystacks)"
             + held_text,
             "Fit: mini-batch K-means (Sculley 2010, as scikit-learn's MiniBatchKMeans), k-means++ init, "
             f"{args.iterations} steps of {args.batch} keys, seed {args.seed}; one codebook per (layer, KV head, "
             f"group) = {L * H * g} K-means problems.", "",
             f"Wall time on this machine (2-core CPU, shared): {wall:.0f} s = model load {times['load_s']:.0f} s + "
             f"key collection {times['collect_s']:.0f} s (shared by every configuration of the run) + fit "
             f"{times['fit_s']:.0f} s. Fitting scales as layers x iterations x batch x H_kv x g x c.", "",
             f"- artifact: `{shown}` ({format_bytes(artifact_path.stat().st_size, 2)} on disk, codebooks stored as "
             f"{args.storage_dtype}, loaded as float32)",
             f"- codebooks on device (float32): {format_bytes(book_b, 2)} for the model ({format_bytes(book_b / L, 2)} per layer)",
             f"- codes: {code_b} B per token per KV head ({dtype}) vs {4 * D} B for a float32 key "
             f"({code_b / (4 * D):.1%}) and {2 * D} B for bfloat16 ({code_b / (2 * D):.1%})",
             *([f"- training errors on the first {args.train_error_samples} of the {args.samples} training samples"]
               if args.train_error_samples < args.samples else []),
             f"- mean relative key error ||k - Q(k)||^2 / ||k||^2: training {train_err['mean']:.4f}"
             + (f", held-out {held_all['mean']:.4f}" if held_all else ""),
             f"- mean centred key error ||k - Q(k)||^2 / ||k - mean k||^2 (share of the keys' variance lost; the "
             f"common offset of a head's keys, e.g. Qwen's k-bias, does not change attention): training "
             f"{train_err['centred_mean']:.4f}" + (f", held-out {held_all['centred_mean']:.4f}" if held_all else ""),
             f"- {args.storage_dtype} storage: mean {on} error {ref['mean']:.6f} vs {f32_err:.6f} with the float32 "
             "codebooks",
             f"- centroids no {on} key is coded to: mean {np.mean(ref['unused_centroids']):.1%} "
             "(no dead-centre reassignment)"]
    if held_err and "attention_tv" in held_err:
        lines += [f"- attention of the last {HC_QUERY_WINDOW} queries of the first held-out sample (all query "
                  "heads): total-variation distance between the softmax over exact and over quantized keys, mean "
                  f"{np.mean(held_err['attention_tv']):.4f}; exact attention mass of the top-p (tau = {HC_TAU}) set "
                  f"chosen from quantized scores, mean {np.mean(held_err['top_p_mass']):.4f} (exact scores would "
                  f"give >= {HC_TAU})"]
    lines += ["", "Per layer (errors are means over KV heads; attention over all query heads):", ""]
    columns = [(train_err, "relative_error", ".4f"), (held_all, "relative_error", ".4f"),
               (held_all, "centred_error", ".4f"), (held_err, "attention_tv", ".4f"), (held_err, "top_p_mass", ".4f"),
               (ref, "unused_centroids", ".1%")]

    def cells(label, value):
        """One table row: ``value(numbers)`` of every column, ``-`` where the errors lack it."""
        return [label] + [format(value(err[key]), fmt) if err and key in err else "-" for err, key, fmt in columns]

    lines += table(["layer", "rel. error (train)", "rel. error (held-out)", "centred error (held-out)", "attention TV",
                    "top-p mass", "unused centroids"],
                   [cells(l, lambda v, l=l: v[l]) for l in range(L)] + [cells("mean", np.mean)], align="r" * 7)
    lines += ["", "Differences from the paper (HCAttention Sec. 4.1, 4.3.3): it fits scikit-learn's MiniBatchKMeans on 3 "
              "LongBench samples (at most 200 passes over the data, batch 10,000, early stopping) for Llama models "
              "with D = 128, and its best key configuration is g = 32 groups (4 dims) with c = 8192 centroids "
              "(uint16 codes); here the same algorithm runs in JAX with a fixed number of mini-batch steps on "
              f"stdlib docstrings, this artifact with c = {c} ({dtype} codes) on {args.samples} samples of "
              f"{args.tokens} tokens ({args.samples * args.tokens / c:.1f} training keys per centroid). g = D/2 "
              "and g = D/4 give the paper's 2 and 4 dims per group (its g = 64 and g = 32 on D = 128)."]
    lines += ["", "Plots: `error.png` (key errors per layer and head; attention errors per layer), `attention.png` "
              f"(HCAttention Fig. 4: attention probabilities of the query at position {HC_FIG_KEYS - 1} of the held-out "
              f"sample over the {HC_FIG_KEYS} keys up to it, exact vs quantized keys, four layers)."]
    stats = {"model": cfg.name, "groups": g, "centroids": c, "sub_dim": d, "samples": args.samples,
             "heldout_samples": args.heldout, "train_error_samples": args.train_error_samples, "tokens": args.tokens,
             "iterations": args.iterations, "batch": args.batch,
             "seed": args.seed, "storage_dtype": args.storage_dtype,
             "times_s": {k: round(v, 1) for k, v in times.items()},
             "artifact_bytes": artifact_path.stat().st_size, "codebook_device_bytes_f32": book_b,
             "code_bytes_per_token_per_head": code_b, "f32_key_bytes_per_token_per_head": 4 * D,
             "train": train_err, "heldout": held_all, "heldout_attention": held_err,
             "heldout_mean_error_float32_codebooks": f32_err}
    write_files(report / "summary.md", "\n".join(lines) + "\n", stats, json_path=report / "stats.json")
    plot_hcattention(report, cfg, g=g, c=c, train_err=train_err, held_all=held_all, held_err=held_err,
                     fig_keys=fig_keys, fig_queries=fig_queries, codebooks=codebooks)
    return lines


def plot_hcattention(report: Path, cfg, *, g, c, train_err, held_all, held_err, fig_keys, fig_queries,
                     codebooks) -> None:
    """error.png (key and attention errors per layer) and attention.png (HCAttention Fig. 4: ``fig_queries``
    ``[L, H_q, 1, D]``, the query at the last of the keys ``fig_keys [L, H_kv, n, D]``, over those keys)."""
    import jax.numpy as jnp

    from kvjax.pq_codebooks import decode_keys, encode_keys

    L, H = cfg.num_layers, cfg.num_kv_heads
    fig = figure((11, 3.8))
    ax = fig.add_subplot(1, 2, 1)
    layers = np.arange(L)
    ax.plot(layers, train_err["relative_error"], "o-", label="training keys (mean over heads)")
    if held_all:
        ax.plot(layers, held_all["relative_error"], "s-", label="held-out keys (mean over heads)")
        ax.plot(layers, held_all["centred_error"], "^-", label="held-out, centred: / ||k - mean k||²")
        per_head = np.asarray(held_all["relative_error_per_head"])
        for h in range(H):
            ax.plot(layers, per_head[:, h], ":", lw=1, color="gray", label="held-out, per KV head" if h == 0 else None)
    ax.set_xlabel("layer")
    ax.set_ylabel("||k - Q(k)||² / ||k||²")
    ax.set_ylim(0, 1.35 * max(np.max(held_all["relative_error_per_head"]) if held_all else 0,
                               max(held_all["centred_error"]) if held_all else 0, max(train_err["relative_error"])))
    ax.set_title(f"key quantization error (g={g}, c={c})", fontsize=10)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    if held_err and "attention_tv" in held_err:
        ax.plot(layers, held_err["attention_tv"], "o-", color="tab:red", label="total-variation distance")
        ax.plot(layers, 1 - np.asarray(held_err["top_p_mass"]), "s-", color="tab:purple",
                label=f"1 - exact mass of quantized top-p (tau={HC_TAU})")
        ax.axhline(1 - HC_TAU, color="gray", ls="--", lw=1, label=f"1 - tau = {1 - HC_TAU:.1f}")
        top = max(max(held_err["attention_tv"]), 1 - min(held_err["top_p_mass"]), 1 - HC_TAU)
        ax.set_ylim(0, 1.4 * top)  # room for the legend
        ax.legend(fontsize=8)
    ax.set_xlabel("layer")
    ax.set_title(f"attention error, held-out queries (g={g}, c={c})", fontsize=10)
    save_figure(fig, report / "error.png", dpi=110)

    if fig_queries is None:
        return
    pick = sorted({0, L // 3, (2 * L) // 3, L - 1})
    n, D = fig_keys.shape[2], fig_keys.shape[3]
    fig = figure((12, 2.6 * len(pick)))
    for i, l in enumerate(pick):
        kq = np.asarray(decode_keys(encode_keys(jnp.asarray(fig_keys[l][None]), jnp.asarray(codebooks[l])),
                                    jnp.asarray(codebooks[l])))[0]
        q = fig_queries[l, 0, -1].astype(np.float64)  # query head 0 (reads KV head 0) at position n - 1
        probs = []
        for kk in (fig_keys[l, 0], kq[0]):
            z = kk.astype(np.float64) @ q * D**-0.5
            p = np.exp(z - z.max())
            probs.append(p / p.sum())
        ax = fig.add_subplot(len(pick), 1, i + 1)
        ax.plot(np.arange(n), probs[0], color="tab:blue", lw=1.4, label="exact keys")
        ax.plot(np.arange(n), probs[1], color="tab:red", lw=1.0, ls="--", label="quantized keys")
        ax.set_yscale("log")
        tv = 0.5 * np.abs(probs[0] - probs[1]).sum()
        ax.set_title(f"layer {l}: query head 0 at position {n - 1} of a held-out sample over keys 0..{n - 1} "
                     f"(total variation {tv:.3f})", fontsize=9)
        ax.set_ylabel("attention prob.")
        if i == 0:
            ax.legend(fontsize=8, loc="lower left")
    fig.axes[-1].set_xlabel("key position")
    fig.suptitle(f"{cfg.name}: attention probabilities, exact vs PQ keys (g={g}, c={c})", fontsize=11)
    fig.tight_layout()
    save_figure(fig, report / "attention.png", dpi=110)
