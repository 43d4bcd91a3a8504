"""Where a RULER sample's question attends in the context, per layer and KV head: the ranks of chosen spans.

``python -m research.question_attention --task niah_multikey_2 --index 0 [--split dev] [--length 4096]
--layers 19,20 --track debonair-grandmother --track 2469590 [--out FILE.md]``

HF ``transformers`` (float32, the ready model's GGUF weights) runs the whole prompt once; a hook takes each chosen
layer's attention input, from which the question's queries and the keys are projected and rotated as the model does.
Per (layer, KV head) the question's attention over the context is aggregated over the query group by its maximum, for
the question's last query and for any of its queries (the maximum over them), and the context positions ranked
(0 = the most attended). Printed: the rank of each token of every tracked string (its last occurrence in the
context) and the ten most attended positions. What the recall methods' leaders see when a question re-anchors them
(:mod:`research.value_spans` shows what their followers then hold).
"""

from __future__ import annotations

import os
import shlex
import sys

import numpy as np

from kvjax.reports import table, write_report


def question_ranks(hf, ids, question_start: int, layers) -> dict:
    """``{(layer, kv head, "last" | "any"): ranks[context positions]}`` of the question's attention (group maximum)."""
    import torch
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    caught = {}

    def hook(layer):
        def grab(module, args, kwargs):
            caught[layer] = (kwargs["hidden_states"], kwargs["position_embeddings"])
        return grab

    handles = [hf.model.layers[n].self_attn.register_forward_pre_hook(hook(n), with_kwargs=True) for n in layers]
    with torch.no_grad():
        hf(torch.tensor([ids]), use_cache=False)
        for h in handles:
            h.remove()
        cfg = hf.config
        D = cfg.hidden_size // cfg.num_attention_heads
        G = cfg.num_attention_heads // cfg.num_key_value_heads
        T = len(ids)
        out = {}
        for n in layers:
            x, (cos, sin) = caught[n]
            attn = hf.model.layers[n].self_attn
            q = attn.q_proj(x).view(1, T, cfg.num_attention_heads, D).transpose(1, 2)
            k = attn.k_proj(x).view(1, T, cfg.num_key_value_heads, D).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            for kv in range(cfg.num_key_value_heads):
                qg = q[0, kv * G:(kv + 1) * G, question_start:]  # [G, Tq, D]
                logits = torch.einsum("gtd,sd->gts", qg, k[0, kv]) / D**0.5
                future = torch.arange(T)[None, :] > (question_start + torch.arange(qg.shape[1]))[:, None]
                p = torch.softmax(logits.masked_fill(future[None], float("-inf")), -1)[..., :question_start]
                for which, v in (("last", p[:, -1].amax(0)), ("any", p.amax(0).amax(0))):
                    order = np.argsort(-v.numpy(), kind="stable")
                    rank = np.empty_like(order)
                    rank[order] = np.arange(len(order))
                    out[(n, kv, which)] = rank
    return out


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM

    from kvjax.evals.suites import get_suite
    from kvjax.models import resolve_model_path
    from kvjax.models.tokenizer import load_tokenizer
    from research.value_spans import ruler_sample_parser, value_tokens

    p = ruler_sample_parser("python -m research.question_attention", __doc__.splitlines()[0])
    p.add_argument("--layers", required=True, help="comma-separated layer indices")
    p.add_argument("--track", action="append", default=[], help="a string of the context (repeatable)")
    args = p.parse_args(argv)
    import torch

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    sample = get_suite("ruler").samples(args.task, tok, args.length, args.index + 1, args.split)[args.index]
    ids = list(sample.prompt_ids)
    context = ids[:sample.question_start]
    spans = {text: value_tokens(tok, context, text) for text in [*args.track, sample.answers[0]]}
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    layers = [int(x) for x in args.layers.split(",")]
    ranks = question_ranks(hf, ids, sample.question_start, layers)
    lines = [f"# Question attention: RULER {args.split} `{args.task}` #{args.index}, {len(context)} context tokens", "",
             "Command: `python -m research.question_attention "
             f"{shlex.join(argv if argv is not None else sys.argv[1:])}`",
             "", f"Answer `{sample.answers[0]}`. Rank of each token (0 = the context position the question attends "
             "most; maximum over the KV head's query group), for the question's last query and for any of its queries.",
             ""]
    rows = []
    for (n, kv, which), rank in ranks.items():
        cells = [" ".join(str(int(rank[i])) for i in span) for span in spans.values()]
        rows.append([f"L{n} head {kv}", which, *cells, " ".join(str(int(i)) for i in np.argsort(rank)[:10])])
    lines += table(["pair", "queries", *(f"`{t}` (tokens {s[0]}-{s[-1]})" for t, s in spans.items()),
                    "10 most attended positions"], rows)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
