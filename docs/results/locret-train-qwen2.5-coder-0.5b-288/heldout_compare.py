"""Held-out loss and top-10% overlap of a heads file on the last ``N`` samples of a Locret training set.

    python docs/results/locret-train-qwen2.5-coder-0.5b-288/heldout_compare.py HEADS.npz DATASET_DIR N
"""

import json
import sys

import jax.numpy as jnp

from kvjax.artifacts import load_artifact
from kvjax.train.dataset import open_dataset
from kvjax.train.locret import TrainConfig, evaluate

heads_path, data, n_held = sys.argv[1], sys.argv[2], int(sys.argv[3])
art = load_artifact(heads_path)
heads = {"w1": jnp.asarray(art.arrays["w1"], jnp.float32), "w2": jnp.asarray(art.arrays["w2"], jnp.float32)}
features, labels, mask, meta = open_dataset(data)
n = meta["samples"]
cfg = TrainConfig()  # the loss settings the heads were trained with (alpha 0.0025, standardised labels)
r = evaluate(heads, features, labels, mask, list(range(n - n_held, n)), cfg.alpha, cfg.label_norm)
print(json.dumps({"heads": heads_path, "top10_overlap": round(r["top10_overlap"], 4), "loss": round(r["loss"], 4)}))
