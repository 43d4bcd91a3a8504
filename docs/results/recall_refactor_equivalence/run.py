"""Record tokens and recall stats of HeteroCache/SyncKV under three schedules, both protocols, to compare two versions
of the code: ``python docs/results/recall_refactor_equivalence/run.py OUT.json`` from each version's checkout (the
prompts are README.md as of commit 2c37c23, read with git)."""
import json, os, subprocess, sys, time
import numpy as np
import jax
from kvjax.api import load, generate_tokens
from kvjax.methods import get_method

out_path = sys.argv[1]
model = load()
tok = model.tokenizer
text = subprocess.run(["git", "show", "2c37c23:README.md"], capture_output=True, text=True, check=True).stdout
ids = tok.encode(text)
rows = [ids[:1200], ids[300:1200]]
question = [tok.encode(" What is the command that runs the tests? Answer:")] * 2
n = min(len(q) for q in question); question = [q[:n] for q in question]
configs = []
for sched in ("whole", "spread", "pipelined"):
    configs += [f"heterocache:budget=0.25:recall_schedule={sched}",
                f"heterocache:budget=0.1:group_layers=24:reanchor=true:rehearsals=2:prefill_from_pivot=true:tau_drift=0.9:window=3:recall_schedule={sched}",
                f"synckv:budget=0.25:recall_schedule={sched}",
                f"synckv:budget=0.1:kernel=7:group_layers=24:rehearsals=2:stride=2:recall_schedule={sched}"]
res = json.load(open(out_path)) if os.path.exists(out_path) else {}
for spec in configs:
    for proto in ("aware", "agnostic"):
        if f"{spec}|{proto}" in res: continue
        t0 = time.time()
        out, count, cache, _ = generate_tokens(model, rows, method=get_method(spec), max_new_tokens=20,
                                               question_rows=question if proto == "agnostic" else None)
        st = cache.stats()
        keep = {k: st[k] for k in ("recall_events", "rows_recalled", "decode_steps") if k in st}
        res[f"{spec}|{proto}"] = {"tokens": np.asarray(out).tolist(), **keep}
        print(spec, proto, keep, f"{time.time()-t0:.1f}s", flush=True)
        json.dump(res, open(out_path, "w"), indent=1)
