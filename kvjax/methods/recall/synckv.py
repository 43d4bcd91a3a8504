"""SyncKV: representative heads (R-heads) keep the full cache and, every ``m`` steps, choose the tokens their
cluster's other heads (NR-heads) hold; those come back from pinned host memory.

Calibration (``kvjax calibrate synckv``, :mod:`kvjax.calibration.synckv`): K-means over each group's similarity rows
makes ``N_r`` clusters (1..4 stored, the method's ``num_representatives`` picks one); the head closest to a centroid is
its R-head.

Runtime (Algorithm 1):

* R-heads keep every prompt token on the device. NR-heads keep ``k = (budget N - F) L / (N - F)`` tokens (``N`` KV
  heads of all layers, ``F`` R-heads; :func:`kvjax.budgets.compressed_head_tokens`), so the device holds the
  budget's fraction of the prompt's KV. ``budget N <= F`` is an error.
* Prefill (Eq. 3-4): ``I_0`` = the top-``k`` tokens of the R-head's last-query attention (max over its GQA group); the
  best ``static_ratio * k`` are the static set, the next ``(1 - static_ratio) * k`` the initial dynamic set; every
  NR-head of the cluster holds its own K/V at ``I_0``, its full prompt K/V goes to ``pinned_host`` memory.
* Anticipation, every ``stride`` (m) decode steps (Eq. 5-7): the R-head's current attention picks ``k_dyn`` prompt
  tokens, and the NR-heads' dynamic slots take those rows from the host (the schedule:
  :mod:`kvjax.methods.recall.schedules`). Suspension, the other steps (Eq. 8): the dynamic set is reused. The
  R-heads score every step and publish on the ``m``-th (predicated: no conditional in the step).

Deviations (each measured in ``docs/methods/synckv.md``): the dynamic set is chosen among prompt tokens outside the
static set (the paper's ``T_kdyn(A_t)`` may pick static tokens again, which would be held twice); cross-layer groups
(``group_layers``); re-anchoring on a question (``reanchor``, the default: a question asked after compression redoes
Eq. 3-4 for its last query before it attends); ``kernel`` pooling (default 1: the paper's equations); recall schedules
other than ``"whole"``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec

from kvjax.artifacts import Artifact
from kvjax.budgets import budget_fraction, compressed_head_tokens
from kvjax.cache import Cache, CacheSpec
from kvjax.methods.recall.base import LeaderFollowerMethod, leader_slices
from kvjax.methods.recall.layout import Follower, LayerPlan, publish, publish_anchor
from kvjax.methods.recall.scores import (leader_probs, leader_queries, prompt_only, staged_scores, to_stored,
                                         top_slots)
from kvjax.selection import row_capacities
from kvjax.sharding import DATA

KIND = "synckv"
# Named configurations (``synckv:preset=tuned``), chosen on the dev split: pooled scores and one R-head for the
# whole model, a departure from the paper (docs/methods/synckv.md).
PRESETS: dict[str, dict] = {
    "tuned": {"kernel": 7, "group_layers": 24, "rehearsals": 2},
}
MAX_REPRESENTATIVES = 4


# -------------------------------------------------------------------------------------- the method
@struct.dataclass
class RepresentativeTracker:
    """Per R-head of a layer: its static set in stored positions ``static[B, n, positions]`` (never re-picked
    by anticipation), and each row's static and total NR-head tokens ``static_rows``, ``keep_rows[B]``."""

    static: jnp.ndarray
    static_rows: jnp.ndarray
    keep_rows: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class SyncKV(LeaderFollowerMethod):
    """SyncKV (see the module docstring); the shared hyper-parameters are :class:`LeaderFollowerMethod`'s.

    Args:
      budget: Mem%, or tokens per head.
      kernel: average pooling of the R-heads' scores over this many tokens (1: none, as the paper's equations).
      rehearsals: passes of a question before the one that counts, each re-anchoring from the R-heads'
        question queries of the pass before.
      stride: ``m``, decode steps between anticipation steps (paper: 5), the recall schedule's decision interval.
      num_representatives: ``N_r`` R-heads per group (None: the artifact's default, the paper's choice for
        the model family: 2 for Llama, 1 for Qwen).
      static_ratio: ``rho``, the static share of the NR-heads' ``k`` tokens (paper: 0.5).
      anticipation: refresh the dynamic sets (False: the paper's "w/o anticipation").
      reanchor: a question after compression re-anchors the static and dynamic sets before it attends (a
        deviation; needs ``anticipation``).
      question_window: re-anchoring scores a question's prompt tokens by the attention of its last
        ``question_window`` queries, summed (1: its last query, as Eq. 3 at prefill).
    """

    kernel: int = 1  # the paper's equations pool nothing
    stride: int = 5
    num_representatives: int | None = None
    static_ratio: float = 0.5
    anticipation: bool = True
    reanchor: bool = True
    question_window: int = 1
    name = "synckv"

    def __post_init__(self):
        self.check_shared()
        if self.stride < 1:
            raise ValueError(f"stride (m) must be >= 1 decode step, got {self.stride}")
        if not 0.0 < self.static_ratio <= 1.0:
            raise ValueError(f"static_ratio (rho) must be in (0, 1], got {self.static_ratio}")
        if self.num_representatives is not None and not 1 <= self.num_representatives <= MAX_REPRESENTATIVES:
            raise ValueError(f"num_representatives (N_r) must be in [1, {MAX_REPRESENTATIVES}], got {self.num_representatives}")
        if self.question_window < 1:
            raise ValueError(f"question_window must be >= 1 query, got {self.question_window}")

    @property
    def every(self) -> int:
        return self.stride

    @property
    def recalls(self) -> bool:
        return self.anticipation

    @property
    def reanchors(self) -> bool:
        return self.reanchor and self.anticipation

    def check_artifact(self, spec: CacheSpec, art: Artifact) -> None:
        roles, _ = self.clusters(art)
        if len(roles) != spec.num_layers or any(len(r) != spec.num_kv_heads for r in roles):
            raise ValueError(f"synckv artifact has roles for {len(roles)} layers x {len(roles[0])} heads; "
                             f"the model has {spec.num_layers} x {spec.num_kv_heads}")

    def representatives(self, art: Artifact) -> int:
        """``N_r``: the method's, or the artifact's default."""
        if self.num_representatives is not None:
            return self.num_representatives
        return int(art.meta_dict().get("default_representatives", 2))

    def clusters(self, art: Artifact):
        """(roles, representative of each head) for ``N_r``."""
        meta = art.meta_dict()
        n_r_wanted = self.representatives(art)
        for n_r, roles, leader in meta["clusters"]:
            if n_r == n_r_wanted:
                return roles, leader
        group = meta["group_layers"]
        raise ValueError(f"N_r={n_r_wanted} is larger than the KV heads of a group in this artifact "
                         f"({group} layer(s) per group; clusters exist for N_r in {[c[0] for c in meta['clusters']]})")

    def plans(self, spec: CacheSpec, art: Artifact) -> tuple[tuple[LayerPlan, ...], int]:
        """Per-layer plans and ``k`` (tokens each NR-head keeps for the longest row); ``art`` as :meth:`artifact_for`
        returns it."""
        roles, leader = self.clusters(art)
        L = spec.longest_row
        N = spec.num_layers * spec.num_kv_heads
        F = sum(row.count("R") for row in roles)
        share = compressed_head_tokens(budget_fraction(self.budget, L), N, F, L,
                                       method=f"SyncKV with N_r={self.representatives(art)}", full="R-heads")
        k = max(1, min(L, int(share)))
        reps = [[h for h, r in enumerate(row) if r == "R"] for row in roles]
        dyn = k - int(self.static_ratio * k)
        plans = []
        for l, row in enumerate(roles):
            followers = tuple(Follower(h, leader[l][h][0], reps[leader[l][h][0]].index(leader[l][h][1]))
                              for h, r in enumerate(row) if r == "NR")
            plans.append(LayerPlan(capacities=tuple(L if r == "R" else k for r in row), full=tuple(reps[l]),
                                   leaders=tuple(reps[l]), followers=followers, picks=max(dyn, 1) if reps[l] else 0,
                                   anchor_picks=k if reps[l] and self.reanchors else 0))
        return tuple(plans), k

    def finish_prefill(self, state, ctx):
        """R-heads keep the prompt; NR-heads hold their R-head's ``I_0``; NR prompt KV to the host."""
        spec = ctx.spec
        plans, k = self.plans(spec, ctx.artifact)
        plan = plans[ctx.layer]
        P, H = spec.prompt_slots, spec.num_kv_heads
        B = state.k.shape[0]
        n = (P - ctx.pad).astype(jnp.int32)  # [B]
        k_rows = row_capacities((k,), self.budget, spec, ctx.pad)[:, 0]  # [B] tokens each NR-head keeps
        static_rows = (self.static_ratio * k_rows).astype(jnp.int32)

        layer_scores = staged_scores(state, ctx, kernel=self.kernel)

        def initial(layer: int, head: int):
            return lax.top_k(layer_scores(layer)[:, head], k)[1].astype(jnp.int32)  # best first

        C = max(plan.capacities)
        in_order = jnp.clip(ctx.pad[:, None] + jnp.arange(C)[None, :], 0, P - 1).astype(jnp.int32)
        idx, lengths = [], []
        lead_of = {f.head: f for f in plan.followers}
        for h in range(H):
            if h in lead_of:
                f = lead_of[h]
                head = plans[f.leader_layer].leaders[f.leader_index]
                i0 = initial(f.leader_layer, head)
                idx.append(jnp.pad(i0, ((0, 0), (0, C - k))))
                lengths.append(k_rows)
            else:
                idx.append(in_order)
                lengths.append(n)
        idx, lengths = jnp.stack(idx, axis=1), jnp.stack(lengths, axis=1)
        nf = len(plan.followers)
        layer = self.build(state, idx, lengths, ctx, plans,
                           region_start=jnp.broadcast_to(static_rows[:, None], (B, nf)),
                           region_count=jnp.broadcast_to((k_rows - static_rows)[:, None], (B, nf)),
                           picks=jnp.zeros((B, len(plan.leaders), max(plan.picks, 1)), jnp.int32), tracker=None)
        positions = layer.paged.block_table.shape[-1] * self.page_size
        statics = []
        for head in plan.leaders:
            i0 = initial(ctx.layer, head)
            in_static = jnp.arange(k)[None, :] < static_rows[:, None]
            mask = jnp.zeros((B, state.k.shape[2]), bool)
            mask = jnp.put_along_axis(mask, i0, in_static, axis=-1, inplace=False)
            statics.append(to_stored(mask[:, None], ctx.pad, positions, False)[:, 0])
        static = jnp.stack(statics, axis=1) if statics else jnp.zeros((B, 0, positions), bool)
        return layer.replace(tracker=RepresentativeTracker(static=static, static_rows=static_rows, keep_rows=k_rows))

    def lead(self, state, q, pad, mesh):
        """Anticipation after a multi-token call: the R-heads pick the best ``k_dyn`` prompt tokens outside their
        static sets for the call's last query, and publish."""
        plan = state.plan
        qg = leader_queries(q, plan.leaders, len(plan.capacities))[:, -1:]
        scores = leader_probs(state.paged, plan.leaders, qg, self.kernel, "max", lookahead=self.lookahead,
                              implementation=self.implementation, mesh=mesh)[:, :, -1]  # [B, n, positions]
        picks = self.anticipated(scores, state.tracker.static, state.prompt_len, pad, state.picks.shape[-1])
        return publish(state, jnp.ones(state.version.shape, bool), picks)

    @staticmethod
    def anticipated(scores, static, prompt_len, pad, width: int):
        """The best ``width`` prompt slots outside the static sets ``static[B, n, positions]`` by ``scores[B, n,
        positions]``, best first."""
        return top_slots(jnp.where(static, -jnp.inf, prompt_only(scores, prompt_len)), pad, width)

    def decide_at_once(self, states, scores, limits, pad):
        """The one-token anticipation of the R-heads of one or several layers side by side: scored every step,
        published on every ``stride``-th (predicated)."""
        width = max(st.picks.shape[-1] for st in states)  # a narrower top is a prefix of the widest
        static = jnp.concatenate([st.tracker.static for st in states], axis=1)
        picks = self.anticipated(scores[:, :, -1], static, states[0].prompt_len, pad, width)
        due = states[0].steps % self.stride == 0
        return [publish(st, jnp.full(st.version.shape, due, bool), picks[:, n, :st.picks.shape[-1]])
                for st, n in zip(states, leader_slices(states))]

    def choose_for_question(self, state, q, pad, mesh):
        """A question asked after compression: the R-heads redo Eq. 3-4 for its last query, or the sum over its last
        ``question_window`` queries (new ``I_0``: static set and initial dynamic set), and publish it as a
        re-anchoring of their NR-heads' whole kept sets."""
        plan, tr = state.plan, state.tracker
        qg = leader_queries(q, plan.leaders, len(plan.capacities))[:, -self.question_window:]
        probs = leader_probs(state.paged, plan.leaders, qg, self.kernel, "max", lookahead=self.lookahead,
                             implementation=self.implementation, mesh=mesh)  # [B, n, W, S]
        scores = jnp.where(jnp.isfinite(probs), probs, 0.0).sum(axis=2)  # [B, n, positions]
        top = top_slots(prompt_only(scores, state.prompt_len), pad, plan.anchor_picks)  # [B, n, k] best first
        K, positions = top.shape[-1], scores.shape[-1]
        in_static = jnp.arange(K)[None, None, :] < tr.static_rows[:, None, None]
        static = jnp.zeros(scores.shape, bool)
        static = jnp.put_along_axis(static, jnp.clip(top - pad[:, None, None], 0, positions - 1), in_static, axis=-1,
                                    inplace=False)
        R = state.picks.shape[-1]
        dyn = jnp.take_along_axis(top, jnp.clip(tr.static_rows[:, None, None] + jnp.arange(R), 0, K - 1), axis=-1)
        return publish_anchor(state.replace(tracker=tr.replace(static=static)), top, dyn)

    def tracker_partition(self, tracker):
        """Indexed by R-head: split by row only."""
        rows = PartitionSpec(DATA)
        return tracker.replace(static=rows, static_rows=rows, keep_rows=rows)

    def method_stats(self, cache: Cache) -> dict:
        """``N_r`` and the artifact's group size."""
        return {"num_representatives": self.representatives(cache.artifact),
                "group_layers": cache.artifact.meta_dict()["group_layers"]}
