"""KVzip through NVIDIA kvpress' own ``KVzipPress`` on the prompts of a kvjax RULER run: the peer a kvjax KVzip run is
held against (same model, same token ids, same protocol: context compressed, then the question, then greedy
decoding).

Three steps, the middle one in a separate environment with kvpress and the ``transformers`` it pins (kvpress 0.5.5
requires ``transformers < 5.3``; kvjax's environment has a newer one, so kvpress is not a kvjax dependency):

1. ``python -m research.kvpress_peer export --run RUN_DIR --out PROMPTS.jsonl`` (kvjax's environment): the run's
   RULER samples as context ids and question ids (the query-agnostic split the run used), with the tokenizer
   folder and kvjax's reconstruction-prompt ids, which the peer checks against kvpress' own.
2. ``python research/kvpress_peer.py generate --prompts PROMPTS.jsonl --budget 0.1 --out OUT.jsonl`` (the kvpress
   environment): HF ``transformers`` (float32, SDPA attention) loads the GGUF weights, prefills each context inside
   ``KVzipPress(compression_ratio=1 - budget)`` (its defaults otherwise), then prefills the question and decodes
   greedily, one sample at a time (kvpress runs KVzip at batch 1). Resumable: samples already in OUT are skipped.
3. ``python -m research.kvpress_peer score --run RUN_DIR --peer OUT.jsonl [...]`` (kvjax's environment): decodes,
   scores with RULER's metric and prints a Markdown table per task beside the run's own KVzip and full-cache records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def export(args) -> None:
    from kvjax.evals import ruler
    from kvjax.evals.records import read_jsonl
    from kvjax.models import resolve_model_path
    from kvjax.models.tokenizer import load_tokenizer, reconstruction_prompt

    with open(os.path.join(args.run, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg["suite"] != "ruler" or cfg["protocol"] != "query-agnostic":
        raise SystemExit(f"{args.run}: a query-agnostic RULER run is needed, got {cfg['suite']} / {cfg['protocol']}")
    path = resolve_model_path(cfg["model"])
    tok = load_tokenizer(path)
    rp = reconstruction_prompt(tok, chat=True)
    recorded = {(r["task"], r["length"], r["index"]): r for r in read_jsonl(os.path.join(args.run, "samples.jsonl"))}
    n = 0
    with open(args.out, "w", encoding="utf-8") as out:
        for length in cfg["lengths"]:
            for task in args.tasks or cfg["tasks"]:
                for s in ruler.make_samples(task, tok, length, cfg["samples"], cfg["split"]):
                    ids = list(s.prompt_ids)
                    r = recorded.get((task, length, s.index))
                    if r is not None and r["prompt_tokens"] != len(ids):
                        raise SystemExit(f"{task} #{s.index}: {len(ids)} tokens, the run recorded {r['prompt_tokens']}")
                    out.write(json.dumps({
                        "task": task, "length": length, "index": s.index, "answers": list(s.answers),
                        "context_ids": ids[:s.question_start], "question_ids": ids[s.question_start:],
                        "max_new_tokens": ruler.max_new_tokens(task), "model_path": path,
                        "tokenizer_dir": tok.name_or_path, "kvjax_prefix": rp.prefix, "kvjax_suffix": list(rp.suffix),
                        "kvjax_first": list(rp.first), "kvjax_later": list(rp.later),
                    }) + "\n")
                    n += 1
    print(f"{n} prompts -> {args.out}")


def generate(args) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import kvpress
    from kvpress.presses import kvzip_press

    prompts = [json.loads(line) for line in open(args.prompts, encoding="utf-8")]
    done = set()
    if os.path.exists(args.out):
        done = {(r["task"], r["length"], r["index"]) for r in map(json.loads, open(args.out, encoding="utf-8"))}
    todo = [p for p in prompts if (p["task"], p["length"], p["index"]) not in done]
    if not todo:
        print("nothing to do")
        return
    torch.set_num_threads(args.threads or os.cpu_count())
    tokenizer = AutoTokenizer.from_pretrained(todo[0]["tokenizer_dir"])

    class TokenizerShim:  # kvpress loads the tokenizer from the model's name; a GGUF model has none it can load
        @staticmethod
        def from_pretrained(*_a, **_k):
            return tokenizer

    kvzip_press.AutoTokenizer = TokenizerShim
    path = todo[0]["model_path"]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = {tokenizer.eos_token_id, *([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])}
    versions = {"kvpress": getattr(kvpress, "__version__", "0.5.5"), "transformers": transformers.__version__,
                "torch": torch.__version__}
    with open(args.out, "a", encoding="utf-8") as out:
        for i, p in enumerate(todo):
            press = kvzip_press.KVzipPress(compression_ratio=round(1 - args.budget, 6))
            ctx = torch.tensor([p["context_ids"]])
            question = torch.tensor([p["question_ids"]])
            cache = DynamicCache()
            t0 = time.perf_counter()
            with torch.inference_mode():
                with press(model):
                    model(input_ids=ctx, past_key_values=cache, use_cache=True)
                    checked = (press.prefix_length == p["kvjax_prefix"]
                               and press._suffix_ids[0].tolist() == p["kvjax_suffix"])
                compress_s = time.perf_counter() - t0
                logits = model(input_ids=question, past_key_values=cache, use_cache=True).logits[:, -1]
                ids = []
                for _ in range(p["max_new_tokens"]):
                    nxt = int(logits.argmax(-1))
                    if nxt in eos:
                        break
                    ids.append(nxt)
                    logits = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits[:, -1]
            kept = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
            evicted = sum(len(m[0]) for m in kept if m is not None)
            total = len(kept) * model.config.num_key_value_heads * ctx.shape[1]
            out.write(json.dumps({
                "task": p["task"], "length": p["length"], "index": p["index"], "budget": args.budget,
                "output_ids": ids, "context_tokens": ctx.shape[1], "kept_share": 1 - evicted / total,
                "template_matches_kvjax": checked, "compress_s": compress_s,
                "total_s": time.perf_counter() - t0, **versions,
            }) + "\n")
            out.flush()
            print(f"[{i + 1}/{len(todo)}] {p['task']} #{p['index']}: {tokenizer.decode(ids)[:60]!r} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)


def score(args) -> None:
    from collections import defaultdict

    from kvjax.evals import ruler
    from kvjax.evals.records import read_jsonl
    from kvjax.models import resolve_model_path
    from kvjax.models.tokenizer import load_tokenizer
    from kvjax.reports import table

    with open(os.path.join(args.run, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    tok = load_tokenizer(resolve_model_path(cfg["model"]))
    prompts = {(p["task"], p["length"], p["index"]): p for p in map(json.loads, open(args.prompts, encoding="utf-8"))}
    runs = defaultdict(dict)  # (method label) -> {(task, length, index): score}
    outputs = {}
    for r in read_jsonl(os.path.join(args.run, "samples.jsonl")):
        label = "full" if r["method"] == "full" else f"kvjax {r['method']} {r['budget']}"
        runs[label][(r["task"], r["length"], r["index"])] = r["score"]
        outputs[(label, r["task"], r["length"], r["index"])] = r["output"]
    mismatched = 0
    for peer in args.peer:
        for r in map(json.loads, open(peer, encoding="utf-8")):
            key = (r["task"], r["length"], r["index"])
            text = tok.decode(r["output_ids"], skip_special_tokens=True)
            label = f"kvpress kvzip {r['budget']}"
            runs[label][key] = ruler.score(r["task"], text, prompts[key]["answers"])
            outputs[(label, *key)] = text
            mismatched += not r["template_matches_kvjax"]
    keys = sorted(set.intersection(*(set(v) for v in runs.values())))
    tasks = sorted({k[0] for k in keys}, key=cfg["tasks"].index)
    labels = sorted(runs, key=lambda s: (s != "full", s.split()[-1], s))
    print(f"samples scored by every column: {len(keys)}; peer passes whose template differs from kvjax's: {mismatched}")
    rows = []
    for task in tasks + ["mean"]:
        ks = [k for k in keys if task in ("mean", k[0])]
        rows.append([task] + [f"{100 * sum(runs[lab][k] for k in ks) / len(ks):.1f}" for lab in labels])
    print("\n".join(table(["task", *labels], rows, align="l" + "r" * len(labels))))
    if args.diff:
        for k in keys:
            texts = {lab: outputs[(lab, *k)] for lab in labels if lab.endswith(args.diff)}
            if len(set(texts.values())) > 1:
                print(json.dumps({"sample": k, **texts}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    e = sub.add_parser("export", help="the run's prompts as context / question ids (kvjax's environment)")
    e.add_argument("--run", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--tasks", nargs="*", help="a subset of the run's tasks")
    g = sub.add_parser("generate", help="kvpress KVzipPress + greedy decoding (kvpress' environment)")
    g.add_argument("--prompts", required=True)
    g.add_argument("--budget", type=float, required=True, help="share of the context's KV pairs kept (1 - compression_ratio)")
    g.add_argument("--out", required=True)
    g.add_argument("--threads", type=int, default=0)
    s = sub.add_parser("score", help="RULER's metric per task beside the run's records (kvjax's environment)")
    s.add_argument("--run", required=True)
    s.add_argument("--prompts", required=True)
    s.add_argument("--peer", nargs="+", required=True)
    s.add_argument("--diff", default="", help="print the samples whose outputs differ among the columns ending so, e.g. 0.1")
    args = ap.parse_args(argv)
    {"export": export, "generate": generate, "score": score}[args.step](args)


if __name__ == "__main__":
    main(sys.argv[1:])
