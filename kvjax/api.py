"""High-level API on text prompts: ``kvjax.load``, ``kvjax.generate``, ``kvjax.compare`` (methods side by side,
one shared prefill) and ``kvjax.ask`` (questions over one compressed context)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import CacheSpec
from kvjax.decoding import Sampling, compress, decode_loop, decode_step, prefill, prefill_prompt, sample
from kvjax.methods import FullCache, get_method
from kvjax.sharding import place_cache, place_rows


@dataclasses.dataclass
class GenerationResult:
    """Output of :func:`generate`: texts and tokens per row, cache statistics and timings.

    ``timings``: ``prefill_s``, ``compress_s``, ``decode_s`` and ``decode_ms_per_token`` (each includes
    the compilation of its jitted function on first use); when streaming and at least 3 tokens were
    generated also ``first_step_s`` (the first decode step, incl. its compilation) and
    ``decode_steady_ms_per_token`` (the steps after it).
    """

    texts: list[str]
    tokens: list[list[int]]
    prompt_tokens: list[int]
    cache_stats: dict
    timings: dict

    @property
    def text(self) -> str:
        """The first row's text."""
        return self.texts[0]


def load(name_or_path: str | None = None, dtype="float32", *, progress: bool = False, mesh=None):
    """Load a ready model (default ``qwen2.5-coder-0.5b``), an HF directory or a GGUF file.

    ``mesh``: split the model (and every cache made for it) over a device mesh: a
    :class:`jax.sharding.Mesh` with axes ``(data, model)``, a dict, or ``"data=2,model=4"``
    (:mod:`kvjax.sharding`). Batch rows go to ``data``, attention heads to ``model``.
    """
    from kvjax.models import DEFAULT_MODEL, load_model

    name = name_or_path or DEFAULT_MODEL
    if progress:
        from tqdm import tqdm

        with tqdm(total=1, desc=f"loading {name}", unit="model", leave=False) as bar:
            model = load_model(name, dtype, mesh=mesh)
            bar.update()
        return model
    return load_model(name, dtype, mesh=mesh)


def _resolve_method(method):
    if method is None:
        return FullCache()
    if isinstance(method, str):
        return get_method(method)
    return method


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token rows to a common length (rounded up to ``multiple``); returns (tokens [B, L], pad [B])."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every prompt must have at least one token")
    longest = max(len(r) for r in rows)
    length = -(-longest // multiple) * multiple
    tokens = np.full((len(rows), length), pad_id, np.int32)
    pad = np.zeros((len(rows),), np.int32)
    for b, r in enumerate(rows):
        tokens[b, length - len(r):] = r
        pad[b] = length - len(r)
    return tokens, pad


def batch_for(model, token_rows: Sequence[Sequence[int]], *, max_new_tokens: int, chunk_size: int | None,
              pad_id: int, question_rows: Sequence[Sequence[int]] | None = None, kv_dtype=None):
    """``(tokens [B, L], pad [B], question [B, Q] or None, spec)`` of a batch of token rows, left-padded to a
    multiple of ``chunk_size``, after checking that it fits the model's context (``kv_dtype``: the spec's)."""
    config = model.config
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 or None, got {chunk_size}")
    tokens, pad = left_pad(token_rows, pad_id, multiple=chunk_size or 1)
    question = None
    if question_rows is not None:
        if len(question_rows) != len(token_rows):
            raise ValueError(f"need one question per prompt: {len(question_rows)} questions for {len(token_rows)} prompts")
        lengths = {len(q) for q in question_rows}
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError(f"the questions of a batch must have one non-zero length in tokens, got {sorted(lengths)}")
        question = np.asarray(question_rows, np.int32)
    q_len = 0 if question is None else question.shape[1]
    longest = max(len(r) for r in token_rows)
    if longest + q_len + max_new_tokens > config.max_position_embeddings:
        question_part = f" + {q_len} question tokens" if q_len else ""
        raise ValueError(
            f"prompt of {longest} tokens{question_part} + max_new_tokens={max_new_tokens} exceeds the "
            f"model's context of {config.max_position_embeddings} tokens"
        )
    B, L = tokens.shape
    spec = CacheSpec.for_model(config, B, L, q_len + max_new_tokens, model.dtype, longest_row=longest, mesh=model.mesh,
                               kv_dtype=kv_dtype)
    return tokens, pad, question, spec


def timed_prefill(model, tokens: np.ndarray, cache, *, chunk_size: int | None, progress: bool, reconstruction=None):
    """``(logits, cache, {"prefill_s": ...})``: the prompt prefilled into ``cache`` (placed on the model's mesh).

    For a method that re-reads the context before compression (KVzip) its passes run too, timed apart
    (``reconstruct_s``); ``reconstruction`` is their prompt (``kvjax.models.tokenizer.reconstruction_prompt``).
    """
    host_tokens = np.asarray(tokens)
    tokens = place_rows(jnp.asarray(tokens), model.mesh)
    t0 = time.perf_counter()
    logits, cache = prefill_prompt(model.graphdef, model.params, tokens, place_cache(cache), chunk_size=chunk_size,
                                   progress=progress)
    jax.block_until_ready(logits)
    timings = {"prefill_s": time.perf_counter() - t0}
    if cache.method.rereads_context():
        if reconstruction is None:
            raise ValueError(f"{cache.method.name} re-reads the context before compression: pass reconstruction="
                             "kvjax.models.tokenizer.reconstruction_prompt(tokenizer, chat) for prompts given as tokens")
        from kvjax.methods.kvzip import score_context

        t0 = time.perf_counter()
        cache = score_context(model.graphdef, model.params, cache, host_tokens, reconstruction)
        jax.block_until_ready(cache)
        timings["reconstruct_s"] = time.perf_counter() - t0
    return logits, cache, timings


def compress_and_decode(model, logits, cache, question, timings: dict, *, max_new_tokens: int, sampling: Sampling,
                        seed: int, eos_ids: Sequence[int], on_token: Callable[[np.ndarray], None] | None = None):
    """Compress a prefilled cache, prefill the question (if any) onto it, and decode: ``(tokens [B, n],
    num_generated [B], cache, timings)`` (``timings`` extended with ``compress_s``, ``question_s``, ``decode_s``,
    ``decode_ms_per_token`` and, when streaming, ``first_step_s`` and ``decode_steady_ms_per_token``)."""
    timings = dict(timings)
    B = cache.spec.batch
    t0 = time.perf_counter()
    cache = compress(cache)
    jax.block_until_ready(cache)
    timings["compress_s"] = time.perf_counter() - t0
    if question is not None:
        t0 = time.perf_counter()
        logits, cache = prefill(model.graphdef, model.params, place_rows(jnp.asarray(question), model.mesh), cache)
        jax.block_until_ready(logits)
        timings["question_s"] = time.perf_counter() - t0
    key = jax.random.PRNGKey(seed)
    key, sub = jax.random.split(key)
    first = sample(logits, sub, sampling)
    eos_ids = tuple(int(e) for e in eos_ids)

    t0 = time.perf_counter()
    if on_token is None:
        out, count, cache = decode_loop(
            model.graphdef, model.params, first, cache, key,
            max_new_tokens=max_new_tokens, eos_ids=eos_ids, sampling=sampling,
        )
        out, count = np.asarray(out), np.asarray(count)
    else:
        out = np.zeros((B, max_new_tokens), np.int32)
        count = np.zeros((B,), np.int32)
        done = np.zeros((B,), bool)
        tok = first
        arrivals = []  # when each token reached the host
        for i in range(max_new_tokens):
            host_tok = np.asarray(tok)
            arrivals.append(time.perf_counter())
            host_tok = np.where(done, out[:, i - 1] if i else host_tok, host_tok)
            out[:, i] = host_tok
            count += ~done
            on_token(host_tok)
            done |= np.isin(host_tok, eos_ids)
            if done.all() or i == max_new_tokens - 1:
                break
            key, sub = jax.random.split(key)
            tok, _, cache = decode_step(model.graphdef, model.params, jnp.asarray(host_tok), cache, sub, sampling=sampling)
    timings["decode_s"] = time.perf_counter() - t0
    timings["decode_ms_per_token"] = 1000 * timings["decode_s"] / max(int(count.max()) - 1, 1)
    if on_token is not None and len(arrivals) >= 3:
        # token 1 waits for the first decode_step call (its compilation, once per process and shape);
        # the steps after it are the steady-state decode speed
        timings["first_step_s"] = arrivals[1] - arrivals[0]
        timings["decode_steady_ms_per_token"] = 1000 * (arrivals[-1] - arrivals[1]) / (len(arrivals) - 2)
    return out, count, cache, timings


def generate_tokens(
    model, token_rows: Sequence[Sequence[int]], *, method=None, max_new_tokens: int = 64,
    sampling: Sampling = Sampling(), seed: int = 0, chunk_size: int | None = None,
    eos_ids: Sequence[int] = (), pad_id: int = 0, on_token: Callable[[np.ndarray], None] | None = None,
    progress: bool = False, question_rows: Sequence[Sequence[int]] | None = None, artifact=None, reconstruction=None,
    kv_dtype=None,
):
    """Generate from token-id prompts; returns (tokens [B, n], num_generated [B], cache, timings).

    ``question_rows`` (optional, one per prompt, all of one length): the prompts are the *context*,
    compressed alone, and the questions are then prefilled onto the compressed cache uncompressed
    (the query-agnostic setting). ``on_token`` switches to the per-step jitted function and is
    called with each step's tokens [B] (streaming); otherwise the whole decode runs in one jitted
    ``while_loop``. ``reconstruction``: the reconstruction prompt of a method that re-reads the context (KVzip;
    ``kvjax.models.tokenizer.reconstruction_prompt``). ``kv_dtype``: the compressed pools' storage dtype (None: the
    model's; :mod:`kvjax.kv_quantization`).
    """
    method = _resolve_method(method)
    tokens, pad, question, spec = batch_for(model, token_rows, max_new_tokens=max_new_tokens, chunk_size=chunk_size,
                                            pad_id=pad_id, question_rows=question_rows, kv_dtype=kv_dtype)
    cache = method.init_cache(spec, artifact).replace(pad=jnp.asarray(pad))
    logits, cache, timings = timed_prefill(model, tokens, cache, chunk_size=chunk_size, progress=progress,
                                           reconstruction=reconstruction)
    return compress_and_decode(model, logits, cache, question, timings, max_new_tokens=max_new_tokens,
                               sampling=sampling, seed=seed, eos_ids=eos_ids, on_token=on_token)


def compare_tokens(
    model, token_rows: Sequence[Sequence[int]], methods: Sequence, *, artifacts: Sequence | None = None,
    max_new_tokens: int = 64, sampling: Sampling = Sampling(), seed: int = 0, chunk_size: int | None = None,
    eos_ids: Sequence[int] = (), pad_id: int = 0, progress: bool = False,
    question_rows: Sequence[Sequence[int]] | None = None, reconstruction=None,
    on_token: Callable[[np.ndarray], None] | None = None, kv_dtype=None,
) -> list[tuple]:
    """:func:`generate_tokens` for each of ``methods`` on the same rows, one result per method, with **one**
    prefill for every method that can share it (:mod:`kvjax.shared_prefill`: the full cache and the
    evict-after-prefill methods); the others run their own. The shared methods' ``timings`` carry the shared
    prefill's ``prefill_s`` and ``prefill_shared_by`` (how many methods it served). With ``on_token`` each method
    decodes step by step, calling it with every token, and its timings separate the first step (with its
    compilation) from the steady state (:func:`compress_and_decode`). ``kv_dtype``: as :func:`generate_tokens`'s."""
    from kvjax.shared_prefill import cache_for, can_share_prefill, init_shared_cache

    methods = [_resolve_method(m) for m in methods]
    if not methods:
        raise ValueError("compare needs at least one method")
    artifacts = [None] * len(methods) if artifacts is None else list(artifacts)
    if len(artifacts) != len(methods):
        raise ValueError(f"need one artifact (or None) per method: {len(artifacts)} for {len(methods)} methods")
    tokens, pad, question, spec = batch_for(model, token_rows, max_new_tokens=max_new_tokens, chunk_size=chunk_size,
                                            pad_id=pad_id, question_rows=question_rows, kv_dtype=kv_dtype)
    decode = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, eos_ids=eos_ids, on_token=on_token)
    shared = [i for i, m in enumerate(methods) if can_share_prefill(m)]
    if len(shared) < 2:
        shared = []
    results: list = [None] * len(methods)
    if shared:
        staged = init_shared_cache([methods[i] for i in shared], spec, [artifacts[i] for i in shared])
        logits, staged, timings = timed_prefill(model, tokens, staged.replace(pad=jnp.asarray(pad)),
                                                chunk_size=chunk_size, progress=progress)
        timings["prefill_shared_by"] = len(shared)
        for i in shared:
            cache = cache_for(staged, methods[i], artifacts[i])
            results[i] = compress_and_decode(model, logits, cache, question, timings, **decode)
        del staged  # device memory: the staging is held only while the methods it served run
    for i, m in enumerate(methods):
        if results[i] is None:
            cache = m.init_cache(spec, artifacts[i]).replace(pad=jnp.asarray(pad))
            logits, cache, timings = timed_prefill(model, tokens, cache, chunk_size=chunk_size, progress=progress,
                                                   reconstruction=reconstruction)
            results[i] = compress_and_decode(model, logits, cache, question, timings, **decode)
    return results


def split_at_question(tokenizer, context: str, question: str, chat: bool) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of ``context + "\n" + question`` formatted for the model (chat template
    with ``chat``), split in front of the question: the question ids carry the template's end of turn."""
    from kvjax.models.tokenizer import format_prompt

    text = format_prompt(tokenizer, context + "\n" + question, chat)
    cut = text.rindex(question)
    return (tokenizer(text[:cut], add_special_tokens=True)["input_ids"],
            tokenizer(text[cut:], add_special_tokens=False)["input_ids"])


def generate(
    model, prompt: str | Sequence[str], *, method=None, max_new_tokens: int = 64, chat: bool = False,
    temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, chunk_size: int | None = None,
    stream: Callable[[str], None] | None = None, progress: bool = False, question: str | Sequence[str] | None = None,
    artifact=None, kv_dtype=None,
) -> GenerationResult:
    """Generate text for one prompt or a batch (left-padded) with a KV-cache ``method``.

    Args:
      model: from :func:`load`.
      prompt: a string or a list of strings.
      method: a method instance (e.g. ``kvjax.methods.FullCache()``), a registered name, or None (full cache).
      max_new_tokens: generation limit (> 0); generation also stops at the tokenizer's EOS.
      chat: wrap the prompt in the model's chat template.
      temperature, top_p, seed: sampling (temperature 0 = greedy).
      chunk_size: prefill the prompt in chunks of this many tokens (bounded activation memory).
      stream: called with each new piece of text of the first row, as it is generated.
      progress: show progress bars (prefill chunks).
      question: None (the prompt is compressed whole), or one question per prompt: the prompt is
        then the *context*, compressed alone, and the question (with the chat template's end of
        turn) is prefilled onto the compressed cache. The full text is formatted as
        ``prompt + "\n" + question`` and split in front of the question; the questions of a batch
        must have one length in tokens.
      artifact: calibration data / trained weights of methods that need them.
      kv_dtype: storage dtype of the compressed page pools and of the full cache: None (the model's), "bfloat16",
        "int8" or "float8_e4m3fn" (per-token scales, :mod:`kvjax.kv_quantization`); the other methods without page
        pools accept only the model's.
    """
    tok = model.tokenizer
    rows, question_rows, eos, pad_id = text_batch(tok, prompt, question, chat)
    on_token = None
    if stream is not None:
        emitted: list[int] = []
        printed = [""]

        def on_token(step_tokens):
            t = int(step_tokens[0])
            if t in eos:
                return
            emitted.append(t)
            text = tok.decode(emitted, skip_special_tokens=True)
            stream(text[len(printed[0]):])
            printed[0] = text

    out, count, cache, timings = generate_tokens(
        model, rows, method=method, max_new_tokens=max_new_tokens, sampling=Sampling(temperature, top_p),
        seed=seed, chunk_size=chunk_size, eos_ids=eos, pad_id=pad_id, on_token=on_token, progress=progress,
        question_rows=question_rows, artifact=artifact, reconstruction=reconstruction_prompt(tok, chat), kv_dtype=kv_dtype,
    )
    return text_result(tok, out, count, cache, timings, rows, question_rows, eos)


def compare(
    model, prompt: str | Sequence[str], methods: Sequence, *, max_new_tokens: int = 64, chat: bool = False,
    chunk_size: int | None = None, question: str | Sequence[str] | None = None, artifacts: Sequence | None = None,
    progress: bool = False, steady_timings: bool = False, kv_dtype=None,
) -> list[GenerationResult]:
    """:func:`generate` (greedy) with each of ``methods`` on the same prompt(s): one result per method, in order.

    The methods that can share a prefill (the full cache and the evict-after-prefill methods) share **one**; the
    others run their own. Each result equals that method's :func:`generate` (the same tokens); a shared
    prefill's time is in every result it served, with ``timings["prefill_shared_by"]``. With ``steady_timings``
    each method decodes step by step, and its timings add ``first_step_s`` (the first step, with its compilation)
    and ``decode_steady_ms_per_token`` (the steps after it), as :func:`generate` does when streaming. ``kv_dtype``:
    as :func:`generate`'s, for every method.
    """
    tok = model.tokenizer
    rows, question_rows, eos, pad_id = text_batch(tok, prompt, question, chat)
    outputs = compare_tokens(model, rows, methods, artifacts=artifacts, max_new_tokens=max_new_tokens,
                             chunk_size=chunk_size, eos_ids=eos, pad_id=pad_id, progress=progress,
                             question_rows=question_rows, reconstruction=reconstruction_prompt(tok, chat),
                             on_token=(lambda _: None) if steady_timings else None, kv_dtype=kv_dtype)
    return [text_result(tok, out, count, cache, timings, rows, question_rows, eos)
            for out, count, cache, timings in outputs]


def reconstruction_prompt(tok, chat: bool):
    """The reconstruction passes' prompt for text formatted with ``chat`` (``kvjax.models.tokenizer.reconstruction_prompt``)."""
    from kvjax.models.tokenizer import reconstruction_prompt as make

    return make(tok, chat)


def text_batch(tok, prompt: str | Sequence[str], question: str | Sequence[str] | None, chat: bool):
    """``(rows, question_rows or None, eos ids, pad id)``: the prompts (and questions) as token ids, formatted as
    :func:`generate` documents."""
    from kvjax.models.tokenizer import format_prompt

    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    question_rows = None
    if question is None:
        rows = [tok(format_prompt(tok, p, chat), add_special_tokens=True)["input_ids"] for p in prompts]
    else:
        questions = [question] if isinstance(question, str) else list(question)
        if len(questions) != len(prompts):
            raise ValueError(f"need one question per prompt: {len(questions)} questions for {len(prompts)} prompts")
        pairs = [split_at_question(tok, p, q, chat) for p, q in zip(prompts, questions)]
        rows, question_rows = [c for c, _ in pairs], [q for _, q in pairs]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    return rows, question_rows, eos, pad_id


def text_result(tok, out, count, cache, timings, rows, question_rows, eos) -> GenerationResult:
    """The :class:`GenerationResult` of generated token ids (EOS dropped)."""
    token_lists = [[int(t) for t in out[b, : count[b]] if t not in eos] for b in range(out.shape[0])]
    texts = [tok.decode(t, skip_special_tokens=True) for t in token_lists]
    return GenerationResult(
        texts=texts, tokens=token_lists,
        prompt_tokens=[len(r) + (len(question_rows[b]) if question_rows else 0) for b, r in enumerate(rows)],
        cache_stats=cache.stats(), timings=timings,
    )


def ask(
    model, context: str, questions: Sequence[str], *, method=None, max_new_tokens: int = 64, chat: bool = False,
    chunk_size: int | None = None, artifact=None, progress: bool = False, kv_dtype=None,
) -> list[GenerationResult]:
    """Several questions over one compressed context: the context is prefilled and compressed **once**.

    Each question (with the chat template's end of turn) is prefilled onto a copy of the compressed
    cache and answered greedily; the context is never recomputed. The text is formatted as in
    :func:`generate` with ``question=``. Returns one result per question (``timings`` of the shared
    prefill and compression are those of the context; ``question_s`` and decode are the question's).
    ``kv_dtype``: as :func:`generate`'s.
    """
    if not questions:
        raise ValueError("ask needs at least one question")
    tok = model.tokenizer
    pairs = [split_at_question(tok, context, q, chat) for q in questions]
    if any(c != pairs[0][0] for c, _ in pairs):
        raise ValueError("the chat template formats the context differently per question; ask cannot share it")
    context_ids, question_ids = pairs[0][0], [q for _, q in pairs]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    method = _resolve_method(method)
    longest_q = max(len(q) for q in question_ids)
    total = len(context_ids) + longest_q + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(f"context of {len(context_ids)} tokens + question of {longest_q} + max_new_tokens={max_new_tokens} "
                         f"exceeds the model's context of {model.config.max_position_embeddings} tokens")
    tokens, pad = left_pad([context_ids], 0, multiple=chunk_size or 1)
    spec = CacheSpec.for_model(model.config, 1, tokens.shape[1], longest_q + max_new_tokens, model.dtype,
                               longest_row=len(context_ids), mesh=model.mesh, kv_dtype=kv_dtype)
    cache = method.init_cache(spec, artifact).replace(pad=jnp.asarray(pad))
    _, cache, shared = timed_prefill(model, tokens, cache, chunk_size=chunk_size, progress=progress,
                                     reconstruction=reconstruction_prompt(tok, chat))
    t0 = time.perf_counter()
    cache = compress(cache)
    jax.block_until_ready(cache)
    shared["compress_s"] = time.perf_counter() - t0
    results = []
    for q in question_ids:
        timings = dict(shared)
        t0 = time.perf_counter()
        mine = jax.tree_util.tree_map(jnp.copy, cache)  # decoding donates its cache: the context stays for the next one
        logits, mine = prefill(model.graphdef, model.params, jnp.asarray([q], jnp.int32), mine)
        timings["question_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        first = sample(logits, jax.random.PRNGKey(0), Sampling())
        out, count, mine = decode_loop(model.graphdef, model.params, first, mine, jax.random.PRNGKey(0),
                                       max_new_tokens=max_new_tokens, eos_ids=tuple(eos))
        out, count = np.asarray(out), np.asarray(count)
        timings["decode_s"] = time.perf_counter() - t0
        ids = [int(t) for t in out[0, : count[0]] if t not in eos]
        results.append(GenerationResult(texts=[tok.decode(ids, skip_special_tokens=True)], tokens=[ids],
                                        prompt_tokens=[len(context_ids) + len(q)], cache_stats=mine.stats(),
                                        timings=timings))
    return results
