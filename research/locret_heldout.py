"""Held-out loss and top-10% overlap of a Locret heads file on the last ``N`` samples of a training set.

``python -m research.locret_heldout HEADS.npz DATASET_DIR N`` prints one JSON line. The dataset is a
``kvjax train-locret`` training set (``kvjax.train.dataset``); rebuilt from the same seed it holds the same samples,
so heads trained apart are scored on the same held-out prompts with the loss the training reports (``TrainConfig``'s
alpha and label normalisation).
"""

from __future__ import annotations

import argparse
import json
import sys


def heldout(heads_path: str, data: str, n_held: int) -> dict:
    """``{"heads", "top10_overlap", "loss"}`` of the heads at ``heads_path`` on the last ``n_held`` samples of ``data``."""
    import jax.numpy as jnp

    from kvjax.artifacts import load_artifact
    from kvjax.train.dataset import open_dataset
    from kvjax.train.locret import TrainConfig, evaluate

    art = load_artifact(heads_path)
    heads = {"w1": jnp.asarray(art.arrays["w1"], jnp.float32), "w2": jnp.asarray(art.arrays["w2"], jnp.float32)}
    features, labels, mask, meta = open_dataset(data)
    n = meta["samples"]
    if not 1 <= n_held <= n:
        raise SystemExit(f"N must be between 1 and the set's {n} samples, got {n_held}")
    cfg = TrainConfig()  # the loss settings the heads were trained with (alpha 0.0025, standardised labels)
    r = evaluate(heads, features, labels, mask, list(range(n - n_held, n)), cfg.alpha, cfg.label_norm)
    return {"heads": heads_path, "top10_overlap": round(r["top10_overlap"], 4), "loss": round(r["loss"], 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.locret_heldout", description=__doc__.splitlines()[0])
    p.add_argument("heads", help="heads .npz (kvjax train-locret's heads.npz, or a shipped one)")
    p.add_argument("data", help="training set directory (~/.cache/kvjax/locret-data/<model>-<samples>x<tokens>-...)")
    p.add_argument("n", type=int, help="held-out samples: the set's last N")
    args = p.parse_args(argv)
    print(json.dumps(heldout(args.heads, args.data, args.n)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
