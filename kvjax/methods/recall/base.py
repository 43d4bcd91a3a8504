"""The lifecycle HeteroCache and SyncKV share: a dense staging prefill, a leader/follower layout
(:mod:`kvjax.methods.recall.layout`), and a decode step that attends, lets the leaders decide, and recalls by a
schedule (:mod:`kvjax.methods.recall.schedules`). A method supplies its plans, its prefill selection, its leaders'
decision (HeteroCache: the drift check; SyncKV: anticipation) and its re-anchoring on a question.

A one-token decode step holds no data-dependent conditional: the leaders decide every step, with the decision
predicated on the step count, and the schedule's transfer has a fixed size. Where the schedule's recall reads the
decisions only in later calls (``pipelined``), the leaders of every layer decide after the layers, side by side
(:meth:`LeaderFollowerMethod.lead_layers`). Re-anchorings happen in multi-token calls
only; those a question's last pass publishes for followers in layers before their leader's are applied by
:meth:`LeaderFollowerMethod.finish_question`, right after that pass.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from kvjax.artifacts import Artifact
from kvjax.budgets import budget_facts, check_budget
from kvjax.cache import Cache, CacheSpec
from kvjax.kv_quantization import stored_vector_bytes
from kvjax.methods.base import check_common
from kvjax.methods.recall.layout import (RecallKV, append_attend, attention_read_bytes, build_layer,
                                         recall_partition, recall_stats)
from kvjax.methods.recall.schedules import RecallSchedule, apply_anchors, make_schedule, refresh_all
from kvjax.methods.recall.scores import leader_queries, leader_query_logits, probs_from_logits, seen_limits
from kvjax.paged import append, paged_chunk_attention
from kvjax.selection import check_lookahead
from kvjax.staging import Recording, StagedKV, init_staging, stage_chunk, staged_partition


def check_calibrated(kernel: int, group_layers, recall_schedule: str, rehearsals: int, lookahead: int = 0) -> None:
    """Validate the hyper-parameters HeteroCache and SyncKV share (score pooling and look-ahead, artifact group size,
    recall schedule, question rehearsals)."""
    make_schedule(recall_schedule, 1)
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be a positive odd number, got {kernel}")
    check_lookahead(lookahead)
    if group_layers is not None and group_layers < 1:
        raise ValueError(f"group_layers must be >= 1 or None, got {group_layers}")
    if rehearsals < 0:
        raise ValueError(f"rehearsals must be >= 0, got {rehearsals}")


def auto_group_layers(num_kv_heads: int, target_units: int = 16) -> int:
    """Adjacent layers per group so a group has at least ``target_units`` KV heads.

    16 units: with one representative per group (SyncKV's N_r = 1, HeteroCache's usual single pivot)
    the full heads are about 1/16 of all heads, so a 10% budget is feasible; groups of 8 (the
    papers' heads per layer) would put the floor at 1/8."""
    return max(1, -(-target_units // num_kv_heads))


def calibrated_artifact(kind: str, spec, artifact, group_layers):
    """The given artifact checked against ``kind`` and the spec's model, or the one shipped for the model
    (``-g<group_layers>``; None: :func:`auto_group_layers`)."""
    from kvjax.artifacts import installed_artifact, require_artifact

    if artifact is None:
        artifact = installed_artifact(kind, spec.model_id, f"g{group_layers or auto_group_layers(spec.num_kv_heads)}")
    return require_artifact(artifact, kind, spec.model_id)


def reanchor_then_attend(state: RecallKV, q, k, v, ctx, choose):
    """A multi-token call that re-anchors: append the tokens, let ``choose(state)`` publish the leaders' choice (when
    the layer has leaders), recall it for every follower, *then* attend; a rehearsal (``ctx.rehearsal``) returns the
    state without the tokens (their rows stay past ``lengths``, overwritten by the real pass)."""
    held = state.paged.lengths
    state = state.replace(paged=append(state.paged, k, v))
    if state.plan.leaders:
        state = choose(state)
    state = refresh_all(state, ctx.layers, ctx.layer, ctx.mesh)
    out = paged_chunk_attention(q, state.paged).astype(q.dtype)
    if ctx.rehearsal:
        state = state.replace(paged=state.paged.replace(lengths=held))
    return out, state


@dataclasses.dataclass(frozen=True)
class LeaderFollowerMethod(abc.ABC):
    """Base of the leader/follower methods: the hyper-parameters they share (a subclass adds its own after them).

    Args:
      budget: fraction of the prompt's KV kept on the device over all heads, or tokens per head.
      kernel: pooling width of the leaders' attention scores (odd; 1: none).
      lookahead: the leaders' decode and question scores extended this many positions forward
        (:func:`kvjax.selection.extend_forward`; 0: none, the papers').
      group_layers: which shipped artifact to load when none is given (None: the model's default).
      rehearsals: passes of a re-anchoring question before the one that counts.
      recall_schedule: ``"whole"`` (the papers'), ``"spread"`` or ``"pipelined"``
        (:mod:`kvjax.methods.recall.schedules`; the method's decision interval is theirs).
      page_size, block, implementation: paged layout, prefill block, decode attention implementation.
    """

    budget: int | float = 0.25
    kernel: int = 5
    lookahead: int = 0
    group_layers: int | None = None
    rehearsals: int = 1
    recall_schedule: str = "whole"
    page_size: int = 16
    block: int = 256
    implementation: str = "auto"
    name: ClassVar[str]

    # -- what a method supplies
    @property
    @abc.abstractmethod
    def every(self) -> int:
        """Decode steps between the leaders' decisions (HeteroCache's drift window, SyncKV's stride)."""

    @property
    @abc.abstractmethod
    def recalls(self) -> bool:
        """Whether followers follow their leaders after prefill (False: the papers' static ablations)."""

    @property
    @abc.abstractmethod
    def reanchors(self) -> bool:
        """Whether a question asked after compression re-anchors every follower before it attends."""

    @abc.abstractmethod
    def check_artifact(self, spec: CacheSpec, art: Artifact) -> None:
        """Raise when ``art`` does not describe the spec's model."""

    @abc.abstractmethod
    def plans(self, spec: CacheSpec, art: Artifact) -> tuple:
        """``(per-layer LayerPlans, the method's set size)``; raises for a budget the full heads do not fit."""

    @abc.abstractmethod
    def lead(self, state: RecallKV, q, pad, mesh) -> RecallKV:
        """The leaders' decision after a multi-token call's tokens are appended and attended (``q[B, T, Hq, D]``,
        ``T > 1``; ``mesh``: the cache's, for scoring per device). A one-token call's is :meth:`lead_one_token`'s."""

    @abc.abstractmethod
    def choose_for_question(self, state: RecallKV, q, pad, mesh) -> RecallKV:
        """A question's re-anchoring: the leaders publish their choice for it (:func:`layout.publish_anchor` or
        :func:`layout.publish`)."""

    @abc.abstractmethod
    def tracker_partition(self, tracker):
        """Partition specs of the method's tracker."""

    @abc.abstractmethod
    def method_stats(self, cache: Cache) -> dict:
        """The method's own facts for ``cache.stats()`` (roles, groups)."""

    # -- shared
    def check_shared(self) -> None:
        """Validate the shared hyper-parameters (call from ``__post_init__``)."""
        check_common(self.page_size, self.block, "max", self.implementation)
        check_budget(self.budget)
        check_calibrated(self.kernel, self.group_layers, self.recall_schedule, self.rehearsals, self.lookahead)

    @property
    def schedule(self) -> RecallSchedule:
        """The recall schedule (:mod:`kvjax.methods.recall.schedules`)."""
        return make_schedule(self.recall_schedule, self.every, enabled=self.recalls, implementation=self.implementation)

    def artifact_for(self, spec: CacheSpec, artifact=None) -> Artifact:
        """The given artifact (checked) or the one shipped for the spec's model."""
        art = calibrated_artifact(self.name, spec, artifact, self.group_layers)
        self.check_artifact(spec, art)
        return art

    def recording(self) -> Recording:
        """A dense staging that keeps the prompt's last query (shareable with other methods)."""
        return Recording(window=1, block=self.block)

    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Dense staging recording the last query; the artifact (or the shipped one) travels with the cache. Any
        ``kv_dtype`` is stored: the pools and the followers' host copy hold it (:mod:`kvjax.methods.recall.layout`)."""
        art = self.artifact_for(spec, artifact)
        self.plans(spec, art)  # validates the budget against the full heads
        return Cache.create(init_staging(spec, self.recording()), self, spec, artifact=art)

    def prefill_chunk(self, state, q, k, v, ctx):
        """Stage and attend."""
        return stage_chunk(state, q, k, v, ctx)

    def build(self, state: StagedKV, idx, lengths, ctx, plans: tuple, *, region_start, region_count, picks,
              tracker) -> RecallKV:
        """The compressed layer from the kept slots per head (:func:`layout.build_layer`), with room for the query its
        leaders decide on after the layers where the schedule lets them."""
        layer = build_layer(state, idx, lengths, ctx.pad, ctx.spec, plans[ctx.layer], page_size=self.page_size,
                            region_start=region_start, region_count=region_count, picks=picks, tracker=tracker)
        if self.schedule.decides_after_layers and layer.plan.leaders:
            B, H, D = state.k.shape[0], ctx.spec.num_heads, state.k.shape[-1]
            layer = layer.replace(query=jnp.zeros((B, 1, H, D), state.k.dtype))
        return layer

    def around_layers(self, cache: Cache, tokens: int, run):
        """The layers inside the recall schedule's whole-cache work (:meth:`RecallSchedule.around_layers`); in a
        one-token call of a schedule that lets them, the leaders decide after the layers (:meth:`lead_layers`)."""
        if tokens == 1 and self.schedule.decides_after_layers:
            run_layers = run

            def run(c: Cache):
                out, c = run_layers(c)
                return out, c.replace(layers=self.lead_layers(c.layers, c.pad, c.spec.mesh))

        return self.schedule.around_layers(cache, tokens, run)

    def lead_layers(self, layers: tuple, pad, mesh) -> tuple:
        """Every layer's leaders decide on the query their layer kept from this one-token call (``query``), for a
        schedule whose recall reads the decisions only in later calls: :meth:`lead_one_token` for the leaders of
        every layer at once, a few kernels instead of a few per layer."""
        at = [i for i, st in enumerate(layers) if st.plan.leaders]
        if not at:
            return layers
        layers = list(layers)
        decided = self.lead_one_token([layers[i] for i in at], [layers[i].query for i in at], pad, mesh)
        for i, st in zip(at, decided):
            layers[i] = st
        return tuple(layers)

    def lead_one_token(self, states: list, queries: list, pad, mesh) -> list:
        """The leaders' decision after a one-token call, for the leaders of one or several layers (``states``, each
        with leaders), each on its layer's query ``q[B, 1, Hq, D]``: each layer scores its leaders' query over its
        own pages; softmax, pooling and the method's decision (:meth:`decide_at_once`) run once, side by side.
        Returns the states after it, in order."""
        positions = {st.paged.block_table.shape[-1] * st.paged.page_size for st in states}
        if len(positions) > 1:
            raise ValueError(f"the leaders decide side by side only over as many stored positions in every layer "
                             f"(leaders are full heads), got {sorted(positions)}")
        logits, limits = [], []
        for st, q in zip(states, queries, strict=True):
            qg = leader_queries(q, st.plan.leaders, len(st.plan.capacities))
            logits.append(leader_query_logits(st.paged, st.plan.leaders, qg, implementation=self.implementation,
                                              mesh=mesh))
            limits.append(seen_limits(st.paged, st.plan.leaders, 1))
        limits = jnp.concatenate(limits, axis=1)
        scores = probs_from_logits(jnp.concatenate(logits, axis=1), limits, self.kernel, "max", self.lookahead)
        return self.decide_at_once(states, scores, limits, pad)

    @abc.abstractmethod
    def decide_at_once(self, states: list, scores, limits, pad) -> list:
        """The one-token decision (:meth:`lead_one_token`) of the leaders of one or several layers (``states``, each
        with leaders and as many stored positions), from their scores side by side, in order: ``scores[B, N, 1,
        positions]`` and the held tokens they saw ``limits[B, N, 1]`` (:func:`kvjax.methods.recall.scores.
        seen_limits`), ``N`` the layers' leaders. Returns the states after it. Every layer with leaders counts the same
        one-token calls (``steps``)."""

    def decode_attend(self, state: RecallKV, q, k, v, ctx):
        """Attend over every head's held tokens, let the leaders decide, recall by the schedule. A multi-token call
        with re-anchoring publishes and recalls *before* it attends, and in a rehearsal (``ctx.rehearsal``) returns
        the state without its tokens."""
        schedule, multi = self.schedule, q.shape[1] > 1
        if multi and self.reanchors:
            return reanchor_then_attend(state, q, k, v, ctx,
                                        lambda st: self.choose_for_question(st, q, ctx.pad, ctx.mesh))
        out, state = append_attend(state, q, k, v, self.implementation, ctx.mesh)
        if not self.recalls:
            return out, state
        if state.plan.leaders and multi:
            state = self.lead(state, q, ctx.pad, ctx.mesh)
        elif state.plan.leaders and schedule.decides_after_layers:
            state = state.replace(query=q.astype(state.query.dtype))  # decided after the layers (lead_layers)
        elif state.plan.leaders:
            state = self.lead_one_token([state], [q], ctx.pad, ctx.mesh)[0]
        if multi:
            return out, refresh_all(state, ctx.layers, ctx.layer, ctx.mesh)
        return out, schedule.step(state, ctx.layers, ctx.layer, ctx.mesh)

    def rereads_context(self) -> bool:
        """Compressed from what the prefill recorded alone."""
        return False

    def question_passes(self) -> int:
        """``1 + rehearsals`` with re-anchoring: each rehearsal lets every leader publish its question choice, so
        followers in layers before their leader's hold it too when the question attends; else one."""
        return 1 + self.rehearsals if self.reanchors else 1

    def finish_question(self, cache: Cache) -> Cache:
        """After a question's last pass: followers in layers before their leader's apply the re-anchoring that pass
        published (the ones after it applied it in the pass)."""
        if not self.reanchors:
            return cache
        layers = list(cache.layers)
        for i, st in enumerate(layers):
            layers[i] = apply_anchors(st, layers, i, cache.spec.mesh)
        return cache.replace(layers=tuple(layers))

    def state_partition(self, state, spec: CacheSpec):
        """The staging's specs, then the leader/follower layout's (:func:`layout.recall_partition`)."""
        if isinstance(state, StagedKV):
            return staged_partition(state)
        return recall_partition(state, self.tracker_partition(state.tracker))

    def stats(self, cache: Cache) -> dict:
        """The method's facts, kept tokens, recall events, rows recalled and rows fetched per one-token step."""
        if cache.stage != "compressed":
            return {}
        layers, schedule = cache.layers, self.schedule
        fetched = sum(schedule.fetched_rows(st, layers, i) for i, st in enumerate(layers))
        return {**self.method_stats(cache), **recall_stats(layers, fetched),
                **budget_facts(self.budget, cache.spec.longest_row)}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Attention over every held token, and the leaders' keys once more for their decision (every step), in their
        stored dtype with their scales."""
        if cache.stage != "compressed":
            return 0
        scoring = 0
        if self.recalls:
            for st in cache.layers:
                if st.plan.leaders:
                    held = int(st.paged.lengths[:, list(st.plan.leaders)].sum())
                    scoring += held * stored_vector_bytes(st.paged.k_pages.shape[-1], st.paged.k_pages.dtype)
        return attention_read_bytes(cache.layers) + scoring


def leader_slices(states: list):
    """Each state's range along the leader axis of its leaders side by side (:meth:`LeaderFollowerMethod.
    decide_at_once`)."""
    start = 0
    for st in states:
        yield slice(start, start + len(st.plan.leaders))
        start += len(st.plan.leaders)
