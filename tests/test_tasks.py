"""RULER-style task generators (kvjax.evals.tasks): needles, depths, prompt sizes, determinism, scoring, errors."""

from __future__ import annotations

import re

import pytest

from kvjax.evals import tasks
from kvjax.evals.tasks import TASKS, TaskSample, make_sample, make_samples, score

NIAH_NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")
VT_STATEMENT = re.compile(r"VAR ([A-Z]{5}) = ([A-Z]{5}|\d{5})\.")


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def haystack_span(context: str) -> tuple[int, int]:
    """Start and end of the haystack: between the intro line and the question (blank lines around it)."""
    return context.index("\n\n") + 2, context.rindex("\n\n")


def real_needle_start(sample: TaskSample) -> int:
    """Character index of the real (multikey) / first needle in the context."""
    c, value = sample.context, sample.answers[0]
    if sample.task == "passkey":
        return c.index(f"The pass key is {value}.")
    if sample.task == "variable_tracking":
        return c.index(f"VAR {value} = ")
    return c.index(next(m.group(0) for m in NIAH_NEEDLE.finditer(c) if m.group(2) == value))


def check_needles(s: TaskSample) -> None:
    """Each task's needles appear exactly as designed, and the question asks about them."""
    c = s.context
    question = c[c.rindex("\n\n") + 2:]
    assert question.endswith(("Answer with the number only.", "Answer with the numbers only.", "separated by commas."))
    assert s.context.endswith(question) and not NIAH_NEEDLE.search(question) and not VT_STATEMENT.search(question)
    if s.task == "passkey":
        (value,) = s.answers
        assert len(value) == 5 and value.isdigit()
        assert c.count(f"The pass key is {value}. Remember it. {value} is the pass key.") == 1
        assert c.count(value) == 2 and question == "What is the pass key? Answer with the number only."
        assert not NIAH_NEEDLE.search(c)
        return
    if s.task == "variable_tracking":
        statements = VT_STATEMENT.findall(c)
        assert len(statements) == tasks.NUM_CHAIN_VARIABLES
        value = next(rhs for _, rhs in statements if rhs.isdigit())
        assert c.count(value) == 2  # the first assignment and the question
        assert f"assigned the value {value} in the text above" in question
        # one chain: value -> first name -> ... ; answers are its names, each assigned once
        assigned = dict(statements)
        assert sorted(assigned) == sorted(s.answers) and len(assigned) == len(statements)
        chain, rhs_of = [], {rhs: lhs for lhs, rhs in statements}
        cur = value
        while cur in rhs_of:
            cur = rhs_of[cur]
            chain.append(cur)
        assert tuple(chain) == s.answers
        for name in s.answers:  # LHS once, RHS once (except the last)
            assert len(re.findall(rf"\b{name}\b", c)) == (1 if name == s.answers[-1] else 2)
        return
    needles = NIAH_NEEDLE.findall(c)
    keys = [k for k, _ in needles]
    values = [v for _, v in needles]
    assert len(set(values)) == len(values)
    for v in values:
        assert c.count(v) == 1
    if s.task == "niah_single":
        assert len(needles) == 1 and values == list(s.answers)
        assert question.startswith(f"What is the special magic number for {keys[0]} mentioned")
    elif s.task == "niah_multikey":
        assert len(needles) == tasks.NUM_NEEDLES and len(set(keys)) == tasks.NUM_NEEDLES
        real = dict(needles)
        asked = [k for k in keys if k in question]
        assert len(asked) == 1 and s.answers == (real[asked[0]],)
    elif s.task == "niah_multivalue":
        assert len(needles) == tasks.NUM_NEEDLES and len(set(keys)) == 1
        assert sorted(values) == sorted(s.answers)
        assert question.startswith(f"What are all the special magic numbers for {keys[0]} mentioned")
    elif s.task == "niah_multiquery":
        assert len(needles) == tasks.NUM_NEEDLES and len(set(keys)) == tasks.NUM_NEEDLES
        real = dict(needles)
        asked = sorted(keys, key=question.index)
        assert all(k in question for k in keys)
        assert s.answers == tuple(real[k] for k in asked)
    else:  # pragma: no cover
        raise AssertionError(s.task)


@pytest.mark.parametrize("target", [1024, 4096])
@pytest.mark.parametrize("haystack", ["prose", "filler"])
@pytest.mark.parametrize("task", TASKS)
def test_needles_depth_question_and_length(tok, task, haystack, target):
    for depth in (0.0, 0.5, 1.0):
        s = make_sample(task, tok, target, depth=depth, haystack=haystack)
        assert (s.task, s.target_tokens, s.depth, s.haystack, s.index) == (task, target, depth, haystack, 0)
        assert 0.98 * target <= len(s.prompt_ids) <= target
        check_needles(s)
        start, end = haystack_span(s.context)
        assert abs((real_needle_start(s) - start) / (end - start) - depth) <= 0.05
        # prompt_ids is exactly the chat-templated context
        templated = tok.apply_chat_template(
            [{"role": "user", "content": s.context}], tokenize=False, add_generation_prompt=True
        )
        assert s.prompt_ids == tuple(tok(templated, add_special_tokens=False)["input_ids"])


def test_other_needles_are_spread_away_from_the_real_one(tok):
    s = make_sample("niah_multikey", tok, 4096, depth=0.5)
    start, end = haystack_span(s.context)
    depths = sorted((m.start() - start) / (end - start) for m in NIAH_NEEDLE.finditer(s.context))
    assert depths == pytest.approx([0.0, 0.25, 0.5, 0.75], abs=0.03)
    assert tasks.needle_depths(1.0, 4) == [1.0, 0.25, 0.5, 0.75]


def test_16k_prompt_is_sized(tok):
    s = make_sample("niah_multikey", tok, 16384, depth=0.25, haystack="prose")
    assert 0.98 * 16384 <= len(s.prompt_ids) <= 16384
    check_needles(s)


def test_without_chat_template(tok):
    s = make_sample("niah_single", tok, 1024, chat=False)
    assert 0.98 * 1024 <= len(s.prompt_ids) <= 1024
    assert s.prompt_ids == tuple(tok(s.context, add_special_tokens=True)["input_ids"])
    assert s.answers == make_sample("niah_single", tok, 1024, chat=True).answers
    assert not tok.decode(s.prompt_ids).startswith("<|im_start|>")


def test_default_depth_and_haystack(tok):
    assert make_sample("passkey", tok, 1024).haystack == "filler"
    assert make_sample("variable_tracking", tok, 1024).haystack == "filler"
    s = make_sample("niah_single", tok, 1024)
    assert s.haystack == "prose" and s.depth == 0.5


def test_same_seed_same_sample_different_seed_or_index_different_values(tok):
    for task in TASKS:
        a = make_sample(task, tok, 1024, seed=3, index=2, depth=0.3)
        assert a == make_sample(task, tok, 1024, seed=3, index=2, depth=0.3)
        assert make_sample(task, tok, 1024, seed=4, index=2, depth=0.3).answers != a.answers
        assert make_sample(task, tok, 1024, seed=3, index=1, depth=0.3).answers != a.answers
    # prose haystacks start at a seed-dependent paragraph
    c0 = make_sample("niah_single", tok, 1024, seed=0).context
    c1 = make_sample("niah_single", tok, 1024, seed=1).context
    assert c0[c0.index("\n\n"):][:200] != c1[c1.index("\n\n"):][:200]


def test_values_do_not_depend_on_depth_or_haystack(tok):
    a = make_sample("niah_multivalue", tok, 1024, depth=0.0, haystack="prose")
    b = make_sample("niah_multivalue", tok, 1024, depth=1.0, haystack="filler")
    assert a.answers == b.answers


def test_make_samples_spreads_depths(tok):
    samples = make_samples("niah_single", tok, 1024, 5, seed=1)
    assert [s.depth for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [s.index for s in samples] == [0, 1, 2, 3, 4]
    assert len({s.answers for s in samples}) == 5
    assert samples[2] == make_sample("niah_single", tok, 1024, index=2, depth=0.5, seed=1)
    (one,) = make_samples("passkey", tok, 1024, 1)
    assert one.depth == 0.5
    assert [s.depth for s in make_samples("passkey", tok, 512, 3, haystack="prose", chat=False)] == [0.0, 0.5, 1.0]


def test_score():
    assert score("The answer is 1234567.", ["1234567"]) == 1.0
    assert score("I don't know", ["1234567"]) == 0.0
    assert score("1111111, 3333333", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert score("  \n 1234567 \n", ["1234567"]) == 1.0
    assert score("1234567", ("1234567",)) == 1.0
    # numbers are substrings, as in RULER's string_match_all: a longer number containing the answer counts
    assert score("91234567", ["1234567"]) == 1.0
    assert score("123456", ["1234567"]) == 0.0
    # variable names must match whole words (case-insensitively, as RULER lowercases)
    assert score("ABCDE, FGHIJ", ["ABCDE", "FGHIJ"]) == 1.0
    assert score("XABCDEY", ["ABCDE"]) == 0.0
    assert score("abcde", ["ABCDE"]) == 1.0
    assert score("VAR ABCDE = 12345", ["ABCDE", "KLMNO"]) == 0.5
    with pytest.raises(ValueError):
        score("1234567", [])


def test_score_of_a_perfect_answer_is_one(tok):
    for task in TASKS:
        s = make_sample(task, tok, 1024)
        assert score(", ".join(s.answers), s.answers) == 1.0
        assert score("", s.answers) == 0.0


def test_bad_inputs(tok):
    with pytest.raises(ValueError, match="unknown task.*niah_single"):
        make_sample("niah", tok, 1024)
    with pytest.raises(ValueError, match="unknown haystack.*prose.*filler"):
        make_sample("niah_single", tok, 1024, haystack="essays")
    for depth in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="depth"):
            make_sample("niah_single", tok, 1024, depth=depth)
    for n in (0, -1):
        with pytest.raises(ValueError, match="num_samples"):
            make_samples("niah_single", tok, 1024, n)
    with pytest.raises(ValueError, match=r"target_tokens >= (\d+)") as err:
        make_sample("niah_multikey", tok, 100)
    minimum = int(re.search(r"target_tokens >= (\d+)", str(err.value)).group(1))
    assert minimum > 100
    for seed in range(5):  # the minimum does not depend on the seed, and fits
        s = make_sample("niah_multikey", tok, minimum, seed=seed)
        assert 0.98 * minimum <= len(s.prompt_ids) <= minimum
    with pytest.raises(ValueError, match=f"target_tokens >= {minimum}"):
        make_sample("niah_multikey", tok, minimum - 1, seed=7)

    class NoTemplate:
        chat_template = None

        def __call__(self, *args, **kwargs):
            return tok(*args, **kwargs)

    with pytest.raises(ValueError, match="chat template"):
        make_sample("niah_single", NoTemplate(), 1024)
    assert len(make_sample("niah_single", NoTemplate(), 1024, chat=False).prompt_ids) <= 1024


def test_prose_haystack_is_cleaned_english():
    corpus = tasks.prose_corpus()
    assert len(corpus) > 100_000
    for marker in (">>>", "::=", "****", "====", "----"):
        assert marker not in corpus
    words = re.findall(r"[a-z]+", corpus.lower())
    for common in ("the", "is", "of", "and", "to", "a", "in"):
        assert words.count(common) > 200
    for para in corpus.split("\n\n"):
        assert para[-1] in '.!?")”’' and len(para.split()) >= 8
    assert tasks.prose_corpus() is corpus  # cached


def test_prose_sample_reads_as_prose(tok):
    s = make_sample("niah_single", tok, 2048, haystack="prose")
    start, end = haystack_span(s.context)
    text = s.context[start:end]
    assert ">>>" not in text and "::=" not in text
    assert " the " in text and " is " in text and "Python" in text
    filler = make_sample("niah_single", tok, 2048, haystack="filler").context
    assert "The grass is green. The sky is blue." in filler
