"""Experiments: SyncKV (kernel=7, one R-head for the whole model), query-agnostic, the 4K suite's prompts of
one task: which variant answers. Run from the repository root: ``python <this file> EXPERIMENT niah_multikey 0.1``.

EXPERIMENT: ``stride`` (m = 5 shipped, 1, 10**6: never after the question), ``window`` (re-anchoring scored by the
question's last 8 or 32 queries), ``passes`` (two rehearsals before the pass that counts, ``rehearsals=2``,
re-anchoring from the last 1 or 8 queries). Outputs: ``<experiment>_output.txt`` (one JSON line per answer; ``raw``
keeps the stop token). They were made with three copies of this script, one per experiment, merged afterwards; the
``passes`` copy called ``rehearse_jit`` twice and ``prefill_jit`` by hand, which :func:`kvjax.decoding.prefill` now
does for ``rehearsals=2``.
"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from kvjax.models import load_model
from kvjax.evals.tasks import make_samples, score
from kvjax.evals.runner import batches, MAX_NEW_TOKENS, stop_token_ids
from kvjax.api import left_pad
from kvjax.cache import CacheSpec
from kvjax.decoding import compress, prefill, prefill_prompt, decode_loop
from kvjax.methods import SyncKV
from kvjax.shared_prefill import cache_for, init_shared_cache

experiment, task, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
base = dict(budget=budget, kernel=7, group_layers=24)
variants = {
    "stride": {f"stride{s}": SyncKV(**base, stride=s) for s in (5, 1, 10**6)},
    "window": {f"qw{w}": SyncKV(**base, question_window=w) for w in (8, 32)},
    "passes": {f"p3qw{w}": SyncKV(**base, rehearsals=2, question_window=w) for w in (1, 8)},
}[experiment]
model = load_model("qwen2.5-coder-0.5b", "float32")
tok, cfg = model.tokenizer, model.config
eos = stop_token_ids(tok)
res = []
for batch in batches(make_samples(task, tok, 4096, 16, seed=0), 4, "query-agnostic"):
    q_len = len(batch[0].prompt_ids) - batch[0].question_start
    rows = [list(s.prompt_ids[:len(s.prompt_ids) - q_len]) for s in batch]
    question = jnp.asarray([list(s.prompt_ids[len(s.prompt_ids) - q_len:]) for s in batch], jnp.int32)
    toks, pad = left_pad(rows, tok.pad_token_id, 1024)
    L = toks.shape[1]
    max_new = MAX_NEW_TOKENS[task]
    spec = CacheSpec.for_model(cfg, len(rows), L, q_len + max_new, model.dtype, longest_row=max(len(r) for r in rows))
    staged = init_shared_cache(list(variants.values()), spec).replace(pad=jnp.asarray(pad))
    _, staged = prefill_prompt(model.graphdef, model.params, jnp.asarray(toks), staged, chunk_size=1024)
    for name, method in variants.items():
        cache = compress(cache_for(staged, method))
        logits, cache = prefill(model.graphdef, model.params, question, cache)  # question_passes() passes
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        gen, count, _ = decode_loop(model.graphdef, model.params, first, cache, jax.random.PRNGKey(0),
                                    max_new_tokens=max_new, eos_ids=eos)
        gen, count = np.asarray(gen), np.asarray(count)
        for b, s in enumerate(batch):
            ids = [int(t) for t in gen[b, :count[b]]]
            text = tok.decode([t for t in ids if t not in eos], skip_special_tokens=True)
            r = {"task": task, "index": s.index, "variant": name, "output": text, "raw": tok.decode(ids),
                 "answers": list(s.answers), "score": score(text, s.answers)}
            res.append(r)
            print(json.dumps(r), flush=True)
        jax.clear_caches()
for name in variants:
    sel = [r["score"] for r in res if r["variant"] == name]
    print(name, round(100 * float(np.mean(sel)), 1), "n =", len(sel), flush=True)
