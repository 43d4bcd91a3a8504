"""Diagnosis: in the query-agnostic protocol, which KV heads attend to the needle (full cache, question in
the prompt), and do those heads hold the needle after SyncKV / HeteroCache recall for the question?"""
import sys
import numpy as np, jax.numpy as jnp
from kvjax.models import load_model
from kvjax.evals.tasks import make_samples
from kvjax.evals.runner import batches
from kvjax.cache import CacheSpec
from kvjax.decoding import compress, prefill, prefill_prompt
from kvjax.methods import SyncKV, HeteroCache
from kvjax.shared_prefill import cache_for, init_shared_cache
from kvjax.api import left_pad
from kvjax.methods.recall.scores import last_query_probs

task = sys.argv[1] if len(sys.argv) > 1 else "niah_single"
model = load_model("qwen2.5-coder-0.5b", "float32")
tok = model.tokenizer
samples = make_samples(task, tok, 4096, 4, seed=0)
batch = batches(samples, 4, "query-agnostic")[0]
q_len = len(batch[0].prompt_ids) - batch[0].question_start
cfg = model.config
H, L_layers = cfg.num_kv_heads, cfg.num_layers
pad_id = tok.pad_token_id

def needle_positions(ids, answer):
    for variant in (answer, " " + answer):
        t = tok.encode(variant, add_special_tokens=False)
        for i in range(len(ids) - len(t) + 1):
            if list(ids[i:i + len(t)]) == t:
                return list(range(i, i + len(t)))
    raise ValueError("needle not found")

def run_prefill(rows, methods, extra):
    toks, pad = left_pad(rows, pad_id, 1024)
    L = toks.shape[1]
    spec = CacheSpec.for_model(cfg, len(rows), L, extra, model.dtype, longest_row=max(len(r) for r in rows))
    staged = init_shared_cache(methods, spec).replace(pad=jnp.asarray(pad))
    _, staged = prefill_prompt(model.graphdef, model.params, jnp.asarray(toks), staged, chunk_size=1024)
    return staged, pad, L

# 1) full prompt (context + question): the last query's attention on the needle, per layer and KV head (group max)
full_rows = [list(s.prompt_ids) for s in batch]
staged, pad_f, Lf = run_prefill(full_rows, [SyncKV(budget=0.25)], 16)
needle_f = [[pad_f[b] + p for p in needle_positions(s.prompt_ids, s.answers[0])] for b, s in enumerate(batch)]
mass = np.zeros((len(batch), L_layers, H))
for l in range(L_layers):
    probs = np.asarray(last_query_probs(staged.layers[l], staged.pad, Lf))  # [B, Hq, S]
    G = probs.shape[1] // H
    for b in range(len(batch)):
        m = probs[b][:, needle_f[b]].sum(-1).reshape(H, G).max(-1)
        mass[b, l] = m
del staged
# 2) context only, compressed, then the question prefilled (as the eval)
ctx_rows = [list(s.prompt_ids[:len(s.prompt_ids) - q_len]) for s in batch]
question = np.asarray([list(s.prompt_ids[len(s.prompt_ids) - q_len:]) for s in batch], np.int32)
methods = {"synckv": SyncKV(budget=0.25), "heterocache": HeteroCache(budget=0.25)}
staged, pad_c, Lc = run_prefill(ctx_rows, list(methods.values()), q_len + 16)
needle_c = [[pad_c[b] + p for p in needle_positions(s.prompt_ids, s.answers[0])] for b, s in enumerate(batch)]
K = [np.asarray(staged.layers[l].k) for l in range(L_layers)]  # [B, H, S, D]
keysets = {}  # (layer, row, head) -> {key row bytes: prompt slot}


def held(state, b, h, l):
    """Prompt slots whose keys head ``h`` of row ``b`` holds (matched by exact key rows)."""
    p = state.paged
    n = int(p.lengths[b, h])
    rows = np.asarray(p.k_pages[p.block_table[b, h]]).reshape(-1, p.k_pages.shape[-1])[:n]
    if (l, b, h) not in keysets:
        ks = K[l][b, h]
        keysets[l, b, h] = {ks[j].tobytes(): j for j in range(ks.shape[0])}
    keyset = keysets[l, b, h]
    return {keyset[r.tobytes()] for r in rows if r.tobytes() in keyset}


for name, method in methods.items():
    cache = compress(cache_for(staged, method))
    before = {}
    plans = [st.plan for st in cache.layers]
    for b in range(len(batch)):
        for l in range(L_layers):
            for h in range(H):
                before[b, l, h] = len(held(cache.layers[l], b, h, l) & set(needle_c[b])) / len(needle_c[b])
    _, cache = prefill(model.graphdef, model.params, jnp.asarray(question), cache)
    rows = []
    for b in range(len(batch)):
        order = np.argsort(-mass[b].ravel())[:8]
        for o in order:
            l, h = divmod(int(o), H)
            after = len(held(cache.layers[l], b, h, l) & set(needle_c[b])) / len(needle_c[b])
            plan = plans[l]
            role = "full" if h in plan.full else ("follower" if h in [f.head for f in plan.followers] else "static")
            rows.append((b, l, h, round(float(mass[b, l, h]), 3), role, round(before[b, l, h], 2), round(after, 2)))
    print(name, "stats", {k: v for k, v in cache.stats().items() if k in ("recall_events", "rows_recalled", "full_heads", "follower_heads")})
    for r in rows:
        print(name, "row %d L%02d h%d needle-mass %.3f %-8s held before %.2f after %.2f" % r)
    del cache
