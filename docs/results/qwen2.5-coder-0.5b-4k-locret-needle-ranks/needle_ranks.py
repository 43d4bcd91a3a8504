"""Where the retaining heads rank each needle of the evaluation's prompts, against the true labels.

For each prompt of ``--task`` at ``--length`` (the evaluation's prompts: ``kvjax.evals.tasks.make_samples``,
seed 0), one forward of the frozen model over prompt + gold answer (``kvjax.train.labels.collect``) gives
each prompt token's retaining-head input and its true label (the largest pre-softmax attention logit
from the answer's tokens, per KV head). The heads' predicted scores and the labels each rank the
evictable tokens (all but the last ``local``) per layer and KV head; a head "keeps" a needle's value
when every token of the value ranks inside ``b = budget * n - local``. This is a static ranking of the
whole prompt: Locret's chunked schedule also forces stabilizers and scores tokens over an already
compressed cache, so it is an explanation, not a replay.

    python docs/results/qwen2.5-coder-0.5b-4k-locret-needle-ranks/needle_ranks.py \
        --task niah_multikey --length 4096 [--heads runs/x/heads.npz] [--pool 7]

``--pool k`` ranks the predicted scores after Locret's ``pool=k`` (max over ``k`` neighbours within each
chunk of ``--chunk`` tokens, :func:`kvjax.methods.locret.pool_within_pieces`); the labels stay unpooled.
"""

import argparse
import re

import jax.numpy as jnp
import numpy as np

import models
from kvjax.evals.tasks import make_samples
from kvjax.artifacts import installed_artifact, load_artifact, model_identity
from kvjax.methods.locret import pool_within_pieces
from kvjax.retaining_heads import KIND
from kvjax.train.labels import collect
from kvjax.train.locret import predict

p = argparse.ArgumentParser()
p.add_argument("--model", default="qwen2.5-coder-0.5b")
p.add_argument("--task", default="niah_multikey")
p.add_argument("--length", type=int, default=4096)
p.add_argument("--samples", type=int, default=4)
p.add_argument("--budgets", default="0.1,0.25")
p.add_argument("--local", type=int, default=100)
p.add_argument("--heads", default=None, help="heads .npz (default: the shipped heads)")
p.add_argument("--pool", type=int, default=1, help="max-pool the predicted scores as locret:pool=K (1: none)")
p.add_argument("--chunk", type=int, default=1024, help="chunk (B) of the pooling's pieces")
args = p.parse_args()
budgets = [float(b) for b in args.budgets.split(",")]

model = kvjax.models.load_model(args.model)
tok = model.tokenizer
art = load_artifact(args.heads) if args.heads else installed_artifact(KIND, model_identity(model.config))
heads = {"w1": jnp.asarray(art.arrays["w1"]), "w2": jnp.asarray(art.arrays["w2"])}
NEEDLE = {"passkey": r"The pass key is (\d+)\.", "niah_single": r"special magic numbers for [\w-]+ is: (\d+)\.",
          "niah_multikey": r"special magic numbers for [\w-]+ is: (\d+)\."}[args.task]


def ranks(scores, body):
    """Rank (0 = best) of each of the first ``body`` tokens per layer and head, from scores ``[L, H, n]``."""
    order = np.argsort(-scores[..., :body], axis=-1, kind="stable")
    r = np.empty_like(order)
    np.put_along_axis(r, order, np.arange(body)[None, None], axis=-1)
    return r


print(f"model {args.model}, task {args.task} @ {args.length}, heads {args.heads or 'shipped'}, pool {args.pool}\n")
print("| prompt (depth) | needle | value tokens | " + " | ".join(
    f"heads keeping it at {b:g}: predicted / labels" for b in budgets) + " | median worst rank: predicted / labels |")
print("|---|---|---|" + "---:|" * (len(budgets) + 1))
for s in make_samples(args.task, tok, args.length, args.samples):
    ids = list(s.prompt_ids)
    pieces = [tok.decode([t]) for t in ids]
    offs = np.cumsum([0] + [len(x) for x in pieces])
    text = "".join(pieces)
    enc = tok.encode(s.answers[0])
    answer = list(getattr(enc, "ids", enc))
    feats, labels, pad, start = collect(model, ids, answer, length=len(ids) + 16, answer_max=16)
    n = len(ids)
    body = n - args.local
    pred = predict(heads, jnp.asarray(feats[:, pad:start]))  # [L, n, Hkv]
    if args.pool > 1:
        pred = pool_within_pieces(pred, jnp.ones(pred.shape[:2], bool), args.chunk, args.pool)
    pred = np.asarray(pred).transpose(0, 2, 1)
    rp, rl = ranks(pred, body), ranks(labels[:, :, pad:start], body)
    for m in re.finditer(NEEDLE, text):
        v0 = int(np.searchsorted(offs, m.start(1), side="right") - 1)
        v1 = int(np.searchsorted(offs, m.end(1), side="left"))
        which = "real" if m.group(1) == s.answers[0] else "distractor"
        if v1 > body:
            print(f"| {s.index} ({s.depth:.2f}) | {which} | {v0}-{v1} | " + " | ".join("local window" for _ in budgets) + " | - |")
            continue
        wp, wl = rp[:, :, v0:v1].max(-1), rl[:, :, v0:v1].max(-1)
        cells = []
        for b in budgets:
            keep = int(b * n) - args.local
            cells.append(f"{(wp < keep).mean():.2f} / {(wl < keep).mean():.2f}")
        print(f"| {s.index} ({s.depth:.2f}) | {which} | {v0}-{v1} | " + " | ".join(cells)
              + f" | {np.median(wp):.0f} / {np.median(wl):.0f} |", flush=True)
