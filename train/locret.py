"""Training Locret's retaining heads with Optax, checkpointed with Orbax (exact resume).

Recipe (paper Sec. 3.3 and its public code; ours scaled to a CPU, see :class:`TrainConfig`):

* loss per layer: ``SmoothL1(pred, label)`` averaged over prompt tokens and KV heads, plus
  ``alpha * mean((pred[k+1] - pred[k])^2)`` over adjacent prompt tokens (smoothness), summed over
  layers (``alpha = 0.0025``);
* AdamW, lr 5e-4, betas (0.9, 0.95), linear warmup over the first 2/3 of the steps (the reference's
  2000 of 3000) then linear decay to 0 (the ``transformers`` linear schedule), gradient **value**
  clipping at 0.5 (``optax.clip``); batch 1;
* only the heads train: the inputs are precomputed features of the frozen model
  (:mod:`kvjax.train.dataset`), so the model's parameters are never an argument of the train step.

**Deviation (the default, ``label_norm="standardize"``; ``"none"`` is the paper's raw labels):** each
sample's labels are standardised per layer and KV head over its prompt tokens (zero mean, unit
standard deviation) before the loss. Inference only ranks a head's own scores (its top-``b``), so an
offset or scale per head carries no information; but Qwen's q/k biases add one of up to ~10^3 to every
logit of some heads (layer 0: mean 932, spread within a head 3.6-15), which a bias-free head must
regress before it can rank, and in the paper's raw-label loss it swamps the ranking (held-out
top-10% overlap at chance in those layers). Measured on Qwen2.5-Coder-0.5B (same data, steps and
seed): held-out top-10% overlap 0.46 -> 0.52; 4K evaluation, 12 prompts per protocol, 10% / 25%
budget: query-agnostic 66.7 -> 75.0 / 83.3 -> 91.7, query-aware 75.0 -> 75.0 / 83.3 -> 91.7
(``docs/results/``, README "Locret").

The data order is a function of ``(seed, step)`` (a fresh permutation of the training samples per
epoch), so a run resumed from an Orbax checkpoint equals an uninterrupted one step for step. Every
``eval_every`` steps the held-out samples' loss and **top-10% overlap** (the share of the tokens a
head ranks in its top 10% by predicted score that are also in the top 10% by label, per layer and
KV head) are recorded. Outputs: ``checkpoints/`` (Orbax), ``metrics.json``, ``loss.png`` and the
heads as a ``"locret"`` artifact (``heads.npz``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.artifacts import save_artifact
from kvjax.reports import figure, save_figure
from kvjax.retaining_heads import apply_head, heads_artifact, init_heads
from kvjax.train.dataset import open_dataset


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (the paper's values where they apply).

    ``hidden`` is d_R (the paper's 1024; see ``kvjax train-locret --help`` for the shipped size),
    ``steps`` the optimiser steps at batch 1, ``heldout`` the last samples of the dataset kept out
    of training for evaluation.
    """

    hidden: int = 128
    steps: int = 1000
    lr: float = 5e-4
    warmup_fraction: float = 2 / 3
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.0
    clip: float = 0.5
    alpha: float = 0.0025
    label_norm: str = "standardize"
    heldout: int = 8
    eval_every: int = 100
    checkpoint_every: int = 100
    seed: int = 0

    def __post_init__(self):
        if self.steps <= 0 or self.hidden <= 0:
            raise ValueError(f"steps and hidden must be > 0, got {self.steps}, {self.hidden}")
        if not 0.0 <= self.warmup_fraction <= 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1], got {self.warmup_fraction}")
        if self.heldout < 0 or self.eval_every <= 0 or self.checkpoint_every <= 0:
            raise ValueError("heldout must be >= 0; eval_every and checkpoint_every > 0")
        if self.label_norm not in LABEL_NORMS:
            raise ValueError(f"label_norm must be one of {', '.join(LABEL_NORMS)}, got {self.label_norm!r}")


LABEL_NORMS = ("none", "standardize")


def standardize_labels(labels, mask, eps: float = 1e-6):
    """``labels[L, H_kv, N]`` with zero mean and unit standard deviation per (layer, KV head) over ``mask[N]``'s tokens."""
    m = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    mean = jnp.sum(labels * m, axis=-1, keepdims=True) / n
    std = jnp.sqrt(jnp.sum(jnp.square(labels - mean) * m, axis=-1, keepdims=True) / n)
    return (labels - mean) / jnp.maximum(std, eps) * m


def smooth_l1(pred, target, beta: float = 1.0):
    """Element-wise SmoothL1 (Huber with ``beta``, PyTorch's definition)."""
    d = jnp.abs(pred - target)
    return jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


def predict(heads, features):
    """Scores ``[L, N, H_kv]`` of every layer's head for ``features[L, N, F]``."""
    return jax.vmap(apply_head)(heads["w1"], heads["w2"], features)


def loss_fn(heads, features, labels, mask, alpha: float, label_norm: str):
    """(total loss, per-layer regression loss ``[L]``) of one sample: SmoothL1 + ``alpha`` x adjacent L2, summed over layers.

    ``features[L, N, F]``, ``labels[L, H_kv, N]``, ``mask[N]`` (prompt tokens); ``label_norm``: "none"
    (the raw labels, the paper) or "standardize" (:func:`standardize_labels`).
    """
    if label_norm == "standardize":
        labels = standardize_labels(labels, mask)
    elif label_norm != "none":
        raise ValueError(f"label_norm must be one of {', '.join(LABEL_NORMS)}, got {label_norm!r}")
    pred = predict(heads, features).swapaxes(1, 2)  # [L, Hkv, N]
    m = mask.astype(jnp.float32)
    Hkv = pred.shape[1]
    reg = jnp.sum(smooth_l1(pred, labels) * m, axis=(1, 2)) / (jnp.sum(m) * Hkv)
    pair = m[1:] * m[:-1]
    smooth = jnp.sum(jnp.square(pred[..., 1:] - pred[..., :-1]) * pair, axis=(1, 2)) / (jnp.maximum(jnp.sum(pair), 1.0) * Hkv)
    return jnp.sum(reg + alpha * smooth), reg


def top_overlap(pred, labels, mask, fraction: float = 0.1):
    """Per (layer, KV head) overlap ``[L, H_kv]`` of the top ``fraction`` prompt tokens by prediction and by label."""
    n = int(mask.sum())
    k = max(1, int(round(fraction * n)))
    idx = np.flatnonzero(mask)
    p, y = pred[..., idx], labels[..., idx]
    top_p = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    top_y = np.argsort(-y, axis=-1, kind="stable")[..., :k]
    hit = np.zeros(p.shape, bool)
    np.put_along_axis(hit, top_y, True, axis=-1)
    return np.take_along_axis(hit, top_p, axis=-1).mean(axis=-1)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Value clipping, then AdamW under linear warmup + linear decay."""
    warm = int(round(cfg.warmup_fraction * cfg.steps))
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, max(warm, 1)), optax.linear_schedule(cfg.lr, 0.0, max(cfg.steps - warm, 1))],
        [max(warm, 1)])
    return optax.chain(optax.clip(cfg.clip),
                       optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def make_step(cfg: TrainConfig):
    """The jitted train step ``(heads, opt_state, features, labels, mask) -> (heads, opt_state, loss)``."""
    opt = make_optimizer(cfg)

    @jax.jit
    def step(heads, opt_state, features, labels, mask):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(heads, features.astype(jnp.float32), labels, mask,
                                                                      cfg.alpha, cfg.label_norm)
        updates, opt_state = opt.update(grads, opt_state, heads)
        return optax.apply_updates(heads, updates), opt_state, loss

    return opt, step


def sample_order(n_train: int, seed: int, step: int) -> int:
    """Training sample of ``step``: a fresh permutation of the samples every epoch, from ``(seed, epoch)``."""
    epoch, i = divmod(step, n_train)
    return int(np.random.default_rng([seed, epoch]).permutation(n_train)[i])


@functools.partial(jax.jit, static_argnames=("alpha", "label_norm"))
def _loss_and_prediction(heads, features, labels, mask, alpha: float, label_norm: str):
    """One held-out sample's loss and scores ``[L, N, H_kv]``, in one compiled call (the heads run once)."""
    return loss_fn(heads, features, labels, mask, alpha, label_norm)[0], predict(heads, features)


def evaluate(heads, features, labels, mask, indices, alpha: float, label_norm: str) -> dict:
    """Held-out loss and top-10% overlap (mean, and per layer) over the samples ``indices``."""
    losses, overlaps = [], []
    for i in indices:
        loss, pred = _loss_and_prediction(heads, jnp.asarray(features[i], jnp.float32), jnp.asarray(labels[i]),
                                          jnp.asarray(mask[i]), alpha, label_norm)
        losses.append(float(loss))
        overlaps.append(top_overlap(np.asarray(pred).swapaxes(1, 2), np.asarray(labels[i]), np.asarray(mask[i])))
    per_layer = np.mean(overlaps, axis=(0, 2)) if overlaps else np.zeros(0)
    return {"loss": float(np.mean(losses)) if losses else float("nan"),
            "top10_overlap": float(per_layer.mean()) if overlaps else float("nan"),
            "top10_overlap_per_layer": [round(float(x), 4) for x in per_layer]}


def _manager(out: Path, cfg: TrainConfig):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        (out / "checkpoints").absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=cfg.checkpoint_every, create=True),
    )


def train(dataset, out, cfg: TrainConfig = TrainConfig(), *, resume: bool = True, progress: bool = False,
          stop_after: int | None = None) -> dict:
    """Train heads on the dataset directory ``dataset``; write checkpoints, metrics, a loss plot and ``heads.npz`` to ``out``.

    ``resume``: continue from the latest checkpoint in ``out`` (the same config is required).
    ``stop_after``: stop (after checkpointing) once this many steps are done, as an interruption
    would (tests of exact resume). Returns the metrics dict (also ``metrics.json``).
    """
    import orbax.checkpoint as ocp

    features, labels, mask, meta = open_dataset(dataset)
    n = meta["samples"]
    n_train = n - cfg.heldout
    if n_train <= 0:
        raise ValueError(f"the training set has {n} samples; {cfg.heldout} held out leave none to train on")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    f_cfg = out / "config.json"
    run_cfg = {"train": dataclasses.asdict(cfg), "dataset": str(Path(dataset).absolute()), "model_id": meta["model_id"]}
    if f_cfg.exists() and resume and json.loads(f_cfg.read_text()) != json.loads(json.dumps(run_cfg)):
        raise ValueError(f"{out} holds a run with another configuration ({f_cfg}); use another --out or drop --resume")
    f_cfg.write_text(json.dumps(run_cfg, indent=1))

    heads = init_heads(meta["num_layers"], meta["features"], meta["num_kv_heads"], cfg.hidden, cfg.seed)
    opt, step_fn = make_step(cfg)
    opt_state = opt.init(heads)
    history = {"step": [], "loss": [], "eval": []}
    start = 0
    mgr = _manager(out, cfg)
    if resume and mgr.latest_step() is not None:
        start = mgr.latest_step()
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), {"heads": heads, "opt": opt_state})
        restored = mgr.restore(start, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                             history=ocp.args.JsonRestore()))
        heads, opt_state, history = restored.state["heads"], restored.state["opt"], restored.history
    heldout = list(range(n_train, n))
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    steps = range(start, end)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = steps = tqdm(steps, desc="train retaining heads", unit="step", initial=start, total=cfg.steps)
    t0 = time.time()
    for s in steps:
        i = sample_order(n_train, cfg.seed, s)
        heads, opt_state, loss = step_fn(heads, opt_state, jnp.asarray(features[i]), jnp.asarray(labels[i]), jnp.asarray(mask[i]))
        history["step"].append(s + 1)
        history["loss"].append(float(loss))
        if bar is not None:
            bar.set_postfix(loss=f"{float(loss):.4f}")
        if (s + 1) % cfg.eval_every == 0 or s + 1 == cfg.steps:
            history["eval"].append({"step": s + 1, **evaluate(heads, features, labels, mask, heldout, cfg.alpha, cfg.label_norm)})
        if (s + 1) % cfg.checkpoint_every == 0 or s + 1 == end:
            mgr.save(s + 1, args=ocp.args.Composite(state=ocp.args.StandardSave({"heads": heads, "opt": opt_state}),
                                                    history=ocp.args.JsonSave(history)), force=True)
    mgr.wait_until_finished()
    wall = time.time() - t0
    metrics = {"steps_done": end, "steps": cfg.steps, "wall_seconds_this_run": round(wall, 1),
               "train_samples": n_train, "heldout_samples": len(heldout), "final_train_loss_mean_last_50":
               float(np.mean(history["loss"][-50:])) if history["loss"] else None,
               "eval": history["eval"], "config": dataclasses.asdict(cfg), "model_id": meta["model_id"],
               "dataset": {k: meta[k] for k in ("samples", "tokens", "answer_max", "settings")}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (out / "history.json").write_text(json.dumps(history))
    if end == cfg.steps:
        last = history["eval"][-1] if history["eval"] else {}
        art = heads_artifact(heads, meta["model_id"], trained=True, steps=cfg.steps, hidden_size=cfg.hidden,
                             train_samples=n_train, tokens=meta["tokens"], seed=cfg.seed, label_norm=cfg.label_norm,
                             heldout_top10_overlap=last.get("top10_overlap", float("nan")))
        save_artifact(art, out / "heads.npz")
        plot_history(history, out / "loss.png", title=f"Locret retaining heads, {meta['model_id'].split(':')[0]}")
    return metrics


def plot_history(history: dict, path, title: str) -> None:
    """Training loss (raw and a 50-step mean) and held-out loss / top-10% overlap against steps, as a PNG."""
    fig = figure((10, 3.8))
    a, b = fig.subplots(1, 2)
    steps, loss = np.asarray(history["step"]), np.asarray(history["loss"])
    a.plot(steps, loss, alpha=0.3, label="train (per step)")
    if len(loss) >= 50:
        a.plot(steps[49:], np.convolve(loss, np.ones(50) / 50, mode="valid"), label="train (50-step mean)")
    ev = history["eval"]
    if ev:
        a.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o-", label="held-out")
        b.plot([e["step"] for e in ev], [e["top10_overlap"] for e in ev], "o-")
    a.set_xlabel("step"), a.set_ylabel("loss (sum over layers)"), a.set_yscale("log"), a.legend()
    b.set_xlabel("step"), b.set_ylabel("held-out top-10% overlap"), b.set_ylim(0, 1)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=110, tight=False)


__all__ = ["TrainConfig", "LABEL_NORMS", "standardize_labels", "smooth_l1", "predict", "loss_fn", "top_overlap",
           "make_optimizer", "make_step", "sample_order", "evaluate", "train", "plot_history"]
