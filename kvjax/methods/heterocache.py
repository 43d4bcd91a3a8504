"""HeteroCache (Shi et al.): head roles from offline calibration, stability-weighted per-head budgets,
and pivot heads that refresh their satellites from host memory when their attention drifts.

Calibration (``kvjax calibrate heterocache``, :func:`heterocache_artifact`): per KV head the
stability score (Eq. 2) and the overlap graph of its group (an edge when the pairwise overlap
reaches ``tau_sim``); **greedy star clustering** (REFERENCE_NOTES): repeatedly the unassigned head
with the most unassigned neighbours (ties: lowest index) becomes a *pivot* and those neighbours its
*satellites*; the remaining heads are *anchors* (stability >= ``tau_stable``) or *volatile*.

Runtime:

* pivots and volatile heads keep the whole prompt on the device; anchors and satellites keep their
  top-``l_i`` tokens. Selection scores follow the reference code: softmax of the prompt's last
  query per query head, average pooling (kernel 5), max over the GQA group; kept tokens in position
  order, no window or sink protection.
* ``l_i`` (Eq. 7-8 as the reference code computes them): ``base = (rho N - F) L / (N - F)``,
  ``w_i = 1 / (stability_i + 1e-6)`` normalised to mean 1 over the compressed heads,
  ``l_i = min(L, int(base * w_i))``; ``N`` = KV heads of all layers, ``F`` = full heads, ``rho`` =
  the budget as a fraction of the prompt (an int budget ``b`` is ``b / L``). ``rho N <= F`` is an error.
  Deviation: where ``base * w_i > L`` the reference code drops the excess; kvjax gives it to the other
  compressed heads in proportion to their weights (:func:`spread_capped`), so the device holds the
  whole budget and a budget of 1.0 keeps every token. Below the clipping point both are identical.
* satellites' prompt KV lives in ``pinned_host`` memory; each pivot buffers its queries and every
  ``window`` decode steps computes each buffered query's top-``base`` set over its full cache
  (pooled, group max). If the **median** overlap with its reference set (normalised by ``base``,
  Eq. 9) is below ``tau_drift``, the reference becomes the last query's set and every satellite's
  first ``l_s`` slots are overwritten with the pivot's current top-``l_s`` prompt tokens, read from
  the host (:mod:`kvjax.head_recall`).

kvjax's choices where the paper is silent or the model differs (each documented):

* **Cross-layer groups** (``group_layers``): the ready models have 2-3 KV heads per layer, not 8.
  Per-layer clustering (``group_layers=1``, the paper's version) then leaves most layers with a
  pivot, so ``F / N`` is 1/2 (Qwen2.5) and budgets below it are impossible. The shipped default
  artifacts cluster ``(layer, head)`` units of ``ceil(16 / Hkv)`` adjacent layers
  (:func:`kvjax.calibration.auto_group_layers`). Token positions are shared across layers, so a
  pivot's choice is meaningful for a satellite of another layer.
  A satellite reads a pivot of a later layer one step late (see :mod:`kvjax.head_recall`).
* Pivots choose from prompt tokens only: tokens decoded after the prompt are on the device for
  every head already.
* Tokens prefilled onto the compressed cache in one call (a question) count as decode steps for the
  drift window: the last ``min(T, window)`` of them are checked at once. Without this, a question
  asked after compression could trigger a refresh only after ``window`` decoded tokens.
* The recall is issued in the step that detects the drift and used from the next step on.
* Ablations: ``allocation=False`` gives every compressed head ``base`` tokens (the paper's
  "w/o allocation"); ``retrieval=False`` never refreshes ("w/o retrieval").
* **Re-anchoring on a question** (``reanchor=True``; off by default, a deviation for a setting the paper does
  not evaluate, as SyncKV's). A multi-token call on the compressed cache makes every pivot publish its
  choice for the call's last query whatever the drift (its reference set becomes that query's). The
  satellites recall it *before* the call attends. The call runs ``1 + rehearsals`` times
  (:func:`kvjax.generate.prefill`), so that satellites in layers before their pivot's hold the choice too. With
  the ``-g24`` artifact of Qwen2.5 (one pivot, in layer 19) and ``rehearsals=2``, at 10%, query-agnostic, 48
  prompts: **95.8** against 14.6 for the shipped default (full cache 95.8;
  ``docs/results/qwen2.5-coder-0.5b-4k-heterocache-g24-reanchor-query-agnostic``); at 25% **100.0** against 31.2
  (``...-g24-reanchor-25-query-agnostic``); at 8K, 12 prompts, 91.7 / 91.7 at 10 / 25% against 33.3 / 33.3 (full
  cache 91.7; ``docs/results/qwen2.5-coder-0.5b-8k-recall-configs-query-agnostic``), and on 48 prompts 89.6 / 95.8
  (full cache 93.8; ``...-8k-recall-configs-48-query-agnostic``). The same groups without
  it scored 0 of 4 on a first screen; its parts are compared in ``docs/RESULTS.md`` ("HeteroCache: re-anchoring
  on the question"). In the query-aware protocol re-anchoring does not act (no multi-token call follows
  compression): there the configuration scores 91.7 / 93.8 at 4K (full cache 95.8) but only **77.1 / 83.3** at
  8K on 48 prompts (full cache 93.8; ``...-8k-recall-configs-48-query-aware``), below both targets.
* **The pivot's choice at prefill** (``prefill_from_pivot=True``; off by default, a deviation). Each satellite's
  prefill set is its pivot's top-``l_i`` tokens for the prompt's last query (pooled, group max, as its own would
  be) instead of its own: the choice re-anchoring gives a question asked after compression, given to a question
  inside the prompt. The reference code keeps each head's own set. Why: in the 8K query-aware run above, 10 of
  the 19 wrong answers were the right needle cut short (``'8367'`` for ``'8367603'``) and 3 more began right and
  went wrong: a satellite's own set, from the one query before the answer, holds the needle's first tokens but
  not the last, and the pivot's drift test (median overlap of sets of ``base`` tokens) does not fire for a few
  tokens, so no recall brings them. The pivot's set holds them. With it the same configuration scores
  **93.8 / 93.8** on those 48 prompts, the full cache's score, with the full cache's three wrong answers and no
  others (13 won, none lost; ``...-8k-heterocache-prefill-from-pivot-48-query-aware``); at 4K, prompts it was not
  found on, 95.8 / 95.8 against 91.7 / 93.8 without it (full cache 95.8; 3 won, none lost;
  ``...-4k-heterocache-prefill-from-pivot-48-query-aware``). In the query-agnostic
  protocol a re-anchoring question overwrites every satellite's set, but the rehearsal's choice depends on the
  prefill sets of satellites before the pivot's layer, so the results there are measured, not inherited: at 8K,
  12 prompts, 91.7 / 91.7 with every output as without it (``...-8k-heterocache-prefill-from-pivot-query-agnostic``);
  at 4K, 48 prompts, 95.8 / 97.9 against 95.8 / 100 without it (full cache 95.8; 142 of 144 outputs the same, the
  one lost answer is the full cache's own wrong one; ``...-4k-heterocache-prefill-from-pivot-48-query-agnostic``);
  at 8K, 48 prompts, 89.6 / 95.8 (full cache 93.8), all 144 outputs as without it
  (``...-8k-heterocache-prefill-from-pivot-48-query-agnostic``).
* ``recall_schedule="spread"``: see :func:`kvjax.head_recall.apply_recalls` (no recall conditional; a new
  choice lands over ``window`` steps). ``"ahead"``: the same moves, written into the satellites' slots one call
  after they are gathered (:func:`kvjax.head_recall.land_pending`; same tokens as ``"spread"``, tested). On an H100
  neither overlapped its recall: 7.99 / 8.41 ms/token against 1.25 without recall, compiled with XLA's default
  schedule, under which no recall can overlap anything. With the latency-hiding scheduler, which decode now
  compiles with on a GPU (session 49, another H100): 7.68 ``"spread"``, 8.50 ``"ahead"`` and 6.81 ``"pipelined"``
  against 1.27 without recall and 1.44 for the full cache; recall overlaps decoding only partly
  (:mod:`kvjax.head_recall`, "Timing").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec

from kvjax.artifacts import Artifact
from kvjax.budgets import check_budget
from kvjax.cache import Cache, CacheSpec
from kvjax.head_recall import (Follower, calibrated_artifact, check_calibrated, LayerPlan, append_attend, apply_recalls, attention_read_bytes, build_layer,
                               land_pending, pending_rows,
                               leader_probs, leader_queries, prompt_only, publish, staged_scores,
                               reanchor_then_attend, recall_partition, recall_stats, to_stored, top_mask, top_slots)
from kvjax.methods.base import check_common
from kvjax.selection import keep_to_indices, keep_top, row_capacities
from kvjax.sharding import DATA
from kvjax.staging import Recording, StagedKV, init_staging, stage_chunk, staged_partition

ROLES = ("pivot", "satellite", "anchor", "volatile")
KIND = "heterocache"


# ------------------------------------------------------------------------------------ calibration
def star_clustering(adjacency: np.ndarray) -> list[tuple[int, list[int]]]:
    """Greedy star clustering of a symmetric bool adjacency (no self loops): ``[(pivot, satellites), ...]``.

    Repeatedly the unassigned node with the most unassigned neighbours (ties: lowest index) becomes
    a pivot and its unassigned neighbours its satellites; stops when the best degree is 0.
    """
    adj = np.asarray(adjacency, bool).copy()
    np.fill_diagonal(adj, False)
    free = np.ones(len(adj), bool)
    clusters = []
    while True:
        degree = np.where(free, (adj & free[None, :]).sum(axis=1), -1)
        pivot = int(np.argmax(degree))
        if degree[pivot] <= 0:
            return clusters
        sats = [int(j) for j in np.flatnonzero(adj[pivot] & free)]
        free[pivot] = False
        free[sats] = False
        clusters.append((pivot, sats))


def classify_group(stability: np.ndarray, similarity: np.ndarray, tau_sim: float, tau_stable: float):
    """Roles of one group's units: (roles list, leader index per unit or -1) from stability ``[U]`` and overlaps ``[U, U]``."""
    U = len(stability)
    adj = (np.asarray(similarity) >= tau_sim) & ~np.eye(U, dtype=bool)
    adj = adj & adj.T
    roles, leader = [""] * U, [-1] * U
    for pivot, sats in star_clustering(adj):
        roles[pivot] = "pivot"
        for s in sats:
            roles[s], leader[s] = "satellite", pivot
    for u in range(U):
        if not roles[u]:
            roles[u] = "anchor" if stability[u] >= tau_stable else "volatile"
    return roles, leader


def heterocache_artifact(stats, model_id: str, *, tau_sim: float = 0.5, tau_stable: float = 0.5) -> Artifact:
    """Head roles, pivots and stability from calibration statistics (:class:`kvjax.calibration.HeadStatistics`)."""
    L, H = stats.stability.shape
    roles = [[""] * H for _ in range(L)]
    leader = [[(-1, -1)] * H for _ in range(L)]
    for gi, units in enumerate(stats.groups()):
        stab = np.array([stats.stability[l, h] for l, h in units])
        r, lead = classify_group(stab, stats.sim_median[gi], tau_sim, tau_stable)
        for u, (l, h) in enumerate(units):
            roles[l][h] = r[u]
            if lead[u] >= 0:
                leader[l][h] = units[lead[u]]
    meta = (
        ("roles", tuple(tuple(r) for r in roles)),
        ("pivot_of", tuple(tuple(tuple(int(x) for x in p) for p in row) for row in leader)),
        ("stability", tuple(tuple(round(float(x), 6) for x in row) for row in stats.stability)),
        ("group_layers", stats.group_layers), ("tau_sim", tau_sim), ("tau_stable", tau_stable),
        ("topk", stats.topk), ("samples", stats.samples), ("decode_steps", stats.decode_steps), ("tokens", stats.tokens),
    )
    arrays = {"stability": np.asarray(stats.stability, np.float32), "similarity": np.asarray(stats.similarity, np.float32)}
    return Artifact(arrays=arrays, kind=KIND, model_id=model_id, meta=meta)


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
    if rho * N <= F:
        raise ValueError(f"budget {rho:.3f} of the prompt cannot hold the {F} full heads (pivot + volatile) out of {N}: "
                         f"HeteroCache needs budget > {F / N:.3f} with this calibration (rho * N > F)")
    if F == N:
        return [[length] * H for _ in range(L)], length
    base = (rho * N - F) * length / (N - F)
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
    """Per pivot of a layer: buffered queries ``q[W, B, n, G, D]``, the reference set ``ref[B, n, positions]``
    and the set size ``base`` (static)."""

    q: jnp.ndarray
    ref: jnp.ndarray
    base: int = struct.field(pytree_node=False, default=1)


@dataclasses.dataclass(frozen=True)
class HeteroCache:
    """HeteroCache (see the module docstring).

    Args:
      budget: fraction of the prompt's KV kept on the device over all heads (``rho``), or tokens per
        head (``rho = budget / prompt``).
      window: drift window ``W`` in decode steps (reference: 5).
      tau_drift: drift threshold (paper: equal to tau_stable, 0.5).
      kernel: pooling of the attention scores (reference: 5, average).
      group_layers: which shipped artifact to load when none is given (None: the model's default,
        cross-layer groups; 1: the paper's per-layer clustering).
      allocation: inverse-stability budgets (False: ``base`` for every compressed head).
      retrieval: pivots refresh satellites (False: static after prefill).
      reanchor: a question asked after compression makes every pivot publish its choice for the question's last
        query, recalled *before* the question attends, after ``rehearsals`` rehearsals of the question (a
        deviation, off by default; see the module docstring).
      rehearsals: passes of such a question before the one that counts (with ``reanchor``).
      prefill_from_pivot: each satellite's prefill set is its pivot's top-``l_i`` for the prompt's last query
        instead of its own (a deviation, off by default: the choice ``reanchor`` gives a question asked after
        compression, given to one inside the prompt; see the module docstring).
      recall_schedule: ``"whole"`` (a satellite's whole kept set is refreshed in the step its pivot's new choice
        reaches it), ``"spread"`` (each decode step moves up to ``1/window`` of it, the tokens it lacks for
        those it no longer needs: no conditional per layer; a deviation, see :func:`kvjax.head_recall.apply_recalls`),
        ``"ahead"`` (``"spread"``'s moves, written one call after they are gathered) or ``"pipelined"`` (gathered
        one call after they are chosen, written the call after: the fastest on an H100, ``docs/RESULTS.md``).
      page_size, implementation: paged layout and decode attention implementation.
    """

    budget: int | float = 0.25
    window: int = 5
    tau_drift: float = 0.5
    kernel: int = 5
    group_layers: int | None = None
    allocation: bool = True
    retrieval: bool = True
    reanchor: bool = False
    rehearsals: int = 1
    prefill_from_pivot: bool = False
    recall_schedule: str = "whole"
    page_size: int = 16
    block: int = 256
    implementation: str = "auto"
    name = "heterocache"

    def __post_init__(self):
        check_common(self.page_size, self.block, "max", self.implementation)
        check_budget(self.budget)
        if self.window < 1:
            raise ValueError(f"window must be >= 1 decode step, got {self.window}")
        if not 0.0 <= self.tau_drift <= 1.0:
            raise ValueError(f"tau_drift must be in [0, 1], got {self.tau_drift}")
        check_calibrated(self.kernel, self.group_layers, self.recall_schedule)
        if self.rehearsals < 0:
            raise ValueError(f"rehearsals must be >= 0, got {self.rehearsals}")

    # -- artifact and allocation
    def artifact_for(self, spec: CacheSpec, artifact=None) -> Artifact:
        """The given artifact (checked) or the one shipped for the spec's model."""
        art = calibrated_artifact(KIND, spec, artifact, self.group_layers)
        meta = art.meta_dict()
        roles = meta["roles"]
        if len(roles) != spec.num_layers or any(len(r) != spec.num_kv_heads for r in roles):
            raise ValueError(f"heterocache artifact has roles for {len(roles)} layers x {len(roles[0])} heads; "
                             f"the model has {spec.num_layers} x {spec.num_kv_heads}")
        return art

    def rho(self, spec: CacheSpec) -> float:
        """The budget as a fraction of the longest row."""
        return self.budget / spec.longest_row if isinstance(self.budget, int) else float(self.budget)

    def plans(self, spec: CacheSpec, art: Artifact) -> tuple[tuple[LayerPlan, ...], int]:
        """Per-layer plans and the base length (drift set size)."""
        meta = art.meta_dict()
        roles, pivot_of = meta["roles"], meta["pivot_of"]
        full = [[r in ("pivot", "volatile") for r in row] for row in roles]
        caps, base = head_capacities(meta["stability"], full, self.rho(spec), spec.longest_row, allocation=self.allocation)
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

    @property
    def recalls_ahead(self) -> bool:
        """Whether decode steps keep recalls in flight across calls (``recall_schedule="ahead"`` or ``"pipelined"``)."""
        return self.recall_schedule in ("ahead", "pipelined") and self.retrieval

    # -- protocol
    def recording(self) -> Recording:
        """A dense staging that keeps the prompt's last query (shareable with other methods)."""
        return Recording(window=1, block=self.block)

    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Dense staging recording the last query; the artifact (or the shipped one) travels with the cache."""
        art = self.artifact_for(spec, artifact)
        self.plans(spec, art)  # validates the budget against the full heads
        return Cache.create(init_staging(spec, self.recording()), self, spec, artifact=art)

    def prefill_chunk(self, state, q, k, v, ctx):
        """Stage and attend."""
        return stage_chunk(state, q, k, v, ctx)

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
        layer = build_layer(state, idx, lengths, ctx.pad, spec, plan, page_size=self.page_size,
                            region_start=jnp.zeros_like(region_count), region_count=region_count,
                            picks=jnp.zeros((B, nl, max(plan.picks, 1)), jnp.int32), tracker=None,
                            pending=pending_rows(plans, plan, self.window) if self.recalls_ahead else 0,
                            pipelined=self.recall_schedule == "pipelined")
        positions = layer.paged.block_table.shape[-1] * self.page_size
        if nl:
            lead = jnp.asarray(plan.leaders, jnp.int32)
            stored = to_stored(scores[:, lead], ctx.pad, positions, -jnp.inf)
            ref = top_mask(stored, base)
            G = spec.num_heads // H
            tracker = PivotTracker(q=jnp.zeros((self.window, B, nl, G, spec.head_dim), state.k.dtype), ref=ref, base=base)
        else:
            tracker = PivotTracker(q=jnp.zeros((self.window, B, 0, 1, spec.head_dim), state.k.dtype),
                                   ref=jnp.zeros((B, 0, positions), bool), base=base)
        return layer.replace(tracker=tracker)

    def pivot_scores(self, layer_scores, plans, ctx):
        """This layer's scores ``[B, H, S]`` with each satellite's row replaced by its pivot's last-query scores
        (``layer_scores``: :func:`kvjax.head_recall.staged_scores`; a pivot may sit in any layer)."""
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

    def drift_check(self, state, qg, pad, *, force: bool = False):
        """Pivots score their queries ``qg[B, T, n, G, D]``; where the median overlap with the reference set is
        below ``tau_drift`` (or with ``force``), the reference becomes the last query's set and the pivot publishes
        its top prompt tokens."""
        plan, tr = state.plan, state.tracker
        scores = leader_probs(state.paged, plan.leaders, qg, self.kernel, "max")  # [B, n, T, positions]
        sets = top_mask(scores, tr.base)
        held = jnp.isfinite(scores).sum(-1)
        overlap = (sets & tr.ref[:, :, None]).sum(-1) / jnp.maximum(jnp.minimum(held, tr.base), 1)
        drift = jnp.median(overlap, axis=-1) < self.tau_drift  # [B, n]
        drift = jnp.ones_like(drift) if force else drift
        picks = top_slots(prompt_only(scores[:, :, -1], state.prompt_len), pad, state.picks.shape[-1])
        state = state.replace(tracker=tr.replace(ref=jnp.where(drift[..., None], sets[:, :, -1], tr.ref)))
        return publish(state, drift, picks)

    def track(self, state, q, pad):
        """Buffer the pivots' queries; check drift every ``window`` steps (a multi-token call is checked at once)."""
        plan, tr = state.plan, state.tracker
        qg = leader_queries(q, plan.leaders, len(plan.capacities))
        T = q.shape[1]
        if T > 1:
            return self.drift_check(state, qg[:, -min(T, self.window):], pad)
        buf = lax.dynamic_update_index_in_dim(tr.q, qg[:, 0].astype(tr.q.dtype), (state.steps - 1) % self.window, axis=0)
        state = state.replace(tracker=tr.replace(q=buf))
        return lax.cond(state.steps % self.window == 0,
                        lambda st: self.drift_check(st, jnp.moveaxis(st.tracker.q, 0, 1), pad), lambda st: st, state)

    def decode_attend(self, state, q, k, v, ctx):
        """Attend over every head's held tokens; pivots check drift; satellites of drifted pivots are refreshed.
        A multi-token call with ``reanchor`` publishes and recalls *before* it attends; in a rehearsal
        (``ctx.rehearsal``) the state is returned without its tokens."""
        state = land_pending(state, ctx.mesh, drain=q.shape[1] > 1)
        if q.shape[1] > 1 and self.reanchor and self.retrieval:
            plan = state.plan
            return reanchor_then_attend(state, q, k, v, ctx, lambda st: self.drift_check(
                st, leader_queries(q, plan.leaders, len(plan.capacities))[:, -1:], ctx.pad, force=True))
        out, state = append_attend(state, q, k, v, self.implementation, ctx.mesh)
        if state.plan.leaders and self.retrieval:
            state = self.track(state, q, ctx.pad)
        spread = self.window if self.recall_schedule != "whole" and q.shape[1] == 1 else None
        return out, apply_recalls(state, ctx, enabled=self.retrieval, spread_over=spread)

    def question_passes(self) -> int:
        """``1 + rehearsals`` with ``reanchor`` (and retrieval): each rehearsal lets every pivot publish its question
        choice, so satellites in layers before their pivot's hold it too when the question attends; else one (a
        question is appended and attended like any later token)."""
        return 1 + self.rehearsals if self.reanchor and self.retrieval else 1

    def state_partition(self, state, spec: CacheSpec):
        """The staging's specs, then the leader/follower layout's (:func:`kvjax.head_recall.recall_partition`);
        the tracker is indexed by leader, so split by row only."""
        if isinstance(state, StagedKV):
            return staged_partition(state)
        return recall_partition(state, state.tracker.replace(q=PartitionSpec(None, DATA), ref=PartitionSpec(DATA)))

    def stats(self, cache: Cache) -> dict:
        """Roles, kept tokens, recall events."""
        if cache.stage != "compressed":
            return {}
        meta = cache.artifact.meta_dict()
        counts = {r: sum(row.count(r) for row in meta["roles"]) for r in ROLES}
        return {"head_roles": counts, "group_layers": meta["group_layers"], **recall_stats(cache.layers)}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Attention over every held token (pivots' drift checks read their keys once per window in addition)."""
        if cache.stage != "compressed":
            return 0
        return attention_read_bytes(cache.layers)
