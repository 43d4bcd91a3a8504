"""SyncKV: representative heads (R-heads) keep the full cache and, every ``m`` steps, choose the tokens
their cluster's other heads (NR-heads) hold; those come back from pinned host memory.

Calibration (``kvjax calibrate synckv``, :func:`synckv_artifact`): per group of KV heads, the
similarity matrix ``S`` (mean overlap coefficient of top-k attended sets over steps and samples,
Eq. 2; GQA groups max-pooled as the paper's Appendix B.1 — the shared calibration records sets with
the group aggregation it is given), distance rows ``D = max(S) - S``, **K-means** (JAX, deterministic
seed, k-means++ initialisation, best of several restarts) into ``N_r`` clusters; the R-head of a
cluster is the head closest to its centroid. Assignments for ``N_r`` = 1..4 are stored in one
artifact, and the method's ``num_representatives`` picks one.

Runtime (Algorithm 1):

* R-heads keep every prompt token on the device. NR-heads keep ``k`` tokens:
  ``k = (budget N - F) L / (N - F)`` (``N`` KV heads of all layers, ``F`` R-heads), so the device
  holds the budget's fraction of the prompt's KV. ``budget N <= F`` is an error.
* Prefill (Eq. 3-4): ``I_0`` = the top-``k`` tokens of the R-head's last-query attention (max over
  its GQA group); the best ``static_ratio * k`` are the static set, the next ``(1 - static_ratio) * k``
  the initial dynamic set; every NR-head of the cluster holds its own K/V at ``I_0``, its full prompt
  K/V goes to ``pinned_host`` memory.
* Anticipation, every ``stride`` (m) decode steps (Eq. 5-7): the R-head's current attention picks
  ``k_dyn`` prompt tokens, and the NR-heads' dynamic slots are overwritten with those rows from the
  host (:mod:`kvjax.head_recall`). Suspension, the other steps (Eq. 8): the dynamic set is reused.

kvjax's choices (documented deviations):

* The dynamic set is chosen among prompt tokens **outside the static set**. The paper's
  ``T_kdyn(A_t)`` may pick static tokens again, which would be held twice and counted twice in the
  softmax. Decoded tokens are not candidates: every head holds them already.
* Cross-layer groups (``group_layers``, as for HeteroCache): with 2-3 KV heads per layer and
  ``N_r = 2``, per-layer clustering makes every head an R-head and compresses nothing (calibration
  reports it). The shipped default artifacts cluster ``ceil(16 / Hkv)`` adjacent layers. An NR-head
  whose R-head is in a later layer uses that R-head's choice from the previous step.
* **Re-anchoring on a question** (``reanchor=True``, the default; a deviation for a setting the paper
  does not evaluate: the question arriving after compression). A multi-token call on the compressed
  cache makes every R-head redo Eq. 3-4 for the call's last query: its best ``rho k`` prompt tokens
  become the static set, the next ``(1 - rho) k`` the dynamic set, and every NR-head's whole kept
  set is recalled from the host *before* the call attends. The call runs twice
  (``question_passes() == 2``): a rehearsal first, so that NR-heads in layers before their R-head's
  also hold the question's choice when it attends (:func:`kvjax.generate.prefill`). The paper's
  query-aware setting never triggers it (decode steps are single tokens). Measured effect on the 4K
  query-agnostic suite, 48 prompts, full cache 95.8: 54.2 / 81.2 / 100.0 at budgets 10 / 25 / 50%
  against 6.2 / 31.2 / 54.2 without it, for 2.2x the bytes recalled at 25%
  (``docs/results/qwen2.5-coder-0.5b-4k-synckv-reanchor-query-agnostic``).
  ``rehearsals`` (default 1) sets how many passes come before the one that counts: each re-anchors from the
  R-heads' question queries of the pass before, computed over NR-heads re-anchored one pass earlier. With one
  R-head for the whole model (``group_layers=24``, in layer 20) the first rehearsal's choice comes from a query
  computed over 20 layers of context-only selections. ``rehearsals=2`` with ``kernel=7:group_layers=24`` at 10%,
  query-agnostic, 48 prompts: **87.5** against 77.1 with one rehearsal (5 ``niah_multikey`` answers won, none
  lost; ``docs/results/qwen2.5-coder-0.5b-4k-synckv-g24-rehearsals2-query-agnostic``). It costs one more forward
  pass of the question and one more recall of the NR-heads' kept sets. ``question_window=W`` scores the
  re-anchoring by the question's last ``W`` queries (summed) instead of its last one: W = 8 / 32 scored 7 / 5 of
  16 ``niah_multikey`` prompts against 6 (``docs/results/qwen2.5-coder-0.5b-4k-synckv-question-passes-experiment``);
  the default stays 1.
  With ``reanchor=False`` a multi-token call is an anticipation step for its last query, recalled
  from the next step on (the paper's asynchronous upload): only the dynamic half ever follows the
  question.
* ``anticipation=False`` is the paper's "w/o anticipation" ablation (static ``I_0`` only).
* ``kernel`` (default 1: the paper's equations, no pooling) average-pools each query head's scores over
  ``kernel`` neighbouring tokens before the R-head picks, as SnapKV and HeteroCache's reference code do, so a
  multi-token value is kept whole. Measured on the 4K suite (48 prompts, full cache 95.8), ``kernel=7``
  against the default at budgets 10 / 25%: query-aware 68.8 / **95.8** against 45.8 / 89.6 (14 answers won,
  none lost; ``docs/results/qwen2.5-coder-0.5b-4k-synckv-kernel7-query-aware``), query-agnostic 54.2 / **91.7**
  against 54.2 / 81.2 (8 won, 3 lost, all lost at 10%;
  ``docs/results/qwen2.5-coder-0.5b-4k-synckv-kernel7-query-agnostic``); 8K query-agnostic (12 prompts, full
  cache 91.7) 66.7 / **100.0** against 66.7 / 83.3. The answers it wins were cut short
  or had a wrong digit. Not the default: the paper's equations do not pool, and results compared with the
  paper's should use its selection; ``synckv:kernel=7`` is the better choice for retrieval.
* ``group_layers=24`` (the shipped ``-g24`` artifact of Qwen2.5: one cluster of all 48 KV heads, one R-head)
  leaves each NR-head 8.1% of the prompt at a 10% budget instead of the 4.0% the default groups of 8 layers
  leave. With ``kernel=7``, on the same 48 prompts: query-aware 91.7 / 95.8 at 10 / 25%, query-agnostic
  77.1 / 95.8 (full cache 95.8; ``docs/results/qwen2.5-coder-0.5b-4k-synckv-g24-query-aware`` and
  ``-query-agnostic``), and 87.5 at 10% query-agnostic with ``rehearsals=2`` (above); with ``rehearsals=2`` at 8K
  query-agnostic (12 prompts, full cache 91.7) 83.3 / 100.0 at 10 / 25%
  (``docs/results/qwen2.5-coder-0.5b-8k-recall-configs-query-agnostic``), on 48 prompts 85.4 / 95.8 (full cache
  93.8; ``...-8k-recall-configs-48-query-agnostic``), and query-aware on those 48 prompts 85.4 / 93.8
  (``...-8k-recall-configs-48-query-aware``). Not the default, for the same reason as
  ``kernel``.
* ``recall_schedule="spread"`` (default ``"whole"``, the paper's): no recall conditional per layer and step,
  which on a GPU runs the host gather serialised. Each decode step, every NR-head replaces up to
  ``ceil(k_dyn / m)`` tokens its R-head's latest choice dropped with chosen tokens it lacks, best first
  (:func:`kvjax.head_recall.spread_moves`), so a new dynamic set lands over ``m`` steps instead of in one. On an
  H100 at 30,720 tokens (random weights), moving the same bytes per step, SyncKV decoded at 7.33 against 8.73
  ms/token with the paper's schedule; the committed forms, in session 46, 5.97 and 6.56 (docs/RESULTS.md, "On a
  GPU").
  Accuracy: the same answers as the paper's schedule in all 24 cells of the ablation's 12 prompts (4K, 10 / 25%,
  query-agnostic, ``kernel=7:group_layers=24:rehearsals=2``;
  ``docs/results/qwen2.5-coder-0.5b-4k-g24-rehearsals-spread-query-agnostic``).
* ``recall_schedule="ahead"``: the spread schedule's moves, gathered from the host in the step that computes them
  and written into the NR-heads' slots at the start of the layer's next call
  (:func:`kvjax.head_recall.land_pending`), so no layer of a step waits for its own transfer. Same tokens as
  ``"spread"`` (tested); a second buffer of ``ceil(k_dyn / m)`` rows per NR-head on the device (counted in the
  device bytes). On an H100 it was no faster than ``"spread"``: 6.73 against 5.97 ms/token, 1.42 without recall.
  All these were compiled with XLA's default schedule, under which no recall can overlap anything. With the
  latency-hiding scheduler, which decode now compiles with on a GPU (session 49, another H100): 5.40 ``"spread"``,
  5.47 ``"ahead"`` and 4.39 ``"pipelined"`` (6.57 with XLA's defaults on the same machine) against 1.43 without
  recall and 1.44 for the full cache; recall overlaps decoding only partly (:mod:`kvjax.head_recall`, "Timing").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec

from kvjax.artifacts import Artifact
from kvjax.budgets import check_budget
from kvjax.cache import Cache, CacheSpec
from kvjax.head_recall import (Follower, calibrated_artifact, check_calibrated, LayerPlan, append_attend, apply_recalls, attention_read_bytes, build_layer, land_pending,
                               pending_rows, reanchor_then_attend,
                               leader_probs, leader_queries, prompt_only, publish, publish_anchor, staged_scores,
                               recall_partition, recall_stats, to_stored, top_slots)
from kvjax.methods.base import check_common
from kvjax.selection import row_capacities
from kvjax.sharding import DATA
from kvjax.staging import Recording, StagedKV, init_staging, stage_chunk, staged_partition

KIND = "synckv"
MAX_REPRESENTATIVES = 4


# ------------------------------------------------------------------------------------ calibration
def kmeans(x, k: int, *, seed: int = 0, iterations: int = 100, restarts: int = 10):
    """K-means of the rows of ``x[n, d]`` into ``k`` clusters (JAX, deterministic for a seed).

    k-means++ initialisation, Lloyd iterations, the restart with the lowest inertia wins.
    Returns ``(assignment int [n], centroids [k, d])`` as numpy arrays.
    """
    x = jnp.asarray(x, jnp.float32)
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k-means needs 1 <= k <= {n} points, got k={k}")
    keys = jax.random.split(jax.random.PRNGKey(seed), restarts)
    assign, cents, inertia = _kmeans_restarts(x, keys, k, iterations)
    best = int(jnp.argmin(inertia))
    return np.asarray(assign[best]), np.asarray(cents[best])


@functools.partial(jax.jit, static_argnums=(2, 3))
def _kmeans_restarts(x, keys, k: int, iterations: int):
    """One k-means++ + Lloyd run per key (vmapped); compiled once per (shape, k, iterations), so calibrating many
    layer groups of one size compiles once."""
    n = x.shape[0]

    def one(key):
        first = jax.random.randint(key, (), 0, n)
        cents = jnp.zeros((k, x.shape[1]), jnp.float32).at[0].set(x[first])
        for i in range(1, k):  # k-means++
            key, sub = jax.random.split(key)
            d2 = jnp.min(((x[:, None] - cents[None, :i]) ** 2).sum(-1), axis=1)
            p = jnp.where(d2.sum() > 0, d2 / jnp.maximum(d2.sum(), 1e-12), jnp.ones(n) / n)
            cents = cents.at[i].set(x[jax.random.choice(sub, n, p=p)])

        def step(c, _):
            a = jnp.argmin(((x[:, None] - c[None]) ** 2).sum(-1), axis=1)
            onehot = jax.nn.one_hot(a, k)
            counts = onehot.sum(0)
            new = (onehot.T @ x) / jnp.maximum(counts, 1)[:, None]
            return jnp.where(counts[:, None] > 0, new, c), None

        cents, _ = lax.scan(step, cents, None, length=iterations)
        assign = jnp.argmin(((x[:, None] - cents[None]) ** 2).sum(-1), axis=1)
        inertia = ((x - cents[assign]) ** 2).sum()
        return assign, cents, inertia

    return jax.vmap(one)(keys)


def cluster_group(similarity: np.ndarray, n_r: int, seed: int = 0):
    """(roles "R"/"NR" per unit, representative index per unit) of one group from its similarity ``[U, U]``."""
    S = np.asarray(similarity, np.float64)
    D = S.max() - S
    assign, cents = kmeans(D, n_r, seed=seed)
    U = len(S)
    rep = [-1] * U
    for c in range(n_r):
        members = np.flatnonzero(assign == c)
        if len(members) == 0:
            continue
        r = int(members[np.argmin(((D[members] - cents[c]) ** 2).sum(-1))])
        for m in members:
            rep[int(m)] = r
    roles = ["R" if rep[u] == u else "NR" for u in range(U)]
    return roles, rep


def synckv_artifact(stats, model_id: str, *, seed: int = 0, default_representatives: int = 2) -> Artifact:
    """Clusters for ``N_r`` = 1..4 (where the groups allow it) from calibration statistics.

    ``default_representatives`` is the ``N_r`` used when the method does not set one (the paper: 2
    for Llama, 1 for Qwen)."""
    L, H = stats.stability.shape
    groups = stats.groups()
    options = []
    for n_r in range(1, MAX_REPRESENTATIVES + 1):
        if any(n_r > len(u) for u in groups):
            break
        roles = [[""] * H for _ in range(L)]
        leader = [[(-1, -1)] * H for _ in range(L)]
        for gi, units in enumerate(groups):
            r, rep = cluster_group(stats.sim_mean[gi], n_r, seed)
            for u, (l, h) in enumerate(units):
                roles[l][h] = r[u]
                if r[u] == "NR":
                    leader[l][h] = units[rep[u]]
        options.append((n_r, tuple(tuple(r) for r in roles),
                        tuple(tuple(tuple(int(x) for x in p) for p in row) for row in leader)))
    meta = (("clusters", tuple(options)), ("group_layers", stats.group_layers), ("topk", stats.topk),
            ("samples", stats.samples), ("decode_steps", stats.decode_steps), ("tokens", stats.tokens), ("seed", seed),
            ("default_representatives", default_representatives))
    arrays = {"similarity": np.asarray(stats.similarity, np.float32), "stability": np.asarray(stats.stability, np.float32)}
    return Artifact(arrays=arrays, kind=KIND, model_id=model_id, meta=meta)


# -------------------------------------------------------------------------------------- the method
@struct.dataclass
class RepresentativeTracker:
    """Per R-head of a layer: its static set in stored positions ``static[B, n, positions]`` (never re-picked
    by anticipation), and each row's static and total NR-head tokens ``static_rows``, ``keep_rows[B]``."""

    static: jnp.ndarray
    static_rows: jnp.ndarray
    keep_rows: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class SyncKV:
    """SyncKV (see the module docstring).

    Args:
      budget: fraction of the prompt's KV kept on the device over all heads (Mem%), or tokens per head.
      stride: ``m``, decode steps between anticipation steps (paper: 5).
      num_representatives: ``N_r`` R-heads per group (None: the artifact's default, the paper's choice for
        the model family: 2 for Llama, 1 for Qwen).
      static_ratio: ``rho``, the static share of the NR-heads' ``k`` tokens (paper: 0.5).
      anticipation: refresh the dynamic sets (False: the paper's "w/o anticipation").
      reanchor: a question after compression re-anchors the static and dynamic sets, in two passes (module
        docstring; a deviation; needs ``anticipation``).
      kernel: average pooling of the R-heads' scores over this many tokens (1: none, as the paper's
        equations; 7 measured better at 25%, see the module docstring).
      group_layers: which shipped artifact to load when none is given (None: the model's default).
      rehearsals: passes of a question before the one that counts, each re-anchoring from the R-heads'
        question queries of the pass before (default 1; more is a deviation measured in the module docstring).
      question_window: re-anchoring scores a question's prompt tokens by the attention of its last
        ``question_window`` queries, summed (1: its last query, as Eq. 3 at prefill).
      recall_schedule: ``"whole"`` (the paper's: an NR-head's whole dynamic set is refreshed in the step its
        R-head's new choice reaches it), ``"spread"`` (each decode step moves up to ``1/m`` of it, the tokens
        it lacks for those it no longer needs: no conditional per layer; a deviation, see the module docstring),
        ``"ahead"`` (``"spread"``'s moves, written one call after they are gathered) or ``"pipelined"`` (gathered
        one call after they are chosen, written the call after: the fastest on an H100, ``docs/RESULTS.md``).
      page_size, block, implementation: paged layout, prefill block, decode attention implementation.
    """

    budget: int | float = 0.25
    stride: int = 5
    num_representatives: int | None = None
    static_ratio: float = 0.5
    anticipation: bool = True
    reanchor: bool = True
    kernel: int = 1
    group_layers: int | None = None
    rehearsals: int = 1
    question_window: int = 1
    recall_schedule: str = "whole"
    page_size: int = 16
    block: int = 256
    implementation: str = "auto"
    name = "synckv"

    def __post_init__(self):
        check_common(self.page_size, self.block, "max", self.implementation)
        check_budget(self.budget)
        if self.stride < 1:
            raise ValueError(f"stride (m) must be >= 1 decode step, got {self.stride}")
        if not 0.0 < self.static_ratio <= 1.0:
            raise ValueError(f"static_ratio (rho) must be in (0, 1], got {self.static_ratio}")
        if self.num_representatives is not None and not 1 <= self.num_representatives <= MAX_REPRESENTATIVES:
            raise ValueError(f"num_representatives (N_r) must be in [1, {MAX_REPRESENTATIVES}], got {self.num_representatives}")
        check_calibrated(self.kernel, self.group_layers, self.recall_schedule)
        if self.rehearsals < 0:
            raise ValueError(f"rehearsals must be >= 0, got {self.rehearsals}")
        if self.question_window < 1:
            raise ValueError(f"question_window must be >= 1 query, got {self.question_window}")

    def artifact_for(self, spec: CacheSpec, artifact=None) -> Artifact:
        """The given artifact (checked) or the one shipped for the spec's model."""
        return calibrated_artifact(KIND, spec, artifact, self.group_layers)

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
        """Per-layer plans and ``k`` (tokens each NR-head keeps for the longest row)."""
        roles, leader = self.clusters(art)
        if len(roles) != spec.num_layers or any(len(r) != spec.num_kv_heads for r in roles):
            raise ValueError(f"synckv artifact has roles for {len(roles)} layers x {len(roles[0])} heads; "
                             f"the model has {spec.num_layers} x {spec.num_kv_heads}")
        L = spec.longest_row
        N = spec.num_layers * spec.num_kv_heads
        F = sum(row.count("R") for row in roles)
        rho = self.budget / L if isinstance(self.budget, int) else float(self.budget)
        if rho * N <= F:
            raise ValueError(f"budget {rho:.3f} of the prompt cannot hold the {F} R-heads out of {N} KV heads: SyncKV "
                             f"with N_r={self.representatives(art)} needs budget > {F / N:.3f} (budget * N > F)")
        k = L if F == N else max(1, min(L, int((rho * N - F) * L / (N - F))))
        reps = [[h for h, r in enumerate(row) if r == "R"] for row in roles]
        dyn = k - int(self.static_ratio * k)
        plans = []
        for l, row in enumerate(roles):
            followers = tuple(Follower(h, leader[l][h][0], reps[leader[l][h][0]].index(leader[l][h][1]))
                              for h, r in enumerate(row) if r == "NR")
            plans.append(LayerPlan(capacities=tuple(L if r == "R" else k for r in row), full=tuple(reps[l]),
                                   leaders=tuple(reps[l]), followers=followers, picks=max(dyn, 1) if reps[l] else 0,
                                   anchor_picks=k if reps[l] and self.reanchor and self.anticipation else 0))
        return tuple(plans), k

    @property
    def recalls_ahead(self) -> bool:
        """Whether decode steps keep recalls in flight across calls (``recall_schedule="ahead"`` or ``"pipelined"``)."""
        return self.recall_schedule in ("ahead", "pipelined") and self.anticipation

    # -- protocol
    def recording(self) -> Recording:
        """A dense staging that keeps the prompt's last query (shareable with other methods)."""
        return Recording(window=1, block=self.block)

    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Dense staging recording the last query; the artifact travels with the cache."""
        art = self.artifact_for(spec, artifact)
        self.plans(spec, art)
        return Cache.create(init_staging(spec, self.recording()), self, spec, artifact=art)

    def prefill_chunk(self, state, q, k, v, ctx):
        """Stage and attend."""
        return stage_chunk(state, q, k, v, ctx)

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
        layer = build_layer(state, idx, lengths, ctx.pad, spec, plan, page_size=self.page_size,
                            region_start=jnp.broadcast_to(static_rows[:, None], (B, nf)),
                            region_count=jnp.broadcast_to((k_rows - static_rows)[:, None], (B, nf)),
                            picks=jnp.zeros((B, len(plan.leaders), max(plan.picks, 1)), jnp.int32), tracker=None,
                            pending=pending_rows(plans, plan, self.stride) if self.recalls_ahead else 0,
                            pipelined=self.recall_schedule == "pipelined")
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

    def anticipate(self, state, qg, pad):
        """R-heads pick the best ``k_dyn`` prompt tokens outside their static sets for their last query and publish."""
        plan = state.plan
        scores = leader_probs(state.paged, plan.leaders, qg[:, -1:], self.kernel, "max")[:, :, -1]  # [B, n, positions]
        scores = jnp.where(state.tracker.static, -jnp.inf, prompt_only(scores, state.prompt_len))
        picks = top_slots(scores, pad, state.picks.shape[-1])
        return publish(state, jnp.ones(state.version.shape, bool), picks)

    def reanchor_for(self, state, qg, pad):
        """A question asked after compression: the R-heads redo Eq. 3-4 for its last query, or the sum over its last
        ``question_window`` queries (new ``I_0``: static set and initial dynamic set), and publish it as a
        re-anchoring of their NR-heads' whole kept sets."""
        plan, tr = state.plan, state.tracker
        probs = leader_probs(state.paged, plan.leaders, qg[:, -self.question_window:], self.kernel, "max")  # [B, n, W, S]
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

    def decode_attend(self, state, q, k, v, ctx):
        """Attend over the held tokens; anticipation every ``stride`` steps (and for a multi-token call); recall.
        A multi-token call with ``reanchor`` re-anchors and recalls *before* it attends; in a rehearsal
        (``ctx.rehearsal``) the state is returned without its tokens."""
        plan = state.plan
        state = land_pending(state, ctx.mesh, drain=q.shape[1] > 1)
        if q.shape[1] > 1 and self.reanchor and self.anticipation:
            return reanchor_then_attend(state, q, k, v, ctx, lambda st: self.reanchor_for(
                st, leader_queries(q, plan.leaders, len(plan.capacities)), ctx.pad))
        out, state = append_attend(state, q, k, v, self.implementation, ctx.mesh)
        if plan.leaders and self.anticipation:
            qg = leader_queries(q, plan.leaders, len(plan.capacities))
            if q.shape[1] > 1:
                state = self.anticipate(state, qg, ctx.pad)
            else:
                state = lax.cond(state.steps % self.stride == 0, lambda st: self.anticipate(st, qg, ctx.pad),
                                 lambda st: st, state)
        spread = self.stride if self.recall_schedule != "whole" and q.shape[1] == 1 else None
        return out, apply_recalls(state, ctx, enabled=self.anticipation, spread_over=spread)

    def question_passes(self) -> int:
        """``1 + rehearsals`` with ``reanchor`` (and anticipation): each rehearsal re-anchors every layer's NR-heads,
        including those in layers before their R-head's, before the question attends; else one."""
        return 1 + self.rehearsals if self.reanchor and self.anticipation else 1

    def state_partition(self, state, spec: CacheSpec):
        """The staging's specs, then the leader/follower layout's (:func:`kvjax.head_recall.recall_partition`);
        the tracker is indexed by leader, so split by row only."""
        if isinstance(state, StagedKV):
            return staged_partition(state)
        rows = PartitionSpec(DATA)
        return recall_partition(state, state.tracker.replace(static=rows, static_rows=rows, keep_rows=rows))

    def stats(self, cache: Cache) -> dict:
        """R/NR heads, kept tokens, recall events."""
        if cache.stage != "compressed":
            return {}
        return {"num_representatives": self.representatives(cache.artifact),
                "group_layers": cache.artifact.meta_dict()["group_layers"], **recall_stats(cache.layers)}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Attention over every held token."""
        if cache.stage != "compressed":
            return 0
        return attention_read_bytes(cache.layers)
