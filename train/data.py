"""Offline, deterministic long-context QA samples for training Locret's retaining heads.

Locret's retaining heads are trained on a long-context SFT set: each sample is one long prompt and one
answer, and the label of a prompt token is the largest attention score it receives from the answer's
tokens. This module builds such samples offline: a :class:`QASample` holds the prompt (chat template
applied, ending with the assistant turn's start) and the answer (followed by the template's end-of-turn
text), both as token ids of the model's own tokenizer.

Source text (:func:`training_corpus`): one of :mod:`kvjax.train.corpora`'s corpora, paragraphs of prose
sentences disjoint from RULER's sources and from kvjax's evaluation haystack. Neither RULER's nor kvjax's
evaluation generators, needles or question templates are used here, so training does not see the
evaluation's text or phrasing. Samples are deterministic per corpus, tokenizer and (for
``stdlib-docstrings``) Python version.

Kinds (:data:`KINDS`); each passage is consecutive corpus sentences from a seed-dependent paragraph on
(wrapping around the corpus; near the end, later sentences may be skipped to fill the prompt closely):

* ``"fact"``: 1-4 synthetic fact sentences (an entity and a random number or code, e.g. "Station Cobalt
  Heron recorded a reading of 48.213 units.") inserted between sentences at random depths; the question
  asks for one value, the answer restates that fact in a full sentence. Values never occur elsewhere.
* ``"name"``: 1-3 sentences linking a person's name to a role; the question asks who holds one role,
  the answer names them in a short sentence.
* ``"continuation"``: a passage sentence (not in the last 10% of the passage) is quoted; the answer is the
  1-2 sentences that follow it, verbatim.
* ``"summary"``: an extractive summary: the opening sentences of an early, a middle and a late paragraph
  of the passage, in order.
* ``"record"``: 2-6 sentences of one shape, each giving one entity a long value (a 6-8 digit number or a
  UUID-like hexadecimal string), at random depths; the question asks for one entity's value, the others
  are distractors of the same kind.
* ``"records"``: as ``"record"``, but the asked entity has 2-4 values spread over the passage; the answer
  lists all of them in the order they occur.

Prompt size: ``tokens`` is the target length of ``prompt_ids``; passages grow by whole sentences (from
per-sentence token counts, corrected by tokenizing the full prompt) to at most ``tokens`` and, in
practice, within a few dozen tokens of it.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
import weakref
from typing import Sequence

from kvjax.models.tokenizer import fill_sentences
from kvjax.train.corpora import CORPORA, corpus_paragraphs

KINDS: tuple[str, ...] = ("fact", "name", "continuation", "summary", "record", "records")
DEFAULT_CORPUS = "stdlib-docstrings"

MIN_TOKENS = 256  # smallest prompt target: instruction, question, chat template and a few passage sentences
SLACK = 32  # the sizing loop aims for tokens - SLACK <= len(prompt_ids) <= tokens


def training_corpus(corpus: str = DEFAULT_CORPUS) -> tuple[tuple[str, ...], ...]:
    """The paragraphs (tuples of sentences) of ``corpus`` (:data:`kvjax.train.corpora.CORPORA`)."""
    return corpus_paragraphs(corpus)


@functools.lru_cache(maxsize=None)
def _corpus_text(corpus: str) -> str:
    return "\n\n".join(" ".join(p) for p in training_corpus(corpus))


@functools.lru_cache(maxsize=None)
def _stream(corpus: str) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """(sentences, paragraph index of each sentence, index of each paragraph's first sentence)."""
    sentences, para_of, firsts = [], [], []
    for p, para in enumerate(training_corpus(corpus)):
        firsts.append(len(sentences))
        sentences.extend(para)
        para_of.extend([p] * len(para))
    return tuple(sentences), tuple(para_of), tuple(firsts)


# --------------------------------------------------------------------------------------------------- templates

INSTRUCTIONS = (
    "Read the following excerpt from software documentation and answer the question after it.",
    "Below is a passage of technical documentation. Answer the question that follows it.",
    "The text below is taken from library documentation; a question about it comes at the end.",
    "Read the text carefully, then answer the question at the end.",
)

ENTITY_ADJECTIVES = (
    "Amber", "Cobalt", "Crimson", "Northern", "Silver", "Granite", "Copper", "Hazel", "Indigo", "Juniper", "Saffron",
    "Obsidian", "Pewter", "Russet", "Sable", "Teal", "Umber", "Verdant", "Ashen", "Coral", "Dusky", "Emerald",
    "Flint", "Ivory", "Lunar", "Maroon", "Ochre", "Slate", "Tawny", "Western",
)
ENTITY_NOUNS = (
    "Heron", "Meridian", "Bastion", "Cormorant", "Delta", "Estuary", "Fjord", "Gannet", "Highland", "Ibis", "Juncture",
    "Kestrel", "Lagoon", "Moorland", "Nimbus", "Outpost", "Pinnacle", "Quarry", "Reef", "Summit", "Tundra",
    "Upland", "Vista", "Wharf", "Zephyr", "Albatross", "Basin", "Causeway", "Dune", "Plateau",
)
FIRST_NAMES = (
    "Adaeze", "Bjorn", "Calla", "Dorian", "Elspeth", "Farid", "Greta", "Hollis", "Ingrid", "Jasper", "Kamala",
    "Lorcan", "Mireille", "Nikolai", "Orla", "Priya", "Quentin", "Rosalind", "Soren", "Tamsin", "Ulric", "Vesna",
    "Wendell", "Ximena", "Yusuf", "Zinnia",
)
LAST_NAMES = (
    "Abernathy", "Blackwood", "Castellanos", "Drummond", "Eriksen", "Fairweather", "Galloway", "Hargreave", "Ivanova",
    "Jablonski", "Kettering", "Lindqvist", "Marchetti", "Nakamura", "Okonkwo", "Pemberton", "Quintero", "Rasmussen",
    "Sutherland", "Thorncastle", "Underhill", "Valdivia", "Whitlock", "Yamamoto", "Zielinski",
)

_LETTERS = "ABCDEFGHJKLMNPRSTUVWXYZ"


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10**n))


# (value generator, inserted sentence, question wordings, answer sentence); {e} entity, {v} value
_FACTS = (
    (
        lambda r: f"{_digits(r, 4)}-{r.choice(_LETTERS)}",
        "The archive code assigned to the {e} survey is {v}.",
        (
            "What archive code was assigned to the {e} survey?",
            "Which archive code does the text give for the {e} survey?",
        ),
        "The archive code assigned to the {e} survey is {v}.",
    ),
    (
        lambda r: f"{_digits(r, 2)}.{r.randrange(1000):03d}",
        "Station {e} recorded a reading of {v} units.",
        ("What reading did Station {e} record?", "How many units did Station {e} record, according to the text?"),
        "Station {e} recorded a reading of {v} units.",
    ),
    (
        lambda r: f"{_digits(r, 2)},{r.randrange(1000):03d}",
        "The {e} expedition was granted a budget of {v} credits.",
        ("How many credits was the {e} expedition granted?", "What budget did the {e} expedition receive?"),
        "The {e} expedition was granted a budget of {v} credits.",
    ),
    (
        lambda r: f"v{r.randrange(2, 10)}.{r.randrange(10, 40)}.{r.randrange(1, 100)}",
        "Release {e} shipped under the version tag {v}.",
        ("Under which version tag did Release {e} ship?", "What version tag does the text give for Release {e}?"),
        "Release {e} shipped under the version tag {v}.",
    ),
    (
        lambda r: f"{r.choice(_LETTERS)}{r.choice(_LETTERS)}-{_digits(r, 4)}",
        "The {e} ferry is registered under the hull number {v}.",
        ("What hull number is the {e} ferry registered under?", "Which hull number belongs to the {e} ferry?"),
        "The {e} ferry is registered under the hull number {v}.",
    ),
    (
        lambda r: f"{_digits(r, 4)}.{r.randrange(10)}",
        "The {e} observatory stands at an altitude of {v} metres.",
        ("At what altitude does the {e} observatory stand?", "How high is the {e} observatory, according to the text?"),
        "The {e} observatory stands at an altitude of {v} metres.",
    ),
)

# (inserted sentence, question wordings, answer sentence); {e} entity, {n} person's name
_ROLES = (
    (
        "The key to the {e} archive is kept by {n}.",
        ("Who keeps the key to the {e} archive?", "Which person holds the key to the {e} archive?"),
        "{n} keeps the key to the {e} archive.",
    ),
    (
        "{n} was appointed curator of the {e} collection.",
        ("Who was appointed curator of the {e} collection?", "Who is the curator of the {e} collection?"),
        "The curator of the {e} collection is {n}.",
    ),
    (
        "The {e} bridge was designed by the engineer {n}.",
        ("Which engineer designed the {e} bridge?", "Who designed the {e} bridge?"),
        "The {e} bridge was designed by {n}.",
    ),
    (
        "{n} works as the night operator of the {e} relay station.",
        ("Who is the night operator of the {e} relay station?", "Who operates the {e} relay station at night?"),
        "The night operator of the {e} relay station is {n}.",
    ),
    (
        "Minutes of the {e} committee are recorded by {n}.",
        ("Who records the minutes of the {e} committee?", "Which person takes the minutes of the {e} committee?"),
        "{n} records the minutes of the {e} committee.",
    ),
    (
        "The {e} orchard is tended by a gardener named {n}.",
        ("What is the name of the gardener who tends the {e} orchard?", "Who tends the {e} orchard?"),
        "The {e} orchard is tended by {n}.",
    ),
)

def _uuid_like(r: random.Random) -> str:
    return "-".join("".join(r.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4, 4, 12))


# Long values of one shape, several per passage ("record": one of several entities is asked; "records": every
# value of one entity is asked, other entities' values are distractors). (value generator, inserted sentence,
# question, question for all values, answer, answer with all values); {e} entity, {v} value(s).
_RECORDS = (
    (
        lambda r: _digits(r, 7),
        "The dispatch log lists {v} as a serial number of the {e} turbine.",
        "Which serial number does the dispatch log list for the {e} turbine?",
        "Which serial numbers does the dispatch log list for the {e} turbine? Give all of them.",
        "The serial number of the {e} turbine is {v}.",
        "The serial numbers of the {e} turbine are {v}.",
    ),
    (
        _uuid_like,
        "Shipment {e} was filed under the tracking identifier {v}.",
        "Under which tracking identifier was shipment {e} filed?",
        "Under which tracking identifiers was shipment {e} filed? Give all of them.",
        "Shipment {e} was filed under the tracking identifier {v}.",
        "Shipment {e} was filed under the tracking identifiers {v}.",
    ),
    (
        lambda r: _digits(r, r.choice((6, 8))),
        "Cabinet {v} holds a logbook of the {e} lighthouse.",
        "Which cabinet holds the logbook of the {e} lighthouse?",
        "Which cabinets hold logbooks of the {e} lighthouse? Give all of them.",
        "The logbook of the {e} lighthouse is in cabinet {v}.",
        "The logbooks of the {e} lighthouse are in cabinets {v}.",
    ),
)


def _listing(values: Sequence[str]) -> str:
    return ", ".join(values[:-1]) + " and " + values[-1] if len(values) > 1 else values[0]


_FOLLOW_QUESTIONS = {
    1: (
        'Which sentence follows "{q}" in the text above? Quote it.',
        'Quote the sentence that comes right after "{q}" in the text above.',
        'In the text above, what is the sentence immediately after "{q}"? Quote it exactly.',
    ),
    2: (
        'Which sentences follow "{q}" in the text above? Quote the next two.',
        'Quote the two sentences that come right after "{q}" in the text above.',
        'In the text above, what are the two sentences immediately after "{q}"? Quote them exactly.',
    ),
}
_SUMMARY_QUESTIONS = (
    "Summarize the text above in {count} sentences built from the opening sentences of its sections: one early, "
    "one from the middle and one late, quoted verbatim and in order.",
    "Write a {count}-sentence extractive summary of the text above: quote the first sentence of an early section, "
    "of a section in the middle and of a late section, in that order.",
    "Give a {count}-sentence summary of the text above made of the opening sentences of three sections spread "
    "over it (beginning, middle, end), quoted exactly and in order.",
)
_SHORT_SUMMARY_QUESTION = (
    "Summarize the text above in {count} made of the opening {sentences} of its sections, quoted verbatim and in order."
)
_NUMBER_WORDS = {1: "one sentence", 2: "two sentences"}


# --------------------------------------------------------------------------------------------------- samples


@dataclasses.dataclass(frozen=True)
class QASample:
    """One training sample: a long prompt (chat template applied) and its answer, as token ids."""

    prompt_ids: tuple[int, ...]  # ends with the generation prompt (the assistant turn's start)
    answer_ids: tuple[int, ...]  # the answer's tokens, then the template's end-of-assistant-turn tokens
    kind: str
    question: str
    answer: str


_PER_TOKENIZER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _cache(tokenizer) -> dict:
    try:
        return _PER_TOKENIZER.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        return {}


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _sentence_counts(tokenizer, corpus: str) -> tuple[int, ...]:
    """Tokens of each corpus sentence with its leading space (one batched call where the tokenizer allows)."""
    cache = _cache(tokenizer)
    if ("counts", corpus) not in cache:
        texts = [" " + s for s in _stream(corpus)[0]]
        if callable(tokenizer):
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            ids = [_encode(tokenizer, t) for t in texts]
        cache[("counts", corpus)] = tuple(len(x) for x in ids)
    return cache[("counts", corpus)]


def _chat(tokenizer, message: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )


def _template_texts(tokenizer) -> tuple[str, str]:
    """(the template's text around an empty user turn, the text it puts after an assistant message)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; QA samples need one (use an instruct model's tokenizer)")
    cache = _cache(tokenizer)
    if "template" not in cache:
        marker = "ANSWERMARKERQX"
        convo = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
        if marker not in convo:
            raise ValueError("the chat template does not render the assistant message; cannot derive its end of turn")
        end = convo[convo.rindex(marker) + len(marker):]
        if not end:
            end = getattr(tokenizer, "eos_token", None) or ""
        if not end:
            raise ValueError("the chat template puts nothing after an assistant message and there is no eos token")
        cache["template"] = (_chat(tokenizer, ""), end)
    return cache["template"]


@dataclasses.dataclass
class _Plan:
    """A sample's random choices, drawn before its passage is sized."""

    instruction: str
    inserts: list[str] = dataclasses.field(default_factory=list)  # sentences put into the passage
    depths: list[float] = dataclasses.field(default_factory=list)  # where (fraction of the passage's sentences)
    question: str = ""  # fixed question (fact, name)
    answer: str = ""  # fixed answer (fact, name)
    depth: float = 0.0  # continuation: depth of the quoted sentence; summary: unused
    follow: int = 1  # continuation: sentences to quote back
    wording: int = 0  # continuation, summary: which question wording
    spots: tuple[float, float, float] = (0.0, 0.0, 0.0)  # summary: position inside the early/middle/late thirds


def _entities(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        e = f"{rng.choice(ENTITY_ADJECTIVES)} {rng.choice(ENTITY_NOUNS)}"
        if e not in out:
            out.append(e)
    return out


def _fresh(value: str, taken: Sequence[str], forbidden: str) -> bool:
    """Whether ``value`` is absent from ``forbidden`` and not contained in (or containing) a taken value."""
    return value not in forbidden and not any(value in t or t in value for t in taken)


def _plan(kind: str, rng: random.Random, template_text: str, corpus: str) -> _Plan:
    plan = _Plan(instruction=rng.choice(INSTRUCTIONS))
    forbidden = _corpus_text(corpus) + "\n" + template_text + "\n" + "\n".join(INSTRUCTIONS)
    if kind == "fact":
        n = rng.randint(1, 4)
        facts = rng.sample(_FACTS, n)
        values: list[str] = []
        for gen, *_ in facts:
            while True:
                v = gen(rng)
                if _fresh(v, values, forbidden):
                    values.append(v)
                    break
        entities = _entities(rng, n)
        plan.inserts = [f[1].format(e=e, v=v) for f, e, v in zip(facts, entities, values)]
        t = rng.randrange(n)
        _, _, questions, answer = facts[t]
        plan.question = rng.choice(questions).format(e=entities[t])
        plan.answer = answer.format(e=entities[t], v=values[t])
    elif kind == "name":
        n = rng.randint(1, 3)
        roles = rng.sample(_ROLES, n)
        entities = _entities(rng, n)
        firsts, lasts = rng.sample(FIRST_NAMES, n), rng.sample(LAST_NAMES, n)
        names = [f"{a} {b}" for a, b in zip(firsts, lasts)]
        if any(name in forbidden for name in names):  # never with these lists; kept as a guard
            raise RuntimeError(f"a drawn name occurs in the corpus: {names}")
        plan.inserts = [r[0].format(e=e, n=nm) for r, e, nm in zip(roles, entities, names)]
        t = rng.randrange(n)
        _, questions, answer = roles[t]
        plan.question = rng.choice(questions).format(e=entities[t])
        plan.answer = answer.format(e=entities[t], n=names[t])
    elif kind in ("record", "records"):
        gen, insert, question, question_all, answer, answer_all = rng.choice(_RECORDS)
        n = rng.randint(2, 6)
        entities = _entities(rng, n)
        owners = list(range(n)) + ([0] * (rng.randint(2, 4) - 1) if kind == "records" else [])
        values: list[str] = []
        for _ in owners:
            while True:
                v = gen(rng)
                if _fresh(v, values, forbidden):
                    values.append(v)
                    break
        plan.inserts = [insert.format(e=entities[o], v=v) for o, v in zip(owners, values)]
        if kind == "record":
            t = rng.randrange(n)
            plan.question = question.format(e=entities[t])
            plan.answer = answer.format(e=entities[t], v=values[t])
        else:
            plan.question = question_all.format(e=entities[0])
            plan.answer = answer_all.format(e=entities[0], v=_listing([v for o, v in zip(owners, values) if o == 0]))
    elif kind == "continuation":
        plan.depth = rng.uniform(0.02, 0.88)
        plan.follow = rng.choice((1, 2))
        plan.wording = rng.randrange(len(_FOLLOW_QUESTIONS[1]))
    elif kind == "summary":
        plan.wording = rng.randrange(len(_SUMMARY_QUESTIONS))
        plan.spots = (rng.random(), rng.random(), rng.random())
    else:
        raise ValueError(f"unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
    plan.depths = [rng.random() for _ in plan.inserts]
    if kind == "records":  # the asked entity's values occur in the order the answer lists them
        mine = [j for j, o in enumerate(owners) if o == 0]
        for j, d in zip(mine, sorted(plan.depths[j] for j in mine)):
            plan.depths[j] = d
    return plan


def _continuation(plan: _Plan, sentences: list[str], passage: str) -> tuple[str, str]:
    """Question quoting a passage sentence and the verbatim 1-2 sentences after it."""
    n = len(sentences)
    for follow in (plan.follow, 1):
        for limit, shortest in ((0.9, 40), (0.9, 0), (1.0, 0)):  # preferably in the first 90%, 40+ characters
            eligible = [i for i in range(n - follow) if i < limit * n]
            good = [
                i for i in eligible
                if len(sentences[i]) >= shortest and passage.count(sentences[i]) == 1
            ]
            if good:
                goal = plan.depth * n
                i = min(good, key=lambda j: (abs(j - goal), j))
                question = _FOLLOW_QUESTIONS[follow][plan.wording].format(q=sentences[i])
                return question, " ".join(sentences[i + 1:i + 1 + follow])
    raise ValueError("the passage is too short for a continuation question; use a larger tokens")


def _summary(plan: _Plan, blocks: list[list[str]]) -> tuple[str, str]:
    """Question asking for an extractive summary, and the opening sentences of an early, middle and late block."""
    nb = len(blocks)
    if nb >= 3:
        picks = []
        for third, spot in enumerate(plan.spots):
            lo, hi = third * nb // 3, (third + 1) * nb // 3
            picks.append(lo + min(int(spot * (hi - lo)), hi - lo - 1))
        question = _SUMMARY_QUESTIONS[plan.wording].format(count="three")
    else:
        picks = list(range(nb))
        question = _SHORT_SUMMARY_QUESTION.format(
            count=_NUMBER_WORDS[nb], sentences="sentence" if nb == 1 else "sentences"
        )
    return question, " ".join(blocks[b][0] for b in picks)


def _assemble(kind: str, plan: _Plan, start: int, chosen: Sequence[int], corpus: str) -> tuple[str, str, str]:
    """(user message, question, answer) for the passage made of stream positions ``chosen`` (relative to ``start``)."""
    sentences, para_of, _ = _stream(corpus)
    n = len(sentences)
    items = [((start + k) // n, para_of[(start + k) % n], sentences[(start + k) % n]) for k in chosen]
    if plan.inserts:  # each inserted sentence goes before the original sentence at its depth (or at the end)
        at = [min(round(d * len(items)), len(items)) for d in plan.depths]
        merged = []
        for b in range(len(items) + 1):
            for j in range(len(plan.inserts)):
                if at[j] == b:
                    key = items[b - 1][:2] if b > 0 else (items[0][:2] if items else (0, 0))
                    merged.append((*key, plan.inserts[j]))
            if b < len(items):
                merged.append(items[b])
        items = merged
    blocks: list[list[str]] = []
    last = None
    for lap, para, text in items:
        if (lap, para) != last:
            blocks.append([])
            last = (lap, para)
        blocks[-1].append(text)
    passage = "\n\n".join(" ".join(b) for b in blocks)
    if kind == "continuation":
        question, answer = _continuation(plan, [t for _, _, t in items], passage)
    elif kind == "summary":
        question, answer = _summary(plan, blocks)
    else:
        question, answer = plan.question, plan.answer
    return f"{plan.instruction}\n\n{passage}\n\n{question}", question, answer


def _check_corpus(corpus) -> None:
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; allowed: {', '.join(CORPORA)}")


def _check_tokens(tokens) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise ValueError(f"tokens must be an int, got {tokens!r}")
    if tokens < MIN_TOKENS:
        raise ValueError(
            f"tokens={tokens} is too small: the instruction, question, chat template and a little passage need "
            f"tokens >= {MIN_TOKENS}"
        )


def make_sample(tokenizer, *, tokens: int, seed: int, kind: str, corpus: str = DEFAULT_CORPUS) -> QASample:
    """One QA sample of ``kind``: its prompt has at most ``tokens`` tokens (in practice at least ``tokens - 40``).

    The same tokenizer and arguments always give the same sample (for a given Python version).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
    _check_corpus(corpus)
    _check_tokens(tokens)
    template_text, end_of_turn = _template_texts(tokenizer)
    rng = random.Random(f"kvjax.train.data:{kind}:{seed}")
    sentences, _, firsts = _stream(corpus)
    start = firsts[rng.randrange(len(firsts))]
    plan = _plan(kind, rng, template_text, corpus)
    counts = _sentence_counts(tokenizer, corpus)
    n = len(sentences)

    def est(k: int) -> int:
        return counts[(start + k) % n]

    def measure(chosen: Sequence[int]) -> tuple[str, str, str, list[int]]:
        message, question, answer = _assemble(kind, plan, start, chosen, corpus)
        return message, question, answer, _encode(tokenizer, _chat(tokenizer, message))

    def select(budget: int) -> list[int]:
        return fill_sentences(est, budget, patience=32)

    probe = list(range(8))
    overhead = len(measure(probe)[3]) - sum(est(k) for k in probe)
    aim = tokens - 4
    bias = 0
    best, best_len, best_chosen = None, -1, []
    chosen: list[int] = []
    for _ in range(8):
        chosen = select(aim - overhead - bias)
        result = measure(chosen)
        got = len(result[3])
        if best_len < got <= tokens:
            best, best_len, best_chosen = result, got, chosen
        if tokens - SLACK <= got <= tokens:
            break
        new_bias = got - overhead - sum(est(k) for k in chosen)
        bias = new_bias if new_bias != bias else bias + (got - aim)
    while best is None and chosen:  # every measurement was over: drop sentences from the end
        chosen = chosen[:-1]
        result = measure(chosen)
        if len(result[3]) <= tokens:
            best, best_len, best_chosen = result, len(result[3]), chosen
    if best is None:
        raise ValueError(f"tokens={tokens} is too small for this {kind!r} sample")
    # still short (the continuation's quoted sentence moves with the passage): add later sentences that fit
    k = best_chosen[-1] + 1 if best_chosen else 0
    for k in range(k, k + 16):
        if best_len >= tokens - SLACK:
            break
        result = measure(best_chosen + [k])
        if len(result[3]) <= tokens:
            best, best_len, best_chosen = result, len(result[3]), best_chosen + [k]
    message, question, answer, ids = best
    answer_ids = _encode(tokenizer, answer) + _encode(tokenizer, end_of_turn)
    return QASample(tuple(ids), tuple(answer_ids), kind, question, answer)


def qa_samples(
    tokenizer,
    *,
    count: int,
    tokens: int,
    seed: int = 0,
    kinds: Sequence[str] = KINDS,
    corpus: str = DEFAULT_CORPUS,
    progress: bool = False,
) -> list[QASample]:
    """``count`` samples of ``corpus``'s text; sample ``i`` has kind ``kinds[i % len(kinds)]`` and a seed drawn
    from ``(seed, i)``."""
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise ValueError(f"count must be a positive int, got {count!r}")
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError("kinds must not be empty")
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
    _check_corpus(corpus)
    _check_tokens(tokens)
    indices = range(count)
    if progress:
        from tqdm import tqdm

        indices = tqdm(indices, desc="QA samples", unit="sample")
    return [
        make_sample(
            tokenizer, tokens=tokens, seed=random.Random(f"{seed}:{i}").getrandbits(64), kind=kinds[i % len(kinds)],
            corpus=corpus,
        )
        for i in indices
    ]


def describe(samples: Sequence[QASample]) -> dict:
    """Summary for a training report: count, samples per kind, and min/mean/max prompt and answer tokens."""

    def stats(values: list[int]) -> dict | None:
        if not values:
            return None
        return {"min": min(values), "mean": round(statistics.fmean(values), 1), "max": max(values)}

    kinds: dict[str, int] = {}
    for s in samples:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return {
        "count": len(samples),
        "kinds": kinds,
        "prompt_tokens": stats([len(s.prompt_ids) for s in samples]),
        "answer_tokens": stats([len(s.answer_ids) for s in samples]),
    }
