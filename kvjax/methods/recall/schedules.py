"""Recall schedules: how a follower's device slots follow its leader's choices in one-token decode steps.

Every schedule does fixed-size, unconditional work in a one-token step (no data-dependent conditional, which on a GPU
is a host synchronisation per layer and serialises the recall it holds):

* :class:`WholeRecall` (the papers'): every step, each follower whose leader has a new version takes its whole
  region from the host; the transfer has the region's size every step, used or not (``rows_fetched_per_step``).
* :class:`SpreadRecall`: every step, each follower replaces up to ``ceil(W / every)`` of the tokens its leader's
  latest choice dropped with chosen tokens it lacks, best first (:func:`spread_moves`), so a new choice lands over
  ``every`` steps and a token already on the device is never moved again.
* :class:`PipelinedRecall`: the spread moves of every layer at once, around a call's layers
  (:meth:`RecallSchedule.around_layers`): chosen before them from the leaders' choices as the previous call left
  them (the loop carry), gathered in one host computation while the layers run, written after them. The layers' work
  hides the gather, and a step launches a few kernels for recall where a layer-by-layer schedule launches a few per
  layer.

Multi-token calls (a question) and the end of a question's last pass refresh whole regions and apply
re-anchorings (:func:`apply_anchors`, :func:`refresh_regions`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.methods.recall.layout import (RecallKV, gather_block, gather_followers,
                                         leader_plan, leader_values, recall_rows, write_followers, write_layers)
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


def spread_moves(held, target, count, spread_over: int, slots: int, most=None):
    """One fixed-size step of a follower towards its leader's choice, without duplicates.

    ``held[..., W]``, ``target[..., W]``: the prompt slots (below ``slots``) the follower's region holds and its
    leader's choice (best first); entries ``>= count[...]`` of both are unused. Returns ``(ids, positions,
    moves)``, each with ``S = ceil(W / spread_over)`` entries per follower: the ``moves`` best chosen tokens the
    follower lacks (``ids``) and the region positions holding tokens the choice dropped, in order (``positions``;
    ``W`` past ``moves``), where they go. Each step only replaces dropped tokens with missing ones, so the region
    never holds a token twice, and after ``spread_over`` steps it holds exactly the choice (as a set). ``most``
    (broadcastable to ``count``): fewer moves per step for followers whose regions are narrower than ``W`` (several
    layers' followers padded to one width), default ``S``.
    """
    W = held.shape[-1]
    S = -(-W // spread_over)
    live = jnp.arange(W) < count[..., None]
    missing = live & ~members(held, live, target, slots)
    dropped = live & ~members(target, live, held, slots)
    src, positions = first_set(missing, S), first_set(dropped, S)
    moves = jnp.minimum(missing.sum(-1), S if most is None else jnp.minimum(most, S)).astype(jnp.int32)
    positions = jnp.where(jnp.arange(S) < moves[..., None], positions, W)
    return jnp.take_along_axis(target, jnp.minimum(src, W - 1), axis=-1), positions, moves


# ------------------------------------------------------------------------------- whole-set refreshes
def followed(state: RecallKV, due, versions, count, tallies=None, **changes) -> RecallKV:
    """``state`` with ``changes`` after the follower slots in ``due[B, n_slots]`` took their leaders' ``versions``,
    writing ``count[B, n_slots]`` rows: the versions they hold and the recall counters updated. ``tallies``: the
    counters' increments ``(followers due, rows)`` when the caller summed them for several layers at once (one
    reduction instead of two per layer), else this layer's own sums."""
    due_n, rows_n = (due.sum(), count.sum()) if tallies is None else tallies
    return state.replace(applied=jnp.where(due, versions, state.applied),
                         recalls=state.recalls + due_n.astype(jnp.int32),
                         rows_moved=state.rows_moved + rows_n.astype(jnp.int32), **changes)


def apply_anchors(state: RecallKV, layers, layer: int, mesh) -> RecallKV:
    """Followers whose leader re-anchored since they last applied a version take the whole re-anchored set (their
    slots ``0 .. region_start + region_count``) from the host, in one fixed-size transfer (a no-op for a layer whose
    leaders never re-anchor)."""
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
    return followed(state, due, anchor_at, count, paged=paged, held=held)


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


def spread_inputs(state: RecallKV, layers, layer: int):
    """A layer's inputs to :func:`spread_moves`: ``(versions[B, n_slots], held, target[B, n_slots, W], count)``:
    the followers' leader versions, their regions' slots and their leaders' choices cut to the ``W`` positions a
    choice reaches, and the live entries (none before a leader's first choice)."""
    versions = leader_values(state, layers, layer, lambda st: st.version)
    picks = leader_values(state, layers, layer, lambda st: st.picks)  # [B, n_slots, R]
    chosen = picks.shape[-1]
    W = min(state.held.shape[-1], chosen)
    count = jnp.where(versions > 0, jnp.minimum(state.region_count, chosen), 0)
    return versions, state.held[..., :W], picks[..., :W], count


def moved(state: RecallKV, versions, ids, positions, count, mesh, tallies=None, due=None):
    """``(state after the moves, ids, count, dst)`` of :func:`spread_moves`' output, the last three flattened per
    host head (``dst`` -1 past the moves): the region positions take the moved tokens, the followers the versions,
    the counters the moves (``tallies``: as :func:`followed`; ``due``: the followers due a new version, when the
    caller has them)."""
    S = positions.shape[-1]
    width = state.held.shape[-1]
    live = jnp.arange(S) < count[..., None]
    positions = jnp.where(live, positions, width)  # past the moves: written nowhere
    dst = jnp.where(live, state.region_start[..., None] + positions, -1)
    flat = [flatten_heads(x, mesh) for x in (ids, count, dst)]
    held = jax.vmap(lambda h, p, i: h.at[p].set(i, mode="drop"))(
        state.held.reshape(-1, width), positions.reshape(-1, S), ids.reshape(-1, S)).reshape(state.held.shape)
    if due is None:  # materialized first, so that the in-place update of applied follows the counters' read
        due, versions = jax.lax.optimization_barrier((versions > state.applied, versions))
    return (followed(state, due, versions, count, tallies, held=held), *flat)


# ------------------------------------------------------------------------------------------ schedules
@dataclasses.dataclass(frozen=True)
class RecallSchedule:
    """How followers follow their leaders in one-token steps; ``every``: the method's decision interval (HeteroCache's
    drift window, SyncKV's stride); ``implementation``: the method's attention implementation, which also picks how
    :class:`PipelinedRecall` writes its rows (:func:`kvjax.methods.recall.layout.write_layers`). The base recalls
    nothing (a method with recall turned off)."""

    every: int = 1
    implementation: str = "auto"
    # whether a one-token call's recall reads the leaders' choices only in later calls, so the leaders may decide
    # after every layer has run (:meth:`kvjax.methods.recall.base.LeaderFollowerMethod.lead_layers`)
    decides_after_layers = False

    def around_layers(self, cache, tokens: int, run):
        """A call on the compressed cache (``tokens`` per row): ``run(cache) -> (logits, cache)`` runs its layers,
        with recall work for every layer at once before or after (the base: none)."""
        return run(cache)

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


@dataclasses.dataclass(frozen=True)
class SpreadRecall(RecallSchedule):
    """A fixed number of moves per step towards the leader's latest choice, written at once."""

    def moves(self, state, layers, layer, mesh):
        """This step's moves: ``(state with held/applied/counters updated, ids, count, dst)``, the last three
        flattened per host head (:func:`kvjax.sharding.flatten_heads`)."""
        versions, held, target, count = spread_inputs(state, layers, layer)
        ids, positions, count = spread_moves(held, target, count, self.every, state.host.length)
        return moved(state, versions, ids, positions, count, mesh)

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
class PipelinedRecall(SpreadRecall):
    """Every layer's spread moves at once, around a call's layers: chosen before them from the leaders' choices as
    the previous call left them (the loop carry), gathered for every layer in one host computation while the layers
    run, and written after them, so the next call attends them. A multi-token call writes them before its layers (its
    whole-region refreshes follow). A follower after its leader's layer moves as under :class:`SpreadRecall`, one
    call later; one before it sees its leader's choice one call sooner than a layer-by-layer schedule would. The
    leaders' one-token decisions, read only by the next call, are made after the layers, all at once."""

    decides_after_layers = True

    def step(self, state, layers, layer, mesh):
        return state  # the next call chooses the moves (:meth:`around_layers`)

    def around_layers(self, cache, tokens, run):
        mesh = cache.spec.mesh
        layers, moves = self.gather_moves(cache.layers, mesh, drain=tokens > 1)
        if tokens > 1:
            return run(cache.replace(layers=self.write_moves(layers, moves, mesh)))
        out, cache = run(cache.replace(layers=layers))
        return out, cache.replace(layers=self.write_moves(cache.layers, moves, mesh))

    def write_moves(self, layers: tuple, moves, mesh) -> tuple:
        """``layers`` with the rows of :meth:`gather_moves` written into their region slots, every layer's at once
        (:func:`kvjax.methods.recall.layout.write_layers`)."""
        if moves is None:
            return layers
        moving, block, dsts = moves
        paged = write_layers([layers[i].paged for i in moving], [layers[i].host for i in moving], block, dsts, mesh,
                             self.implementation)
        written = dict(zip(moving, paged))
        return tuple(st.replace(paged=written[i]) if i in written else st for i, st in enumerate(layers))

    def gather_moves(self, layers: tuple, mesh, *, drain: bool):
        """Every layer's spread moves from ``layers`` (each layer's followers padded to one width; a follower moves
        as many tokens per call as in its own layer) and their host rows in one gather: ``(layers with held, applied
        and counters updated, moves)``, ``moves`` for :meth:`write_moves`: ``(layers moving, the gathered rows'
        block, per layer their region slots)``, None when no layer has followers. ``drain`` (a
        multi-token call): no moves for a follower due a new version, which takes its whole region in the call
        (:func:`refresh_regions`)."""
        moving = [i for i, st in enumerate(layers) if st.plan.followers]
        if not moving:
            return layers, None
        layers = list(layers)
        inputs = [spread_inputs(layers[i], layers, i) for i in moving]
        if drain:  # a follower due a new version neither moves nor applies it: the call's refresh stays due
            for j, i in enumerate(moving):
                v, h, t, c = inputs[j]
                due = v > layers[i].applied
                inputs[j] = (jnp.where(due, layers[i].applied, v), h, t, jnp.where(due, 0, c))
        n = max(held.shape[1] for _, held, _, _ in inputs)
        W = max(held.shape[-1] for _, held, _, _ in inputs)

        def stacked(arrays):  # [B, n_i(, W_i)] per layer -> [layers, B, n(, W)], zero-padded
            return jnp.stack([jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, W - x.shape[-1])] * (x.ndim - 2))
                              for x in arrays])

        versions, held, target, count = (stacked(x) for x in zip(*inputs))
        most = jnp.asarray([-(-h.shape[-1] // self.every) for _, h, _, _ in inputs], jnp.int32)[:, None, None]
        ids, positions, count = spread_moves(held, target, count, self.every, layers[moving[0]].host.length, most)
        cut = [(inputs[j][1].shape[1], -(-inputs[j][1].shape[-1] // self.every)) for j in range(len(moving))]
        # the gather needs only the moves: it can start before anything below
        block = gather_block([layers[i].host for i in moving],
                             [flatten_heads(ids[j, :, :n, :S], mesh) for j, (n, S) in enumerate(cut)],
                             [flatten_heads(count[j, :, :n], mesh) for j, (n, _) in enumerate(cut)], mesh)
        due = versions > stacked([layers[i].applied for i in moving])
        # Everything read from the versions and followers' state as the previous call left them is computed before
        # any layer updates them in place (the leaders' versions later in the call, the followers' below); without
        # this order XLA copies every layer's versions and applied versions to keep the old values for readers it
        # cannot order (the counters' reduction).
        leaders = {f.leader_layer for i in moving for f in layers[i].plan.followers}
        old = {i: (layers[i].version, layers[i].applied) for i in sorted(leaders | set(moving))}
        old, versions, due, ids, positions, count = jax.lax.optimization_barrier(
            (old, versions, due, ids, positions, count))
        layers = [st.replace(version=old[i][0], applied=old[i][1]) if i in old else st for i, st in enumerate(layers)]
        tallies = due.sum((1, 2)), count.sum((1, 2))  # every layer's counter increments in one reduction each
        dsts = []
        for j, (i, (n, S)) in enumerate(zip(moving, cut)):
            layers[i], _, _, dst = moved(layers[i], versions[j, :, :n], ids[j, :, :n, :S], positions[j, :, :n, :S],
                                         count[j, :, :n], mesh, (tallies[0][j], tallies[1][j]), due[j, :, :n])
            dsts.append(dst)
        return tuple(layers), (moving, block, dsts)


SCHEDULES = {"whole": WholeRecall, "spread": SpreadRecall, "pipelined": PipelinedRecall}
RECALL_SCHEDULES = tuple(SCHEDULES)


def make_schedule(name: str, every: int, *, enabled: bool = True, implementation: str = "auto") -> RecallSchedule:
    """The schedule called ``name`` (:data:`RECALL_SCHEDULES`) with decision interval ``every`` for a method whose
    attention runs as ``implementation``; with ``enabled`` False (recall turned off), one that recalls nothing."""
    if name not in SCHEDULES:
        raise ValueError(f"recall_schedule must be one of {RECALL_SCHEDULES}, got {name!r}")
    return SCHEDULES[name](every, implementation) if enabled else RecallSchedule(every, implementation)
