"""Which tokens of a RULER needle's value a compressed cache still holds, per layer and KV head.

``python -m research.value_spans --task niah_single_1 --index 0 [--split dev] [--length 4096]
[--methods snapkv:budget=0.25,...] [--after-question] [--track TEXT ...] [--bins 0,200,...] [--out FILE.md]``

The sample's context (without the question: the query-agnostic protocol) is prefilled once and shared by the full cache
and every method (:mod:`kvjax.shared_prefill`; methods that cannot share a prefill are refused). For each method the
compressed cache's held keys are matched, row by row, to the full cache's keys of the same layer and KV head, which
gives the prompt positions each head holds. The answer's characters are located in the context by decoding it token by
token. Printed per method: for each of the value's tokens, the share of (layer, KV head) pairs holding it, and how many
pairs hold the whole value. ``--after-question``: the holdings after the question is prefilled onto the compressed
cache (what a recalling method re-anchors on it); ``--track``: other strings of the context to report the same way
(another needle's value, say the one a wrong answer gave); ``--bins``: each (layer, KV head)'s held positions counted
in those position ranges (where a set lies in the context).
"""

from __future__ import annotations

import argparse
import shlex
import sys

import numpy as np

from kvjax.reports import table, write_report

DEFAULT_METHODS = "snapkv:budget=0.1,snapkv:budget=0.25,hbw:budget=0.25,heterocache:preset=suite:budget=0.1,synckv:preset=tuned:budget=0.1"


def value_tokens(tokenizer, ids, answer: str) -> list[int]:
    """Indices into ``ids`` of the tokens whose decoded text overlaps the last occurrence of ``answer``."""
    pieces = [tokenizer.decode([t]) for t in ids]
    text = "".join(pieces)
    at = text.rfind(answer)
    if at < 0:
        raise ValueError(f"answer {answer!r} not found in the decoded context")
    out, pos = [], 0
    for i, p in enumerate(pieces):
        if pos < at + len(answer) and pos + len(p) > at:
            out.append(i)
        pos += len(p)
    return out


def held_positions(layer_state, full_k, pad: int) -> list[np.ndarray]:
    """Per KV head, the prompt positions (0 = the context's first token) whose keys the compressed layer holds, found
    by exact match against the full cache's keys ``full_k[H, S, D]`` of the same layer."""
    paged = layer_state.paged if hasattr(layer_state, "paged") else layer_state
    k_pages, table, lengths = (np.asarray(x) for x in (paged.k_pages, paged.block_table, paged.lengths))
    out = []
    for h in range(table.shape[1]):
        where = {row.tobytes(): s for s, row in enumerate(full_k[h])}
        rows = k_pages[table[0, h]].reshape(-1, k_pages.shape[-1])[: int(lengths[0, h])]
        found = (where.get(r.tobytes()) for r in rows)
        out.append(np.asarray(sorted(s - pad for s in found if s is not None and s >= pad)))
    return out


def ruler_sample_parser(prog: str, description: str, out_help: str | None = None):
    """Arguments naming one RULER sample (task, index, split, length, model) and the report file."""
    from kvjax.models import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--task", required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--split", default="dev")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", default=None, help=out_help)
    return p


def sample_parser(prog: str, description: str, default_methods: str, out_help: str | None = None):
    """Arguments shared by the scripts that compress one RULER sample's context for several methods."""
    p = ruler_sample_parser(prog, description, out_help)
    p.add_argument("--methods", default=default_methods, help="comma list of method specs with their budgets")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--after-question", action="store_true",
                   help="the holdings after the question is prefilled onto the compressed cache")
    return p


def load_sample(args):
    """(model, [(spec, method)], sample, context token ids) for parsed :func:`sample_parser` arguments; methods that
    cannot share one prefill are refused before the model loads."""
    import kvjax
    from kvjax.evals.suites import get_suite
    from kvjax.methods import get_method
    from kvjax.shared_prefill import can_share_prefill

    methods = [(spec, get_method(spec)) for spec in args.methods.split(",") if spec]
    for spec, m in methods:
        if not can_share_prefill(m):
            raise ValueError(f"{spec}: runs its own prefill; this script compares methods that share one")
    model = kvjax.load(args.model, "float32")
    sample = get_suite("ruler").samples(args.task, model.tokenizer, args.length, args.index + 1, args.split)[args.index]
    return model, methods, sample, list(sample.prompt_ids[: sample.question_start])


def question_ids(sample, args):
    """The sample's question token ids with ``--after-question``, else None."""
    return list(sample.prompt_ids[sample.question_start:]) if args.after_question else None


def held_by_method(model, context, methods, chunk_size: int, question=None) -> dict[str, list[list[set]]]:
    """spec -> per layer, per KV head, the context positions its compressed cache holds: the context is prefilled
    once, shared by the full cache and every method, and each held key is matched to the full cache's; with
    ``question`` (token ids), after that question is prefilled onto each compressed cache."""
    import jax.numpy as jnp

    from kvjax.cache import CacheSpec
    from kvjax.decoding import compress, prefill, prefill_prompt
    from kvjax.methods import FullCache
    from kvjax.methods.base import round_up
    from kvjax.shared_prefill import cache_for, init_shared_cache

    L = round_up(len(context), chunk_size)
    pad = L - len(context)
    tokens = np.full((1, L), model.tokenizer.pad_token_id or 0, np.int32)
    tokens[0, pad:] = context
    room = 64 if question is None else len(question) + 8
    spec = CacheSpec.for_model(model.config, 1, L, room, model.dtype, longest_row=len(context))
    full_method = FullCache()
    staged = init_shared_cache([full_method] + [m for _, m in methods], spec).replace(pad=jnp.asarray([pad], jnp.int32))
    _, staged = prefill_prompt(model.graphdef, model.params, jnp.asarray(tokens), staged, chunk_size=chunk_size)
    full = compress(cache_for(staged, full_method))
    full_k = [np.asarray(layer.k)[0] for layer in full.layers]  # [H, S, D]
    held = {}
    for spec_text, method in methods:
        cache = compress(cache_for(staged, method))
        if question is not None:
            _, cache = prefill(model.graphdef, model.params, jnp.asarray([question], jnp.int32), cache)
        held[spec_text] = [[set(h.tolist()) for h in held_positions(state, full_k[i], pad)]
                           for i, state in enumerate(cache.layers)]
    return held


def main(argv=None) -> int:
    parser = sample_parser("python -m research.value_spans", __doc__.splitlines()[0], DEFAULT_METHODS)
    parser.add_argument("--track", action="append", default=[],
                        help="another string of the context to report (repeatable)")
    parser.add_argument("--bins", default=None, help="comma-separated position edges: held positions per range")
    args = parser.parse_args(argv)
    model, methods, sample, context = load_sample(args)
    tok = model.tokenizer
    question = question_ids(sample, args)
    when = "after the question is prefilled onto the compressed cache" if args.after_question else "after compression"
    lines = [f"# Value tokens held: RULER {args.split} `{args.task}` #{args.index}, {len(context)} context tokens",
             "", f"Command: `python -m research.value_spans {shlex.join(argv if argv is not None else sys.argv[1:])}`",
             "", f"Held {when}. Each cell: the share of the {model.config.num_layers} x {model.config.num_kv_heads} "
             "(layer, KV head) pairs that hold the token; `whole`: pairs holding every token of the value.", ""]
    held_all = held_by_method(model, context, methods, args.chunk_size, question)
    for label, text in [("answer", sample.answers[0])] + [("tracked", t) for t in args.track]:
        span = value_tokens(tok, context, text)
        pieces = [tok.decode([context[i]]) for i in span]
        lines += [f"## The {label} `{text}`", "", f"Context tokens {span[0]}..{span[-1]} ({len(span)} tokens).", ""]
        shares, per_layer = [], []
        for spec_text, held in held_all.items():
            pairs = [s for layer in held for s in layer]
            share = [sum(i in s for s in pairs) / len(pairs) for i in span]
            whole = sum(all(i in s for i in span) for s in pairs)
            shares.append([spec_text, *(f"{x:.0%}" for x in share), whole])
            # per layer and KV head: how many of the value's tokens it holds
            per_layer.append((spec_text, [[sum(i in s for i in span) for s in layer] for layer in held]))
        lines += table(["method", *(f"`{p.strip() or repr(p)}`" for p in pieces), "whole"], shares,
                       align="l" + "r" * (len(span) + 1))
        lines += ["", f"Value tokens held (of {len(span)}) per layer, its KV heads separated by `/`:", ""]
        lines += table(["method", *(f"L{i}" for i in range(model.config.num_layers))],
                       [[spec_text, *("/".join(str(n) for n in heads) for heads in layers)]
                        for spec_text, layers in per_layer], align="l" + "r" * model.config.num_layers)
        lines += [""]
    if args.bins:
        edges = [int(x) for x in args.bins.split(",")]
        ranges = [f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])]
        lines += ["## Held positions by range", "",
                  "Per (layer, KV head): how many held context positions fall in each range, and the total.", ""]
        rows = [[spec_text, f"L{i} head {h}", *np.histogram(sorted(s), bins=edges)[0].tolist(), len(s)]
                for spec_text, held in held_all.items() for i, layer in enumerate(held) for h, s in enumerate(layer)]
        lines += table(["method", "pair", *ranges, "held"], rows, align="ll" + "r" * (len(ranges) + 1)) + [""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
