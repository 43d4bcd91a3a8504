"""Offline head calibration shared by HeteroCache and SyncKV: which tokens each KV head attends to. Each method's
own step from these statistics to its artifact is a module here (:mod:`kvjax.calibration.heterocache`,
:mod:`kvjax.calibration.synckv`), registered in :mod:`kvjax.calibration.registry`.

The model runs on local calibration text (docstrings of the Python standard library's modules:
*not* the evaluation haystacks, which come from ``pydoc_data.topics`` and filler sentences), one
sample at a time: prefill, then ``decode_steps`` greedy decode steps. At the prompt's last query
and at every decode step, each KV head's **attended set** is the top-``k`` key positions of the
query's softmax attention, aggregated over the head's query group and smoothed by 1-D average
pooling (kernel 5), as the HeteroCache reference code does (REFERENCE_NOTES "HeteroCache"):

* **stability** of a head (HeteroCache Eq. 2): median over decode steps of
  ``|S_step ∩ S_prefill| / k``, averaged over samples;
* **pairwise overlap** of two heads at a step (Eq. 1, the overlap coefficient; sets have equal
  size so it is ``|S_i ∩ S_j| / k``); aggregated per pair as the mean over steps and samples
  (SyncKV Eq. 2) and as the median over steps averaged over samples (used for HeteroCache's graph);
* **similarity score** of a head (HeteroCache Eq. 3): median over steps of its largest overlap with
  another head of its group.

Heads are compared within a **group**: one layer in the papers (``group_layers=1``), or
``group_layers`` adjacent layers (kvjax's variant for models with few KV heads per layer: token
positions are the same in every layer, so one head's attended set can stand in for a head of
another layer).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from kvjax.artifacts import Artifact, no_artifact
from kvjax.attention import MASK_VALUE, causal_cache_attention
from kvjax.cache import Cache, CacheSpec
from kvjax.methods.base import LayerLocal
from kvjax.methods.recall.base import auto_group_layers
from kvjax.selection import gqa_aggregate, pool1d
from kvjax.sharding import not_shardable
from kvjax.staging import Recording, StagedKV, init_staging, stage_chunk, write_slots

CALIBRATION_MODULES = (
    "argparse", "collections", "email.message", "json", "logging", "pathlib", "subprocess", "threading", "typing",
    "unittest", "asyncio", "datetime", "decimal", "fractions", "heapq", "itertools", "functools", "string",
    "textwrap", "zipfile", "tarfile", "csv", "sqlite3", "http.client", "urllib.request", "xml.etree.ElementTree",
    "random", "statistics", "shutil", "tempfile",
)


def calibration_corpus() -> str:
    """Docstrings of :data:`CALIBRATION_MODULES` and their public classes and functions, in a fixed order."""
    docs = []
    for name in CALIBRATION_MODULES:
        mod = importlib.import_module(name)
        docs.append(inspect.getdoc(mod) or "")
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                doc = inspect.getdoc(obj)
                if doc:
                    docs.append(doc)
    return "\n\n".join(d for d in docs if d)


def calibration_rows(tokenizer, samples: int, tokens: int) -> list[list[int]]:
    """``samples`` consecutive, non-overlapping slices of ``tokens`` tokens of the calibration corpus."""
    ids = tokenizer.encode(calibration_corpus())
    if samples * tokens > len(ids):
        raise ValueError(f"the calibration corpus has {len(ids)} tokens; {samples} samples of {tokens} do not fit")
    return [list(ids[i * tokens:(i + 1) * tokens]) for i in range(samples)]


# ------------------------------------------------------------------------------ the recorder method
@struct.dataclass
class RecordedKV:
    """A dense layer plus the attended set of the latest query ``topk[B, Hkv, k]`` (slot ids)."""

    k: jax.Array
    v: jax.Array
    topk: jax.Array


def attended_set(q, k, q_slot, pad, *, topk: int, kernel: int, gqa: str):
    """Top-``topk`` slots per KV head ``[B, Hkv, topk]`` of one query ``q[B, Hq, D]`` at slot ``q_slot``.

    Softmax (f32) over the visible keys ``k[B, Hkv, S, D]`` (slots ``pad .. q_slot``), average
    pooling (``kernel``) and aggregation over the query group (``gqa``).
    """
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv, D).astype(jnp.float32)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k.astype(jnp.float32), precision=lax.Precision.HIGHEST) * D**-0.5
    slots = jnp.arange(S)
    visible = (slots[None, :] <= q_slot) & (slots[None, :] >= pad[:, None])  # [B, S]
    p = jax.nn.softmax(jnp.where(visible[:, None, None], s, MASK_VALUE), axis=-1).reshape(B, Hq, S)
    p = pool1d(p, visible[:, None, :], kernel, "avg")
    scores = jnp.where(visible[:, None, :], gqa_aggregate(p, Hkv, gqa), -jnp.inf)
    return lax.top_k(scores, topk)[1].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AttentionRecorder(LayerLocal):
    """A full dense cache that records each later query's attended set (:func:`attended_set`).

    Used only by calibration: prefill the prompt but its last token, compress, then feed the last
    prompt token (its set is the *prefill* set) and decode; after each call every layer's ``topk``
    holds the set of that call's (single) query.
    """

    topk: int
    kernel: int = 5
    gqa: str = "mean"
    block: int = 256
    name = "attention_recorder"

    def recording(self):
        """Runs its own prefill (it is never shared)."""
        return None

    def artifact_for(self, spec: CacheSpec, artifact=None) -> None:
        """No artifact (a given one is an error)."""
        no_artifact(artifact, self.name)

    def init_cache(self, spec: CacheSpec, artifact=None) -> Cache:
        """Dense staging with room for the decode steps."""
        self.artifact_for(spec, artifact)
        return Cache.create(init_staging(spec, Recording(block=self.block)), self, spec)

    def prefill_chunk(self, state: StagedKV, q, k, v, ctx):
        """Stage and attend."""
        return stage_chunk(state, q, k, v, ctx)

    def finish_prefill(self, state: StagedKV, ctx) -> RecordedKV:
        """Keep the dense buffers."""
        B, H = state.k.shape[:2]
        return RecordedKV(state.k, state.v, jnp.zeros((B, H, self.topk), jnp.int32))

    def decode_attend(self, state: RecordedKV, q, k, v, ctx):
        """Write, attend, record the set of the (single) query."""
        if q.shape[1] != 1:
            raise ValueError("AttentionRecorder records one query per call")
        k_all, v_all = write_slots(state.k, k, ctx.start), write_slots(state.v, v, ctx.start)
        out = causal_cache_attention(q, k_all, v_all, q_start=ctx.start, pad=ctx.pad, scale=q.shape[-1] ** -0.5,
                                     block=self.block, implementation="xla")
        top = attended_set(q[:, 0], k_all, ctx.start, ctx.pad, topk=self.topk, kernel=self.kernel, gqa=self.gqa)
        return out, RecordedKV(k_all, v_all, top)

    def state_partition(self, state, spec: CacheSpec):
        """Calibration runs on one device."""
        raise not_shardable(self.name, "calibration records every head's attended sets on one device")

    def stats(self, cache) -> dict:
        """Nothing to report."""
        return {}

    def bytes_read_per_step(self, cache) -> int:
        """Not a serving method."""
        return 0


def record_sets(model, rows, *, decode_steps: int, topk: int, kernel: int = 5, gqa: str = "mean",
                progress: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """Attended sets of every (layer, KV head) for each token row (greedy decoding after the prompt).

    Returns one ``(prefill_sets [L, Hkv, topk], step_sets [T, L, Hkv, topk])`` pair (positions) per row.
    """
    from kvjax.decoding import compress, decode_step, prefill_prompt

    if decode_steps < 1:
        raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    recorder = AttentionRecorder(topk=topk, kernel=kernel, gqa=gqa)
    out = []
    it = rows
    if progress:
        from tqdm import tqdm

        it = tqdm(rows, desc="calibration samples", unit="sample")
    key = jax.random.PRNGKey(0)
    for row in it:
        if len(row) - 1 < topk:
            raise ValueError(f"a calibration sample of {len(row)} tokens is shorter than top-k {topk} + 1")
        tokens = np.asarray([row], np.int32)
        spec = CacheSpec.for_model(model.config, 1, tokens.shape[1] - 1, decode_steps + 1, model.dtype)
        cache = recorder.init_cache(spec)
        _, cache = prefill_prompt(model.graphdef, model.params, tokens[:, :-1], cache, chunk_size=1024)
        cache = compress(cache)

        def sets(c):
            return np.stack([np.asarray(st.topk[0]) for st in c.layers])  # [L, H, k]

        tok, _, cache = decode_step(model.graphdef, model.params, jnp.asarray(tokens[:, -1]), cache, key)
        prefill_sets = sets(cache)
        steps = []
        for _ in range(decode_steps):
            tok, _, cache = decode_step(model.graphdef, model.params, tok, cache, key)
            steps.append(sets(cache))
        out.append((prefill_sets, np.stack(steps)))
    return out


# -------------------------------------------------------------------------------------- statistics
def membership(sets: np.ndarray, positions: int) -> np.ndarray:
    """Index sets ``[..., k]`` as float membership vectors ``[..., positions]``."""
    flat = sets.reshape(-1, sets.shape[-1])
    out = np.zeros((flat.shape[0], positions), np.float32)
    np.put_along_axis(out, flat, 1.0, axis=1)
    return out.reshape(*sets.shape[:-1], positions)


@dataclasses.dataclass
class HeadStatistics:
    """Calibration statistics (numpy).

    Attributes:
      stability: ``[L, Hkv]`` median over steps of the overlap with the prefill set, mean over samples.
      stability_curve: ``[T, L, Hkv]`` overlap with the prefill set per step, mean over samples.
      group_layers: layers per group; groups are ``range(0, L, group_layers)`` (the last may be shorter).
      sim_mean, sim_median: per group ``[U, U]`` pairwise overlaps (mean over steps; median over steps),
        averaged over samples; units of a group are ``(layer, head)`` in layer-major order.
      similarity: ``[L, Hkv]`` HeteroCache's S_sim (median over steps of the largest overlap with another
        head of the group), mean over samples.
      topk, samples, decode_steps, tokens: the run's settings.
    """

    stability: np.ndarray
    stability_curve: np.ndarray
    group_layers: int
    sim_mean: list
    sim_median: list
    similarity: np.ndarray
    topk: int
    samples: int
    decode_steps: int
    tokens: int

    def groups(self) -> list[list[tuple[int, int]]]:
        """Units ``(layer, head)`` of each group."""
        L, H = self.stability.shape
        return unit_groups(L, H, self.group_layers)


def unit_groups(num_layers: int, num_kv_heads: int, group_layers: int) -> list[list[tuple[int, int]]]:
    """``(layer, head)`` units of each group of ``group_layers`` adjacent layers (layer-major order)."""
    if group_layers < 1:
        raise ValueError(f"group_layers must be >= 1, got {group_layers}")
    return [[(l, h) for l in range(s, min(s + group_layers, num_layers)) for h in range(num_kv_heads)]
            for s in range(0, num_layers, group_layers)]


def head_statistics(records, *, topk: int, group_layers: int, tokens: int = 0) -> HeadStatistics:
    """Stability, pairwise overlaps and similarity scores from :func:`record_sets`' output."""
    L, H = records[0][0].shape[:2]
    T = records[0][1].shape[0]
    groups = unit_groups(L, H, group_layers)
    stab, curve, simil = [], [], []
    sim_mean = [np.zeros((len(g), len(g))) for g in groups]
    sim_median = [np.zeros((len(g), len(g))) for g in groups]
    for prefill, steps in records:
        positions = int(max(steps.max(), prefill.max())) + 1
        o = (membership(steps, positions) * membership(prefill, positions)[None]).sum(-1) / topk  # [T, L, H]
        curve.append(o)
        stab.append(np.median(o, axis=0))
        best = np.zeros((T, L, H))
        for gi, units in enumerate(groups):
            ls = np.array([u[0] for u in units])
            hs = np.array([u[1] for u in units])
            member = membership(steps[:, ls, hs], int(steps.max()) + 1)  # [T, U, positions]
            pair = np.einsum("tup,tvp->tuv", member, member) / topk  # [T, U, U] overlap coefficients
            sim_mean[gi] += pair.mean(axis=0) / len(records)
            sim_median[gi] += np.median(pair, axis=0) / len(records)
            off = np.where(np.eye(len(units), dtype=bool)[None], -1.0, pair)
            best[:, ls, hs] = off.max(axis=2) if len(units) > 1 else 0.0
        simil.append(np.median(best, axis=0))
    return HeadStatistics(
        stability=np.mean(stab, axis=0), stability_curve=np.mean(curve, axis=0), group_layers=group_layers,
        sim_mean=sim_mean, sim_median=sim_median, similarity=np.mean(simil, axis=0), topk=topk,
        samples=len(records), decode_steps=T, tokens=tokens,
    )


def few_heads_warning(num_kv_heads: int, group_layers: int, representatives: int) -> str | None:
    """A sentence when per-group clustering cannot save anything (every head would be a representative)."""
    units = num_kv_heads * group_layers
    if representatives >= units:
        return (f"{units} KV heads per group ({num_kv_heads} per layer x {group_layers} layer(s)) and "
                f"{representatives} representatives per group: every head is a representative and nothing is "
                "compressed; use --group-layers > 1 (kvjax's cross-layer variant)")
    return None


@dataclasses.dataclass(frozen=True)
class HeadRoleCalibrator:
    """How one method turns the recorded statistics into its artifact (``kvjax calibrate <kind>``; registered in
    :data:`kvjax.calibration.registry.CALIBRATORS`).

    Attributes:
      kind: the method's name, the artifact's kind.
      gqa: how a group's query heads are pooled when recording attended sets (``"mean"`` or ``"max"``).
      add_options: adds the method's own command-line options to ``kvjax calibrate``'s parser.
      build: ``(statistics, model_id, parsed args, model config) -> Artifact``.
      feasibility: ``(artifact, model config) -> lines``: head counts and the smallest budget the artifact allows.
      warnings: ``(model config, group_layers) -> lines``: where the clustering cannot save much.
      layer_roles: ``artifact -> (role names, each layer's role per KV head)``, for the report's plot.
    """

    kind: str
    gqa: str
    add_options: Callable[[argparse.ArgumentParser], None]
    build: Callable[..., Artifact]
    feasibility: Callable[..., list]
    warnings: Callable[..., list]
    layer_roles: Callable[[Artifact], tuple]


__all__ = ["HeadRoleCalibrator", "CALIBRATION_MODULES", "calibration_corpus", "calibration_rows", "AttentionRecorder", "attended_set",
           "record_sets", "membership", "HeadStatistics", "unit_groups", "head_statistics",
           "auto_group_layers", "few_heads_warning"]
