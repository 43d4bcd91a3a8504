"""The cache layout HeteroCache and SyncKV share: leader heads, follower heads, and the host copy.

Some KV heads (**leaders**: HeteroCache's pivots, SyncKV's R-heads) keep every token on the device and, from their
own attention, choose which prompt tokens their **followers** (satellites, NR-heads) should hold. A follower keeps a
fixed number of prompt tokens on the device and its whole prompt KV in ``pinned_host`` memory
(:mod:`kvjax.host_tier`). When its leader publishes a new choice, a region of the follower's device slots is
overwritten with those tokens' rows from the host copy (:mod:`kvjax.methods.recall.schedules`). Other heads
(HeteroCache's anchors and volatile heads) keep a static set or everything.

One layer's state is a :class:`RecallKV`:

* ``paged``: every head's tokens in page pools with per-head capacities (:mod:`kvjax.paged`): leaders and other full
  heads hold the whole prompt in order (stored position ``j`` of row ``b`` is slot ``pad[b] + j``), compressed heads
  their selection; later tokens are appended to all;
* ``host``: the followers' prompt K/V (one host head per (row, follower slot)), in the cache's ``kv_dtype`` as the
  pools: an int8 / float8_e4m3fn copy holds the quantized rows and their per-token scales, both in ``pinned_host``
  memory, so a recall moves the stored bytes and scales (one packed block, :func:`kvjax.host_tier.pack_rows`) and
  writes both into the pools' slots, the rows the pools would hold had the tokens been kept at compression;
* ``picks[B, n_leaders, R]`` / ``version[B, n_leaders]``: the prompt slots each leader of this layer last chose (best
  first) and how many times it chose;
* ``anchor_picks[B, n_leaders, K]`` / ``anchor_at[B, n_leaders]``: a leader's latest **re-anchoring** (a question
  asked after compression): the slots its followers' whole kept prompt set (slots ``0 .. region_start +
  region_count``) should hold, best first, and the version it was published with (0: never). Unused (``K = 1``)
  when the plan's ``anchor_picks`` is 0;
* ``applied[B, n_slots]``: the leader version each follower holds; ``region_start``, ``region_count[B, n_slots]``:
  the follower's slots a recall overwrites; ``held[B, n_slots, W]``: the prompt slot each of those region positions
  holds now. One entry per follower slot (:func:`follower_slots`): without a mesh, the followers in order.

A leader may sit in another layer (cross-layer groups): a follower reads it from the other layers' states. A leader
in an earlier layer is read as of this call, one in a later layer as of the previous call.

Meshes: a layer's follower slots are grouped by the mesh's KV-head blocks and each block is padded to the same
number of slots with unused ones (no host copy, never recalled), so the per-follower arrays split by (row, KV head)
and the host copy by device block (:func:`kvjax.sharding.flatten_heads`): each device holds the host rows of its own
followers, gathers them in its own ``device_host`` region and writes them into its own block of the page pool.
Leader-indexed state (``picks``, ``version``, the method's tracker) is split by row only: a follower on another
device reads its leader's choice, a few token ids per step, which the compiler moves between devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.attention import resolve_implementation
from kvjax.host_tier import (HostKV, Prefetch, issue, pool_rows, recall_block, scatter_to_slots, take, to_host,
                              unpack_rows)
from kvjax.kv_quantization import quantize, stored_vector_bytes
from kvjax.paged import (PagedKV, append, build_paged, paged_attention, paged_chunk_attention, paged_device_bytes,
                         paged_partition, paged_read_bytes, shard_map)
from kvjax.sharding import (BY_DEVICE, DATA, MODEL, REPLICATED, ROWS_HEADS, OnHost, axis_size, device_block,
                            flatten_heads, is_split)
from kvjax.pallas_kernels.row_write import write_rows


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


# Partition specs of a follower gather (:func:`gather_followers`): split by device, like the host copy it comes from.
FETCHED_BY_DEVICE = Prefetch(k=BY_DEVICE, v=BY_DEVICE, idx=BY_DEVICE, count=BY_DEVICE)
FETCHED_QUANTIZED_BY_DEVICE = FETCHED_BY_DEVICE.replace(k_scales=BY_DEVICE, v_scales=BY_DEVICE)


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
    # int32 [] decode calls with one token, counted where a leader times its decisions by it (0 in layers without
    # leaders: a per-layer increment is a kernel launch of its own on a GPU)
    steps: jax.Array
    recalls: jax.Array  # int32 [] follower refreshes (summed over rows)
    rows_moved: jax.Array  # int32 [] token rows brought from the host
    # [B, 1, Hq, D] the query of the layer's last one-token call, where its leaders decide after every layer has run
    # (``recall_schedule="pipelined"``: :meth:`LeaderFollowerMethod.lead_layers`); None elsewhere
    query: jax.Array | None = None
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


def leader_plan(state: RecallKV, layers, layer: int, f: Follower) -> LayerPlan:
    """The plan of follower ``f``'s leader layer (``layers``: every layer's state, ``layer``: this one's index)."""
    return state.plan if f.leader_layer == layer else layers[f.leader_layer].plan


def leader_values(state: RecallKV, layers, layer: int, read):
    """``read(leader layer state)[:, leader]`` for each follower slot: ``[B, n_slots, ...]`` (0 in padding slots;
    per-leader vectors zero-padded to the widest)."""
    live, follower = slot_followers(state.slots)
    vals = []
    for f in state.plan.followers:
        src = state if f.leader_layer == layer else layers[f.leader_layer]
        vals.append(read(src)[:, f.leader_index])
    if vals[0].ndim == 2:
        width = max(x.shape[-1] for x in vals)
        vals = [jnp.pad(x, ((0, 0), (0, width - x.shape[-1]))) for x in vals]
    vals = jnp.stack(vals, axis=1)[:, follower]
    return vals if vals.ndim == 3 else jnp.where(live[None], vals, 0)


# -------------------------------------------------------------------------------------------- build
def host_copy(k, v, slot_heads, live, mesh, page_size: int, kv_dtype: str | None = None) -> HostKV:
    """The followers' prompt ``k, v[B, Hkv, P, D]`` in ``pinned_host`` memory, one host head per (row, slot) in
    device-block order (:func:`kvjax.sharding.flatten_heads`); padding slots ``~live`` hold zeros. ``kv_dtype``
    (None: ``k``'s): the rows are stored as the pools store them, int8 / float8_e4m3fn with their per-token scales
    (:func:`kvjax.kv_quantization.quantize`) beside them in ``pinned_host`` memory."""
    B, _, S, _ = k.shape
    ids = jnp.asarray(slot_heads, jnp.int32)
    heads = flatten_heads(np.stack(np.broadcast_arrays(np.arange(B)[:, None], np.asarray(slot_heads)[None]), -1), mesh)
    pad = (-S) % page_size
    stored = kv_dtype is not None and kv_dtype != k.dtype.name

    def place(x):  # [B, n_slots, P, ...] -> host heads [B * n_slots, P + pad, ...] in pinned_host memory
        x = flatten_heads(x, mesh)
        return to_host(jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)))

    def stage(x):
        x = jnp.where(jnp.asarray(live)[None, :, None, None], x[:, ids], 0)  # [B, n_slots, P, D]
        x, scales = quantize(x, kv_dtype) if stored else (x, None)
        return (place(x),) if scales is None else (place(x), place(scales))

    (k_host, *k_scales), (v_host, *v_scales) = stage(k), stage(v)
    return HostKV(k_host, v_host, *k_scales, *v_scales, heads=tuple(map(tuple, heads.tolist())), length=S,
                  page_size=page_size)


def build_layer(st, keep_idx, keep_len, pad, spec, plan: LayerPlan, *, page_size: int, region_start, region_count,
                picks, tracker) -> RecallKV:
    """A :class:`RecallKV` (no rows in flight) from a staged layer, the kept slots per head, and the method's
    regions, picks and tracker.

    ``keep_idx[B, Hkv, C]`` / ``keep_len[B, Hkv]``: kept prompt slots per head (in storage order).
    ``region_start``, ``region_count``: ``[B, n_followers]`` (or broadcastable), in ``plan.followers`` order.
    ``picks[B, n_leaders, R]``: the leaders' initial choice (version 0: followers hold it already).
    """
    P = spec.prompt_slots
    paged = build_paged(st.k, st.v, keep_idx, keep_len, plan.capacities, spec.room, page_size, spec.mesh,
                        spec.kv_dtype)
    B = st.k.shape[0]
    nf, nl = len(plan.followers), len(plan.leaders)
    slots = follower_slots(plan.followers, spec.num_kv_heads, spec.mesh) if nf else ()
    live, follower = slot_followers(slots)
    blocks = axis_size(spec.mesh, MODEL)
    per_block, width = spec.num_kv_heads // blocks, len(slots) // blocks
    slot_heads = [plan.followers[i].head if i >= 0 else (n // width) * per_block for n, i in enumerate(slots)]
    host = (host_copy(st.k[:, :, :P], st.v[:, :, :P], slot_heads, live, spec.mesh, page_size, spec.kv_dtype)
            if nf else None)

    def per_slot(x):  # [B, n_followers] -> [B, n_slots], 0 in padding slots
        x = jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B, nf))
        return jnp.where(jnp.asarray(live)[None], x[:, jnp.asarray(follower)], 0)

    zeros = jnp.zeros((), jnp.int32)
    start, count = per_slot(region_start), per_slot(region_count)
    width = max([plan.capacities[f.head] for f in plan.followers], default=1)
    heads_of_slots = jnp.asarray(slot_heads, jnp.int32) if nf else jnp.zeros((0,), jnp.int32)
    at = jnp.clip(start[..., None] + jnp.arange(width), 0, keep_idx.shape[-1] - 1)  # [B, n_slots, W]
    held = jnp.take_along_axis(keep_idx[:, heads_of_slots], at, axis=-1).astype(jnp.int32)
    return RecallKV(
        paged=paged, host=host, slots=slots, region_start=start, region_count=count, held=held,
        applied=jnp.zeros((B, len(slots)), jnp.int32), prompt_len=(P - pad).astype(jnp.int32),
        picks=jnp.asarray(picks, jnp.int32), version=jnp.zeros((B, nl), jnp.int32),
        anchor_picks=jnp.zeros((B, nl, max(plan.anchor_picks, 1)), jnp.int32), anchor_at=jnp.zeros((B, nl), jnp.int32),
        tracker=tracker, steps=zeros, recalls=zeros, rows_moved=zeros, plan=plan,
    )


# ------------------------------------------------------------------------------------------- decode
def append_attend(state: RecallKV, q, k, v, implementation: str, mesh=None):
    """Append the new tokens to every head and attend (kernel for one token, per device on a ``mesh``; XLA for a chunk)."""
    paged = append(state.paged, k, v)
    # the page writes read the old lengths: order them before the lengths' in-place update (else XLA copies them)
    # (plain pools: the scales are None, empty leaves of the barrier's operand)
    k_pages, v_pages, k_scales, v_scales, lengths = jax.lax.optimization_barrier(
        (paged.k_pages, paged.v_pages, paged.k_scales, paged.v_scales, state.paged.lengths))
    paged = paged.replace(k_pages=k_pages, v_pages=v_pages, k_scales=k_scales, v_scales=v_scales,
                          lengths=lengths + k.shape[1])
    if q.shape[1] == 1:
        out = paged_attention(q[:, 0], paged, implementation=implementation, mesh=mesh)[:, None]
    else:
        out = paged_chunk_attention(q, paged)
    steps = state.steps + (1 if q.shape[1] == 1 and state.plan.leaders else 0)
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
    ``count[B * n_slots]`` (a quantized copy: in its stored dtype, with their scales ``k_scales, v_scales[B *
    n_slots, R]``, from one packed transfer)."""
    arrays = host.arrays()

    def local(*args):  # one device's followers (or all)
        return issue(host.with_arrays(*args[:-2]), *args[-2:])

    fetched = FETCHED_QUANTIZED_BY_DEVICE if host.quantized else FETCHED_BY_DEVICE
    return per_device(local, mesh, (BY_DEVICE,) * (len(arrays) + 2), fetched, *arrays, ids, count)


def gather_block(hosts: list, ids: list, counts: list, mesh):
    """:func:`gather_followers` of several layers at once (``hosts``, ``ids``, ``counts``: one per layer): one host
    computation per device for all of them, its rows left in the one block it returns
    (:func:`kvjax.host_tier.recall_block`; on a mesh each device's block, in device order), for
    :func:`write_layers` (quantized copies: each row with its scale, :func:`kvjax.host_tier.pack_rows`)."""
    n, per = len(hosts), len(hosts[0].arrays())  # host arrays per layer: k, v (and their scales)

    def local(*args):  # one device's followers of every layer (or all)
        tiers = [h.with_arrays(*args[j:per * n:n]) for j, h in enumerate(hosts)]
        return recall_block(tiers, args[per * n:(per + 1) * n], args[(per + 1) * n:])

    return per_device(local, mesh, (BY_DEVICE,) * ((per + 2) * n), BY_DEVICE,
                      *[h.arrays()[x] for x in range(per) for h in hosts], *ids, *counts)


def write_layers(pageds: list, hosts: list, block, dsts: list, mesh, implementation: str) -> list:
    """:func:`write_followers` of several layers at once, from :func:`gather_block`'s ``block``: every layer's key
    and value rows in one :func:`kvjax.pallas_kernels.row_write.write_rows` per device, one kernel on a GPU where XLA
    launches a scatter per pool (``implementation``: the method's attention implementation; its ``"auto"`` writes
    with the kernel on a GPU and with XLA's scatters on a CPU or TPU, where the kernel has no form). ``dsts``: per
    layer the region slot of each gathered row ``[B * n_slots, R]``, negative for a row not written. Returns the
    layers' :class:`PagedKV`. Quantized pools: the block's rows and scales are split apart
    (:func:`kvjax.host_tier.unpack_rows`) and the scales written into the scale pools by a second
    :func:`write_rows` at the same slots (rows of one value)."""
    n = len(pageds)
    impl = resolve_implementation(implementation)
    impl = "xla" if impl == "pallas" and jax.default_backend() == "tpu" else impl
    quantized = pageds[0].quantized

    def local(block, *args):
        pools, scale_pools, slots, sizes = [], [], [], []
        for kp, vp, table, pairs, dst, *scales in zip(*(args[i * n:(i + 1) * n] for i in range(len(args) // n))):
            first, row, head = device_block(mesh, *table.shape[:2])  # local page ids, rows and heads
            num_pages, ps, D = kp.shape
            at = pool_rows(num_pages, ps, table - first * num_pages, pairs[:, 0] - row, pairs[:, 1] - head, dst)
            pools += [kp.reshape(-1, D), vp.reshape(-1, D)]
            scale_pools += [s.reshape(-1, 1) for s in scales]
            slots += [at, at]
            sizes += [at.shape[0]] * 2
        slots = jnp.concatenate(slots)
        if not quantized:
            out = write_rows(pools, block, slots, sizes, implementation=impl)
            return tuple(x.reshape(p.shape) for x, p in zip(out[0::2] + out[1::2], args[:2 * n]))  # keys, then values
        rows, row_scales = unpack_rows(block, pools[0].dtype)
        out = write_rows(pools, rows, slots, sizes, implementation=impl)
        out_scales = write_rows(scale_pools, row_scales[:, None], slots, sizes, implementation=impl)
        return tuple(x.reshape(p.shape) for x, p in zip(out[0::2] + out[1::2] + out_scales[0::2] + out_scales[1::2],
                                                         args[:2 * n] + args[5 * n:]))

    pairs = [jnp.asarray(h.heads, jnp.int32) for h in hosts]  # [B * n_slots, 2] (row, KV head) of each host head
    scales = [p.k_scales for p in pageds] + [p.v_scales for p in pageds] if quantized else []
    pools = 4 if quantized else 2
    out = per_device(local, mesh, (BY_DEVICE,) * (1 + 2 * n) + (ROWS_HEADS,) * n + (BY_DEVICE,) * ((pools) * n),
                     (BY_DEVICE,) * (pools * n), block, *[p.k_pages for p in pageds], *[p.v_pages for p in pageds],
                     *[p.block_table for p in pageds], *pairs, *dsts, *scales)
    fields = ("k_pages", "v_pages", "k_scales", "v_scales")[:pools]  # out: every layer's keys, values (, scales)
    return [p.replace(**{f: out[i * n + layer] for i, f in enumerate(fields)}) for layer, p in enumerate(pageds)]


def write_followers(paged: PagedKV, host: HostKV, fetched: Prefetch, dst, mesh) -> PagedKV:
    """Write gathered rows (:func:`gather_followers`) into the followers' region slots ``dst[B * n_slots, R]`` (the
    first ``fetched.count`` of each), per device on a mesh (each device into its own pages)."""
    pairs = jnp.asarray(host.heads, jnp.int32)  # [B * n_slots, 2] (row, KV head) of each host head
    rk, rv = take(fetched)
    # quantized pools: the scale pools and the rows' scales, written at the same slots
    scales = (paged.k_scales, paged.v_scales, fetched.k_scales, fetched.v_scales) if paged.quantized else ()

    def local(k_pages, v_pages, table, pairs, rk, rv, dst, count, *scales):
        block, row, head = device_block(mesh, *table.shape[:2])  # local page ids, rows and heads
        return scatter_to_slots(k_pages, v_pages, table - block * k_pages.shape[0], rk, rv, pairs[:, 0] - row,
                                pairs[:, 1] - head, dst, count, scales=scales)

    out = per_device(local, mesh, (BY_DEVICE, BY_DEVICE, ROWS_HEADS) + (BY_DEVICE,) * (5 + len(scales)),
                     (BY_DEVICE,) * (2 + len(scales) // 2), paged.k_pages, paged.v_pages, paged.block_table, pairs,
                     rk, rv, dst, fetched.count, *scales)
    return paged.replace(**dict(zip(("k_pages", "v_pages", "k_scales", "v_scales"), out)))


def recall_rows(state: RecallKV, picks, count, dst, mesh) -> PagedKV:
    """The follower slots' host rows ``picks[B, n_slots, R]`` (the first ``count[B, n_slots]`` of each) written
    into their region slots ``dst[B, n_slots, R]`` now: one gather of fixed size, then the writes."""
    picks, count, dst = (flatten_heads(x, mesh) for x in (picks, count, dst))
    return write_followers(state.paged, state.host, gather_followers(state.host, picks, count, mesh), dst, mesh)


# ------------------------------------------------------------------------------------ partition, stats
def recall_partition(state: RecallKV, tracker) -> RecallKV:
    """Partition specs of a :class:`RecallKV` (see the module docstring), with the method's ``tracker`` specs."""
    host = None if state.host is None else state.host.with_arrays(*[OnHost(BY_DEVICE)] * len(state.host.arrays()))
    rows = jax.sharding.PartitionSpec(DATA)
    query = None if state.query is None else jax.sharding.PartitionSpec(DATA, None, MODEL)  # [B, 1, Hq, D]
    return state.replace(paged=paged_partition(state.paged), host=host, query=query,
                         region_start=ROWS_HEADS, region_count=ROWS_HEADS, applied=ROWS_HEADS, held=ROWS_HEADS,
                         prompt_len=rows, picks=rows, version=rows, anchor_picks=rows, anchor_at=rows,
                         tracker=tracker, steps=REPLICATED, recalls=REPLICATED, rows_moved=REPLICATED)


def recall_stats(states, fetched_per_step: int) -> dict:
    """Kept tokens per head, pools, host copy, recall events, rows moved (concrete values); ``fetched_per_step``:
    host rows one one-token step transfers (its schedule's fixed size, summed over layers and rows)."""
    steps = max(int(st.steps) for st in states)  # counted by the layers with leaders
    followers = sum(len(st.plan.followers) * st.applied.shape[0] for st in states)
    recalls = sum(int(st.recalls) for st in states)
    rows = sum(int(st.rows_moved) for st in states)
    pool = states[0].paged.k_pages
    row_bytes = stored_vector_bytes(pool.shape[-1], pool.dtype)  # one key or value row, its scale included
    return {
        "kept_tokens_per_head": [list(st.plan.capacities) for st in states],
        "full_heads": sum(len(st.plan.full) for st in states),
        "follower_heads": sum(len(st.plan.followers) for st in states),
        "page_pool_bytes": sum(paged_device_bytes(st.paged) for st in states),
        "decode_steps": steps,
        "recall_events": recalls,
        "recall_trigger_rate": recalls / (steps * followers) if steps and followers else 0.0,
        "rows_recalled": rows,
        "bytes_recalled": 2 * rows * row_bytes,
        "rows_fetched_per_step": fetched_per_step,
        "bytes_fetched_per_step": 2 * fetched_per_step * row_bytes,
    }


def attention_read_bytes(states) -> int:
    """K/V bytes one step's attention reads: every held token of every head."""
    return sum(paged_read_bytes(st.paged) for st in states)
