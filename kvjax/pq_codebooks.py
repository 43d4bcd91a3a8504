"""Product-quantisation (PQ) codebooks for HCAttention's keys: fitting, encoding, decoding, the artifact.

HCAttention (Sec. 3.1) splits each post-RoPE key ``k in R^D`` of a KV head into ``g`` groups of
``d = D // g`` dims and replaces each sub-vector by the nearest of ``c`` centroids of that group's
codebook, fitted offline by K-means on calibration keys. Layouts (those of
:mod:`kvjax.pallas_kernels.pq_attention`)::

    codebooks : [H_kv, g, c, D // g]   float32       one layer (an artifact holds [L, H_kv, g, c, D // g])
    codes     : [B, H_kv, S, g]        uint8 (c <= 256) | uint16 (256 < c <= 65536)

One codebook per (layer, KV head, group): the paper's "separate codebooks for each group" (its
Table 4(b) ``64*``), which it reports as slightly better than sharing one codebook across groups.

**K-means.** The paper fits with scikit-learn's ``MiniBatchKMeans`` (Sculley 2010): 3 samples, at
most 200 iterations, batch 10,000. :func:`kmeans_minibatch` is that algorithm in JAX, vectorised
over many independent problems (every (KV head, group) of a layer at once):

* init: k-means++ (one candidate per step; scikit-learn's greedy variant tries ``2 + log c``) on
  a random subsample of ``min(n, max(3 * batch, 3 * c))`` points, as scikit-learn's ``init_size``;
* each step draws ``batch`` points with replacement, assigns each to its nearest centre (f32,
  ``precision=HIGHEST``), and moves each centre to the running mean of every point ever assigned
  to it: per-centre counts ``v`` and per-point learning rate ``1 / v`` (Sculley's update; within a
  batch the assignments are computed first, so the sequential per-point updates equal the
  count-weighted batch mean used here and in scikit-learn);
* ``iterations`` counts mini-batch *steps*. scikit-learn's ``max_iter`` counts passes over the data
  (steps = ``max_iter * n / batch``) and stops early when the smoothed batch inertia stops
  improving; here the step count is fixed (jit-friendly, deterministic);
* no reassignment of dead centres (scikit-learn moves centres with < 1% of the largest count to
  random points). k-means++ seeds every centre on a distinct data point, so a centre is dead only
  when no sampled point is ever nearest to it; :func:`quantization_error` reports the fraction of
  centroids no key uses, so the cost of this choice is measured rather than assumed.

Cost per layer and step: ``H_kv * g * batch * c`` distances of ``d`` dims (the assignments), i.e.
proportional to ``layers * iterations * batch * H_kv * g * c``; the batch is scored in chunks whose distance
block ``4 * H_kv * g * chunk * c`` bytes stays within :func:`distance_block_bytes` (at most 256 points; the
assignments do not depend on the chunk). Measured on
qwen2.5-coder-0.5b (2 KV heads, D = 64, c = 256, 12,288 training keys, 2-core CPU): about 13 s per
layer for g = 32 and 6 s for g = 16 at 100 steps of 4096; the held-out key error is already flat
after 25 such steps, and 100 steps of 1024 reach the same error (layers 0, 12, 23 checked).

This module is core (jax, numpy, kvjax); :func:`collect_keys` drives a model (``kvjax.load``)
through :mod:`kvjax.decoding`, imported lazily.
"""

from __future__ import annotations

import functools
import hashlib
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.artifacts import Artifact, frozen_meta
from kvjax.selection import top_p_select

KIND = "hcattention"
HIGHEST = lax.Precision.HIGHEST
SCORE_CHUNK = 256  # most K-means batch points scored per chunk
# the distance block of encoding and of the K-means assignments: on a CPU one that stays in its caches (8 MiB
# encodes 1.6-2.5x faster than 512 MiB: research.bench_pq_encode; the c = 8192 fit's steps 1.6x faster than its
# earlier 256-point chunks, 256 MiB); elsewhere few large blocks (each block is one step of a sequential loop)
DISTANCE_BLOCK_BYTES_CPU = 8 * 2**20
DISTANCE_BLOCK_BYTES = 512 * 2**20


def distance_block_bytes() -> int:
    """Bytes of one ``[..., c]`` distance block on the default backend (:data:`DISTANCE_BLOCK_BYTES_CPU` on a CPU,
    else :data:`DISTANCE_BLOCK_BYTES`)."""
    return DISTANCE_BLOCK_BYTES_CPU if jax.default_backend() == "cpu" else DISTANCE_BLOCK_BYTES


def _map_chunks(fn, x, axis: int, size: int):
    """``fn`` over ``x`` in chunks of ``size`` along ``axis``, one after another (``lax.map``), the outputs joined
    along the same axis. The last chunk is padded with zeros and its extra outputs dropped; ``fn`` maps a chunk to
    an output with the chunk's axes up to ``axis`` in place. One chunk that covers ``axis`` is ``fn(x)``."""
    m = x.shape[axis]
    if m <= size:
        return fn(x)
    n = -(-m // size)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n * size - m)
    xp = jnp.pad(x, pad)
    chunks = jnp.moveaxis(xp.reshape(x.shape[:axis] + (n, size) + x.shape[axis + 1:]), axis, 0)
    out = jnp.moveaxis(lax.map(fn, chunks), 0, axis)  # [..., n, size, ...]
    out = out.reshape(out.shape[:axis] + (n * size,) + out.shape[axis + 2:])
    return lax.slice_in_dim(out, 0, m, axis=axis)


def code_dtype(num_centroids: int):
    """``jnp.uint8`` for ``c <= 256`` centroids, ``jnp.uint16`` for ``c <= 65536``; ValueError otherwise."""
    c = int(num_centroids)
    if c < 1:
        raise ValueError(f"need at least 1 centroid, got {c}")
    if c <= 256:
        return jnp.uint8
    if c <= 65536:
        return jnp.uint16
    raise ValueError(f"{c} centroids do not fit uint16 codes; allowed: 1..65536")


def codebook_variant(groups: int, centroids: int) -> str:
    """Artifact variant name of a codebook configuration, ``"g<groups>-c<centroids>"``."""
    return f"g{int(groups)}-c{int(centroids)}"


# ------------------------------------------------------------------------------------------ K-means
def _first_argmin(s):
    """Index of the first minimum along the last axis (= ``jnp.argmin``; a min and a masked min are
    2-3x faster than XLA:CPU's variadic argmin reduction)."""
    m = jnp.min(s, axis=-1, keepdims=True)
    return jnp.min(jnp.where(s == m, lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1), s.shape[-1]), axis=-1)


def _dots(x, cents):
    """``x . C`` over the last axis (``d``, a few dims) of ``x[..., 1, d]`` and ``cents[..., c, d]``, f32: the ``d``
    products summed in order, as elementwise work XLA fuses with what follows (a dot of 2-4 terms per output, as
    ``einsum``, runs 2-8x slower on a CPU: :mod:`research.bench_pq_encode`)."""
    out = x[..., 0] * cents[..., 0]
    for i in range(1, x.shape[-1]):
        out = out + x[..., i] * cents[..., i]
    return out


def _nearest(x, cents):
    """Index of the nearest centre ``[N, m]`` for points ``x[N, m, d]`` and centres ``cents[N, c, d]``.

    argmin over ``||C||^2 - 2 x.C`` (``||x||^2`` is constant per point), f32, HIGHEST precision: a dot, as the
    shipped codebooks were fitted (:func:`_dots` differs from it in the last bit, which moves near-ties).
    """
    cn = jnp.sum(cents * cents, axis=-1)  # [N, c]
    dots = jnp.einsum("nmd,ncd->nmc", x, cents, precision=HIGHEST)
    return _first_argmin(cn[:, None, :] - 2.0 * dots)


def _kmeanspp(x, key, c: int):
    """k-means++ seeds ``[N, c, d]`` from ``x[N, m, d]`` (one candidate per step, vectorised over N).

    Each seed is drawn with probability proportional to the squared distance to the nearest seed so
    far (inverse-CDF sampling: one uniform per problem), so seeds are distinct points unless fewer
    than ``c`` distinct points exist (then the rest are drawn uniformly).
    """
    N, m, _ = x.shape
    rows = jnp.arange(N)
    key, sub = jax.random.split(key)
    first = jax.random.randint(sub, (N,), 0, m)
    cents = jnp.zeros((N, c, x.shape[-1]), jnp.float32).at[:, 0].set(x[rows, first])
    d2 = jnp.sum((x - x[rows, first][:, None]) ** 2, axis=-1)  # [N, m] squared distance to the nearest seed

    def body(i, carry):
        cents, d2 = carry
        u = 1.0 - jax.random.uniform(jax.random.fold_in(key, i), (N,))  # (0, 1]
        cdf = jnp.cumsum(d2, axis=-1)
        total = cdf[:, -1]
        weighted = jnp.sum(cdf < (u * total)[:, None], axis=-1)  # first index with cdf >= u * total
        uniform = jnp.floor((1.0 - u) * m).astype(jnp.int32)
        pick = jnp.clip(jnp.where(total > 0, weighted, uniform), 0, m - 1)
        new = x[rows, pick]  # [N, d]
        cents = lax.dynamic_update_slice_in_dim(cents, new[:, None], i, axis=1)
        return cents, jnp.minimum(d2, jnp.sum((x - new[:, None]) ** 2, axis=-1))

    cents, _ = lax.fori_loop(1, c, body, (cents, d2))
    return cents


@functools.partial(jax.jit, static_argnames=("c", "iterations", "batch", "init_size", "chunk"))
def _kmeans(x, key, *, c: int, iterations: int, batch: int, init_size: int, chunk: int):
    N, n, d = x.shape
    rows = jnp.arange(N)[:, None]
    key, k_init, k_sub = jax.random.split(key, 3)
    if init_size < n:
        sub = jax.vmap(lambda k: jax.random.choice(k, n, (init_size,), replace=False))(jax.random.split(k_sub, N))
        seeds_from = x[rows, sub]
    else:
        seeds_from = x
    cents = _kmeanspp(seeds_from, k_init, c)
    seg = (jnp.arange(N)[:, None] * c)  # [N, 1] offset of each problem's centres

    def step(t, carry):
        cents, counts = carry
        idx = jax.random.randint(jax.random.fold_in(key, t), (N, batch), 0, n)
        xb = x[rows, idx]  # [N, batch, d]
        assign = _map_chunks(lambda xc: _nearest(xc, cents), xb, 1, chunk)
        ids = (seg + assign).reshape(-1)
        sums = jax.ops.segment_sum(xb.reshape(-1, d), ids, num_segments=N * c).reshape(N, c, d)
        got = jax.ops.segment_sum(jnp.ones_like(ids, jnp.float32), ids, num_segments=N * c).reshape(N, c)
        total = counts + got
        # running mean of every point ever assigned (per-point learning rate 1 / count)
        new = (cents * counts[..., None] + sums) / jnp.maximum(total, 1.0)[..., None]
        cents = jnp.where(got[..., None] > 0, new, cents)
        return cents, total

    cents, _ = lax.fori_loop(0, iterations, step, (cents, jnp.zeros((N, c), jnp.float32)))
    return cents


def kmeans_minibatch(points, num_centroids: int, *, iterations: int = 100, batch: int = 4096, seed: int = 0):
    """Mini-batch K-means (Sculley 2010) of ``N`` independent problems at once (JAX, deterministic).

    Args:
      points: float ``[N, n, d]``: ``n`` points of ``d`` dims per problem.
      num_centroids: ``c`` centres per problem (``1 <= c <= n``).
      iterations: mini-batch steps (not passes over the data; see the module docstring).
      batch: points drawn (with replacement) per step and problem.
      seed: PRNG seed (init subsample, k-means++ seeds, batches).
    Returns the centres ``[N, c, d]`` float32 (a jax array).
    """
    x = jnp.asarray(points, jnp.float32)
    if x.ndim != 3:
        raise ValueError(f"points must be [N, n, d], got shape {x.shape}")
    N, n, d = x.shape
    c = int(num_centroids)
    code_dtype(c)  # 1..65536
    if n < c:
        raise ValueError(f"k-means with {c} centroids needs at least {c} points per problem, got n={n}")
    if iterations < 0 or batch < 1:
        raise ValueError(f"need iterations >= 0 and batch >= 1, got iterations={iterations}, batch={batch}")
    init_size = min(n, max(3 * batch, 3 * c))
    chunk = max(1, min(int(batch), SCORE_CHUNK, distance_block_bytes() // (4 * N * c)))
    return _kmeans(x, jax.random.PRNGKey(seed), c=c, iterations=int(iterations), batch=int(batch),
                   init_size=init_size, chunk=chunk)


# --------------------------------------------------------------------------------- encode / decode
def _check_layout(k, codebooks):
    if k.ndim != 4:
        raise ValueError(f"keys must be [B, H_kv, S, D], got shape {k.shape}")
    if codebooks.ndim != 4:
        raise ValueError(f"codebooks must be [H_kv, g, c, D // g], got shape {codebooks.shape}")
    H, g, _, d = codebooks.shape
    if k.shape[1] != H or k.shape[3] != g * d:
        raise ValueError(f"keys {k.shape} do not match codebooks {codebooks.shape}: need H_kv={H} and D={g} x {d}")


PRODUCT_FORMS = ("sum", "dot")


@functools.partial(jax.jit, static_argnames=("chunk", "block_bytes", "products"))
def encode_keys(k, codebooks, *, chunk: int = 1024, block_bytes: int | None = None, products: str = "sum"):
    """PQ codes ``[B, H_kv, S, g]`` of keys ``k[B, H_kv, S, D]`` for ``codebooks[H_kv, g, c, D // g]``.

    Nearest centroid per group by squared Euclidean distance (argmin of ``||C||^2 - 2 k.C``, f32; ties go
    to the lower index), computed over ``S`` in chunks of at most ``chunk`` tokens (``S`` padded), fewer
    where the distance block, ``4 * B * H_kv * chunk * g * c`` bytes, would exceed ``block_bytes``
    (default: :func:`distance_block_bytes`). ``products``: ``k.C`` as the ``d`` products summed elementwise
    (``"sum"``, :func:`_dots`) or as a dot (``"dot"``: ``einsum``, HIGHEST precision, as the K-means
    fit; :mod:`research.bench_pq_encode` compares them). uint8 codes for ``c <= 256``, else uint16. Jittable.
    """
    if products not in PRODUCT_FORMS:
        raise ValueError(f"products must be one of {', '.join(PRODUCT_FORMS)}, got {products!r}")
    _check_layout(k, codebooks)
    B, H, S, D = k.shape
    _, g, c, d = codebooks.shape
    out_dtype = code_dtype(c)
    cb = codebooks.astype(jnp.float32)
    cn = jnp.sum(cb * cb, axis=-1)  # [H, g, c]
    if block_bytes is None:
        block_bytes = distance_block_bytes()
    size = max(1, min(int(chunk), S, int(block_bytes) // (4 * B * H * g * c)))

    def one(x):  # [B, H, size, g, d]
        if products == "dot":
            dots = jnp.einsum("bhsgd,hgcd->bhsgc", x, cb, precision=HIGHEST)
        else:
            dots = _dots(x[..., None, :], cb[None, :, None])  # [B, H, size, g, c]
        return _first_argmin(cn[None, :, None] - 2.0 * dots).astype(out_dtype)

    return _map_chunks(one, k.astype(jnp.float32).reshape(B, H, S, g, d), 2, size)  # [B, H, S, g]


@jax.jit
def decode_keys(codes, codebooks):
    """Quantised keys ``[B, H_kv, S, D]`` float32: each group's sub-vector is its code's centroid."""
    B, H, S, g = codes.shape
    Hc, gc, c, d = codebooks.shape
    if (Hc, gc) != (H, g):
        raise ValueError(f"codes {codes.shape} do not match codebooks {codebooks.shape}")
    flat = (jnp.arange(H)[:, None, None] * g + jnp.arange(g)[None, None, :]) * c + codes.astype(jnp.int32)
    return codebooks.astype(jnp.float32).reshape(H * g * c, d)[flat].reshape(B, H, S, g * d)


# ------------------------------------------------------------------------------------------ fitting
def fit_codebooks(keys_per_layer, *, groups: int, centroids: int, iterations: int = 100, batch: int = 4096,
                  seed: int = 0, progress: bool = False, callback=None, checkpoint=None):
    """Codebooks ``[L, H_kv, g, c, D // g]`` float32 (numpy) from calibration keys ``[L, H_kv, n, D]``.

    One :func:`kmeans_minibatch` per (layer, KV head, group); each layer's ``H_kv * g`` problems run
    vectorised, layer ``l`` with seed ``seed * 1000 + l``. ``progress`` shows a bar over layers;
    ``callback(layer)`` is called after each layer.

    ``checkpoint`` (a path): the finished layers are saved there after each layer, and a fit started again with
    the same keys and settings resumes after them (a large ``c`` takes hours on a CPU); a checkpoint of other keys
    or settings is ignored and overwritten. Each layer's fit depends only on its keys and seed, so a resumed fit
    equals an uninterrupted one. The checkpoint also holds ``seconds``, the fit's time over every run so far.
    """
    keys = keys_per_layer
    if len(np.shape(keys)) != 4:
        raise ValueError(f"keys_per_layer must be [L, H_kv, n, D], got shape {np.shape(keys)}")
    L, H, n, D = np.shape(keys)
    g = int(groups)
    if g < 1 or D % g:
        raise ValueError(f"groups must divide the head dim D={D}, got {g}")
    d = D // g
    out = np.zeros((L, H, g, int(centroids), d), np.float32)
    done, fingerprint, before, t0 = 0, None, 0.0, time.perf_counter()
    if checkpoint is not None:
        fingerprint = _fit_fingerprint(keys, g, int(centroids), int(iterations), int(batch), int(seed))
        done, before = _resume(Path(checkpoint), fingerprint, out)
    layers = range(done, L)
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc=f"k-means g={g} c={centroids}", unit="layer", initial=done, total=L)
    for l in layers:
        x = jnp.asarray(keys[l], jnp.float32).reshape(H, n, g, d).transpose(0, 2, 1, 3).reshape(H * g, n, d)
        cents = kmeans_minibatch(x, centroids, iterations=iterations, batch=batch, seed=seed * 1000 + l)
        out[l] = np.asarray(cents).reshape(H, g, int(centroids), d)
        if checkpoint is not None:
            tmp = Path(checkpoint).with_suffix(".tmp.npz")
            np.savez(tmp, fingerprint=fingerprint, codebooks=out[:l + 1], seconds=before + time.perf_counter() - t0)
            tmp.replace(checkpoint)  # a fit killed while saving keeps the previous checkpoint
        if callback is not None:
            callback(l)
    return out


def _fit_fingerprint(keys, g: int, c: int, iterations: int, batch: int, seed: int) -> str:
    """What a checkpoint must match to be resumed: the keys' bytes and the fit's settings."""
    digest = hashlib.sha256(np.ascontiguousarray(keys, np.float32).tobytes()).hexdigest()
    return f"{digest}:{np.shape(keys)}:g={g}:c={c}:iterations={iterations}:batch={batch}:seed={seed}"


def _resume(path: Path, fingerprint: str, out: np.ndarray) -> tuple[int, float]:
    """Copies the finished layers of the checkpoint at ``path`` into ``out``; returns how many (0 if there is none
    or it belongs to another fit) and the seconds they took."""
    if not path.exists():
        return 0, 0.0
    with np.load(path) as saved:
        if str(saved["fingerprint"]) != fingerprint:
            print(f"{path}: a checkpoint of other keys or settings; starting the fit again")
            return 0, 0.0
        done = saved["codebooks"].shape[0]
        out[:done] = saved["codebooks"]
        seconds = float(saved["seconds"])
    print(f"{path}: resuming after {done} finished layer(s) ({seconds:.0f} s)")
    return done, seconds


def collect_keys(model, rows, *, chunk_size: int = 1024, progress: bool = False, query_window: int = 0):
    """Post-RoPE keys ``[L, H_kv, n_total, D]`` float32 (numpy) of every layer over the token ``rows``.

    Each row is prefilled alone with the full cache (``model`` from ``kvjax.load``: ``graphdef``,
    ``params``, ``config``, ``dtype``); its keys are its slots of every layer's staging, concatenated
    over rows in order. With ``query_window > 0`` returns ``(keys, queries)``, ``queries
    [L, H_q, rows * query_window, D]`` the post-RoPE queries of each row's last ``query_window``
    tokens (per row in order), for attention-error checks.
    """
    from kvjax.cache import Cache, CacheSpec
    from kvjax.decoding import prefill_prompt
    from kvjax.methods.full import FullCache
    from kvjax.staging import Recording, init_staging

    method = FullCache()
    it = rows
    if progress:
        from tqdm import tqdm

        it = tqdm(rows, desc="collecting keys", unit="sample")
    keys, queries = [], []
    for row in it:
        tokens = np.asarray([row], np.int32)
        S = tokens.shape[1]
        if S < max(1, query_window):
            raise ValueError(f"a row of {S} tokens is shorter than query_window={query_window}")
        spec = CacheSpec.for_model(model.config, 1, S, 0, model.dtype)
        cache = Cache.create(init_staging(spec, Recording(window=query_window, block=method.block)), method, spec)
        _, cache = prefill_prompt(model.graphdef, model.params, tokens, cache, chunk_size=chunk_size)
        keys.append(np.stack([np.asarray(st.k[0, :, :S], np.float32) for st in cache.layers]))
        if query_window:
            queries.append(np.stack([np.asarray(st.q_window[0], np.float32).transpose(1, 0, 2) for st in cache.layers]))
    keys = np.concatenate(keys, axis=2)
    if query_window:
        return keys, np.concatenate(queries, axis=2)
    return keys


# ------------------------------------------------------------------------------------------- errors
def quantization_error(keys_per_layer, codebooks, *, queries=None, tau: float = 0.9, progress: str | None = None) -> dict:
    """How well ``codebooks[L, H_kv, g, c, D // g]`` represent keys ``[L, H_kv, n, D]``.

    Returns a dict of lists (JSON-ready):

    * ``relative_error`` ``[L]``: ``||k - Q(k)||^2 / ||k||^2`` summed over tokens, mean over heads;
      ``relative_error_per_head`` ``[L][H_kv]``; ``mean``: mean over layers;
    * ``centred_error`` ``[L]``: ``||k - Q(k)||^2 / ||k - mean(k)||^2`` (the head's mean key over the
      tokens), mean over heads: the share of the keys' variance lost. Keys with a large common
      offset (Qwen's k-bias) have a small ``relative_error`` that hides this; attention logits
      ``q . k`` only see the variation (the offset shifts every logit of a query equally);
    * ``unused_centroids`` ``[L]``: fraction of centroids (over heads and groups) no key is coded to;
    * with ``queries [L, H_q, m, D]``, the post-RoPE queries of the keys' last ``m`` positions (one
      sequence; query ``i`` sits at position ``n - m + i`` and sees keys ``0 .. n - m + i``):
      ``attention_tv`` ``[L]``, total-variation distance between the softmax over exact and over
      quantised keys (mean over query heads and queries), and ``top_p_mass`` ``[L]``, the exact
      attention mass of the top-``tau`` set chosen from quantised scores (HCAttention's selection;
      ``>= tau`` is perfect).

    ``progress`` (a label) shows a bar over layers: with thousands of centroids each layer's
    encoding takes seconds to minutes on a CPU.
    """
    keys = np.asarray(keys_per_layer, np.float32)
    cbs = np.asarray(codebooks, np.float32)
    L, H, n, D = keys.shape
    if cbs.shape[:2] != (L, H):
        raise ValueError(f"codebooks {cbs.shape} do not match keys {keys.shape}")
    c = cbs.shape[3]
    rel, rel_heads, centred, unused, tv, mass = [], [], [], [], [], []
    layers = range(L)
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc=progress, unit="layer")
    for l in layers:
        codes = encode_keys(jnp.asarray(keys[l][None]), jnp.asarray(cbs[l]))
        kq = np.asarray(decode_keys(codes, jnp.asarray(cbs[l])))[0]  # [H, n, D]
        k64 = keys[l].astype(np.float64)
        per_head = ((k64 - kq) ** 2).sum(axis=(1, 2)) / np.maximum((k64**2).sum(axis=(1, 2)), 1e-30)
        rel_heads.append(per_head.tolist())
        rel.append(float(per_head.mean()))
        var = ((k64 - k64.mean(axis=1, keepdims=True)) ** 2).sum(axis=(1, 2))
        centred.append(float((((k64 - kq) ** 2).sum(axis=(1, 2)) / np.maximum(var, 1e-30)).mean()))
        used = np.zeros((H, cbs.shape[2], c), bool)
        cs = np.asarray(codes[0]).astype(np.int64)  # [H, n, g]
        for h in range(H):
            for gi in range(cbs.shape[2]):
                used[h, gi, cs[h, :, gi]] = True
        unused.append(float(1.0 - used.mean()))
        if queries is not None:
            q = np.asarray(queries[l], np.float64)  # [Hq, m, D]
            Hq, m, _ = q.shape
            qg = q.reshape(H, Hq // H, m, D)
            pos = np.arange(n)[None, :] <= (n - m + np.arange(m))[:, None]  # [m, n]
            probs = []
            for kk in (k64, kq.astype(np.float64)):
                z = (qg @ kk[:, None].swapaxes(-1, -2)) * D**-0.5  # [H, G, m, n] (matmul: BLAS)
                z = np.where(pos, z, -np.inf)
                z = z - z.max(-1, keepdims=True)
                p = np.exp(z)
                probs.append(p / p.sum(-1, keepdims=True))
            tv.append(float(0.5 * np.abs(probs[0] - probs[1]).sum(-1).mean()))
            # Eq. 4 on the quantized keys' attention; the exact attention's mass of what it selects
            chosen = np.asarray(top_p_select(jnp.asarray(probs[1], jnp.float32), jnp.ones(probs[1].shape[:-1], jnp.float32),
                                             jnp.zeros((), jnp.float32), tau))
            mass.append(float((probs[0] * chosen).sum(-1).mean()))
    out = {"relative_error": rel, "relative_error_per_head": rel_heads, "mean": float(np.mean(rel)),
           "centred_error": centred, "centred_mean": float(np.mean(centred)), "unused_centroids": unused}
    if queries is not None:
        out.update(attention_tv=tv, top_p_mass=mass, tau=tau)
    return out


# ----------------------------------------------------------------------------------------- artifact
def hcattention_artifact(codebooks, model_id: str, *, samples: int, tokens: int, iterations: int, batch: int,
                         seed: int, relative_error=(), storage_dtype: str = "float16", **extra) -> Artifact:
    """The ``"hcattention"`` artifact: ``arrays={"codebooks": float32 [L, H_kv, g, c, D // g]}``.

    ``meta`` records groups, centroids, the calibration settings (``samples`` x ``tokens`` of
    stdlib docstrings, ``iterations``, ``batch``, ``seed``), the per-layer ``relative_error`` (rounded
    to 5 digits), ``storage_dtype`` (the dtype of the codebooks in an ``.npz`` file; loaded back as
    float32) and any ``extra`` keyword facts (frozen to tuples so ``meta`` stays hashable).
    """
    cbs = np.asarray(codebooks, np.float32)
    if cbs.ndim != 5:
        raise ValueError(f"codebooks must be [L, H_kv, g, c, D // g], got shape {cbs.shape}")
    L, H, g, c, d = cbs.shape
    code_dtype(c)

    def frozen(v):
        return frozen_meta(v, digits=5)

    meta = (("groups", g), ("centroids", c), ("head_dim", g * d), ("samples", int(samples)), ("tokens", int(tokens)),
            ("iterations", int(iterations)), ("batch", int(batch)), ("seed", int(seed)),
            ("calibration", "stdlib docstrings (kvjax.calibration.calibration_corpus)"),
            ("relative_error", frozen(list(relative_error))), ("storage_dtype", storage_dtype))
    meta += tuple((k, frozen(v)) for k, v in extra.items())
    return Artifact(arrays={"codebooks": cbs}, kind=KIND, model_id=model_id, meta=meta)


__all__ = ["KIND", "code_dtype", "codebook_variant", "kmeans_minibatch", "encode_keys", "decode_keys",
           "fit_codebooks", "collect_keys", "quantization_error", "hcattention_artifact"]
