"""Prefill/decode consistency, chunked prefill, left padding, sampling and the compile counter (tiny models)."""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.api import generate_tokens
from kvjax.decoding import TRACE_COUNTS, Sampling, compress, decode_step, prefill, sample
from kvjax.methods import FullCache
from kvjax.models import load_model
from kvjax.models.llama import forward
from tests.tiny import PEAKED, save_tiny
from kvjax.cache import new_cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny("qwen2", str(path), seed=1, scale=PEAKED)
    return load_model(str(path), "float32", tokenizer=False)


def full_forward_logits(model, tokens):
    B, T = tokens.shape
    cache = new_cache(FullCache(block=16), model.config, B, T, 0, model.dtype)
    logits, _ = forward(model.graphdef, model.params, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), (B, T)), cache)
    return np.asarray(logits)


def test_prefill_then_decode_equals_full_forward(tiny):
    tokens = np.random.default_rng(0).integers(0, 97, size=(1, 40)).astype(np.int32)
    ref = full_forward_logits(tiny, tokens)
    cache = new_cache(FullCache(block=16), tiny.config, 1, 30, 10, tiny.dtype)
    last, cache = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, :30]), cache)
    np.testing.assert_allclose(np.asarray(last), ref[:, 29], atol=1e-5)
    cache = compress(cache)
    key = jax.random.PRNGKey(0)
    for t in range(30, 40):
        _, logits, cache = decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, t]), cache, key)
        np.testing.assert_allclose(np.asarray(logits), ref[:, t], atol=1e-5, err_msg=f"step {t}")


def test_chunked_prefill_equals_one_shot(tiny):
    tokens = np.random.default_rng(1).integers(0, 97, size=(1, 50)).astype(np.int32)
    one_shot = new_cache(FullCache(block=16), tiny.config, 1, 50, 1, tiny.dtype)
    ref, _ = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens), one_shot)
    cache = new_cache(FullCache(block=16), tiny.config, 1, 50, 1, tiny.dtype)
    for start in range(0, 50, 16):
        last, cache = prefill(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, start:start + 16]), cache)
    np.testing.assert_allclose(np.asarray(last), np.asarray(ref), atol=1e-5)
    a = generate_tokens(tiny, [list(tokens[0])], max_new_tokens=12)[0]
    b = generate_tokens(tiny, [list(tokens[0])], max_new_tokens=12, chunk_size=16)[0]
    np.testing.assert_array_equal(a, b)


def test_left_padded_batch_matches_rows_alone(tiny):
    rng = np.random.default_rng(2)
    rows = [list(rng.integers(0, 97, size=n)) for n in (7, 33, 20)]
    batch, count, _, _ = generate_tokens(tiny, rows, max_new_tokens=10, pad_id=0)
    for b, row in enumerate(rows):
        alone, _, _, _ = generate_tokens(tiny, [row], max_new_tokens=10)
        np.testing.assert_array_equal(batch[b], alone[0], err_msg=f"row {b}")
    assert list(count) == [10, 10, 10]


def test_streaming_equals_while_loop(tiny):
    row = list(np.random.default_rng(3).integers(0, 97, size=25))
    loop, _, _, _ = generate_tokens(tiny, [row], max_new_tokens=9)
    seen = []
    streamed, _, _, _ = generate_tokens(tiny, [row], max_new_tokens=9, on_token=lambda t: seen.append(int(t[0])))
    np.testing.assert_array_equal(loop, streamed)
    assert seen == list(loop[0])


def test_streaming_timings_split_the_first_step(tiny):
    """Streaming reports the first (compiling) step apart from the steady steps; the loop path does not."""
    row = list(np.random.default_rng(3).integers(0, 97, size=25))
    _, count, _, t = generate_tokens(tiny, [row], max_new_tokens=9, on_token=lambda t: None)
    assert int(count[0]) == 9
    assert {"first_step_s", "decode_steady_ms_per_token"} <= set(t)
    # the first step and the 7 steady steps together fit in the whole decode time
    assert t["first_step_s"] + 7 * t["decode_steady_ms_per_token"] / 1000 <= t["decode_s"] + 1e-9
    _, _, _, t_loop = generate_tokens(tiny, [row], max_new_tokens=9)
    assert "decode_steady_ms_per_token" not in t_loop


def test_eos_stops_and_is_counted(tiny):
    row = list(np.random.default_rng(4).integers(0, 97, size=12))
    free, _, _, _ = generate_tokens(tiny, [row], max_new_tokens=8)
    eos = int(free[0, 3])
    first = list(free[0]).index(eos)
    out, count, _, _ = generate_tokens(tiny, [row], max_new_tokens=8, eos_ids=[eos])
    assert int(count[0]) == first + 1
    assert all(int(t) == eos for t in out[0, first:])


def test_decode_compiles_once(tiny):
    row = list(np.random.default_rng(5).integers(0, 97, size=17))
    generate_tokens(tiny, [row], max_new_tokens=6, on_token=lambda t: None)
    before = dict(TRACE_COUNTS)
    generate_tokens(tiny, [row], max_new_tokens=6, on_token=lambda t: None)  # 5 decode steps, same shapes
    assert TRACE_COUNTS["decode_step"] == before["decode_step"]
    start = TRACE_COUNTS["decode_step"]
    # shapes no other test uses (batch 2, 64 slots): exactly one trace for 39 steps
    generate_tokens(tiny, [row[:15], row], max_new_tokens=40, on_token=lambda t: None)
    assert TRACE_COUNTS["decode_step"] == start + 1
    loop_before = TRACE_COUNTS["decode_loop"]
    generate_tokens(tiny, [row], max_new_tokens=20)
    generate_tokens(tiny, [row[::-1]], max_new_tokens=20)
    assert TRACE_COUNTS["decode_loop"] == loop_before + 1


def donated_aliases(lowered) -> dict:
    """``{argument index: output index}`` of a lowered jit's donated arguments (its StableHLO ``tf.aliasing_output``)."""
    text = lowered.as_text()
    sig = text[text.index("func.func public @main("):]
    sig = sig[:sig.index("{\n")]
    return {int(a): int(o) for a, o in re.findall(r"%arg(\d+): [^%]*?tf\.aliasing_output = (\d+)", sig)}


def test_donated_cache_leaves_alias_their_own_outputs(tiny):
    """Every cache leaf is written back into its own buffer: XLA gives a donated buffer to the first output of its
    shape, so sampled tokens ``int32[B]`` returned before the cache would take the buffer of the cache's first
    ``int32[B]`` leaf (``pad``) and shift every later one, a device copy each per step."""
    from kvjax.decoding import decode_loop_jit, decode_step_jit

    cache = new_cache(FullCache(block=16), tiny.config, 2, 16, 8, tiny.dtype)
    _, cache = prefill(tiny.graphdef, tiny.params, jnp.zeros((2, 16), jnp.int32), cache)
    cache = compress(cache)
    leaves = jax.tree_util.tree_leaves(cache)
    assert any(x.shape == (2,) and x.dtype == jnp.int32 for x in leaves)  # the collision this guards against
    first = len(jax.tree_util.tree_leaves(tiny.params)) + 1  # the cache's leaves follow the parameters and tokens
    own = {first + i: i for i in range(len(leaves))}
    tokens, key = jnp.zeros((2,), jnp.int32), jax.random.PRNGKey(0)
    assert donated_aliases(decode_step_jit.lower(tiny.graphdef, tiny.params, tokens, cache, key)) == own
    assert donated_aliases(decode_loop_jit.lower(tiny.graphdef, tiny.params, tokens, cache, key,
                                                 max_new_tokens=4)) == own


def test_top_p_keeps_smallest_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.log(jnp.asarray(probs))[None].repeat(2000, axis=0)
    keys = jax.random.PRNGKey(0)
    drawn = np.asarray(sample(logits, keys, Sampling(temperature=1.0, top_p=0.75)))
    assert set(np.unique(drawn)) == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
    assert abs((drawn == 0).mean() - 0.5 / 0.8) < 0.05
    greedy = np.asarray(sample(logits[:3], keys, Sampling()))
    assert list(greedy) == [0, 0, 0]


def test_sampling_is_deterministic_per_seed(tiny):
    row = list(np.random.default_rng(6).integers(0, 97, size=10))
    s = Sampling(temperature=1.0, top_p=0.9)
    a = generate_tokens(tiny, [row], max_new_tokens=8, sampling=s, seed=3)[0]
    b = generate_tokens(tiny, [row], max_new_tokens=8, sampling=s, seed=3)[0]
    c = generate_tokens(tiny, [row], max_new_tokens=8, sampling=s, seed=4)[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_ask_several_questions_over_one_compressed_context(tiny_chat_model):
    """kvjax.ask compresses the context once; at budget 1.0 each answer equals generate() with the full cache
    and the question after the context; at a small budget the cache holds the budget, not the context."""
    import kvjax
    from kvjax.methods import SnapKV

    model = load_model(tiny_chat_model, "float32")
    context = ("Ada keeps three cats named Pixel, Byte and Nibble. Her brother Alan keeps a parrot called Turing. "
               "The cats sleep in the kitchen and the parrot sleeps in the study. ") * 3
    questions = ["How many cats does Ada keep?", "What is the parrot called?"]
    answers = kvjax.ask(model, context, questions, method=SnapKV(budget=1.0, window=8), chat=True, max_new_tokens=12)
    for q, got in zip(questions, answers):
        ref = kvjax.generate(model, context, question=q, chat=True, max_new_tokens=12)
        assert got.tokens == ref.tokens and got.text == ref.text, q
        assert got.prompt_tokens == ref.prompt_tokens
    assert answers[0].tokens != answers[1].tokens  # the questions lead to different answers
    small = kvjax.ask(model, context, questions[:1], method=SnapKV(budget=32, window=8), chat=True, max_new_tokens=4)
    assert small[0].cache_stats["kept_tokens_per_head"][0] == [32, 32]


def test_decode_compiler_options_turn_on_the_gpu_scheduler_only_on_a_gpu():
    """XLA:GPU's latency-hiding scheduler for the top-level decode programs on a GPU (host recalls overlap the step,
    tests/test_gpu_schedule.py); no option elsewhere, where the GPU flag would mean nothing."""
    from kvjax.decoding import GPU_DECODE_COMPILER_OPTIONS, decode_compiler_options

    assert GPU_DECODE_COMPILER_OPTIONS == {"xla_gpu_enable_latency_hiding_scheduler": True}
    assert decode_compiler_options("gpu") == decode_compiler_options("cuda") == GPU_DECODE_COMPILER_OPTIONS
    assert decode_compiler_options("cpu") == decode_compiler_options("tpu") == {}
    assert decode_compiler_options() == {}  # this machine's backend is the CPU


def test_decode_compiler_options_can_be_turned_off(monkeypatch):
    """``KVJAX_DECODE_XLA_DEFAULTS=1``: XLA's defaults on a GPU too (``0`` or empty: kvjax's options)."""
    from kvjax.decoding import GPU_DECODE_COMPILER_OPTIONS, XLA_DEFAULTS_ENV, decode_compiler_options

    monkeypatch.setenv(XLA_DEFAULTS_ENV, "1")
    assert decode_compiler_options("gpu") == {}
    monkeypatch.setenv(XLA_DEFAULTS_ENV, "0")
    assert decode_compiler_options("gpu") == GPU_DECODE_COMPILER_OPTIONS


def test_decode_with_the_gpu_options_generates_the_same_tokens(tiny, monkeypatch):
    """The path a GPU takes (the loop and the streaming step compiled with the GPU options, which the CPU ignores)
    runs and gives the tokens of the plain path."""
    generate_mod = importlib.import_module("kvjax.decoding")

    row = list(np.random.default_rng(4).integers(0, 97, size=25))
    loop, _, _, _ = generate_tokens(tiny, [row], max_new_tokens=6)
    streamed, _, _, _ = generate_tokens(tiny, [row], max_new_tokens=6, on_token=lambda t: None)
    asked = []

    def gpu_options(platform=None):
        asked.append(platform)
        return dict(generate_mod.GPU_DECODE_COMPILER_OPTIONS)

    monkeypatch.setattr(generate_mod, "decode_compiler_options", gpu_options)
    gpu_loop, _, _, _ = generate_tokens(tiny, [row], max_new_tokens=6)
    assert len(asked) == 1  # the loop asked once
    gpu_streamed, _, _, _ = generate_tokens(tiny, [row], max_new_tokens=6, on_token=lambda t: None)
    assert len(asked) == 1 + 5  # and each of the 5 streaming steps
    np.testing.assert_array_equal(gpu_loop, loop)
    np.testing.assert_array_equal(gpu_streamed, streamed)


def test_ask_with_kvzip_compresses_once_and_answers_as_separate_calls(tiny_chat_model):
    """KVzip's use: the context is scored by reconstruction and compressed once, then every question is answered
    from that cache; each answer equals a separate generate() that compresses the same context for its question."""
    import kvjax
    from kvjax.methods import KVzip

    model = load_model(tiny_chat_model, "float32")
    context = ("Ada keeps three cats named Pixel, Byte and Nibble. Her brother Alan keeps a parrot called Turing. "
               "The cats sleep in the kitchen and the parrot sleeps in the study. ") * 3
    questions = ["How many cats does Ada keep?", "What is the parrot called?", "Where do the cats sleep?"]
    method = KVzip(budget=0.3, chunk=64)
    answers = kvjax.ask(model, context, questions, method=method, chat=True, max_new_tokens=10)
    for q, got in zip(questions, answers):
        ref = kvjax.generate(model, context, question=q, method=method, chat=True, max_new_tokens=10)
        assert got.tokens == ref.tokens, q
        assert got.cache_stats["kept_tokens_per_head"] == ref.cache_stats["kept_tokens_per_head"]
        assert got.timings["reconstruct_s"] > 0
    from kvjax.api import split_at_question

    n = len(split_at_question(model.tokenizer, context, questions[0], True)[0])  # the context's tokens
    kept = sum(sum(layer) for layer in answers[0].cache_stats["kept_tokens_per_head"])
    heads = model.config.num_layers * model.config.num_kv_heads
    assert heads * n - int(heads * n * 0.7) - 2 <= kept <= heads * n - int(heads * n * 0.7)  # ties may evict more
