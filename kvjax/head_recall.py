"""Leader and follower heads: the cache layout HeteroCache and SyncKV share.

Some KV heads (**leaders**: HeteroCache's pivots, SyncKV's R-heads) keep every token on the device
and, from their own attention, choose which prompt tokens their **followers** (satellites,
NR-heads) should hold. A follower keeps a fixed number of prompt tokens on the device, and its whole
prompt KV in ``pinned_host`` memory (:mod:`kvjax.host_tier`). When its leader publishes a new choice,
a region of the follower's device slots is overwritten with those tokens' rows from the host copy.
Other heads (HeteroCache's anchors and volatile heads) keep a static set or everything.

One layer's state is a :class:`RecallKV`:

* ``paged``: every head's tokens in page pools with per-head capacities (:mod:`kvjax.paged`):
  leaders and other full heads hold the whole prompt in order (stored position ``j`` of row ``b`` is
  slot ``pad[b] + j``), compressed heads their selection; later tokens are appended to all;
* ``host``: the followers' prompt K/V (one host head per (row, follower));
* ``picks[B, n_leaders, R]`` / ``version[B, n_leaders]``: the prompt slots each leader of this layer
  last chose (best first) and how many times it chose;
* ``anchor_picks[B, n_leaders, K]`` / ``anchor_at[B, n_leaders]``: a leader's latest **re-anchoring**
  (SyncKV's new ``I_0`` for a question asked after compression): the slots its followers' whole
  kept prompt set (slots ``0 .. region_start + region_count``) should hold, best first, and the
  version it was published with (0: never). Unused (``K = 1``, never published) when the plan's
  ``anchor_picks`` is 0;
* ``applied[B, n_slots]``: the leader version each follower holds; ``region_start``,
  ``region_count[B, n_slots]``: the follower's slots a recall overwrites; ``held[B, n_slots, W]``: the prompt
  slot each of those region positions holds now. One entry per follower
  slot (:func:`follower_slots`): without a mesh, the followers in order.

The method decides when a leader publishes (HeteroCache: attention drift; SyncKV: every ``m`` steps)
in its ``decode_attend``; :func:`apply_recalls` then refreshes every follower whose leader has a new
version. The recall is one host-gather transfer for all followers of the layer
(:func:`kvjax.host_tier.recall`), inside ``lax.cond`` so steps without a new choice move nothing.
A leader may sit in another layer (kvjax's cross-layer groups): a follower reads it from
``ctx.layers``. A leader in an earlier layer is read as of this step, one in a later layer as of the
previous step.

Meshes: a layer's follower slots are grouped by the mesh's KV-head blocks and each block is padded
to the same number of slots with unused ones (no host copy, never recalled), so the per-follower
arrays split by (row, KV head) and the host copy by device block (:func:`kvjax.sharding.flatten_heads`):
each device holds the host rows of its own followers, gathers them in its own ``device_host`` region
and writes them into its own block of the page pool (pools of heads with different capacities are
padded per block: :func:`kvjax.paged.page_layout`). Leader-indexed state (``picks``, ``version``, the
method's tracker) is split by row only: a follower on another device reads its leader's choice, a few
token ids per step, which the compiler moves between devices.

Timing: the step that publishes attends with the followers' old tokens. The recall is issued in that
step, after the layer's attention, and is first used by the layer's next call (the paper's
asynchronous update). Measured on GPUs (docs/RESULTS.md, "On a GPU"), it does **not** overlap the
remaining layers: on an H100 at 30,720 tokens a SyncKV step costs 5.8–8.7 ms with recall against 1.2
without. ``docs/results/microbench/recall_step.py`` located the cost there. The per-layer ``lax.cond``'s host
synchronisation costs only 13 µs (XLA:GPU's ``ConditionalThunk`` copies the predicate to the host). But a
recall *inside* a conditional runs serialised, about 0.6 ms per layer, while the same bytes issued
unconditionally pipeline (2.4× cheaper in that benchmark).

``spread_over`` (the methods' ``recall_schedule="spread"``) therefore has no recall conditional. It moves a
fixed number of rows every step, only tokens the follower lacks, in place of ones its leader dropped
(:func:`spread_moves`), so a new choice lands over ``m`` steps instead of one. On the H100, at matched bytes
(13 MiB per step), SyncKV decoded at 7.33 ms/token with it against 8.73 with the whole-set schedule. That is
still far from the 1.2 without recall, and the committed forms of both were not timed (docs/RESULTS.md). Unlike the
benchmark's, a layer's indices depend on the same step's leader choice, so each layer still waits for a
device → host → device round trip (not profiled). Issuing each recall one step ahead would remove that wait
if the host gather can run beside the device's compute at all; ``recall_step.py``'s ``dep-*`` variants and the
``profile`` stage of ``scripts/gpu_checks.sh`` measure that (``docs/GPU.md``).

``recall_schedule="ahead"`` is that schedule: the spread moves a layer computes in step ``t`` are gathered in step
``t`` (:func:`gather_followers`) and kept in the layer's :class:`PendingRecall`; the layer's call in step ``t + 1``
writes them into their slots before it attends (:func:`land_pending`). It attends over the same tokens as
``"spread"`` (the rows land before the first attention that could read them) and costs a device buffer of one
step's rows per follower. Within a step nothing waits for the gather, so XLA may finish it as late as the end of
the step (the loop carries it).

Measured on an H100 (session 46, docs/RESULTS.md "On a GPU, third session"), neither schedule overlaps: SyncKV
decodes at 5.97 (``spread``) and 6.73 (``ahead``) ms/token against 1.42 without recall and 1.43 for the full cache.
The profile shows XLA running the gathers of all layers as one host-offloaded computation per step. It needs every
layer's indices, so it starts when the step's device work is done, and the loop must wait for it before the next
step, with the GPU idle meanwhile (3.5–4.3 ms per step).

``recall_schedule="pipelined"`` is the next attempt: the moves chosen in call ``t`` are kept in the layer's
:class:`PendingRecall`, gathered at the start of call ``t + 1`` (their inputs come from the loop carry, ready when
the step begins) and written in call ``t + 2`` (:func:`land_pending`), so a whole step of device work can hide the
gather. A follower holds a new choice one call later than with ``"ahead"``. A multi-token call writes everything
in flight before it attends; a re-anchoring cancels the moves in flight for the followers it refreshes (a guard:
today a re-anchoring reaches a follower only after a multi-token call, which drains). Tested on the CPU: the
same answers as ``"spread"`` on the 4K query-agnostic ablation prompts and as ``"whole"`` on the same tasks at 8K in
both protocols (``docs/results/qwen2.5-coder-0.5b-{4k-g24,8k}-pipelined-query-*``), and in the GPU lowering every layer's
host gather depends only on the loop carry, where ``"ahead"``'s depend on the step's attention
(``tests/test_gpu_host_syncs.py``). On an H100 (session 49) it is the fastest schedule (below).

Why none of the timed schedules overlapped (session 48, found without a GPU by compiling the decode loop for an
H100: ``python -m evals.gpu_schedule``, docs/RESULTS.md): XLA:GPU's latency-hiding scheduler is off by default
(jax 0.10.2 and 0.11.2), and without it XLA schedules the host gather's start and done back to back, so nothing
overlapped whatever the schedule; every GPU figure above was compiled so. kvjax's decode programs now compile with
it on a GPU (:data:`kvjax.generate.GPU_DECODE_COMPILER_OPTIONS`). Then the one host call per step (XLA merges the
layers' gathers) spans 772 of a SyncKV step's 1,170 device operations with ``"pipelined"`` (HeteroCache 704 of
1,119; jax 0.10.2, about the same with 0.11.2) and 277–399 with ``"spread"`` or ``"ahead"``, whose indices come
late in the step (``tests/test_gpu_schedule.py``).

Timed on an H100 with it (session 49, docs/RESULTS.md "On a GPU, fourth session"): SyncKV decodes at 4.39
ms/token with ``"pipelined"`` against 6.57 with XLA's defaults on the same machine (5.40 ``"spread"``, 5.47
``"ahead"``; 1.43 without recall, 1.44 the full cache; HeteroCache 6.81 against 1.27). The profile shows 0.8–1.1
ms of each step's GPU work running while the host gather runs (0.23 ms without the scheduler). What a pipelined
step still spends: about 1.2 ms of recall device work (the 24 host-to-device copies of the gathered rows run on the
compute stream), 27 conditionals per step, each a host synchronisation on a GPU (the 24 re-anchoring checks of
:func:`apply_recalls` and SyncKV's 3 anticipation checks), and the gather's wait for its inputs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from kvjax.attention import MASK_VALUE
from kvjax.host_tier import HostKV, Prefetch, empty_prefetch, issue, scatter_to_slots, take, to_host
from kvjax.paged import (PagedKV, append, paged_attention, paged_chunk_attention, paged_device_bytes, paged_partition,
                         paged_read_bytes, shard_map)
from kvjax.selection import gqa_aggregate, pool1d, window_attention
from kvjax.sharding import (BY_DEVICE, DATA, MODEL, REPLICATED, ROWS_HEADS, OnHost, axis_size, device_block,
                            flatten_heads, is_split)


@dataclasses.dataclass(frozen=True)
class Follower:
    """A follower head of a layer and its leader: ``leader_layer`` and the leader's index among that layer's leaders."""

    head: int
    leader_layer: int
    leader_index: int


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Static roles of one layer's KV heads.

    Attributes:
      capacities: prompt tokens each KV head keeps for the longest row (full heads: the whole row).
      full: heads that keep every token.
      leaders: heads that publish picks (a subset of ``full``), in order.
      followers: heads refreshed from the host with their leader's picks.
      picks: tokens each leader of this layer publishes (the largest region of its followers).
      anchor_picks: tokens a re-anchoring publishes (the followers' whole kept prompt set); 0: the method
        never re-anchors.
    """

    capacities: tuple
    full: tuple = ()
    leaders: tuple = ()
    followers: tuple = ()
    picks: int = 0
    anchor_picks: int = 0


# Partition specs of a follower gather (:func:`gather_followers`, :class:`PendingRecall`): split by device, like the
# host copy it comes from.
FETCHED_BY_DEVICE = Prefetch(k=BY_DEVICE, v=BY_DEVICE, idx=BY_DEVICE, count=BY_DEVICE)


@struct.dataclass
class PendingRecall:
    """Follower rows gathered from the host in one decode call, written into their slots at the layer's next call
    (``recall_schedule="ahead"``): the gather as a :class:`kvjax.host_tier.Prefetch` (one host head per (row,
    follower slot), in :func:`kvjax.sharding.flatten_heads` order like the host copy; ``count`` 0: nothing
    pending) and ``dst[B * n_slots, S]``, the region slot each row goes to."""

    fetched: Prefetch
    dst: jax.Array
    # ``recall_schedule="pipelined"`` only: the moves the previous call chose, gathered by the next call (into
    # ``fetched``) and written by the one after: host rows ``chosen[B * n_slots, S]`` (the first ``chosen_count``
    # of each) and their region slots ``chosen_dst``
    chosen: jax.Array | None = None
    chosen_count: jax.Array | None = None
    chosen_dst: jax.Array | None = None


@struct.dataclass
class RecallKV:
    """One layer of a leader/follower cache (see the module docstring)."""

    paged: PagedKV
    host: HostKV | None
    region_start: jax.Array  # int32 [B, n_slots]
    region_count: jax.Array  # int32 [B, n_slots]
    applied: jax.Array  # int32 [B, n_slots]
    held: jax.Array  # int32 [B, n_slots, W] prompt slot each region position holds (positions < region_count)
    prompt_len: jax.Array  # int32 [B] real prompt tokens of each row (held in order by full heads)
    picks: jax.Array  # int32 [B, n_leaders, R]
    version: jax.Array  # int32 [B, n_leaders]
    anchor_picks: jax.Array  # int32 [B, n_leaders, K]
    anchor_at: jax.Array  # int32 [B, n_leaders] version of the latest re-anchoring (0: none)
    tracker: object  # the method's per-leader state
    steps: jax.Array  # int32 [] decode calls with one token
    recalls: jax.Array  # int32 [] follower refreshes (summed over rows)
    # int32 [] token rows brought from the host, counted when chosen (``"pipelined"`` gathers them a call later)
    rows_moved: jax.Array
    pending: PendingRecall | None = None  # rows in flight (``recall_schedule="ahead"`` or ``"pipelined"`` only)
    plan: LayerPlan = struct.field(pytree_node=False, default=None)
    slots: tuple = struct.field(pytree_node=False, default=())  # follower index of each slot, -1: padding


def follower_slots(followers: tuple, num_kv_heads: int, mesh) -> tuple:
    """The follower (index into ``followers``) of each slot, ``-1`` for padding: the followers of each of the
    mesh's ``model`` blocks of KV heads, in order, each block padded to the fullest one's count."""
    blocks = axis_size(mesh, MODEL)
    per_block = num_kv_heads // blocks
    groups = [[i for i, f in enumerate(followers) if f.head // per_block == blk] for blk in range(blocks)]
    width = max(len(g) for g in groups)
    return tuple(x for g in groups for x in g + [-1] * (width - len(g)))


def slot_followers(slots: tuple):
    """``(live bool [n_slots], follower int32 [n_slots])`` of :func:`follower_slots`' output: whether a slot holds a
    follower, and which (0 for padding slots, so it can index ``[..., n_followers]`` arrays; mask with ``live``)."""
    slots = np.asarray(slots, np.int32)
    return slots >= 0, np.maximum(slots, 0)


# --------------------------------------------------------------------------- calibrated methods
RECALL_SCHEDULES = ("whole", "spread", "ahead", "pipelined")


def check_calibrated(kernel: int, group_layers, recall_schedule: str = "whole") -> None:
    """Validate the hyper-parameters HeteroCache and SyncKV share (score pooling, artifact group size, recall schedule)."""
    if recall_schedule not in RECALL_SCHEDULES:
        raise ValueError(f"recall_schedule must be one of {RECALL_SCHEDULES}, got {recall_schedule!r}")
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be a positive odd number, got {kernel}")
    if group_layers is not None and group_layers < 1:
        raise ValueError(f"group_layers must be >= 1 or None, got {group_layers}")


def calibrated_artifact(kind: str, spec, artifact, group_layers):
    """The given artifact checked against ``kind`` and the spec's model, or the one shipped for the model
    (``-g<group_layers>``; None: :func:`kvjax.calibration.auto_group_layers`)."""
    from kvjax.artifacts import require_artifact, shipped_artifact
    from kvjax.calibration import auto_group_layers

    if artifact is None:
        artifact = shipped_artifact(kind, spec.model_id, f"g{group_layers or auto_group_layers(spec.num_kv_heads)}")
    return require_artifact(artifact, kind, spec.model_id)


# ------------------------------------------------------------------------------------------ scores
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
    while :func:`kvjax.generate.compress` runs), so a leader in any layer can be scored.
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


def leader_probs(paged: PagedKV, heads: tuple, qg, kernel: int, gqa: str):
    """Scores of consecutive queries ``qg[B, T, n, G, D]`` (:func:`leader_queries`) over the leader heads' held tokens.

    Returns ``[B, n, T, positions]`` (f32): softmax per query head over the tokens each query saw
    (the ``T`` queries are the newest tokens, already appended: query ``t`` saw all but the last
    ``T - 1 - t``), average pooling (``kernel``), aggregation over the group (``gqa``); -inf where unseen.
    """
    B, T, n, G, D = qg.shape
    M = paged.block_table.shape[-1]
    ps = paged.page_size
    ids = jnp.asarray(heads, jnp.int32)
    k = paged.k_pages[paged.block_table[:, ids]].reshape(B, n, M * ps, D).astype(jnp.float32)
    s = jnp.einsum("btngd,bnsd->bntgs", qg.astype(jnp.float32), k, precision=lax.Precision.HIGHEST) * D**-0.5
    lengths = paged.lengths[:, ids]  # [B, n]
    limit = lengths[..., None] - T + jnp.arange(T) + 1  # [B, n, T]
    seen = jnp.arange(M * ps)[None, None, None, :] < limit[..., None]  # [B, n, T, S]
    p = jax.nn.softmax(jnp.where(seen[:, :, :, None], s, MASK_VALUE), axis=-1)  # [B, n, T, G, S]
    p = pool1d(p, seen[:, :, :, None], kernel, "avg")
    agg = p.mean(axis=3) if gqa == "mean" else p.max(axis=3)
    return jnp.where(seen, agg, -jnp.inf)


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


# -------------------------------------------------------------------------------------------- build
def host_copy(k, v, slot_heads, live, mesh, page_size: int) -> HostKV:
    """The followers' prompt ``k, v[B, Hkv, P, D]`` in ``pinned_host`` memory, one host head per (row, slot) in
    device-block order (:func:`kvjax.sharding.flatten_heads`); padding slots ``~live`` hold zeros."""
    B, _, S, _ = k.shape
    ids = jnp.asarray(slot_heads, jnp.int32)
    heads = flatten_heads(np.stack(np.broadcast_arrays(np.arange(B)[:, None], np.asarray(slot_heads)[None]), -1), mesh)
    pad = (-S) % page_size

    def stage(x):
        x = jnp.where(jnp.asarray(live)[None, :, None, None], x[:, ids], 0)  # [B, n_slots, P, D]
        return to_host(jnp.pad(flatten_heads(x, mesh), ((0, 0), (0, pad), (0, 0))))

    return HostKV(k=stage(k), v=stage(v), heads=tuple(map(tuple, heads.tolist())), length=S, page_size=page_size)


def pending_rows(plans, plan: LayerPlan, spread_over: int) -> int:
    """Rows per follower one decode step of the spread schedule moves in the layer of ``plan`` (``plans``: every
    layer's): ``ceil(W / spread_over)``, ``W`` the most tokens a follower's region or its leader's choice holds."""
    if not plan.followers:
        return 0
    held = max(plan.capacities[f.head] for f in plan.followers)
    chosen = max(max(plans[f.leader_layer].picks, 1) for f in plan.followers)
    return -(-min(held, chosen) // spread_over)


def build_layer(st, keep_idx, keep_len, pad, spec, plan: LayerPlan, *, page_size: int, region_start, region_count,
                picks, tracker, pending: int = 0, pipelined: bool = False):
    """A :class:`RecallKV` from a staged layer, the kept slots per head, and the method's regions/picks/tracker.

    ``keep_idx[B, Hkv, C]`` / ``keep_len[B, Hkv]``: kept prompt slots per head (in storage order).
    ``region_start``, ``region_count``: ``[B, n_followers]`` (or broadcastable), in ``plan.followers`` order.
    ``picks[B, n_leaders, R]``: the leaders' initial choice (version 0: followers hold it already).
    ``pending``: rows per follower of an empty :class:`PendingRecall` (:func:`pending_rows`; the ``"ahead"``
    schedule, and with ``pipelined`` the ``"pipelined"`` one), 0 for none.
    """
    from kvjax.paged import build_paged

    P = spec.prompt_slots
    paged = build_paged(st.k, st.v, keep_idx, keep_len, plan.capacities, spec.room, page_size, spec.mesh)
    B = st.k.shape[0]
    nf, nl = len(plan.followers), len(plan.leaders)
    slots = follower_slots(plan.followers, spec.num_kv_heads, spec.mesh) if nf else ()
    live, follower = slot_followers(slots)
    blocks = axis_size(spec.mesh, MODEL)
    per_block, width = spec.num_kv_heads // blocks, len(slots) // blocks
    slot_heads = [plan.followers[i].head if i >= 0 else (n // width) * per_block for n, i in enumerate(slots)]
    host = host_copy(st.k[:, :, :P], st.v[:, :, :P], slot_heads, live, spec.mesh, page_size) if nf else None

    def per_slot(x):  # [B, n_followers] -> [B, n_slots], 0 in padding slots
        x = jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B, nf))
        return jnp.where(jnp.asarray(live)[None], x[:, jnp.asarray(follower)], 0)

    zeros = jnp.zeros((), jnp.int32)
    start, count = per_slot(region_start), per_slot(region_count)
    width = max([plan.capacities[f.head] for f in plan.followers], default=1)
    heads_of_slots = jnp.asarray(slot_heads, jnp.int32) if nf else jnp.zeros((0,), jnp.int32)
    at = jnp.clip(start[..., None] + jnp.arange(width), 0, keep_idx.shape[-1] - 1)  # [B, n_slots, W]
    held = jnp.take_along_axis(keep_idx[:, heads_of_slots], at, axis=-1).astype(jnp.int32)
    waiting = None
    if pending and nf:
        rows = jnp.zeros((host.n_heads, pending), jnp.int32)
        waiting = PendingRecall(fetched=empty_prefetch(host, pending), dst=rows)
        if pipelined:
            waiting = waiting.replace(chosen=rows, chosen_count=jnp.zeros((host.n_heads,), jnp.int32), chosen_dst=rows)
    return RecallKV(
        paged=paged, host=host, slots=slots, region_start=start, region_count=count, held=held,
        applied=jnp.zeros((B, len(slots)), jnp.int32), prompt_len=(P - pad).astype(jnp.int32),
        picks=jnp.asarray(picks, jnp.int32),
        version=jnp.zeros((B, nl), jnp.int32),
        anchor_picks=jnp.zeros((B, nl, max(plan.anchor_picks, 1)), jnp.int32), anchor_at=jnp.zeros((B, nl), jnp.int32),
        tracker=tracker, steps=zeros, recalls=zeros, rows_moved=zeros, pending=waiting, plan=plan,
    )


# ------------------------------------------------------------------------------------------- decode
def append_attend(state: RecallKV, q, k, v, implementation: str, mesh=None):
    """Append the new tokens to every head and attend (kernel for one token, per device on a ``mesh``; XLA for a chunk)."""
    paged = append(state.paged, k, v)
    if q.shape[1] == 1:
        out = paged_attention(q[:, 0], paged, implementation=implementation, mesh=mesh)[:, None]
    else:
        out = paged_chunk_attention(q, paged)
    steps = state.steps + (1 if q.shape[1] == 1 else 0)
    return out.astype(q.dtype), state.replace(paged=paged, steps=steps)


def publish(state: RecallKV, new, picks):
    """Leaders with ``new[B, n_leaders]`` set publish ``picks[B, n_leaders, R]`` (their version increases)."""
    return state.replace(picks=jnp.where(new[..., None], picks, state.picks), version=state.version + new.astype(jnp.int32))


def publish_anchor(state: RecallKV, anchor_picks, picks):
    """Every leader re-anchors: its followers' whole kept prompt set becomes ``anchor_picks[B, n_leaders, K]``
    (best first) and their region ``picks[B, n_leaders, R]`` (one new version for both)."""
    state = publish(state, jnp.ones(state.version.shape, bool), picks)
    return state.replace(anchor_picks=anchor_picks.astype(jnp.int32), anchor_at=state.version)


def per_device(fn, mesh, in_specs, out_specs, *args):
    """``fn(*args)``, run per device under ``shard_map`` on a multi-device ``mesh``."""
    if is_split(mesh):
        return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    return fn(*args)


def gather_followers(host: HostKV, ids, count, mesh) -> Prefetch:
    """Host rows ``ids[B * n_slots, R]`` (flattened follower slots, :func:`kvjax.sharding.flatten_heads`) brought to
    the device in one transfer per device (:func:`kvjax.host_tier.issue`): ``k, v[B * n_slots, R, D]``, zero past
    ``count[B * n_slots]``."""

    def local(host_k, host_v, ids, count):  # one device's followers (or all)
        return issue(host.replace(k=host_k, v=host_v), ids, count)

    return per_device(local, mesh, (BY_DEVICE,) * 4, FETCHED_BY_DEVICE, host.k, host.v, ids, count)


def write_followers(paged: PagedKV, host: HostKV, fetched: Prefetch, dst, mesh) -> PagedKV:
    """Write gathered rows (:func:`gather_followers`) into the followers' region slots ``dst[B * n_slots, R]`` (the
    first ``fetched.count`` of each), per device on a mesh (each device into its own pages)."""
    pairs = jnp.asarray(host.heads, jnp.int32)  # [B * n_slots, 2] (row, KV head) of each host head
    rk, rv = take(fetched)

    def local(k_pages, v_pages, table, pairs, rk, rv, dst, count):
        block, row, head = device_block(mesh, *table.shape[:2])  # local page ids, rows and heads
        return scatter_to_slots(k_pages, v_pages, table - block * k_pages.shape[0], rk, rv, pairs[:, 0] - row,
                                pairs[:, 1] - head, dst, count)

    kp, vp = per_device(local, mesh, (BY_DEVICE, BY_DEVICE, ROWS_HEADS) + (BY_DEVICE,) * 5, (BY_DEVICE, BY_DEVICE),
                        paged.k_pages, paged.v_pages, paged.block_table, pairs, rk, rv, dst, fetched.count)
    return paged.replace(k_pages=kp, v_pages=vp)


def land_pending(state: RecallKV, mesh=None, *, drain: bool = False) -> RecallKV:
    """Write the rows the layer's previous call gathered (``recall_schedule="ahead"`` / ``"pipelined"``) into their
    slots; call it before the layer attends. A no-op for the other schedules (no pending rows).

    ``"pipelined"``: then gather the moves the previous call chose, for the next call to write (the gather's
    inputs are ready when the call begins, so a whole step of device work can hide it). With ``drain`` (a
    multi-token call, e.g. a question) they are written now too, so nothing is in flight across it.
    """
    p = state.pending
    if p is None:
        return state
    paged = write_followers(state.paged, state.host, p.fetched, p.dst, mesh)
    done = p.fetched.replace(count=jnp.zeros_like(p.fetched.count))
    if p.chosen is None:
        return state.replace(paged=paged, pending=p.replace(fetched=done))
    fetched = gather_followers(state.host, p.chosen, p.chosen_count, mesh)
    nothing = jnp.zeros_like(p.chosen_count)
    if drain:
        paged = write_followers(paged, state.host, fetched, p.chosen_dst, mesh)
        return state.replace(paged=paged, pending=p.replace(fetched=done, chosen_count=nothing))
    return state.replace(paged=paged, pending=p.replace(fetched=fetched, dst=p.chosen_dst, chosen_count=nothing))


def apply_recalls(state: RecallKV, ctx, *, enabled: bool = True, spread_over: int | None = None):
    """Refresh every follower whose leader published a version it does not hold, from the host (one transfer;
    a re-anchoring it has not applied first, in a transfer of its own, then any newer region).

    ``spread_over``: ``None`` refreshes a follower's whole region in the step its leader's new choice reaches it,
    inside ``lax.cond``. An int ``m`` (one-token calls only) has no conditional for the region: every step, each
    follower replaces up to ``ceil(W / m)`` of the tokens it holds that its leader's latest choice no longer has
    with chosen tokens it lacks (best first; :func:`spread_moves`), ``W`` the most tokens a choice or a region of
    the layer holds. The transfer has that fixed size; ``rows_moved`` counts the tokens replaced.

    A layer built with a :class:`PendingRecall` (``recall_schedule="ahead"``, :func:`pending_rows` of room) keeps
    the rows ``spread_over`` gathers for its next call (:func:`land_pending`) instead of writing them now, so nothing
    in this call waits for the transfer. The next call attends over the same tokens as with the plain spread schedule.
    With ``recall_schedule="pipelined"`` it keeps the moves themselves: the next call gathers them, the one after
    writes them, so each lands one call later than with ``"ahead"``. A re-anchoring here cancels the moves still
    in flight for the followers it refreshes (they were chosen from the set it replaces).
    """
    plan = state.plan
    if not plan.followers or not enabled:
        return state
    live, follower = slot_followers(state.slots)

    def leader_values(read):  # read(leader layer state)[:, leader] per slot: [B, n_slots, ...] (0 in padding slots)
        vals = []
        for f in plan.followers:
            src = state if f.leader_layer == ctx.layer else ctx.layers[f.leader_layer]
            vals.append(read(src)[:, f.leader_index])
        if vals[0].ndim == 2:
            width = max(x.shape[-1] for x in vals)
            vals = [jnp.pad(x, ((0, 0), (0, width - x.shape[-1]))) for x in vals]
        vals = jnp.stack(vals, axis=1)[:, follower]
        return vals if vals.ndim == 3 else jnp.where(live[None], vals, 0)

    versions = leader_values(lambda st: st.version)
    host = state.host
    moved = jnp.zeros((), jnp.int32)
    recalls = jnp.zeros((), jnp.int32)
    applied, held = state.applied, state.held
    paged, pending = state.paged, state.pending

    def refresh(paged, picks, count, dst):  # picks, dst [B, n_slots, R]: host rows and the device slots they go to
        picks, count, dst = (flatten_heads(x, ctx.mesh) for x in (picks, count, dst))
        return write_followers(paged, host, gather_followers(host, picks, count, ctx.mesh), dst, ctx.mesh)

    if any(leader_plan(state, ctx, f).anchor_picks for f in plan.followers):
        # a re-anchoring the follower has not applied: its whole kept prompt set, then any newer region
        anchor_at = leader_values(lambda st: st.anchor_at)
        anchor_picks = leader_values(lambda st: st.anchor_picks)
        anchor_due = anchor_at > applied
        K = anchor_picks.shape[-1]
        count = jnp.where(anchor_due, jnp.minimum(state.region_start + state.region_count, K), 0)
        dst = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), anchor_picks.shape)
        paged = lax.cond(jnp.any(anchor_due), lambda p: refresh(p, anchor_picks, count, dst), lambda p: p, paged)
        at = jnp.clip(state.region_start[..., None] + jnp.arange(held.shape[-1]), 0, K - 1)
        held = jnp.where(anchor_due[..., None], jnp.take_along_axis(anchor_picks, at, axis=-1), held)
        applied = jnp.where(anchor_due, anchor_at, applied)
        if pending is not None:  # rows in flight were chosen from the set the re-anchoring replaces (moves chosen
            # but not yet gathered, ``"pipelined"``, are replaced below by this call's, chosen from the new set)
            keep = ~flatten_heads(anchor_due, ctx.mesh)
            pending = pending.replace(fetched=pending.fetched.replace(count=jnp.where(keep, pending.fetched.count, 0)))
        recalls, moved = recalls + anchor_due.sum().astype(jnp.int32), moved + count.sum().astype(jnp.int32)
    picks = leader_values(lambda st: st.picks)  # [B, n_slots, R]
    chosen = picks.shape[-1]  # tokens a choice holds (static): no region takes more
    region = jnp.minimum(state.region_count, chosen)
    due = versions > applied
    if spread_over is None:
        count = jnp.where(due, region, 0)
        dst = state.region_start[..., None] + jnp.arange(chosen, dtype=jnp.int32)
        paged = lax.cond(jnp.any(due), lambda p: refresh(p, picks, count, dst), lambda p: p, paged)
        held = jnp.where(due[..., None], fit_width(picks, held.shape[-1]), held)
    else:  # a fixed-size step towards the leader's latest choice (none before its first: version 0)
        W = min(held.shape[-1], chosen)  # a region's positions a choice can reach
        ids, positions, count = spread_moves(held[..., :W], picks[..., :W], jnp.where(versions > 0, region, 0),
                                             spread_over, host.length)
        flat_ids, flat_count, flat_dst = (flatten_heads(x, ctx.mesh)
                                          for x in (ids, count, state.region_start[..., None] + positions))
        if pending is not None and flat_ids.shape != pending.dst.shape:
            raise ValueError(f"apply_recalls: {flat_ids.shape[1]} rows per follower to move, room for "
                             f"{pending.dst.shape[1]} (build the layer with pending_rows)")
        if pending is not None and pending.chosen is not None:  # "pipelined": gathered by the next call (land_pending)
            pending = pending.replace(chosen=flat_ids, chosen_count=flat_count, chosen_dst=flat_dst)
        elif pending is not None:  # the "ahead" schedule: written at the next call (land_pending)
            pending = PendingRecall(fetched=gather_followers(host, flat_ids, flat_count, ctx.mesh), dst=flat_dst)
        else:
            paged = write_followers(paged, host, gather_followers(host, flat_ids, flat_count, ctx.mesh), flat_dst,
                                    ctx.mesh)
        flat = jax.vmap(lambda h, p, i: h.at[p].set(i, mode="drop"))(  # positions W: dropped
            held.reshape(-1, held.shape[-1]), positions.reshape(-1, positions.shape[-1]), ids.reshape(-1, ids.shape[-1]))
        held = flat.reshape(held.shape)
    return state.replace(paged=paged, pending=pending, applied=jnp.where(due, versions, applied), held=held,
                         recalls=state.recalls + recalls + due.sum().astype(jnp.int32),
                         rows_moved=state.rows_moved + moved + count.sum().astype(jnp.int32))


def fit_width(x, width: int):
    """``x[..., R]`` cut or zero-padded to ``[..., width]``."""
    R = x.shape[-1]
    return x[..., :width] if R >= width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - R)])


def members(values, live, queries, slots: int):
    """Whether each ``queries[..., j]`` is one of the ``live`` entries of ``values[..., W]`` (prompt slots below
    ``slots``), through a per-row table of ``slots`` flags: linear work, no sort."""
    lead, W = values.shape[:-1], values.shape[-1]

    def one(v, lv, q):
        table = jnp.zeros((slots,), bool).at[jnp.where(lv, v, slots)].set(True, mode="drop")
        return table[jnp.clip(q, 0, slots - 1)]

    flat = jax.vmap(one)(values.reshape(-1, W), live.reshape(-1, W), queries.reshape(-1, queries.shape[-1]))
    return flat.reshape(*lead, queries.shape[-1])


def first_set(mask, n: int):
    """Indices of the first ``n`` set entries of ``mask[..., W]``, in order; ``W`` where there are fewer."""
    lead, W = mask.shape[:-1], mask.shape[-1]
    rank = jnp.cumsum(mask, axis=-1) - 1

    def one(m, r):
        return jnp.full((n,), W, jnp.int32).at[jnp.where(m, r, n)].set(jnp.arange(W, dtype=jnp.int32), mode="drop")

    return jax.vmap(one)(mask.reshape(-1, W), rank.reshape(-1, W)).reshape(*lead, n)


def spread_moves(held, target, count, spread_over: int, slots: int):
    """One fixed-size step of a follower towards its leader's choice, without duplicates.

    ``held[B, n, W]``, ``target[B, n, W]``: the prompt slots (below ``slots``) the follower's region holds and its
    leader's choice (best first); entries ``>= count[B, n]`` of both are unused. Returns ``(ids, positions,
    moves)``, each with ``S = ceil(W / spread_over)`` entries per follower: the ``moves`` best chosen tokens the
    follower lacks (``ids``) and the region positions holding tokens the choice dropped, in order (``positions``;
    ``W`` past ``moves``), where they go. Each step only replaces dropped tokens with missing ones, so the region
    never holds a token twice, and after ``spread_over`` steps it holds exactly the choice (as a set).
    """
    W = held.shape[-1]
    S = -(-W // spread_over)
    live = jnp.arange(W) < count[..., None]
    missing = live & ~members(held, live, target, slots)
    dropped = live & ~members(target, live, held, slots)
    src, positions = first_set(missing, S), first_set(dropped, S)
    moves = jnp.minimum(missing.sum(-1), S).astype(jnp.int32)
    positions = jnp.where(jnp.arange(S) < moves[..., None], positions, W)
    return jnp.take_along_axis(target, jnp.minimum(src, W - 1), axis=-1), positions, moves


def reanchor_then_attend(state: RecallKV, q, k, v, ctx, choose):
    """A multi-token call that re-anchors: append the tokens, let ``choose(state)`` publish the leaders' choice (when
    the layer has leaders), recall it for every follower, *then* attend; a rehearsal (``ctx.rehearsal``) returns the
    state without the tokens (their rows stay past ``lengths``, overwritten by the real pass)."""
    held = state.paged.lengths
    state = state.replace(paged=append(state.paged, k, v))
    if state.plan.leaders:
        state = choose(state)
    state = apply_recalls(state, ctx)
    out = paged_chunk_attention(q, state.paged).astype(q.dtype)
    if ctx.rehearsal:
        state = state.replace(paged=state.paged.replace(lengths=held))
    return out, state


def leader_plan(state: RecallKV, ctx, f: Follower) -> LayerPlan:
    """The plan of follower ``f``'s leader layer."""
    return state.plan if f.leader_layer == ctx.layer else ctx.layers[f.leader_layer].plan


def recall_partition(state: RecallKV, tracker) -> RecallKV:
    """Partition specs of a :class:`RecallKV` (see the module docstring), with the method's ``tracker`` specs."""
    host = None if state.host is None else state.host.replace(k=OnHost(BY_DEVICE), v=OnHost(BY_DEVICE))
    pending = None
    if state.pending is not None:
        pending = PendingRecall(fetched=FETCHED_BY_DEVICE, dst=BY_DEVICE)
        if state.pending.chosen is not None:
            pending = pending.replace(chosen=BY_DEVICE, chosen_count=BY_DEVICE, chosen_dst=BY_DEVICE)
    rows = jax.sharding.PartitionSpec(DATA)
    return state.replace(paged=paged_partition(state.paged), host=host, pending=pending, region_start=ROWS_HEADS,
                         region_count=ROWS_HEADS, applied=ROWS_HEADS, held=ROWS_HEADS, prompt_len=rows, picks=rows, version=rows,
                         anchor_picks=rows, anchor_at=rows,
                         tracker=tracker, steps=REPLICATED, recalls=REPLICATED, rows_moved=REPLICATED)


# -------------------------------------------------------------------------------------------- stats
def recall_stats(states) -> dict:
    """Kept tokens per head, pools, host copy, recall events and rows moved (concrete values)."""
    steps = max(int(st.steps) for st in states)
    followers = sum(len(st.plan.followers) * st.applied.shape[0] for st in states)
    recalls = sum(int(st.recalls) for st in states)
    rows = sum(int(st.rows_moved) for st in states)
    d, itemsize = states[0].paged.k_pages.shape[-1], states[0].paged.k_pages.dtype.itemsize
    return {
        "kept_tokens_per_head": [list(st.plan.capacities) for st in states],
        "full_heads": sum(len(st.plan.full) for st in states),
        "follower_heads": sum(len(st.plan.followers) for st in states),
        "page_pool_bytes": sum(paged_device_bytes(st.paged) for st in states),
        "decode_steps": steps,
        "recall_events": recalls,
        "recall_trigger_rate": recalls / (steps * followers) if steps and followers else 0.0,
        "rows_recalled": rows,
        "bytes_recalled": 2 * rows * d * itemsize,
    }


def attention_read_bytes(states) -> int:
    """K/V bytes one step's attention reads: every held token of every head."""
    return sum(paged_read_bytes(st.paged) for st in states)


__all__ = ["RECALL_SCHEDULES", "check_calibrated", "calibrated_artifact", "Follower", "LayerPlan", "PendingRecall", "RecallKV", "last_query_probs", "prompt_scores", "staged_scores", "to_stored", "leader_queries", "leader_probs", "prompt_only",
           "top_mask", "top_slots", "follower_slots", "slot_followers", "host_copy", "pending_rows", "build_layer", "append_attend", "publish", "publish_anchor", "per_device",
           "gather_followers", "write_followers", "land_pending", "apply_recalls", "reanchor_then_attend", "fit_width", "members", "first_set", "spread_moves", "leader_plan", "recall_partition", "recall_stats",
           "attention_read_bytes"]
