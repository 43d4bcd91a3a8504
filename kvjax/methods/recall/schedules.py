"""Recall schedules: how a follower's device slots follow its leader's choices in one-token decode steps.

Every schedule does fixed-size, unconditional work in a one-token step (no data-dependent conditional, which on a GPU
is a host synchronisation per layer and serialises the recall it holds):

* :class:`WholeRecall` (the papers'): every step, each follower whose leader has a new version takes its whole
  region from the host; the transfer has the region's size every step, used or not (``rows_fetched_per_step``).
* :class:`SpreadRecall`: every step, each follower replaces up to ``ceil(W / every)`` of the tokens its leader's
  latest choice dropped with chosen tokens it lacks, best first (:func:`spread_moves`), so a new choice lands over
  ``every`` steps and a token already on the device is never moved again.
* :class:`AheadRecall`: the spread moves, gathered in the call that chooses them and written at the layer's next
  call, before it attends (same attended tokens as ``SpreadRecall``): nothing in a call waits for its own gather.
* :class:`PipelinedRecall`: the spread moves chosen in call ``t`` are gathered at the start of call ``t + 1`` (their
  inputs come from the loop carry) and written in call ``t + 2``, so a whole step of device work can hide the gather.

Multi-token calls (a question) and the end of a question's last pass refresh whole regions and apply
re-anchorings (:func:`apply_anchors`, :func:`refresh_regions`); a multi-token call first writes everything in flight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.host_tier import empty_prefetch
from kvjax.methods.recall.layout import (LayerPlan, PendingRecall, RecallKV, gather_followers, leader_plan,
                                         leader_values, recall_rows, write_followers)
from kvjax.sharding import flatten_heads


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


# ------------------------------------------------------------------------------- whole-set refreshes
def followed(state: RecallKV, due, versions, count, **changes) -> RecallKV:
    """``state`` with ``changes`` after the follower slots in ``due[B, n_slots]`` took their leaders' ``versions``,
    writing ``count[B, n_slots]`` rows: the versions they hold and the recall counters updated."""
    return state.replace(applied=jnp.where(due, versions, state.applied),
                         recalls=state.recalls + due.sum().astype(jnp.int32),
                         rows_moved=state.rows_moved + count.sum().astype(jnp.int32), **changes)


def apply_anchors(state: RecallKV, layers, layer: int, mesh) -> RecallKV:
    """Followers whose leader re-anchored since they last applied a version take the whole re-anchored set (their
    slots ``0 .. region_start + region_count``) from the host, in one fixed-size transfer (a no-op for a layer whose
    leaders never re-anchor). Moves still in flight for those followers are cancelled: they were chosen from the set
    the re-anchoring replaces."""
    plan = state.plan
    if not plan.followers or not any(leader_plan(state, layers, layer, f).anchor_picks for f in plan.followers):
        return state
    anchor_at = leader_values(state, layers, layer, lambda st: st.anchor_at)
    anchor_picks = leader_values(state, layers, layer, lambda st: st.anchor_picks)
    due = anchor_at > state.applied
    K = anchor_picks.shape[-1]
    count = jnp.where(due, jnp.minimum(state.region_start + state.region_count, K), 0)
    dst = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), anchor_picks.shape)
    paged = recall_rows(state, anchor_picks, count, dst, mesh)
    at = jnp.clip(state.region_start[..., None] + jnp.arange(state.held.shape[-1]), 0, K - 1)
    held = jnp.where(due[..., None], jnp.take_along_axis(anchor_picks, at, axis=-1), state.held)
    pending = state.pending
    if pending is not None:
        keep = ~flatten_heads(due, mesh)
        pending = pending.replace(fetched=pending.fetched.replace(count=jnp.where(keep, pending.fetched.count, 0)))
    return followed(state, due, anchor_at, count, paged=paged, held=held, pending=pending)


def refresh_regions(state: RecallKV, layers, layer: int, mesh) -> RecallKV:
    """Followers whose leader published a version they do not hold take its whole choice into their region, in one
    fixed-size transfer."""
    if not state.plan.followers:
        return state
    versions = leader_values(state, layers, layer, lambda st: st.version)
    picks = leader_values(state, layers, layer, lambda st: st.picks)  # [B, n_slots, R]
    chosen = picks.shape[-1]
    due = versions > state.applied
    count = jnp.where(due, jnp.minimum(state.region_count, chosen), 0)
    dst = state.region_start[..., None] + jnp.arange(chosen, dtype=jnp.int32)
    paged = recall_rows(state, picks, count, dst, mesh)
    held = jnp.where(due[..., None], fit_width(picks, state.held.shape[-1]), state.held)
    return followed(state, due, versions, count, paged=paged, held=held)


def refresh_all(state: RecallKV, layers, layer: int, mesh) -> RecallKV:
    """A multi-token call's recall: re-anchorings first, then any newer region."""
    return refresh_regions(apply_anchors(state, layers, layer, mesh), layers, layer, mesh)


def chosen_width(state: RecallKV, layers, layer: int) -> int:
    """Tokens the widest choice of this layer's followers' leaders holds (static)."""
    return max(max(leader_plan(state, layers, layer, f).picks, 1) for f in state.plan.followers)


# ------------------------------------------------------------------------------------------ schedules
@dataclasses.dataclass(frozen=True)
class RecallSchedule:
    """How followers follow their leaders in one-token steps; ``every``: the method's decision interval (HeteroCache's
    drift window, SyncKV's stride). The base recalls nothing (a method with recall turned off)."""

    every: int = 1

    def room(self, plans: tuple, plan: LayerPlan) -> int:
        """Rows per follower kept in flight between calls (0: none)."""
        return 0

    def with_room(self, layer: RecallKV, plans: tuple) -> RecallKV:
        """``layer`` (just built, nothing in flight) with its empty in-flight buffers, if the schedule keeps any."""
        return layer

    def land(self, state: RecallKV, mesh, *, drain: bool) -> RecallKV:
        """At the start of a call, before it attends: write what earlier calls gathered. ``drain`` (a multi-token
        call): leave nothing in flight."""
        return state

    def step(self, state: RecallKV, layers, layer: int, mesh) -> RecallKV:
        """A one-token call's recall, after the leaders' decision."""
        return state

    def fetched_rows(self, state: RecallKV, layers, layer: int) -> int:
        """Host rows one one-token step transfers for this layer (static)."""
        return 0


@dataclasses.dataclass(frozen=True)
class WholeRecall(RecallSchedule):
    """A new choice replaces the follower's whole region in the step it reaches the follower."""

    def step(self, state, layers, layer, mesh):
        return refresh_regions(state, layers, layer, mesh)

    def fetched_rows(self, state, layers, layer):
        return state.host.n_heads * chosen_width(state, layers, layer) if state.plan.followers else 0


def pending_rows(plans: tuple, plan: LayerPlan, every: int) -> int:
    """Rows per follower one spread step moves in the layer of ``plan`` (``plans``: every layer's): ``ceil(W /
    every)``, ``W`` the most tokens a follower's region or its leader's choice holds."""
    if not plan.followers:
        return 0
    held = max(plan.capacities[f.head] for f in plan.followers)
    chosen = max(max(plans[f.leader_layer].picks, 1) for f in plan.followers)
    return -(-min(held, chosen) // every)


@dataclasses.dataclass(frozen=True)
class SpreadRecall(RecallSchedule):
    """A fixed number of moves per step towards the leader's latest choice, written at once."""

    def moves(self, state, layers, layer, mesh):
        """This step's moves: ``(state with held/applied/counters updated, ids, count, dst)``, the last three
        flattened per host head (:func:`kvjax.sharding.flatten_heads`)."""
        versions = leader_values(state, layers, layer, lambda st: st.version)
        picks = leader_values(state, layers, layer, lambda st: st.picks)  # [B, n_slots, R]
        chosen = picks.shape[-1]
        region = jnp.minimum(state.region_count, chosen)
        held = state.held
        W = min(held.shape[-1], chosen)  # a region's positions a choice can reach
        ids, positions, count = spread_moves(held[..., :W], picks[..., :W], jnp.where(versions > 0, region, 0),
                                             self.every, state.host.length)
        flat = [flatten_heads(x, mesh) for x in (ids, count, state.region_start[..., None] + positions)]
        held = jax.vmap(lambda h, p, i: h.at[p].set(i, mode="drop"))(  # positions W: dropped
            held.reshape(-1, held.shape[-1]), positions.reshape(-1, positions.shape[-1]),
            ids.reshape(-1, ids.shape[-1])).reshape(held.shape)
        due = versions > state.applied
        state = followed(state, due, versions, count, held=held)
        return (state, *flat)

    def step(self, state, layers, layer, mesh):
        if not state.plan.followers:
            return state
        state, ids, count, dst = self.moves(state, layers, layer, mesh)
        return state.replace(paged=write_followers(state.paged, state.host,
                                                   gather_followers(state.host, ids, count, mesh), dst, mesh))

    def fetched_rows(self, state, layers, layer):
        if not state.plan.followers:
            return 0
        return state.host.n_heads * -(-min(state.held.shape[-1], chosen_width(state, layers, layer)) // self.every)


@dataclasses.dataclass(frozen=True)
class AheadRecall(SpreadRecall):
    """The spread moves, gathered in the call that chooses them and written at the layer's next call."""

    def room(self, plans, plan):
        return pending_rows(plans, plan, self.every)

    def with_room(self, layer, plans):
        rows = self.room(plans, layer.plan)
        if not rows:
            return layer
        dst = jnp.zeros((layer.host.n_heads, rows), jnp.int32)
        return layer.replace(pending=PendingRecall(fetched=empty_prefetch(layer.host, rows), dst=dst))

    def land(self, state, mesh, *, drain):
        p = state.pending
        if p is None:
            return state
        paged = write_followers(state.paged, state.host, p.fetched, p.dst, mesh)
        done = p.fetched.replace(count=jnp.zeros_like(p.fetched.count))
        return state.replace(paged=paged, pending=p.replace(fetched=done))

    def step(self, state, layers, layer, mesh):
        if not state.plan.followers:
            return state
        state, ids, count, dst = self.moves(state, layers, layer, mesh)
        check_room(state.pending, ids)
        return state.replace(pending=PendingRecall(fetched=gather_followers(state.host, ids, count, mesh), dst=dst))


@dataclasses.dataclass(frozen=True)
class PipelinedRecall(AheadRecall):
    """The spread moves chosen in one call, gathered at the start of the next (from the loop carry) and written in
    the one after; a multi-token call writes everything in flight before it attends."""

    def with_room(self, layer, plans):
        layer = super().with_room(layer, plans)
        if layer.pending is None:
            return layer
        rows = layer.pending.dst
        return layer.replace(pending=layer.pending.replace(
            chosen=rows, chosen_count=jnp.zeros((layer.host.n_heads,), jnp.int32), chosen_dst=rows))

    def land(self, state, mesh, *, drain):
        p = state.pending
        if p is None:
            return state
        state = super().land(state, mesh, drain=drain)
        p = state.pending
        fetched = gather_followers(state.host, p.chosen, p.chosen_count, mesh)
        nothing = jnp.zeros_like(p.chosen_count)
        if drain:
            paged = write_followers(state.paged, state.host, fetched, p.chosen_dst, mesh)
            return state.replace(paged=paged, pending=p.replace(chosen_count=nothing))
        return state.replace(pending=p.replace(fetched=fetched, dst=p.chosen_dst, chosen_count=nothing))

    def step(self, state, layers, layer, mesh):
        if not state.plan.followers:
            return state
        state, ids, count, dst = self.moves(state, layers, layer, mesh)
        check_room(state.pending, ids)
        return state.replace(pending=state.pending.replace(chosen=ids, chosen_count=count, chosen_dst=dst))


def check_room(pending: PendingRecall | None, ids) -> None:
    """Raise when a layer's in-flight buffer does not fit one step's moves ``ids[n, S]``."""
    if pending is None or pending.dst.shape != ids.shape:
        room = "none" if pending is None else pending.dst.shape[1]
        raise ValueError(f"recall schedule: {ids.shape[1]} rows per follower to move, room for {room} "
                         "(build the layer with the schedule's with_room)")


SCHEDULES = {"whole": WholeRecall, "spread": SpreadRecall, "ahead": AheadRecall, "pipelined": PipelinedRecall}
RECALL_SCHEDULES = tuple(SCHEDULES)


def make_schedule(name: str, every: int, *, enabled: bool = True) -> RecallSchedule:
    """The schedule called ``name`` (:data:`RECALL_SCHEDULES`) with decision interval ``every``; with ``enabled``
    False (recall turned off), one that recalls nothing."""
    if name not in SCHEDULES:
        raise ValueError(f"recall_schedule must be one of {RECALL_SCHEDULES}, got {name!r}")
    return SCHEDULES[name](every) if enabled else RecallSchedule(every)
