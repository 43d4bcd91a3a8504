"""HeteroCache (Shi et al.): head roles from offline calibration, stability-weighted per-head budgets, and pivot
heads that refresh their satellites from host memory when their attention drifts.

Calibration (``kvjax calibrate heterocache``, :mod:`kvjax.calibration.heterocache`): each KV head is a *pivot*, a
*satellite* of one pivot, an *anchor* or *volatile*, from its stability and its overlaps with the heads of its group.

Runtime:

* pivots and volatile heads keep the whole prompt on the device; anchors and satellites keep their top-``l_i``
  tokens: softmax of the prompt's last query per query head, average pooling (kernel 5), max over the GQA group;
  kept tokens in position order, no window or sink protection (as the reference code).
* ``l_i`` (Eq. 7-8 as the reference code computes them): ``base = (rho N - F) L / (N - F)``
  (:func:`kvjax.budgets.compressed_head_tokens`), ``w_i = 1 / (stability_i + 1e-6)`` normalised to mean 1 over the
  compressed heads, ``l_i = min(L, int(base * w_i))``. Where ``base * w_i > L`` the reference code drops the excess;
  kvjax gives it to the other compressed heads in proportion to their weights (:func:`spread_capped`), so a budget
  of 1.0 keeps every token. Below the clipping point both are identical.
* satellites' prompt KV lives in ``pinned_host`` memory. Each decode step every pivot scores its query over its full
  cache and records the overlap of that query's top-``base`` set with its reference set (Eq. 9); every ``window``
  steps, if the **median** of the window's overlaps is below ``tau_drift``, the reference becomes the last query's
  set and every satellite's first ``l_s`` slots take the pivot's current top-``l_s`` prompt tokens from the host
  (the schedule: :mod:`kvjax.methods.recall.schedules`). The paper buffers the window's queries and scores them at
  the check; scoring each when it arrives gives the same overlaps (the pivot's held tokens only grow) with no
  conditional in the step.

Deviations (each measured in ``docs/methods/heterocache.md``): cross-layer groups (``group_layers``) for models with
few KV heads per layer; pivots choose among prompt tokens only; a multi-token call is checked at once (its last
``min(T, window)`` queries); ``reanchor`` (a question asked after compression re-anchors every satellite before it
attends); ``prefill_from_pivot``; ``drift_above_chance``; recall schedules other than ``"whole"``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec

from kvjax.artifacts import Artifact
from kvjax.budgets import budget_fraction, compressed_head_tokens
from kvjax.cache import Cache, CacheSpec
from kvjax.methods.recall.base import LeaderFollowerMethod, leader_slices
from kvjax.methods.recall.layout import Follower, LayerPlan, publish
from kvjax.methods.recall.scores import (leader_probs, leader_queries, prompt_only, seen_limits, staged_scores,
                                         to_stored, top_mask, top_slots)
from kvjax.selection import keep_to_indices, keep_top, row_capacities, small_median
from kvjax.sharding import DATA

ROLES = ("pivot", "satellite", "anchor", "volatile")
KIND = "heterocache"
# Named configurations (``heterocache:preset=tuned``); each departs from the paper: one pivot for the whole model,
# re-anchoring on a question asked after compression, satellites starting from their pivot's choice (``suite``, chosen
# on kvjax's own three-task suite); ``suite-lookahead`` also extends the pivots' scores 16 positions forward,
# ``suite-lookahead-unpooled`` also scores without pooling, and ``tuned`` also checks drift on the overlap above chance
# (the last three chosen in turn on RULER's dev split; docs/methods/heterocache.md).
SUITE_PRESET = {"group_layers": 24, "reanchor": True, "rehearsals": 2, "prefill_from_pivot": True}
PRESETS: dict[str, dict] = {
    "tuned": {**SUITE_PRESET, "lookahead": 16, "kernel": 1, "drift_above_chance": True},
    "suite-lookahead-unpooled": {**SUITE_PRESET, "lookahead": 16, "kernel": 1},
    "suite-lookahead": {**SUITE_PRESET, "lookahead": 16},
    "suite": SUITE_PRESET,
}


def spread_capped(total: float, weights: np.ndarray, cap: int) -> np.ndarray:
    """Split ``total`` in proportion to ``weights``, no share above ``cap``; what capped shares cannot take goes to the others."""
    share = np.zeros(len(weights))
    free = np.ones(len(weights), bool)
    left = float(total)
    while free.any() and left > 1e-9:
        part = left * weights * free / weights[free].sum()
        over = free & (share + part > cap)
        if not over.any():
            return share + part
        left -= float((cap - share[over]).sum())
        share[over] = cap
        free &= ~over
    return share


def head_capacities(stability, full, rho: float, length: int, *, allocation: bool = True):
    """(capacities per layer and head, base) by Eq. 7-8 as the reference code (see module docstring).

    ``stability[L][H]`` floats, ``full[L][H]`` bools, ``rho`` the kept fraction, ``length`` the prompt.
    """
    L, H = len(stability), len(stability[0])
    N = L * H
    F = sum(bool(x) for row in full for x in row)
    base = compressed_head_tokens(rho, N, F, length, method="HeteroCache with this calibration",
                                  full="full heads (pivot + volatile)")
    if F == N:
        return [[length] * H for _ in range(L)], length
    comp = [(l, h) for l in range(L) for h in range(H) if not full[l][h]]
    w = np.array([1.0 / (stability[l][h] + 1e-6) for l, h in comp]) if allocation else np.ones(len(comp))
    share = spread_capped(base * len(comp), w / w.mean(), length)
    caps = [[length] * H for _ in range(L)]
    for (l, h), c in zip(comp, share):
        caps[l][h] = max(1, int(c))
    return caps, max(1, int(base))


# -------------------------------------------------------------------------------------- the method
@struct.dataclass
class PivotTracker:
    """Per pivot of a layer: the overlaps of the window's queries with the reference set ``overlap[W, B, n]``, the
    reference set ``ref[B, n, positions]`` and the set size ``base`` (static)."""

    overlap: jnp.ndarray
    ref: jnp.ndarray
    base: int = struct.field(pytree_node=False, default=1)


@dataclasses.dataclass(frozen=True)
class HeteroCache(LeaderFollowerMethod):
    """HeteroCache (see the module docstring); the shared hyper-parameters are :class:`LeaderFollowerMethod`'s.

    Args:
      budget: ``rho``, or tokens per head (``rho = budget / prompt``).
      kernel: pooling of the attention scores (reference: 5, average).
      group_layers: None: the model's default, cross-layer groups; 1: the paper's per-layer clustering.
      window: drift window ``W`` in decode steps (reference: 5), the recall schedule's decision interval.
      tau_drift: drift threshold (paper: equal to tau_stable, 0.5).
      allocation: inverse-stability budgets (False: ``base`` for every compressed head, the paper's "w/o allocation").
      retrieval: pivots refresh satellites (False: static after prefill, "w/o retrieval").
      reanchor: a question asked after compression makes every pivot publish its choice for the question's last
        query, recalled *before* the question attends, after ``rehearsals`` rehearsals of the question (a
        deviation, off by default).
      prefill_from_pivot: each satellite's prefill set is its pivot's top-``l_i`` for the prompt's last query
        instead of its own (a deviation, off by default).
      drift_above_chance: the drift check compares ``tau_drift`` with the overlap above chance, ``(o - c) / (1 - c)``
        for ``c = base / held``, the overlap of two random sets of ``base`` among the held tokens, instead of the
        overlap ``o`` itself (a deviation, off by default). The paper's overlap cannot fall below about ``c``, so
        from budgets near ``tau_drift`` on its check never fires.
    """

    window: int = 5
    tau_drift: float = 0.5
    allocation: bool = True
    retrieval: bool = True
    reanchor: bool = False
    prefill_from_pivot: bool = False
    drift_above_chance: bool = False
    name = "heterocache"

    def __post_init__(self):
        self.check_shared()
        if self.window < 1:
            raise ValueError(f"window must be >= 1 decode step, got {self.window}")
        if not 0.0 <= self.tau_drift <= 1.0:
            raise ValueError(f"tau_drift must be in [0, 1], got {self.tau_drift}")

    @property
    def every(self) -> int:
        return self.window

    @property
    def recalls(self) -> bool:
        return self.retrieval

    @property
    def reanchors(self) -> bool:
        return self.reanchor and self.retrieval

    def check_artifact(self, spec: CacheSpec, art: Artifact) -> None:
        roles = art.meta_dict()["roles"]
        if len(roles) != spec.num_layers or any(len(r) != spec.num_kv_heads for r in roles):
            raise ValueError(f"heterocache artifact has roles for {len(roles)} layers x {len(roles[0])} heads; "
                             f"the model has {spec.num_layers} x {spec.num_kv_heads}")

    def plans(self, spec: CacheSpec, art: Artifact) -> tuple[tuple[LayerPlan, ...], int]:
        """Per-layer plans and the base length (drift set size)."""
        meta = art.meta_dict()
        roles, pivot_of = meta["roles"], meta["pivot_of"]
        full = [[r in ("pivot", "volatile") for r in row] for row in roles]
        caps, base = head_capacities(meta["stability"], full, budget_fraction(self.budget, spec.longest_row),
                                     spec.longest_row, allocation=self.allocation)
        pivots = [[h for h, r in enumerate(row) if r == "pivot"] for row in roles]
        region = {}  # pivot -> largest satellite capacity
        for l, row in enumerate(roles):
            for h, r in enumerate(row):
                if r == "satellite":
                    p = tuple(pivot_of[l][h])
                    region[p] = max(region.get(p, 0), caps[l][h])
        plans = []
        for l, row in enumerate(roles):
            followers = tuple(Follower(h, pivot_of[l][h][0], pivots[pivot_of[l][h][0]].index(pivot_of[l][h][1]))
                              for h, r in enumerate(row) if r == "satellite")
            plans.append(LayerPlan(
                capacities=tuple(caps[l]), full=tuple(h for h in range(len(row)) if full[l][h]),
                leaders=tuple(pivots[l]), followers=followers,
                picks=max([region.get((l, p), 0) for p in pivots[l]], default=0),
            ))
        return tuple(plans), base

    def finish_prefill(self, state, ctx):
        """Keep top-``l_i`` per compressed head, everything for full heads; offload satellites; pivot reference sets."""
        spec = ctx.spec
        plans, base = self.plans(spec, ctx.artifact)
        plan = plans[ctx.layer]
        P, H = spec.prompt_slots, spec.num_kv_heads
        layer_scores = staged_scores(state, ctx, kernel=self.kernel)
        scores = layer_scores(ctx.layer)  # [B, H, S]
        if self.prefill_from_pivot and plan.followers:
            scores = self.pivot_scores(layer_scores, plans, ctx)
        caps = row_capacities(plan.capacities, self.budget, spec, ctx.pad)
        n = (P - ctx.pad)[:, None]
        full = jnp.asarray([h in plan.full for h in range(H)])[None, :]
        caps = jnp.where(full, n, caps)
        S = scores.shape[-1]
        slots = jnp.arange(S)[None, None, :]
        real = (slots >= ctx.pad[:, None, None]) & (slots < P)
        keep = keep_top(scores, jnp.zeros_like(real), real, caps)
        idx, lengths = keep_to_indices(keep, max(plan.capacities))
        B = state.k.shape[0]
        nl = len(plan.leaders)
        region_count = lengths[:, jnp.asarray([f.head for f in plan.followers], jnp.int32)]  # satellites' kept tokens
        layer = self.build(state, idx, lengths, ctx, plans, region_start=jnp.zeros_like(region_count),
                           region_count=region_count, picks=jnp.zeros((B, nl, max(plan.picks, 1)), jnp.int32),
                           tracker=None)
        positions = layer.paged.block_table.shape[-1] * self.page_size
        overlap = jnp.zeros((self.window, B, nl), jnp.float32)
        if nl:
            lead = jnp.asarray(plan.leaders, jnp.int32)
            ref = top_mask(to_stored(scores[:, lead], ctx.pad, positions, -jnp.inf), base)
        else:
            ref = jnp.zeros((B, 0, positions), bool)
        return layer.replace(tracker=PivotTracker(overlap=overlap, ref=ref, base=base))

    def pivot_scores(self, layer_scores, plans, ctx):
        """This layer's scores ``[B, H, S]`` with each satellite's row replaced by its pivot's last-query scores
        (``layer_scores``: :func:`kvjax.methods.recall.scores.staged_scores`; a pivot may sit in any layer)."""
        own = layer_scores(ctx.layer)
        followers = {f.head: f for f in plans[ctx.layer].followers}
        rows = []
        for h in range(ctx.spec.num_kv_heads):
            f = followers.get(h)
            if f is None:
                rows.append(own[:, h])
            else:
                rows.append(layer_scores(f.leader_layer)[:, plans[f.leader_layer].leaders[f.leader_index]])
        return jnp.stack(rows, axis=1)

    def scored(self, state, q, mesh):
        """The pivots' scores of the call's last ``min(T, window)`` queries ``[B, n, T', positions]``, their
        top-``base`` sets, and each set's overlap with the reference set ``[B, n, T']`` (Eq. 9)."""
        plan = state.plan
        qg = leader_queries(q, plan.leaders, len(plan.capacities))[:, -min(q.shape[1], self.window):]
        scores = leader_probs(state.paged, plan.leaders, qg, self.kernel, "max", lookahead=self.lookahead,
                              implementation=self.implementation, mesh=mesh)
        limits = seen_limits(state.paged, plan.leaders, qg.shape[1])
        return (scores, *self.overlaps(scores, limits, state.tracker.ref, state.tracker.base))

    def overlaps(self, scores, limits, ref, base: int):
        """Top-``base`` sets of ``scores[B, n, T, positions]`` and their overlaps with the reference sets ``ref[B, n,
        positions]`` ``[B, n, T]`` (``limits``: the held tokens each query saw, :func:`seen_limits`); with
        ``drift_above_chance`` the overlap above chance (1 where the sets hold every held token)."""
        sets = top_mask(scores, base)
        held = jnp.clip(limits, 0, scores.shape[-1])  # = isfinite(scores).sum(-1), no reduction
        size = jnp.maximum(jnp.minimum(held, base), 1)
        overlap = (sets & ref[:, :, None]).sum(-1) / size
        if not self.drift_above_chance:
            return sets, overlap
        chance = size / jnp.maximum(held, 1)
        return sets, jnp.where(chance < 1, (overlap - chance) / jnp.maximum(1 - chance, 1e-9), 1.0)

    def publish_drift(self, state, drift, scores, sets, pad):
        """Pivots with ``drift[B, n]`` take the last query's set as their reference and publish its top prompt
        tokens."""
        tr = state.tracker
        picks = top_slots(prompt_only(scores[:, :, -1], state.prompt_len), pad, state.picks.shape[-1])
        state = state.replace(tracker=tr.replace(ref=jnp.where(drift[..., None], sets[:, :, -1], tr.ref)))
        return publish(state, drift, picks)

    def recorded(self, window, overlap, steps):
        """The window of overlaps ``[W, B, n]`` with a one-token call's overlaps ``[B, n]`` at the call's step."""
        return lax.dynamic_update_index_in_dim(window, overlap, (steps - 1) % self.window, axis=0)

    def drifted(self, window, steps):
        """The drift decision after a one-token call (predicated: no conditional): at the window's last step, the
        median overlap below ``tau_drift``."""
        return (steps % self.window == 0) & (small_median(window, axis=0) < self.tau_drift)

    def lead(self, state, q, pad, mesh):
        """The drift check of a multi-token call: its last ``min(T, window)`` queries decide at once, on the median
        of their overlaps."""
        scores, sets, overlap = self.scored(state, q, mesh)
        return self.publish_drift(state, jnp.median(overlap, axis=-1) < self.tau_drift, scores, sets, pad)

    def decide_at_once(self, states, scores, limits, pad):
        """The one-token drift check of the pivots of one or several layers side by side: record each pivot's
        overlap, and at the window's last step decide on the median of the window's overlaps. Each layer's tracker
        is updated from its own arrays, so the update is in place."""
        steps = states[0].steps
        sets, overlap = self.overlaps(scores, limits, jnp.concatenate([st.tracker.ref for st in states], axis=1),
                                      states[0].tracker.base)
        drift = self.drifted(self.recorded(jnp.concatenate([st.tracker.overlap for st in states], axis=2),
                                           overlap[..., 0], steps), steps)
        width = max(st.picks.shape[-1] for st in states)  # a narrower top is a prefix of the widest
        picks = top_slots(prompt_only(scores[:, :, -1], states[0].prompt_len), pad, width)
        decided = []
        for st, n in zip(states, leader_slices(states)):
            tr = st.tracker
            tracker = tr.replace(ref=jnp.where(drift[:, n, None], sets[:, n, -1], tr.ref),
                                 overlap=self.recorded(tr.overlap, overlap[:, n, 0], steps))
            decided.append(publish(st.replace(tracker=tracker), drift[:, n], picks[:, n, :st.picks.shape[-1]]))
        return decided

    def choose_for_question(self, state, q, pad, mesh):
        """Every pivot publishes its choice for the question's last query, whatever the drift."""
        scores, sets, _ = self.scored(state, q[:, -1:], mesh)
        return self.publish_drift(state, jnp.ones(state.version.shape, bool), scores, sets, pad)

    def tracker_partition(self, tracker):
        """Indexed by pivot: split by row only."""
        return tracker.replace(overlap=PartitionSpec(None, DATA), ref=PartitionSpec(DATA))

    def method_stats(self, cache: Cache) -> dict:
        """Roles and the artifact's group size."""
        meta = cache.artifact.meta_dict()
        return {"head_roles": {r: sum(row.count(r) for row in meta["roles"]) for r in ROLES},
                "group_layers": meta["group_layers"]}
