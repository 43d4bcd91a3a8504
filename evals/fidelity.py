"""Fidelity without tasks: how far a compressed cache's next-token distributions drift from the full cache's.

For a real text (a prefix of P tokens plus a continuation of N + 1 tokens), the prefix is prefilled
once (shared by every method, :mod:`kvjax.shared_prefill`), each method compresses it, and then the
continuation is fed token by token (teacher forcing) through the method's decode path. At each of
the N steps we compare the method's next-token distribution q with the full cache's p:

* ``kl``: KL(p || q) in nats, averaged over steps and texts;
* ``top1``: fraction of steps where argmax q == argmax p;
* ``nll``: the method's negative log-likelihood of the true next token (the full cache's as ``nll``
  of ``full``), a perplexity-style check.

The first token after the prefix is predicted from the prefill's logits, which are identical for
every method (compression happens after the prefill), so it is not scored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.decoding import forward_step


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def teacher_forced_logprobs(graphdef, params, cache, tokens):
    """Feed ``tokens[B, N]`` one decode step at a time; returns (log-probs f32 [B, N, V], cache)."""

    def body(cache, tok):
        logits, cache = forward_step(graphdef, params, tok, cache)
        return cache, jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    cache, logprobs = lax.scan(body, cache, tokens.T)
    return logprobs.transpose(1, 0, 2), cache


def compare_logprobs(ref: np.ndarray, got: np.ndarray, targets: np.ndarray) -> dict:
    """KL(ref || got), top-1 agreement and NLL of ``targets`` from log-prob arrays ``[B, N, V]``.

    Returns per-text lists and means: ``kl``, ``top1``, ``nll`` (of ``got``).
    """
    if ref.shape != got.shape or ref.shape[:2] != targets.shape:
        raise ValueError(f"shape mismatch: ref {ref.shape}, got {got.shape}, targets {targets.shape}")
    p = np.exp(ref)
    kl = np.sum(p * (ref - got), axis=-1)  # [B, N]
    kl = np.maximum(kl, 0.0)  # float round-off can give -1e-9
    top1 = (ref.argmax(-1) == got.argmax(-1)).astype(np.float64)
    nll = -np.take_along_axis(got, targets[..., None], axis=-1)[..., 0]
    return {
        "kl": float(kl.mean()), "top1": float(top1.mean()), "nll": float(nll.mean()),
        "kl_per_text": kl.mean(axis=1).tolist(), "top1_per_text": top1.mean(axis=1).tolist(),
    }


def fidelity_texts(tokenizer, num_texts: int, prefix_tokens: int, continuation_tokens: int, seed: int = 0) -> np.ndarray:
    """``[num_texts, prefix + continuation + 1]`` token ids of real English prose at different corpus offsets.

    The prose is the local corpus of :mod:`kvjax.evals.tasks` (Python's ``pydoc_data`` documentation text).
    """
    from kvjax.evals.tasks import prose_corpus

    if num_texts <= 0 or prefix_tokens <= 0 or continuation_tokens <= 0:
        raise ValueError(f"need num_texts, prefix_tokens, continuation_tokens > 0; got {num_texts}, {prefix_tokens}, {continuation_tokens}")
    corpus = prose_corpus()
    need = prefix_tokens + continuation_tokens + 1
    ids = tokenizer(corpus, add_special_tokens=False)["input_ids"]
    if len(ids) < need:
        raise ValueError(f"the prose corpus has {len(ids)} tokens, fewer than the {need} needed")
    rng = np.random.default_rng(seed)
    starts = rng.choice(len(ids) - need + 1, size=num_texts, replace=False)
    return np.stack([np.asarray(ids[s:s + need], np.int32) for s in sorted(starts)])


def run_fidelity(model, methods, texts: np.ndarray, prefix_tokens: int, *, chunk_size: int = 1024, progress: bool = False,
                 kv_dtype=None):
    """Compare every method in ``methods`` (a dict label -> method) with the full cache on ``texts``.

    Returns ``{label: {kl, top1, nll, device_bytes, ...}}`` plus ``"full"``. One shared prefill. ``kv_dtype``: the
    storage dtype of the methods' caches (:mod:`kvjax.kv_quantization`; None: the model's); the reference ``"full"``
    keeps the model's.
    """
    from kvjax.cache import CacheSpec
    from kvjax.decoding import compress, prefill_prompt
    from kvjax.methods import FullCache
    from kvjax.shared_prefill import cache_for, init_shared_cache

    B, total = texts.shape
    N = total - prefix_tokens - 1
    if N <= 0:
        raise ValueError(f"texts of {total} tokens leave no continuation after a {prefix_tokens}-token prefix")
    full = FullCache()
    all_methods = {"full": full, **{k: v for k, v in methods.items() if k != "full"}}
    spec = CacheSpec.for_model(model.config, B, prefix_tokens, N, model.dtype)
    stored = CacheSpec.for_model(model.config, B, prefix_tokens, N, model.dtype, kv_dtype=kv_dtype)
    if kv_dtype is not None:  # a method that cannot store kv_dtype refuses here, before the prefill
        for label, method in all_methods.items():
            if label != "full":
                jax.eval_shape(lambda m=method: m.init_cache(stored))
    staged = init_shared_cache(list(all_methods.values()), spec)
    _, staged = prefill_prompt(model.graphdef, model.params, texts[:, :prefix_tokens], staged, chunk_size=chunk_size)
    feed = jnp.asarray(texts[:, prefix_tokens:prefix_tokens + N])
    targets = texts[:, prefix_tokens + 1:]
    items = list(all_methods.items())
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc=f"fidelity {B}x{prefix_tokens}+{N}", unit="method", leave=False)
    ref = None
    out = {}
    for label, method in items:
        cache = compress(cache_for(staged, method).replace(spec=spec if label == "full" else stored))
        stats = cache.stats()
        logprobs, _ = teacher_forced_logprobs(model.graphdef, model.params, cache, feed)
        logprobs = np.asarray(logprobs)
        if ref is None:
            ref = logprobs
        out[label] = {**compare_logprobs(ref, logprobs, targets), "device_bytes": stats["device_bytes"],
                      "host_bytes": stats["host_bytes"]}
    return out
