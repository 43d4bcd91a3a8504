"""SyncKV re-anchoring on a question (query-agnostic protocol), against reanchor=False, in one pass and in
two passes (the question prefilled, its tokens dropped from every head, prefilled again). Needs commit 1945237
(``SyncKV(reanchor=...)``, reverted by the next commit). Usage: python reanchor.py TASKS [BUDGET]"""
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

tasks = sys.argv[1].split(",")
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
model = load_model("qwen2.5-coder-0.5b", "float32")
tok, cfg = model.tokenizer, model.config
eos = stop_token_ids(tok)
methods = {"synckv": (SyncKV(budget=budget, reanchor=False), 1), "reanchor-sync": (SyncKV(budget=budget), 1),
           "reanchor-sync-2pass": (SyncKV(budget=budget), 2)}
res = []
for task in tasks:
    for batch in batches(make_samples(task, tok, 4096, 4, seed=0), 4, "query-agnostic"):
        q_len = len(batch[0].prompt_ids) - batch[0].question_start
        max_new = MAX_NEW_TOKENS[task]
        rows = [list(s.prompt_ids[:len(s.prompt_ids) - q_len]) for s in batch]
        question = jnp.asarray([list(s.prompt_ids[len(s.prompt_ids) - q_len:]) for s in batch], jnp.int32)
        toks, pad = left_pad(rows, tok.pad_token_id, 1024)
        spec = CacheSpec.for_model(cfg, len(rows), toks.shape[1], 2 * q_len + max_new, model.dtype, longest_row=max(len(r) for r in rows))
        staged = init_shared_cache([m for m, _ in methods.values()], spec).replace(pad=jnp.asarray(pad))
        _, staged = prefill_prompt(model.graphdef, model.params, jnp.asarray(toks), staged, chunk_size=1024)
        for name, (method, passes) in methods.items():
            cache = compress(cache_for(staged, method))
            start = int(cache.length)
            logits, cache = prefill(model.graphdef, model.params, question, cache)
            if passes == 2:
                cache = cache.replace(length=jnp.asarray(start, jnp.int32), layers=tuple(
                    st.replace(paged=st.paged.replace(lengths=st.paged.lengths - q_len)) for st in cache.layers))
                logits, cache = prefill(model.graphdef, model.params, question, cache)
            first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            gen, count, cache = decode_loop(model.graphdef, model.params, first, cache, jax.random.PRNGKey(0),
                                            max_new_tokens=max_new, eos_ids=eos)
            st = cache.stats()
            gen, count = np.asarray(gen), np.asarray(count)
            for b, s in enumerate(batch):
                text = tok.decode([int(t) for t in gen[b, :count[b]] if int(t) not in eos], skip_special_tokens=True)
                r = {"task": task, "index": s.index, "method": name, "output": text, "answer": s.answers,
                     "score": score(text, s.answers), "rows_recalled": st["rows_recalled"]}
                res.append(r)
                print(json.dumps(r), flush=True)
for name in methods:
    sel = [r["score"] for r in res if r["method"] == name]
    print(name, round(100 * float(np.mean(sel)), 1), "n =", len(sel))
