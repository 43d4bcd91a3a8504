"""HeteroCache's calibration (``kvjax calibrate heterocache``): head roles from the recorded statistics.

Per KV head the stability score (Eq. 2) and the overlap graph of its group (an edge when the pairwise overlap reaches
``tau_sim``); greedy star clustering (as the reference code): repeatedly the unassigned head with the most unassigned
neighbours (ties: lowest index) becomes a *pivot* and those neighbours its *satellites*; the remaining heads are
*anchors* (stability >= ``tau_stable``) or *volatile*.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvjax.artifacts import Artifact
from kvjax.calibration import HeadRoleCalibrator, HeadStatistics
from kvjax.methods.recall.heterocache import KIND, ROLES


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


def add_options(p: argparse.ArgumentParser) -> None:
    """HeteroCache's thresholds on the ``kvjax calibrate`` command line."""
    p.add_argument("--tau-sim", type=float, default=0.5, help="HeteroCache similarity threshold")
    p.add_argument("--tau-stable", type=float, default=0.5, help="HeteroCache stability threshold")


def build(stats: HeadStatistics, model_id: str, args: argparse.Namespace, config) -> Artifact:
    """The artifact from the command line's thresholds."""
    return heterocache_artifact(stats, model_id, tau_sim=args.tau_sim, tau_stable=args.tau_stable)


def feasibility(art: Artifact, config) -> list[str]:
    """Role counts and the smallest budget the artifact allows (rho N > F)."""
    roles = art.meta_dict()["roles"]
    N = config.num_layers * config.num_kv_heads
    counts = {r: sum(row.count(r) for row in roles) for r in ROLES}
    F = counts["pivot"] + counts["volatile"]
    return [f"roles over {N} KV heads: " + ", ".join(f"{v} {k}" for k, v in counts.items()),
            f"full heads F = {F}: budgets must exceed F / N = {F / N:.3f}"]


def warnings(config, group_layers: int) -> list[str]:
    """Per-layer clustering on fewer KV heads than the paper's models have."""
    if group_layers == 1:
        return [f"per-layer clustering on {config.num_kv_heads} KV heads per layer (the papers' models have 8)"]
    return []


def layer_roles(art: Artifact) -> tuple:
    """The four roles and each layer's role per KV head."""
    return ROLES, art.meta_dict()["roles"]


# the reference code pools a group's query heads by their mean
CALIBRATOR = HeadRoleCalibrator(kind=KIND, gqa="mean", add_options=add_options, build=build, feasibility=feasibility,
                                warnings=warnings, layer_roles=layer_roles)
