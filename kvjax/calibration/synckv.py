"""SyncKV's calibration (``kvjax calibrate synckv``): clusters of similar heads from the recorded statistics.

Per group of KV heads, the similarity matrix ``S`` (mean overlap coefficient of top-k attended sets over steps and
samples, Eq. 2; GQA groups max-pooled as the paper's Appendix B.1), distance rows ``D = max(S) - S``, **K-means** (JAX,
deterministic seed, k-means++ initialisation, best of several restarts) into ``N_r`` clusters; the R-head of a cluster
is the head closest to its centroid. Assignments for ``N_r`` = 1..4 are stored in one artifact, and the method's
``num_representatives`` picks one.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.artifacts import Artifact
from kvjax.calibration import HeadRoleCalibrator, HeadStatistics, few_heads_warning
from kvjax.methods.recall.synckv import KIND, MAX_REPRESENTATIVES


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


def paper_representatives(config) -> int:
    """SyncKV's N_r as its paper sets it per model family: 1 for Qwen, 2 for Llama."""
    return 1 if "qwen" in config.architecture.lower() else 2


def add_options(p: argparse.ArgumentParser) -> None:
    """SyncKV's k-means seed on the ``kvjax calibrate`` command line."""
    p.add_argument("--seed", type=int, default=0, help="SyncKV k-means seed")


def build(stats: HeadStatistics, model_id: str, args: argparse.Namespace, config) -> Artifact:
    """The artifact from the command line's seed, with the paper's ``N_r`` for the model's family as its default."""
    return synckv_artifact(stats, model_id, seed=args.seed, default_representatives=paper_representatives(config))


def feasibility(art: Artifact, config) -> list[str]:
    """R-head counts and the smallest budget per ``N_r`` (budget N > F)."""
    N = config.num_layers * config.num_kv_heads
    out = []
    for n_r, roles, _ in art.meta_dict()["clusters"]:
        F = sum(row.count("R") for row in roles)
        out.append(f"N_r = {n_r}: {F} R-heads of {N}; budgets must exceed {F / N:.3f}")
    return out


def warnings(config, group_layers: int) -> list[str]:
    """Groups too small for one or two representatives to stand for the others."""
    return [w for n_r in (1, 2) if (w := few_heads_warning(config.num_kv_heads, group_layers, n_r))]


def layer_roles(art: Artifact) -> tuple:
    """R / NR and each layer's role per KV head, for ``N_r`` = 2 where the artifact has it (else its first)."""
    clusters = art.meta_dict()["clusters"]
    return ("R", "NR"), dict((c[0], c[1]) for c in clusters).get(2) or clusters[0][1]


# the paper's Appendix B.1 max-pools a group's query heads
CALIBRATOR = HeadRoleCalibrator(kind=KIND, gqa="max", add_options=add_options, build=build, feasibility=feasibility,
                                warnings=warnings, layer_roles=layer_roles)
