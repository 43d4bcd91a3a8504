"""``kvjax train-locret``: build the QA training set, label it with the frozen model, train the retaining heads.

    kvjax train-locret --model qwen2.5-coder-0.5b --corpus django-docs --samples 40 --heldout 4 --tokens 4096 \\
        --hidden 128 --steps 1000 --out runs/locret-heads

Three resumable stages, each with a progress bar: QA samples (:mod:`kvjax.train.data`), features and
labels from one forward of the frozen model per sample (:mod:`kvjax.train.dataset`, stored under
``--data-dir``, by default in the kvjax cache directory), then Optax training with Orbax checkpoints
(:mod:`kvjax.train.locret`). ``--out`` receives ``checkpoints/``, ``metrics.json``, ``loss.png``,
``heads.npz`` and ``report.md``; ``--install`` copies ``heads.npz`` to this machine's artifacts
(``$KVJAX_CACHE/artifacts/locret/<model>.npz``), where ``--method locret`` finds a model's heads when none ship
with kvjax; ``--ship`` to the shipped location (``kvjax/data/locret/<model>.npz``)."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The ``kvjax train-locret`` argument parser."""
    from kvjax.models import DEFAULT_MODEL
    from kvjax.train.corpora import CORPORA
    from kvjax.train.data import KINDS
    from kvjax.train.dataset import TARGETS

    p = argparse.ArgumentParser(prog="kvjax train-locret", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"ready model name, HF directory or .gguf file (default {DEFAULT_MODEL})")
    d = p.add_argument_group("data")
    d.add_argument("--corpus", default="django-docs", choices=CORPORA,
                   help="source text of the samples (kvjax.train.corpora; django-docs is downloaded once with pip)")
    d.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated sample kinds, cycled (default all: {','.join(KINDS)})")
    d.add_argument("--samples", type=int, default=40, help="QA samples (training + held-out)")
    d.add_argument("--heldout", type=int, default=4, help="samples kept out of training for evaluation")
    d.add_argument("--tokens", type=int, default=4096, help="prompt length of each sample, in the model's tokens")
    d.add_argument("--answer-max", type=int, default=128, help="answer tokens that label the prompt (longer answers are cut)")
    d.add_argument("--data-seed", type=int, default=0, help="seed of the QA generator")
    d.add_argument("--target", default="attention", choices=TARGETS,
                   help="labels: attention (the paper's causal importance from the answer) or reconstruction (the log of "
                   "KVzip's query-agnostic score, as NVIDIA's KVzap; kvjax.train.labels)")
    d.add_argument("--data-dir", default=None, help="where the features and labels are stored (default: kvjax cache dir)")
    t = p.add_argument_group("training")
    t.add_argument("--hidden", type=int, default=128, help="d_R, the heads' hidden size (paper: 1024)")
    t.add_argument("--steps", type=int, default=1000, help="optimiser steps, batch 1 (paper: 3000)")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--alpha", type=float, default=0.0025, help="weight of the adjacent-smoothness L2 loss")
    t.add_argument("--label-norm", default="standardize", choices=["standardize", "none"],
                   help="labels standardised per sample, layer and KV head (the default, a deviation: see kvjax.train.locret) "
                   "or as they are (none: the paper)")
    t.add_argument("--seed", type=int, default=0, help="seed of the heads' init and the data order")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--checkpoint-every", type=int, default=100)
    t.add_argument("--no-resume", action="store_true", help="start over instead of resuming from --out's checkpoints")
    p.add_argument("--out", required=True, help="run directory (checkpoints, metrics, loss plot, heads.npz, report.md)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--install", action="store_true", help="copy the trained heads to this machine's artifacts, "
                       "$KVJAX_CACHE/artifacts/locret/<model>.npz, where --method locret finds them (after shipped ones)")
    where.add_argument("--ship", action="store_true", help="copy the trained heads to kvjax/data/locret/<model>.npz, "
                       "the heads that ship with kvjax")
    return p


def default_data_dir(model_name: str, args: argparse.Namespace) -> Path:
    """Where the training set for these data settings is cached (one folder per model, corpus, kinds, size, target)."""
    from kvjax.models.registry import cache_dir
    kinds = "-".join(k for k in args.kinds.split(",") if k)
    name = (f"{model_name}-{args.corpus}-{kinds}-{args.samples}x{args.tokens}-a{args.answer_max}-seed{args.data_seed}"
            + ("" if args.target == "attention" else f"-{args.target}"))
    return Path(cache_dir()) / "locret-data" / name


def main(argv=None) -> int:
    """Entry point of ``kvjax train-locret``."""
    args = build_parser().parse_args(argv)
    from kvjax.artifacts import model_identity
    from kvjax.artifacts import shipped_artifact_path, user_artifact_path
    from kvjax.retaining_heads import KIND
    from kvjax.models import load_model
    from kvjax.models.registry import cache_dir
    from kvjax.models.tokenizer import reconstruction_prompt
    from kvjax.train.data import describe, qa_samples
    from kvjax.train.dataset import build_dataset
    from kvjax.train.locret import TrainConfig, train

    kinds = tuple(k for k in args.kinds.split(",") if k)
    if args.heldout >= args.samples:
        raise ValueError(f"--heldout ({args.heldout}) must be smaller than --samples ({args.samples})")
    cfg = TrainConfig(hidden=args.hidden, steps=args.steps, lr=args.lr, alpha=args.alpha, label_norm=args.label_norm,
                      heldout=args.heldout, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                      seed=args.seed)
    t0 = time.time()
    model = load_model(args.model, "float32")
    model_id = model_identity(model.config)
    name = model_id.split(":")[0]
    data_dir = Path(args.data_dir or default_data_dir(name, args))
    samples = qa_samples(model.tokenizer, count=args.samples, tokens=args.tokens, seed=args.data_seed, kinds=kinds,
                         corpus=args.corpus, progress=True)
    settings = {"generator": "kvjax.train.data.qa_samples", "count": args.samples, "tokens": args.tokens,
                "seed": args.data_seed, "kinds": list(kinds), "corpus": args.corpus, "target": args.target}
    t_data = time.time()
    reconstruction = reconstruction_prompt(model.tokenizer, chat=True) if args.target == "reconstruction" else None
    build_dataset(model, samples, data_dir, tokens=args.tokens, answer_max=args.answer_max, settings=settings, progress=True,
                  target=args.target, reconstruction=reconstruction)
    t_labels = time.time()
    metrics = train(data_dir, args.out, cfg, resume=not args.no_resume, progress=True)
    t_train = time.time()
    out = Path(args.out)
    timing = {"qa_samples_s": round(t_data - t0, 1), "labels_s": round(t_labels - t_data, 1),
              "training_s": round(t_train - t_labels, 1)}
    metrics["data"] = {**describe(samples), "corpus": args.corpus}
    metrics["wall_seconds"] = timing
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    write_report(out, metrics, argv, model_id)
    print(f"trained heads: {out / 'heads.npz'}; report: {out / 'report.md'}")
    if args.install or args.ship:
        dest = (shipped_artifact_path if args.ship else user_artifact_path)(KIND, model_id, suffix=".npz")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "heads.npz", dest)
        print(f"heads of {name} installed: {dest}")
    return 0


def write_report(out: Path, metrics: dict, argv, model_id: str) -> None:
    """``report.md``: the command, data size, steps, wall times, held-out top-10% overlap, the loss plot."""
    import sys

    from kvjax.reports import write_report as write_files

    cmd = "kvjax train-locret " + " ".join(argv if argv is not None else sys.argv[1:])
    ev = metrics["eval"]
    first, last = (ev[0], ev[-1]) if ev else ({}, {})
    data = metrics.get("data", {})
    standardized = metrics["config"].get("label_norm") == "standardize"
    lines = [
        f"# Locret retaining heads: {model_id.split(':')[0]}", "",
        f"Command: `{cmd}`", "",
        f"- model: `{model_id}`",
        f"- data: {metrics['dataset']['samples']} QA samples of {metrics['dataset']['tokens']} prompt tokens "
        f"({metrics['train_samples']} train, {metrics['heldout_samples']} held out); corpus {data.get('corpus', 'stdlib-docstrings')}; kinds {data.get('kinds', {})}",
        f"- heads: d_R = {metrics['config']['hidden']}; {metrics['steps']} steps at batch 1; labels "
        f"{'standardised per sample, layer and KV head' if standardized else 'raw (the paper)'}",
        f"- wall time (this machine): {metrics.get('wall_seconds', {})}",
        f"- held-out top-10% overlap: {first.get('top10_overlap', float('nan')):.3f} at step {first.get('step')} -> "
        f"{last.get('top10_overlap', float('nan')):.3f} at step {last.get('step')} (chance: 0.10)",
        f"- held-out loss: {first.get('loss', float('nan')):.4f} -> {last.get('loss', float('nan')):.4f}",
        f"- per-layer overlap at the end: {last.get('top10_overlap_per_layer')}",
        ("- the loss is summed over layers, on standardised labels (each layer's loss is on the same scale); "
         "the overlap is scale-free" if standardized else
         "- the loss is summed over layers: layers with large attention logits (labels are pre-softmax "
         "logits) dominate it; the overlap is scale-free"), "",
        "![loss](loss.png)", "",
    ]
    write_files(out / "report.md", "\n".join(lines))


__all__ = ["build_parser", "main", "write_report"]
