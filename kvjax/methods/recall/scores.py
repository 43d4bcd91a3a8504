"""Attention scores the leader/follower methods choose tokens by: the prompt's last query at prefill, the leaders'
queries over their held tokens at decode, and top-k helpers over stored positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.attention import MASK_VALUE, resolve_implementation
from kvjax.kv_quantization import dequantize
from kvjax.paged import PagedKV, local_block_table, shard_map
from kvjax.selection import extend_forward, gqa_aggregate, pool1d, window_attention
from kvjax.sharding import BY_DEVICE, ROWS_HEADS, is_split


def last_query_probs(st, pad, prompt_slots: int):
    """Softmax (f32) of the prompt's last query over its keys, per query head ``[B, Hq, S]`` (staging recorded window >= 1)."""
    return window_attention(st.q_window[:, -1:], st.k, pad, prompt_slots)


def prompt_scores(probs, pad, prompt_slots: int, num_kv_heads: int, *, kernel: int, gqa: str):
    """Per KV head scores ``[B, Hkv, S]`` from query-head probabilities: avg pooling, group aggregation; -inf off the prompt."""
    S = probs.shape[-1]
    slots = jnp.arange(S)[None, :]
    real = (slots >= pad[:, None]) & (slots < prompt_slots)
    pooled = pool1d(probs, real[:, None, :], kernel, "avg")
    return jnp.where(real[:, None, :], gqa_aggregate(pooled, num_kv_heads, gqa), -jnp.inf)


def staged_scores(state, ctx, *, kernel: int):
    """Last-query prompt scores of staged layers during ``finish_prefill``: returns ``scores(layer) -> [B, Hkv, S]``.

    Each layer is scored once (:func:`last_query_probs`, :func:`prompt_scores` with ``gqa="max"``) and
    remembered; ``state`` is this layer's staging, ``ctx.layers`` the others' (every layer is still staged
    while :func:`kvjax.decoding.compress` runs), so a leader in any layer can be scored.
    """
    P, H = ctx.spec.prompt_slots, ctx.spec.num_kv_heads
    done = {}

    def scores(layer: int):
        if layer not in done:
            staged = state if layer == ctx.layer else ctx.layers[layer]
            probs = last_query_probs(staged, ctx.pad, P)
            done[layer] = prompt_scores(probs, ctx.pad, P, H, kernel=kernel, gqa="max")
        return done[layer]

    return scores


def to_stored(slot_values, pad, positions: int, fill):
    """Values per prompt slot ``[B, n, S]`` -> per stored position ``[B, n, positions]`` of a full head (``j`` <-> slot ``pad + j``)."""
    S = slot_values.shape[-1]
    j = pad[:, None] + jnp.arange(positions)[None, :]  # [B, positions]
    got = jnp.take_along_axis(slot_values, jnp.clip(j, 0, S - 1)[:, None, :], axis=2)
    return jnp.where((j < S)[:, None, :], got, fill)


def leader_queries(q, heads: tuple, num_kv_heads: int):
    """The leader heads' query groups of ``q[B, T, Hq, D]``: ``[B, T, n, G, D]``."""
    B, T, Hq, D = q.shape
    return q.reshape(B, T, num_kv_heads, Hq // num_kv_heads, D)[:, :, jnp.asarray(heads, jnp.int32)]


def leader_probs(paged: PagedKV, heads: tuple, qg, kernel: int, gqa: str, *, lookahead: int = 0,
                 implementation: str = "xla", mesh=None, multiply_reduce: bool | None = None):
    """Scores of consecutive queries ``qg[B, T, n, G, D]`` (:func:`leader_queries`) over the leader heads' held tokens.

    Returns ``[B, n, T, positions]`` (f32): softmax per query head over the tokens each query saw
    (the ``T`` queries are the newest tokens, already appended: query ``t`` saw all but the last
    ``T - 1 - t``), average pooling (``kernel``), aggregation over the group (``gqa``), extended ``lookahead``
    positions forward; -inf where unseen: :func:`probs_from_logits` of :func:`leader_query_logits`.
    """
    s = leader_query_logits(paged, heads, qg, implementation=implementation, mesh=mesh, multiply_reduce=multiply_reduce)
    return probs_from_logits(s, seen_limits(paged, heads, qg.shape[1]), kernel, gqa, lookahead)


def leader_query_logits(paged: PagedKV, heads: tuple, qg, *, implementation: str = "xla", mesh=None,
                        multiply_reduce: bool | None = None):
    """Logits ``[B, n, T, G, positions]`` (f32, scaled) of the queries ``qg[B, T, n, G, D]`` over the leader heads'
    stored positions (past what a query saw: anything; :func:`probs_from_logits` masks it).

    The logits of one query come from :func:`leader_logits` where the paged-scores kernel has a form (a TPU, by
    the method's ``implementation``; per device on a ``mesh``). Otherwise ``multiply_reduce`` (default: one query,
    on a GPU) scores by a multiply-reduce, which the compiler fuses with the page gather, so the leaders' keys are
    read once where they lie; a matmul reads a gathered copy (written first: three passes over the keys on an H100),
    but runs faster on a CPU and for several queries.

    Quantized pools (int8, float8_e4m3fn): the leaders' keys are dequantized (pages times their per-token scales, in
    the queries' dtype) and scored by XLA, as attention reads them; the paged-scores kernel reads unscaled pages only.
    """
    B, T, n, G, D = qg.shape
    M = paged.block_table.shape[-1]
    ps = paged.page_size
    impl = resolve_implementation(implementation)
    if T == 1 and not paged.quantized and (impl == "pallas_interpret" or (impl == "pallas" and
                                                                          jax.default_backend() == "tpu")):
        return leader_logits(paged, heads, qg[:, 0], impl, mesh)[:, :, None]  # [B, n, 1, G, S]
    tables = paged.block_table[:, jnp.asarray(heads, jnp.int32)]
    pages = paged.k_pages[tables]  # [B, n, M, ps, D]
    if paged.quantized:
        pages = dequantize(pages, paged.k_scales[tables], qg.dtype)
    if multiply_reduce is None:
        multiply_reduce = T == 1 and jax.default_backend() == "gpu"
    if multiply_reduce:
        k = pages.reshape(B, n, 1, M * ps, 1, D).astype(jnp.float32)
        q = qg.transpose(0, 2, 1, 3, 4)[:, :, :, None].astype(pages.dtype).astype(jnp.float32)  # [B, n, T, 1, G, D]
        return jnp.swapaxes((k * q).sum(-1), -1, -2) * D**-0.5  # exact products, as the matmul's below
    return jnp.einsum("btngd,bnsd->bntgs", qg.astype(pages.dtype), pages.reshape(B, n, M * ps, D),
                      precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32) * D**-0.5


def probs_from_logits(s, limits, kernel: int, gqa: str, lookahead: int = 0):
    """:func:`leader_probs` from the logits ``s[B, n, T, G, positions]`` and the held tokens each query saw
    ``limits[B, n, T]`` (:func:`seen_limits`): softmax per query head over the seen positions, pooling, aggregation
    over the group, :func:`extend_forward` by ``lookahead``; ``[B, n, T, positions]``, -inf where unseen. Leaders are
    independent: the logits of leaders of several layers, concatenated along ``n``, give those layers' scores
    concatenated."""
    seen = jnp.arange(s.shape[-1])[None, None, None, :] < limits[..., None]  # [B, n, T, S]
    p = jax.nn.softmax(jnp.where(seen[:, :, :, None], s, MASK_VALUE), axis=-1)  # [B, n, T, G, S]
    p = pool1d(p, seen[:, :, :, None], kernel, "avg")
    agg = p.mean(axis=3) if gqa == "mean" else p.max(axis=3)
    return jnp.where(seen, extend_forward(agg, lookahead), -jnp.inf)


def seen_limits(paged: PagedKV, heads: tuple, T: int):
    """Held tokens each of the call's ``T`` newest queries saw, per leader ``[B, n, T]``: query ``t`` all but the last
    ``T - 1 - t`` (appended with it); positions below the limit are the ones :func:`leader_probs` scores."""
    lengths = paged.lengths[:, jnp.asarray(heads, jnp.int32)]  # [B, n]
    return lengths[..., None] - T + jnp.arange(T) + 1


def leader_logits(paged: PagedKV, heads: tuple, q, implementation: str, mesh=None):
    """Logits ``[B, n, G, positions]`` of one query per leader head ``q[B, n, G, D]`` over its held tokens, by the
    paged-scores kernel (:func:`kvjax.pallas_kernels.paged_scores.paged_scores`: each leader's pages read where they lie,
    ``MASK_VALUE`` past its length). On a multi-device ``mesh`` every device scores the leaders among its own rows and
    KV heads from its block of the pool (the others get length 0: no page is read for them)."""
    from kvjax.pallas_kernels.paged_scores import paged_scores

    B, n, G, D = q.shape
    H, M = paged.block_table.shape[1:]
    ids = jnp.asarray(heads, jnp.int32)
    if not is_split(mesh):
        out = paged_scores(q.reshape(B * n, G, D), paged.k_pages, paged.block_table[:, ids].reshape(B * n, M),
                           paged.lengths[:, ids].reshape(-1), implementation=implementation)
        return out.reshape(B, n, G, -1)
    q_all = jnp.zeros((B, H, G, D), q.dtype).at[:, ids].set(q)
    leader = jnp.zeros((H,), bool).at[ids].set(True)
    lengths = jnp.where(leader[None, :], paged.lengths, 0)

    def local(q, k_pages, table, lengths):
        b, h = table.shape[:2]
        table = local_block_table(table, k_pages.shape[0], mesh)
        out = paged_scores(q.reshape(b * h, G, D), k_pages, table.reshape(b * h, M), lengths.reshape(-1),
                           implementation=implementation)
        return out.reshape(b, h, G, -1)

    out = shard_map(local, mesh=mesh, in_specs=(ROWS_HEADS, BY_DEVICE, ROWS_HEADS, ROWS_HEADS), out_specs=ROWS_HEADS,
                    check_vma=False)(q_all, paged.k_pages, paged.block_table, lengths)
    return out[:, ids]


def prompt_only(scores, prompt_len):
    """Scores over stored positions ``[B, n, positions]`` with everything past each row's prompt set to -inf."""
    j = jnp.arange(scores.shape[-1])
    return jnp.where(j[None, None, :] < prompt_len[:, None, None], scores, -jnp.inf)


def top_mask(scores, k: int):
    """Bool mask of the top-``k`` entries along the last axis (only finite entries)."""
    k = min(k, scores.shape[-1])
    vals, idx = lax.top_k(scores, k)
    mask = jnp.zeros(scores.shape, bool)
    mask = jnp.put_along_axis(mask, idx, jnp.isfinite(vals), axis=-1, inplace=False)
    return mask


def top_slots(scores, pad, count: int):
    """Best-first prompt slots ``[B, n, count]`` from scores over stored positions ``[B, n, positions]``."""
    count = min(count, scores.shape[-1])
    _, j = lax.top_k(scores, count)
    return (j + pad[:, None, None]).astype(jnp.int32)
