"""Deterministic RULER-style long-context retrieval tasks, sized in the model's own tokens, and their scoring.

Tasks (keys of :data:`TASKS`), after RULER (Hsieh et al., 2024) and the passkey test (Mohtashami & Jaggi, 2023):

* ``passkey``: a 5-digit pass key hidden once in the haystack (``"The pass key is 68231. Remember it. 68231 is the
  pass key."``).
* ``niah_single``: one needle ``"One of the special magic numbers for {key} is: {value}."`` (word-pair key,
  7-digit value).
* ``niah_multikey``: the real needle plus 3 distractor needles with other keys and values; asks for the real key.
* ``niah_multivalue``: 4 needles with the same key and different values; all 4 values must be answered.
* ``niah_multiquery``: 4 needles with different keys; the question asks for all 4 keys.
* ``variable_tracking``: a chain of 5 variables, ``VAR ABCDE = 12345.`` then ``VAR FGHIJ = ABCDE.`` ... (RULER's
  default of 4 hops after the first assignment); all 5 names must be answered.

Haystacks (no downloads):

* ``"prose"``: English prose from the Python language reference as shipped with every Python in the standard
  library module ``pydoc_data.topics`` (the texts behind ``help("if")`` etc.). Topics are taken sorted by key and
  cleaned: reST headings, underlines, tables, grammar productions (``::=``), interactive sessions (``>>>``), bullet
  lists, code blocks and other paragraphs that do not read as sentences (ragged indentation, < 80% letters, no
  sentence-final punctuation, < 8 words) are dropped, ``*emphasis*`` and footnote marks are removed, whitespace is
  collapsed and duplicates dropped; haystacks also leave out the ~1% of sentences longer than 300 characters. For
  Python 3.11 that is 677 paragraphs, 163K characters, ~36K SmolLM2 tokens (the text differs a little between Python
  versions, so samples are deterministic per Python version). Each sample's haystack starts at a seed-dependent
  paragraph and wraps around the corpus when longer.
* ``"filler"``: the classic repeated filler "The grass is green. The sky is blue. ..." of :mod:`kvjax.evals.passkey`.

Defaults: ``passkey`` and ``variable_tracking`` use the filler (as in the passkey test and RULER's VT), the ``niah_*``
tasks prose. Needles sit between sentences. A sample's values, keys and haystack offset come from a
:class:`random.Random` seeded with a SHA-256 of ``(task, seed, index, target_tokens)``, so they do not depend on the
depth or the haystack kind; values never occur in the prose corpus (nor in each other).

A sample's tokenized prompt (chat template applied by default) is at most ``target_tokens`` long and at least 98% of
it: whole sentences are chosen from cached per-sentence token counts, corrected by tokenizing the full prompt (2-3
times); only when no set of whole sentences hits that window (targets of a few hundred tokens) does the haystack end
in a sentence cut at a word. :func:`score` is RULER's ``string_match_all``: the fraction of answers found in the output.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import random
import re
import weakref
from typing import Sequence

from kvjax.models.tokenizer import fill_sentences

TASKS: tuple[str, ...] = (
    "passkey",
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
)
HAYSTACKS: tuple[str, ...] = ("prose", "filler")
DEFAULT_HAYSTACK: dict[str, str] = {
    "passkey": "filler",
    "niah_single": "prose",
    "niah_multikey": "prose",
    "niah_multivalue": "prose",
    "niah_multiquery": "prose",
    "variable_tracking": "filler",
}

MAX_NEW_TOKENS: dict[str, int] = {  # answer tokens per task
    "passkey": 12, "niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "niah_multiquery": 48,
    "variable_tracking": 40,
}
FILLER_SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."
)
NUM_NEEDLES = 4  # needles of the multi-needle NIAH tasks
NUM_CHAIN_VARIABLES = 5  # variables in the variable-tracking chain (first assignment + 4 hops)
MAX_SENTENCE_CHARS = 300  # longer prose sentences (~1%) are left out: needles sit between sentences
MIN_FRACTION = 0.98  # prompts are at least this fraction of target_tokens

ADJECTIVES = (
    "gentle", "quiet", "bold", "calm", "bright", "silent", "rapid", "ancient", "golden", "hidden", "lucky", "brave",
    "clever", "distant", "eager", "fancy", "fierce", "fragile", "frozen", "giant", "hollow", "humble", "icy", "jolly",
    "kind", "lazy", "little", "lively", "lonely", "loud", "mellow", "misty", "modern", "narrow", "noble", "odd",
    "pale", "polite", "proud", "purple", "quick", "rare", "rough", "royal", "rusty", "sandy", "scarlet", "shy",
    "sleepy", "smooth", "solid", "sour", "spicy", "steady", "stormy", "sunny", "swift", "tall", "tender", "tiny",
    "vivid", "warm", "wild", "windy", "wise", "wooden", "young", "zesty",
)
NOUNS = (
    "harbor", "river", "eagle", "forest", "meadow", "mountain", "lantern", "castle", "garden", "island", "valley",
    "falcon", "comet", "canyon", "desert", "ember", "feather", "glacier", "hammer", "horizon", "jungle", "kettle",
    "ladder", "marble", "mirror", "needle", "orchard", "pebble", "pepper", "planet", "pocket", "puzzle", "rabbit",
    "ribbon", "rocket", "saddle", "shadow", "shelter", "spider", "statue", "tiger", "tunnel", "violin", "walnut",
    "window", "wizard", "anchor", "beacon", "blossom", "bridge", "cactus", "candle", "cloud", "compass", "dolphin",
    "dragon", "engine", "fountain", "galaxy", "helmet", "lemon", "magnet", "otter", "parrot", "quartz", "sparrow",
)

_PASSKEY_INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key afterwards."
)
_NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
_VT_INTRO = "Memorize and track the chain of variable assignments hidden in the following text."


@dataclasses.dataclass(frozen=True)
class TaskSample:
    """One task prompt: the user message, its tokens and every string the answer must contain."""

    task: str
    index: int  # sample index within its (task, length) set
    target_tokens: int
    depth: float  # depth of the (real/first) needle, 0..1 of the haystack
    haystack: str  # "prose" | "filler"
    context: str  # the user message (intro, haystack with needles, question), without chat template
    prompt_ids: tuple[int, ...]  # tokenized prompt, chat template applied if chat=True, special tokens included
    answers: tuple[str, ...]  # every string that must appear in the answer
    question_start: int = 0  # prompt_ids[question_start:] is the question part (question + template end)


# --------------------------------------------------------------------------------------------------- corpus


_PUNCT_LINE = re.compile(r"^\s*[\W_]+\s*$")
_SENTENCE_END = re.compile(r"[.!?][\"”’)]?$")
_SENTENCE_SPLIT = re.compile(
    r"(?:(?<=[.!?])|(?<=[.!?][\"”’)]))(?<!e\.g\.)(?<!i\.e\.)(?<!etc\.)(?<!vs\.)\s+(?=[A-Z\"“(])"
)


def _clean_paragraph(para: str) -> str | None:
    """The paragraph as one line of prose, or None when it is code, grammar, markup, a list or a heading."""
    lines = [line for line in para.split("\n") if line.strip()]
    if not lines or any(_PUNCT_LINE.match(line) for line in lines):  # underlines, table borders
        return None
    if len({len(line) - len(line.lstrip()) for line in lines}) > 1:  # ragged indentation: code, lists
        return None
    if lines[0].lstrip()[:1] in "*+|-•" or re.match(r"\s*(\d+\.|\(\d+\))\s", lines[0]):  # lists, tables
        return None
    text = " ".join(line.strip() for line in lines)
    if any(mark in text for mark in ("::=", ">>>", "...", "#")):
        return None
    text = re.sub(r"\s*\[\d+\]", "", text)  # footnote marks
    text = re.sub(r"(?<![\w\"*])\*{1,2}(\w[^*\"]*?)\*{1,2}(?![\w*])", r"\1", text)  # *emphasis*, **strong**
    text = re.sub(r"\s+", " ", text).strip()
    if not _SENTENCE_END.search(text) or len(text.split()) < 8:
        return None
    nonspace = [c for c in text if not c.isspace()]
    if sum(c.isalpha() for c in nonspace) < 0.8 * len(nonspace):
        return None
    if sum(c in "{}[]=<>()" for c in text) > 0.02 * len(text):
        return None
    return text


@functools.lru_cache(maxsize=None)
def prose_paragraphs() -> tuple[tuple[str, ...], ...]:
    """The cleaned prose corpus: paragraphs (tuples of sentences) from ``pydoc_data.topics``, topics sorted by key."""
    from pydoc_data.topics import topics

    seen: set[str] = set()
    paragraphs = []
    for key in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[key]):
            text = _clean_paragraph(para)
            if text is None or text in seen:
                continue
            seen.add(text)
            paragraphs.append(tuple(s for s in _SENTENCE_SPLIT.split(text) if s))
    return tuple(paragraphs)


@functools.lru_cache(maxsize=None)
def prose_corpus() -> str:
    """The cleaned prose corpus as one string (paragraphs separated by blank lines)."""
    return "\n\n".join(" ".join(p) for p in prose_paragraphs())


@functools.lru_cache(maxsize=None)
def _haystack_sentences(kind: str) -> tuple[tuple[str, ...], tuple[bool, ...], tuple[int, ...]]:
    """(sentences, starts-a-paragraph flags, index of each paragraph's first sentence) of a haystack kind."""
    if kind == "filler":
        return FILLER_SENTENCES, (False,) * len(FILLER_SENTENCES), (0,)
    sentences, starts, firsts = [], [], []
    for para in prose_paragraphs():
        firsts.append(len(sentences))
        kept = [s for s in para if len(s) <= MAX_SENTENCE_CHARS]
        for i, s in enumerate(kept):
            sentences.append(s)
            starts.append(i == 0)
    return tuple(sentences), tuple(starts), tuple(firsts)


_COUNTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _sentence_counts(tokenizer, kind: str) -> tuple[int, ...]:
    """Tokens of each haystack sentence (with its leading space), one batched call per tokenizer and kind."""
    try:
        per_tok = _COUNTS.setdefault(tokenizer, {})
    except TypeError:  # tokenizer not weak-referenceable: no cache
        per_tok = {}
    if kind not in per_tok:
        sentences = _haystack_sentences(kind)[0]
        ids = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
        per_tok[kind] = tuple(len(x) for x in ids)
    return per_tok[kind]


# --------------------------------------------------------------------------------------------------- tasks


@dataclasses.dataclass
class _Spec:
    intro: str
    needles: list[str]  # needles[0] is the real / first needle, placed at the sample's depth
    question: str
    answers: tuple[str, ...]


def _rng(task: str, seed: int, index: int, target_tokens: int) -> random.Random:
    digest = hashlib.sha256(f"kvjax-tasks|{task}|{seed}|{index}|{target_tokens}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _draw_number(rng: random.Random, digits: int, taken: set[str]) -> str:
    corpus = prose_corpus()
    while True:
        value = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if value not in taken and value not in corpus and not any(value in t or t in value for t in taken):
            taken.add(value)
            return value


def _draw_key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if not any(key in t or t in key for t in taken):  # "icy-otter" would hide in "spicy-otter"
            taken.add(key)
            return key


def _draw_variable(rng: random.Random, taken: set[str]) -> str:
    corpus = prose_corpus()
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken and name not in corpus and name not in ("VAR",):
            taken.add(name)
            return name


def _niah_needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _task_spec(task: str, rng: random.Random) -> _Spec:
    numbers: set[str] = set()
    keys: set[str] = set()
    if task == "passkey":
        value = _draw_number(rng, 5, numbers)
        return _Spec(
            _PASSKEY_INTRO,
            [f"The pass key is {value}. Remember it. {value} is the pass key."],
            "What is the pass key? Answer with the number only.",
            (value,),
        )
    if task in ("niah_single", "niah_multikey"):
        key, value = _draw_key(rng, keys), _draw_number(rng, 7, numbers)
        needles = [_niah_needle(key, value)]
        if task == "niah_multikey":
            for _ in range(NUM_NEEDLES - 1):
                needles.append(_niah_needle(_draw_key(rng, keys), _draw_number(rng, 7, numbers)))
        question = (
            f"What is the special magic number for {key} mentioned in the provided text? Answer with the number only."
        )
        return _Spec(_NIAH_INTRO, needles, question, (value,))
    if task == "niah_multivalue":
        key = _draw_key(rng, keys)
        values = [_draw_number(rng, 7, numbers) for _ in range(NUM_NEEDLES)]
        question = (
            f"What are all the special magic numbers for {key} mentioned in the provided text? "
            "Answer with the numbers only."
        )
        return _Spec(_NIAH_INTRO, [_niah_needle(key, v) for v in values], question, tuple(values))
    if task == "niah_multiquery":
        pairs = [(_draw_key(rng, keys), _draw_number(rng, 7, numbers)) for _ in range(NUM_NEEDLES)]
        names = ", ".join(k for k, _ in pairs[:-1]) + f", and {pairs[-1][0]}"
        question = (
            f"What are all the special magic numbers for {names} mentioned in the provided text? "
            "Answer with the numbers only."
        )
        return _Spec(_NIAH_INTRO, [_niah_needle(k, v) for k, v in pairs], question, tuple(v for _, v in pairs))
    if task == "variable_tracking":
        value = _draw_number(rng, 5, numbers)
        names: set[str] = set()
        chain = [_draw_variable(rng, names) for _ in range(NUM_CHAIN_VARIABLES)]
        needles = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = {a}." for a, b in zip(chain, chain[1:])]
        question = (
            f"Find all variables that are assigned the value {value} in the text above. "
            "Answer with the variable names only, separated by commas."
        )
        return _Spec(_VT_INTRO, needles, question, tuple(chain))
    raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")


def needle_depths(depth: float, num_needles: int) -> list[float]:
    """Depths of a sample's needles: the first at ``depth``, the others evenly spaced after it, wrapping at 1."""
    return [depth] + [(depth + j / num_needles) % 1.0 for j in range(1, num_needles)]


# --------------------------------------------------------------------------------------------------- assembly


def format_prompt_text(tokenizer, context: str, chat: bool) -> str:
    """``context`` as one user turn of the chat template with the generation prompt (as is without ``chat``)."""
    if not chat:
        return context
    messages = [{"role": "user", "content": context}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def tokenize_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt text (the chat template already holds its special tokens)."""
    return tokenizer(text, add_special_tokens=not chat)["input_ids"]


def _render(pieces: Sequence[tuple[str, str]]) -> str:
    if not pieces:
        return ""
    return pieces[0][1] + "".join(sep + text for sep, text in pieces[1:])


def _needle_boundaries(pieces: Sequence[tuple[str, str]], needles: Sequence[str], depths: Sequence[float]) -> list[int]:
    """For each needle, the sentence boundary (0..len(pieces)) nearest to its depth.

    Depth is the needle's start in characters over the final haystack's length (needles included).
    """
    offsets = [0]
    for i, (sep, text) in enumerate(pieces):
        offsets.append(offsets[-1] + (0 if i == 0 else len(sep)) + len(text))
    final = offsets[-1] + sum(len(n) + 1 for n in needles)
    bounds = [0] * len(needles)
    before, last = 0, 0  # characters of the needles placed before this one, last boundary used
    for i in sorted(range(len(needles)), key=lambda i: (depths[i], i)):
        goal = depths[i] * final - before
        last = min(range(last, len(offsets)), key=lambda b: (abs(offsets[b] - goal), b))
        bounds[i] = last
        before += len(needles[i]) + 1
    return bounds


def _place(pieces: Sequence[tuple[str, str]], needles: Sequence[str], bounds: Sequence[int]) -> str:
    """The haystack text with each needle inserted (as its own sentence) before the piece at its boundary."""
    at: dict[int, list[str]] = {}
    for i in sorted(range(len(needles)), key=lambda i: (bounds[i], i)):
        at.setdefault(bounds[i], []).append(needles[i])
    out: list[tuple[str, str]] = []
    for b in range(len(pieces) + 1):
        out.extend((" ", n) for n in at.get(b, ()))
        if b < len(pieces):
            out.append(pieces[b])
    return _render(out)


def _context(spec: _Spec, haystack_text: str) -> str:
    return f"{spec.intro}\n\n{haystack_text}\n\n{spec.question}"


def make_sample(
    task: str,
    tokenizer,
    target_tokens: int,
    *,
    index: int = 0,
    depth: float | None = None,
    seed: int = 0,
    haystack: str | None = None,
    chat: bool = True,
) -> TaskSample:
    """One sample of ``task`` whose prompt is ``0.98 * target_tokens <= len(prompt_ids) <= target_tokens``.

    ``depth`` (default 0.5) places the real / first needle at that fraction of the haystack (the other needles follow
    at evenly spaced depths, wrapping around). ``haystack`` is ``"prose"`` or ``"filler"`` (default per task, see
    :data:`DEFAULT_HAYSTACK`). With ``chat`` the tokenizer's chat template wraps the context as one user turn.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    haystack = DEFAULT_HAYSTACK[task] if haystack is None else haystack
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; allowed: {', '.join(HAYSTACKS)}")
    depth = 0.5 if depth is None else float(depth)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if isinstance(target_tokens, bool) or not isinstance(target_tokens, int) or target_tokens <= 0:
        raise ValueError(f"target_tokens must be a positive int, got {target_tokens!r}")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True needs a tokenizer with a chat template; this tokenizer has none (use chat=False)")

    rng = _rng(task, seed, index, target_tokens)
    sentences, starts, firsts = _haystack_sentences(haystack)
    paragraph = rng.randrange(len(prose_paragraphs()))  # drawn for both kinds: same values for either haystack
    start = firsts[paragraph] if haystack == "prose" else 0
    spec = _task_spec(task, rng)
    depths = needle_depths(depth, len(spec.needles))

    def fixed_tokens(spec: _Spec) -> int:
        return len(tokenize_prompt(tokenizer, format_prompt_text(tokenizer, _context(spec, " ".join(spec.needles)), chat), chat))

    fixed = fixed_tokens(spec)
    minimum = 2 * fixed_tokens(_task_spec(task, _rng(task, 0, 0, 0)))  # seed-independent: a reference sample
    if target_tokens < minimum:
        raise ValueError(
            f"target_tokens={target_tokens} is too small for task {task!r}: its intro, needles, question and template "
            f"take about {minimum // 2} tokens; use target_tokens >= {minimum}"
        )

    counts = _sentence_counts(tokenizer, haystack)
    n_sent = len(sentences)
    low, high = math.ceil(MIN_FRACTION * target_tokens), target_tokens
    aim = high - max(1, (high - low) // 4)

    def piece(k: int) -> tuple[str, str]:
        j = (start + k) % n_sent
        return ("\n\n" if starts[j] else " ", sentences[j])

    def est(k: int) -> int:
        return counts[(start + k) % n_sent]

    def select(budget: int) -> list[int]:
        return fill_sentences(est, budget, patience=64)

    def measure(pieces: list[tuple[str, str]], bounds: Sequence[int] | None = None) -> tuple[str, list[int]]:
        bounds = _needle_boundaries(pieces, spec.needles, depths) if bounds is None else bounds
        context = _context(spec, _place(pieces, spec.needles, bounds))
        return context, tokenize_prompt(tokenizer, format_prompt_text(tokenizer, context, chat), chat)

    # whole sentences, estimated from the cached counts and corrected by measuring the full prompt
    bias = 0  # measured tokens minus estimate
    best: list[int] = []  # the longest selection measured within target_tokens
    best_n = -1
    for _ in range(6):
        chosen = select(aim - fixed - bias)
        context, ids = measure([piece(k) for k in chosen])
        if low <= len(ids) <= high:
            break
        if best_n < len(ids) <= high:
            best, best_n = chosen, len(ids)
        new_bias = len(ids) - fixed - sum(est(k) for k in chosen)
        bias = new_bias if new_bias != bias else bias + (len(ids) - aim)
    else:
        # whole sentences keep missing the window (short targets): the needles stay where they are in the best
        # selection, whose last sentence is followed by as many words of the next ones as fit
        pieces = [piece(k) for k in best]
        bounds = _needle_boundaries(pieces, spec.needles, depths)
        first = best[-1] + 1 if best else 0
        words = _render([piece(k) for k in range(first, first + 64)]).split(" ")
        sep = piece(first)[0]

        def with_words(kept: list[str]) -> tuple[str, list[int]]:
            tail = [(sep, " ".join(kept))] if kept else []
            return measure(pieces + tail, [b if b < len(pieces) else b + len(tail) for b in bounds])

        lo_w, hi_w = 0, len(words)  # largest prefix of words keeping the prompt within target_tokens
        while lo_w < hi_w:
            mid = (lo_w + hi_w + 1) // 2
            if len(with_words(words[:mid])[1]) <= high:
                lo_w = mid
            else:
                hi_w = mid - 1
        kept = words[:lo_w]
        context, ids = with_words(kept)
        for word in words[lo_w + 1:lo_w + 33]:  # the next word is too long: try shorter ones after it
            if len(ids) >= low:
                break
            tried = with_words(kept + [word])
            if len(tried[1]) <= high:
                kept, (context, ids) = kept + [word], tried
        if not low <= len(ids) <= high:
            raise RuntimeError(f"could not fit {task!r} into {low}..{high} tokens (got {len(ids)})")
    return TaskSample(
        task=task,
        index=index,
        target_tokens=target_tokens,
        depth=depth,
        haystack=haystack,
        context=context,
        prompt_ids=tuple(ids),
        answers=spec.answers,
        question_start=question_start(tokenizer, format_prompt_text(tokenizer, context, chat), spec.question, ids, chat),
    )


def question_start(tokenizer, text: str, question: str, ids: Sequence[int], chat: bool) -> int:
    """Index of the first token of the question part of ``ids`` (the tokens of ``text``).

    The question part starts at the blank line before ``question``. Tokenizers may merge the
    context's last characters with that line break into one token; the boundary is then the end of
    the longest common prefix of ``ids`` and the context's own tokens, so the question part starts a
    token early and the prompt's tokens are the same in both evaluation protocols.
    """
    cut = text.rindex("\n\n" + question)
    return tokens_before(tokenizer, text[:cut], ids, chat)


def tokens_before(tokenizer, head: str, ids: Sequence[int], chat: bool) -> int:
    """How many of ``ids`` (a prompt's tokens) belong to its text prefix ``head``: the longest common prefix of
    ``ids`` and ``head``'s own tokens (a token merging ``head``'s end with what follows counts as after)."""
    own = tokenize_prompt(tokenizer, head, chat)
    n = 0
    while n < min(len(own), len(ids)) and own[n] == ids[n]:
        n += 1
    if n == 0 or n >= len(ids):
        raise RuntimeError(f"could not locate the question in the prompt (common prefix {n} of {len(ids)} tokens)")
    return n


def make_samples(
    task: str,
    tokenizer,
    target_tokens: int,
    num_samples: int,
    *,
    seed: int = 0,
    haystack: str | None = None,
    chat: bool = True,
) -> list[TaskSample]:
    """``num_samples`` samples (indices 0..n-1) with depths evenly spread: ``i / (n - 1)`` (0.5 for one sample).

    Depths are spread over all samples, for any ``num_samples`` (no cycling).
    """
    if num_samples <= 0:
        raise ValueError(f"num_samples must be > 0, got {num_samples}")
    depths = [0.5] if num_samples == 1 else [i / (num_samples - 1) for i in range(num_samples)]
    return [
        make_sample(task, tokenizer, target_tokens, index=i, depth=d, seed=seed, haystack=haystack, chat=chat)
        for i, d in enumerate(depths)
    ]


# --------------------------------------------------------------------------------------------------- scoring


def score(output: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` found in ``output`` (RULER's ``string_match_all``), 0..1.

    Numbers are plain, case-sensitive substrings as in RULER, so ``"1234567"`` counts inside ``"91234567"``.
    Word-like answers (letters / underscores, such as variable names) must match a whole word, case-insensitively
    as in RULER: ``"ABCDE"`` is found in ``"ABCDE, FGHIJ"`` but not in ``"XABCDEY"``.
    """
    if isinstance(answers, str):
        answers = (answers,)
    if not answers:
        raise ValueError("answers must not be empty")
    output = output.strip()
    found = 0
    for answer in answers:
        if re.fullmatch(r"\w+", answer) and not answer.isdigit():
            found += bool(re.search(rf"\b{re.escape(answer)}\b", output, flags=re.IGNORECASE))
        else:
            found += answer in output
    return found / len(answers)
