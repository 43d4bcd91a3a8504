"""Check: is the full cache's low score on some RULER 16K test tasks the model's, or kvjax's?

HF ``transformers`` (float32, SDPA attention, greedy) generates on the same RULER test prompts as the
``qwen2.5-coder-0.5b-ruler-16k-test-query-aware`` run, and each answer is printed beside the full cache's recorded
one. Run from the repository root: ``python -m research.full_cache_vs_transformers vt:2 niah_multikey_3:2 cwe:1``
(task:first-n-samples); one JSON line per sample on stdout.
"""
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from kvjax.evals import ruler
from kvjax.evals.records import read_jsonl
from kvjax.models import resolve_model_path
from kvjax.models.tokenizer import load_tokenizer

RUN = "docs/results/qwen2.5-coder-0.5b-ruler-16k-test-query-aware/samples.jsonl"
LENGTH, SAMPLES = 16384, 4  # the run's length and samples per task (RULER generates a set whole)

wanted = [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[1:]]
path = resolve_model_path("qwen2.5-coder-0.5b")
tokenizer = load_tokenizer(path)
recorded = {(r["task"], r["index"]): r for r in read_jsonl(RUN) if r["method"] == "full"}
hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                          dtype=torch.float32, attn_implementation="sdpa").eval()
for task, n in wanted:
    for s in ruler.make_samples(task, tokenizer, LENGTH, SAMPLES, "test")[:n]:
        start = time.time()
        ids = torch.tensor([list(s.prompt_ids)])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=ruler.max_new_tokens(task), do_sample=False)
        text = tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
        r = recorded[(task, s.index)]
        assert r["prompt_tokens"] == len(s.prompt_ids), "not the run's prompt"
        print(json.dumps({"task": task, "index": s.index, "prompt_tokens": len(s.prompt_ids),
                          "answers": list(s.answers), "transformers": text, "kvjax_full_cache": r["output"],
                          "same": ruler.postprocess(text) == ruler.postprocess(r["output"]),
                          "transformers_score": ruler.score(task, text, s.answers), "kvjax_score": r["score"],
                          "seconds": round(time.time() - start)}), flush=True)
