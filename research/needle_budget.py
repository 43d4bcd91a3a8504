"""Where a compressed cache spends its budget on a haystack of RULER needles: needle values, needle keys, the rest.

``python -m research.needle_budget --task niah_multikey_2 --index 0 [--split dev] [--length 4096]
[--methods snapkv:budget=0.25,...] [--out FILE.md]``

In RULER's ``niah_multikey_2`` / ``niah_multikey_3`` the haystack is made of needle sentences (RULER's ``niah.py``
template, ``One of the special magic {type_needle_v} for {key} is: {value}.``) and only one key is asked about after
the context. Without the question (the query-agnostic protocol) a cache must keep every needle's value to answer.

The sample's context is prefilled once and shared by the full cache and every method, and each held key is mapped
back to its prompt position, as in :mod:`research.value_spans` (whose ``held_by_method`` this uses). The needles are
located in the decoded context with a regular expression built from the template in RULER's installed ``niah.py``.
Printed per method: the share of all held (layer, KV head, position) entries that are needle-value tokens, needle-key
tokens, the needles' other tokens and the rest; how many needles' values are whole in at least half of the (layer, KV
head) pairs; in how many pairs the asked needle's value is whole.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass

import numpy as np

from kvjax.reports import table, write_report
from research.value_spans import DEFAULT_METHODS as VALUE_SPANS_METHODS
from research.value_spans import held_by_method, load_sample, question_ids, sample_parser

_SPECS = VALUE_SPANS_METHODS.split(",") + ["hbw:budget=0.1", "heterocache:preset=suite:budget=0.25",
                                           "synckv:preset=tuned:budget=0.25"]
_NAMES = [s.split(":")[0] for s in _SPECS]
DEFAULT_METHODS = ",".join(sorted(_SPECS, key=lambda s: (_NAMES.index(s.split(":")[0]), s)))

CATEGORIES = ("value", "key", "template", "rest")  # the order of the token classes (a token takes its first match)
RECALL_PRESETS = ("heterocache", "synckv")


@dataclass(frozen=True)
class Needle:
    """One needle sentence of the context: its key and value strings and their token indices."""

    key: str
    value: str
    tokens: tuple[int, ...]  # every token overlapping the sentence
    key_tokens: tuple[int, ...]  # tokens overlapping the key (none of them a value token)
    value_tokens: tuple[int, ...]  # tokens overlapping the value


def needle_template() -> str:
    """The needle sentence of RULER's installed ``data/synthetic/niah.py`` (its ``needle = "..."`` line)."""
    from kvjax.evals.ruler import package_dir

    path = os.path.join(package_dir(), "data", "synthetic", "niah.py")
    with open(path, encoding="utf-8") as f:
        found = re.findall(r'^needle = "(.*)"\s*$', f.read(), re.M)
    if len(found) != 1:
        raise ValueError(f"{path}: expected one `needle = \"...\"` line, found {len(found)}")
    return found[0]


def needle_pattern(template: str) -> re.Pattern:
    """A regular expression for ``template``'s sentences: its literal text, each ``{field}`` a named group of the
    fewest characters within a line (RULER's word keys can hold an apostrophe: ``tam-o'-shanter``), the last field
    up to the next whitespace. The text after the last field is optional: the context ends where RULER's question
    starts, which cuts the last needle's final period."""
    parts = re.split(r"\{(\w+)\}", template)
    if "key" not in parts[1::2] or "value" not in parts[1::2]:
        raise ValueError(f"needle template {template!r} has no {{key}} and {{value}} fields")
    last = len(parts) - 2
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^\\s]+?)" if i == last else f"(?P<{p}>[^\\n]+?)"
                    for i, p in enumerate(parts[:-1]))
    return re.compile(regex + (f"(?:{re.escape(parts[-1])})?" if parts[-1] else "") + r"(?=\s|$)")


def locate_needles(tokenizer, ids, template: str) -> list[Needle]:
    """Every needle sentence of ``template`` in ``ids``' text (decoded token by token), in order; a token belongs to
    the value, key or sentence when its decoded text overlaps it. Raises ``ValueError`` below 2 needles."""
    pieces = [tokenizer.decode([t]) for t in ids]
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - np.asarray([len(p) for p in pieces])
    text = "".join(pieces)

    def overlapping(a: int, b: int) -> tuple[int, ...]:
        return tuple(int(i) for i in np.flatnonzero((starts < b) & (ends > a)))

    needles = []
    for m in needle_pattern(template).finditer(text):
        value = overlapping(*m.span("value"))
        key = tuple(i for i in overlapping(*m.span("key")) if i not in value)
        needles.append(Needle(m.group("key"), m.group("value"), overlapping(*m.span()), key, value))
    if len(needles) < 2:
        raise ValueError(f"found {len(needles)} needle sentences of {template!r} in the context; this study needs a "
                         "haystack of at least 2 (RULER's niah_multikey_2 / niah_multikey_3)")
    return needles


def token_classes(needles: list[Needle], n: int) -> np.ndarray:
    """Per context token, its index in :data:`CATEGORIES`: 0 value, 1 key, 2 the needles' other tokens, 3 the rest."""
    cls = np.full(n, 3, np.int8)
    for nd in needles:
        cls[list(nd.tokens)] = np.minimum(cls[list(nd.tokens)], 2)
    for nd in needles:
        cls[list(nd.key_tokens)] = np.minimum(cls[list(nd.key_tokens)], 1)
    for nd in needles:
        cls[list(nd.value_tokens)] = 0
    return cls


def budget_row(held: list[list[set]], needles: list[Needle], cls: np.ndarray, asked: list[int]) -> dict:
    """One method's numbers from its held positions per layer and KV head."""
    pairs = [s for layer in held for s in layer]
    counts = np.zeros(len(CATEGORIES), np.int64)
    for s in pairs:
        counts += np.bincount(cls[sorted(s)], minlength=len(CATEGORIES)) if s else 0
    whole = np.asarray([sum(all(i in s for i in nd.value_tokens) for s in pairs) for nd in needles])
    value_total = sum(len(nd.value_tokens) for nd in needles)
    return {
        "pairs": len(pairs),
        "held_per_pair": float(counts.sum() / len(pairs)),
        "held_share": {c: float(counts[i] / max(counts.sum(), 1)) for i, c in enumerate(CATEGORIES)},
        "value_tokens_held_per_pair": float(counts[0] / len(pairs) / value_total),
        "needles_whole_half": int((whole * 2 >= len(pairs)).sum()),
        "needles_whole_any": int((whole > 0).sum()),
        "asked_whole_pairs": [int(whole[a]) for a in asked],
        "whole_per_pair": [[sum(all(i in s for i in nd.value_tokens) for nd in needles) for s in layer]
                           for layer in held],
    }


def main(argv=None) -> int:
    import jax

    args = sample_parser("python -m research.needle_budget", __doc__.splitlines()[0], DEFAULT_METHODS,
                         out_help="Markdown report; its numbers go beside it as JSON").parse_args(argv)
    model, methods, sample, context = load_sample(args)
    tok = model.tokenizer
    template = needle_template()
    needles = locate_needles(tok, context, template)  # before the prefill: a clear error costs no model run
    asked = [i for i, nd in enumerate(needles) if nd.value in sample.answers]
    if not asked:
        raise ValueError(f"no needle's value is the sample's answer {sample.answers}")
    cls = token_classes(needles, len(context))
    tokens_of = np.bincount(cls, minlength=len(CATEGORIES))
    rows = {spec_text: budget_row(held, needles, cls, asked)
            for spec_text, held in held_by_method(model, context, methods, args.chunk_size,
                                                  question_ids(sample, args)).items()}

    n_layers, n_kv = model.config.num_layers, model.config.num_kv_heads
    npairs = n_layers * n_kv
    value_len = sorted({len(nd.value_tokens) for nd in needles})
    command = f"python -m research.needle_budget {shlex.join(argv if argv is not None else sys.argv[1:])}"
    a = needles[asked[0]]
    lines = [f"# Budget on a haystack of needles: RULER {args.split} `{args.task}` #{args.index}, "
             f"{len(context)} context tokens", "", f"Command: `{command}`", "",
             f"Model {args.model} (float32, {n_layers} layers x {n_kv} KV heads = {npairs} pairs), "
             f"jax {jax.__version__}. "
             "The context is compressed without the question (query-agnostic); the tables are taken after "
             "compression, before the question and before decoding.", "",
             f"Needle template (RULER's `niah.py`): `{template}`", "",
             f"- needles in the context: **{len(needles)}**; context tokens: **{len(context)}**",
             f"- value tokens of all needles: **{tokens_of[0]}** = **{tokens_of[0] / len(context):.1%}** of the "
             "context "
             f"(the smallest budget that could hold every value; {'/'.join(map(str, value_len))} tokens per value)",
             f"- key tokens: {tokens_of[1]} ({tokens_of[1] / len(context):.1%}); the needles' other tokens: "
             f"{tokens_of[2]} ({tokens_of[2] / len(context):.1%}); the rest (outside every needle sentence): "
             f"{tokens_of[3]} ({tokens_of[3] / len(context):.1%})",
             f"- asked needle: key `{a.key}`, value `{a.value}` (needle {asked[0] + 1} of {len(needles)}, value tokens "
             f"{a.value_tokens[0]}..{a.value_tokens[-1]})", ""]
    if any(s.split(":")[0] in RECALL_PRESETS for s in rows):
        lines += ["HeteroCache and SyncKV presets keep the whole prompt in one leader head and recall positions for "
                  "the follower heads from host memory during decoding; the rows count what the device holds after "
                  "compression (as `research.value_spans` does), not what decoding recalls.", ""]
    lines += ["Shares of all held (layer, KV head, position) entries; `held / context`: entries per pair over the "
              "context tokens; `values held`: value tokens held per pair over all needles' value tokens; "
              f"`whole in >= {npairs // 2} pairs`: needles whose value every token of is held by at least half the "
              f"pairs; `asked whole`: pairs (of {npairs}) holding the asked needle's value whole.", ""]
    lines += table(["method", "held / context", "needle values", "needle keys", "needle other", "rest", "values held",
                    f"whole in >= {npairs // 2} pairs", "whole in >= 1 pair", "asked whole"],
                   [[s, f"{r['held_per_pair'] / len(context):.1%}", *(f"{r['held_share'][c]:.1%}" for c in CATEGORIES),
                     f"{r['value_tokens_held_per_pair']:.1%}", f"{r['needles_whole_half']} / {len(needles)}",
                     f"{r['needles_whole_any']} / {len(needles)}", "/".join(map(str, r["asked_whole_pairs"]))]
                    for s, r in rows.items()], align="l" + "r" * 9)
    lines += ["", f"Needles (of {len(needles)}) whose value each pair holds whole, per layer, its KV heads "
              "separated by `/`:", ""]
    lines += table(["method", *(f"L{i}" for i in range(n_layers))],
                   [[s, *("/".join(map(str, heads)) for heads in r["whole_per_pair"])] for s, r in rows.items()],
                   align="l" + "r" * n_layers)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        data = {"task": args.task, "index": args.index, "split": args.split, "length": args.length,
                "model": args.model, "jax": jax.__version__, "command": command, "context_tokens": len(context),
                "needles": len(needles), "tokens_by_class": dict(zip(CATEGORIES, tokens_of.tolist())),
                "asked": asked, "answers": list(sample.answers), "methods": rows}
        write_report(args.out, text, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
