"""Oracle: query-agnostic protocol, but the compression chooses with the question's last query
(swapped into the context-only staging) instead of the context's last query. The question is still prefilled
over the compressed cache. Tells whether selection (fixable by recall) or the question's states are the gap."""
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

def staged_for(rows, extra):
    toks, pad = left_pad(rows, tok.pad_token_id, 1024)
    spec = CacheSpec.for_model(cfg, len(rows), toks.shape[1], extra, model.dtype, longest_row=max(len(r) for r in rows))
    staged = init_shared_cache(list(methods.values()), spec).replace(pad=jnp.asarray(pad))
    _, staged = prefill_prompt(model.graphdef, model.params, jnp.asarray(toks), staged, chunk_size=1024)
    return staged

for task in tasks:
    for batch in batches(make_samples(task, tok, 4096, 4, seed=0), 4, "query-agnostic"):
        q_len = len(batch[0].prompt_ids) - batch[0].question_start
        max_new = MAX_NEW_TOKENS[task]
        ctx_rows = [list(s.prompt_ids[:len(s.prompt_ids) - q_len]) for s in batch]
        full_rows = [list(s.prompt_ids) for s in batch]
        question = jnp.asarray([r[len(r) - q_len:] for r in full_rows], jnp.int32)
        staged = staged_for(ctx_rows, q_len + max_new)
        full = staged_for(full_rows, max_new)
        qwin = [st.q_window for st in full.layers]
        del full
        oracle = staged.replace(layers=tuple(st.replace(q_window=w) for st, w in zip(staged.layers, qwin)))
        for name, method in methods.items():
            for variant, src in (("shipped", staged), ("oracle", oracle)):
                cache = compress(cache_for(src, method))
                logits, cache = prefill(model.graphdef, model.params, question, cache)
                first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                gen, count, _ = decode_loop(model.graphdef, model.params, first, cache, jax.random.PRNGKey(0),
                                            max_new_tokens=max_new, eos_ids=eos)
                gen, count = np.asarray(gen), np.asarray(count)
                for b, s in enumerate(batch):
                    text = tok.decode([int(t) for t in gen[b, :count[b]] if int(t) not in eos], skip_special_tokens=True)
                    r = {"task": task, "index": s.index, "method": name, "variant": variant, "output": text,
                         "score": score(text, s.answers)}
                    res.append(r)
                    print(json.dumps(r), flush=True)
for name in methods:
    for variant in ("shipped", "oracle"):
        sel = [r["score"] for r in res if r["method"] == name and r["variant"] == variant]
        print(name, variant, round(100 * float(np.mean(sel)), 1), "n =", len(sel))
