"""Experiment: two-pass question prefill in the query-agnostic protocol. Pass 1 prefills the question
(leaders choose, followers are refreshed from the host); the question's tokens are then dropped from every head
(lengths rolled back) and pass 2 prefills it again over the refreshed cache. Compared with one pass, same prompts."""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from kvjax.models import load_model
from kvjax.evals.tasks import make_samples, score
from kvjax.evals.runner import batches, MAX_NEW_TOKENS, stop_token_ids
from kvjax.api import left_pad
from kvjax.cache import CacheSpec
from kvjax.decoding import compress, prefill, prefill_prompt, decode_loop
from kvjax.methods import SyncKV, HeteroCache
from kvjax.shared_prefill import cache_for, init_shared_cache

tasks = sys.argv[1].split(",")
model = load_model("qwen2.5-coder-0.5b", "float32")
tok, cfg = model.tokenizer, model.config
eos = stop_token_ids(tok)
methods = {"heterocache": HeteroCache(budget=0.25), "synckv": SyncKV(budget=0.25)}
res = []
for task in tasks:
    for batch in batches(make_samples(task, tok, 4096, 4, seed=0), 4, "query-agnostic"):
        q_len = len(batch[0].prompt_ids) - batch[0].question_start
        rows = [list(s.prompt_ids[:len(s.prompt_ids) - q_len]) for s in batch]
        question = jnp.asarray([list(s.prompt_ids[len(s.prompt_ids) - q_len:]) for s in batch], jnp.int32)
        toks, pad = left_pad(rows, tok.pad_token_id, 1024)
        L = toks.shape[1]
        max_new = MAX_NEW_TOKENS[task]
        spec = CacheSpec.for_model(cfg, len(rows), L, 2 * q_len + max_new, model.dtype, longest_row=max(len(r) for r in rows))
        staged = init_shared_cache(list(methods.values()), spec).replace(pad=jnp.asarray(pad))
        _, staged = prefill_prompt(model.graphdef, model.params, jnp.asarray(toks), staged, chunk_size=1024)
        for name, method in methods.items():
            for passes in (1, 2):
                cache = compress(cache_for(staged, method))
                start = int(cache.length)
                logits, cache = prefill(model.graphdef, model.params, question, cache)
                if passes == 2:
                    cache = cache.replace(length=jnp.asarray(start, jnp.int32), layers=tuple(
                        st.replace(paged=st.paged.replace(lengths=st.paged.lengths - q_len)) for st in cache.layers))
                    logits, cache = prefill(model.graphdef, model.params, question, cache)
                first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                gen, count, _ = decode_loop(model.graphdef, model.params, first, cache, jax.random.PRNGKey(0),
                                            max_new_tokens=max_new, eos_ids=eos)
                gen, count = np.asarray(gen), np.asarray(count)
                for b, s in enumerate(batch):
                    text = tok.decode([int(t) for t in gen[b, :count[b]] if int(t) not in eos], skip_special_tokens=True)
                    r = {"task": task, "index": s.index, "method": name, "passes": passes, "output": text,
                         "score": score(text, s.answers)}
                    res.append(r)
                    print(json.dumps(r), flush=True)
for name in methods:
    for passes in (1, 2):
        sel = [r["score"] for r in res if r["method"] == name and r["passes"] == passes]
        print(name, passes, "pass:", round(100 * float(np.mean(sel)), 1), "n =", len(sel))
