"""The on-disk training set of Locret's retaining heads: features and labels of every sample, computed once.

The frozen model's forward dominates the cost of training the heads (a 0.5B model over 1K tokens
takes ~10 s on a 2-core CPU; one optimiser step of the heads well under a second), and the heads
never change the model's activations, so each sample's inputs and targets are computed once
(:func:`kvjax.train.labels.collect`) and stored:

* ``features.npy`` float16 ``[n, L, N, F]`` (memory-mapped; the heads' inputs, pre-RoPE [Q, K, V]);
* ``labels.npy`` float32 ``[n, L, H_kv, N]``: the ``target``'s (``"attention"``: the paper's causal importance from the
  answer; ``"reconstruction"``: the logarithm of KVzip's query-agnostic score, :mod:`kvjax.train.labels`);
* ``mask.npy`` bool ``[n, N]``: the prompt tokens (left padding and the answer are not trained on);
* ``dataset.json``: model identity, layout (``N = tokens + answer_max``), data settings and progress.

Building is resumable (samples already written are skipped) and deterministic from the seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvjax.artifacts import model_identity
from kvjax.retaining_heads import feature_size
from kvjax.train.labels import collect, reconstruction_labels

FORMAT = 1


def dataset_meta(path) -> dict:
    """The ``dataset.json`` of a dataset directory (clear error when there is none)."""
    f = Path(path) / "dataset.json"
    if not f.exists():
        raise ValueError(f"{path} is not a Locret training set (no dataset.json); build one with kvjax.train.dataset.build_dataset")
    return json.loads(f.read_text())


TARGETS = ("attention", "reconstruction")


def build_dataset(model, samples, path, *, tokens: int, answer_max: int, settings: dict | None = None,
                  progress: bool = False, target: str = "attention", reconstruction=None) -> dict:
    """Write the features, labels and masks of ``samples`` (:class:`kvjax.train.data.QASample`) under ``path``.

    Each sample is laid out at ``N = tokens + answer_max`` slots (prompt left-padded, answer last;
    answers longer than ``answer_max`` tokens are cut: only their first tokens label the prompt).
    ``settings`` (the data generator's arguments) is recorded. ``target``: "attention" (the paper's labels) or
    "reconstruction" (KVzip's scores; ``reconstruction`` is then the model's reconstruction prompt,
    ``kvjax.models.tokenizer.reconstruction_prompt(tokenizer, chat=True)``). Returns the dataset's metadata.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; allowed: {', '.join(TARGETS)}")
    if (target == "reconstruction") != (reconstruction is not None):
        raise ValueError("the reconstruction target needs the model's reconstruction prompt (and only it does)")
    c = model.config
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    n, N = len(samples), tokens + answer_max
    shape_f = (n, c.num_layers, N, feature_size(c.num_heads, c.num_kv_heads, c.head_dim))
    meta = {"format": FORMAT, "model_id": model_identity(c), "samples": n, "tokens": tokens, "answer_max": answer_max,
            "length": N, "num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "features": shape_f[-1],
            "settings": settings or {}, "kinds": [s.kind for s in samples], "target": target, "done": 0}
    f_meta = path / "dataset.json"
    if f_meta.exists():
        old = json.loads(f_meta.read_text())
        old.setdefault("target", "attention")  # datasets written before targets existed
        if {k: old.get(k) for k in meta if k != "done"} != {k: v for k, v in meta.items() if k != "done"}:
            raise ValueError(f"{path} holds a different training set ({f_meta}); use another directory")
        meta["done"] = old["done"]
    mode = "r+" if meta["done"] else "w+"
    feats = np.lib.format.open_memmap(path / "features.npy", mode=mode, dtype=np.float16, shape=shape_f)
    labels = np.lib.format.open_memmap(path / "labels.npy", mode=mode, dtype=np.float32,
                                       shape=(n, c.num_layers, c.num_kv_heads, N))
    mask = np.lib.format.open_memmap(path / "mask.npy", mode=mode, dtype=bool, shape=(n, N))
    f_meta.write_text(json.dumps(meta, indent=1))
    todo = range(meta["done"], n)
    if progress:
        from tqdm import tqdm

        todo = tqdm(todo, desc="labels (frozen model forward)", unit="sample", initial=meta["done"], total=n)
    for i in todo:
        s = samples[i]
        f, lab, pad, start = collect(model, s.prompt_ids, s.answer_ids[:answer_max], length=N, answer_max=answer_max)
        if target == "reconstruction":
            lab = reconstruction_labels(model, s.prompt_ids, length=N, pad=pad, reconstruction=reconstruction)
        feats[i] = f.astype(np.float16)
        labels[i] = lab
        mask[i] = (np.arange(N) >= pad) & (np.arange(N) < start)
        for a in (feats, labels, mask):
            a.flush()
        meta["done"] = i + 1
        f_meta.write_text(json.dumps(meta, indent=1))
    return meta


def open_dataset(path):
    """(features, labels, mask) memory-maps and the metadata of a complete dataset."""
    meta = dataset_meta(path)
    if meta["done"] != meta["samples"]:
        raise ValueError(f"the training set in {path} is incomplete ({meta['done']} of {meta['samples']} samples); "
                         "run the build again to finish it")
    path = Path(path)
    return (np.load(path / "features.npy", mmap_mode="r"), np.load(path / "labels.npy", mmap_mode="r"),
            np.load(path / "mask.npy", mmap_mode="r"), meta)


__all__ = ["build_dataset", "open_dataset", "dataset_meta", "FORMAT", "TARGETS"]
