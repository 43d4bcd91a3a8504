"""HeteroCache and SyncKV with a quantized ``kv_dtype``: the followers' host copy holds the quantized rows and their
scales, a recall writes both into the pools' slots, the decode output is attention over the dequantized pages (float64
reference), the bytes held and moved count the scales, and int8 generation compiles its decode loop once and stays
close to float32's log-probabilities on the tiny model, for every recall schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import AttendContext, new_cache
from kvjax.decoding import TRACE_COUNTS, compress, decode_loop, decode_loop_jit, decode_step, prefill
from kvjax.kv_quantization import QMAX, quantize
from kvjax.methods import HeteroCache, SyncKV
from kvjax.methods.recall.schedules import RECALL_SCHEDULES
from kvjax.methods.recall.scores import leader_query_logits
from kvjax.paged import build_paged
from tests.test_heterocache_synckv import L, hc_artifact, sk_artifact, tiny, tiny_pair  # noqa: F401 (fixtures)

ROOM = 8
FP8_RELATIVE = 2.0**-4  # e4m3: 3 mantissa bits
FP8_SUBNORMAL_STEP = 2.0**-9  # e4m3fn's smallest subnormal, in units of the scale


def method_and_artifact(which: str, model, schedule: str = "whole", every: int = 1):
    """A method that recalls every ``every`` steps (HeteroCache: drift forced at each window) and its artifact: layer 0
    head 0 leads layer 0 head 1 and layer 1 head 0 (tests/test_heterocache_synckv.py's artifacts). ``schedule``
    ``"pipelined-kernel"``: ``"pipelined"`` writing with the row-write kernel's GPU form, interpreted."""
    implementation = "pallas_interpret" if schedule.endswith("-kernel") else "auto"
    schedule = schedule.removesuffix("-kernel")
    if which == "heterocache":
        return (HeteroCache(budget=0.6, block=16, window=every, tau_drift=1.0, recall_schedule=schedule,
                            implementation=implementation), hc_artifact(model))
    return (SyncKV(budget=0.5, block=16, stride=every, num_representatives=1, static_ratio=0.5,
                   recall_schedule=schedule, implementation=implementation), sk_artifact(model))


def staged_then_compressed(model, method, tokens, artifact, kv_dtype):
    """``(float K, V of every layer's staging [B, Hkv, S, D] as numpy, the compressed cache)``."""
    cache = new_cache(method, model.config, tokens.shape[0], tokens.shape[1], ROOM, model.dtype, artifact=artifact,
                      kv_dtype=kv_dtype)
    _, cache = prefill(model.graphdef, model.params, jnp.asarray(tokens), cache)
    staged = [(np.asarray(st.k), np.asarray(st.v)) for st in cache.layers]  # before compress donates them
    return staged, compress(cache)


def pool_rows(paged, b: int, h: int, which: str = "k"):
    """``(rows [positions, D], scales [positions])`` head ``h`` of row ``b`` stores, in storage order."""
    pages = np.asarray(getattr(paged, f"{which}_pages"))[np.asarray(paged.block_table[b, h])]
    scales = np.asarray(getattr(paged, f"{which}_scales"))[np.asarray(paged.block_table[b, h])]
    return pages.reshape(-1, pages.shape[-1]), scales.reshape(-1)


def dequantized(rows, scales) -> np.ndarray:
    return rows.astype(np.float64) * scales.astype(np.float64)[:, None]


def ref_attention(q, k, v):
    """Softmax attention of ``q[G, D]`` over ``k, v[n, D]`` (numpy, float64)."""
    s = q.astype(np.float64) @ k.T / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def check_scheme(x, deq, scales, kv_dtype: str) -> None:
    """The dequantized rows are within the scheme's error of the float rows ``x`` (float64 numpy; scales absmax /
    qmax)."""
    x = x.astype(np.float64)
    np.testing.assert_allclose(scales, np.abs(x).max(-1) / QMAX[kv_dtype], rtol=1e-6)
    s = scales.astype(np.float64)[:, None]
    bound = s / 2 if kv_dtype == "int8" else FP8_RELATIVE * np.abs(x) + FP8_SUBNORMAL_STEP * s
    assert (np.abs(deq - x) <= bound * (1 + 1e-6) + 1e-30).all()


@pytest.mark.parametrize("which,kv_dtype,schedule", [
    ("heterocache", "int8", "whole"), ("heterocache", "float8_e4m3fn", "whole"), ("synckv", "int8", "spread"),
    ("synckv", "float8_e4m3fn", "pipelined-kernel")])
def test_forced_recall_writes_the_quantized_host_rows_and_scales(tiny, which, kv_dtype, schedule):
    """A recall every step, twice (``whole`` and ``spread``: the scatter per pool; ``pipelined-kernel``: the row-write
    kernel, rows then scales): the host copy holds the followers' prompt K/V quantized (as ``quantize`` of the
    staged float rows; within the scheme's error of them, numpy) with their scales, both in ``pinned_host``; each
    follower's region then holds exactly the host rows and scales of the tokens its ``held`` names; a third step's
    output is attention over the dequantized pages (float64 numpy reference)."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 97, size=(1, L + 3)).astype(np.int32)
    method, art = method_and_artifact(which, tiny, schedule)
    staged, cache = staged_then_compressed(tiny, method, tokens[:, :L], art, kv_dtype)
    initial = [np.asarray(st.held) for st in cache.layers]
    key = jax.random.PRNGKey(0)
    for t in range(L, L + 2):
        _, _, cache = decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, t]), cache, key)
    assert cache.stats()["recall_events"] > 0
    moved = False
    for layer, st in enumerate(cache.layers):
        if not st.plan.followers:
            continue
        host = st.host
        assert host.k.dtype == jnp.dtype(kv_dtype) and host.k_scales.dtype == jnp.float32
        assert {x.sharding.memory_kind for x in host.arrays()} == {"pinned_host"}
        for n, f in enumerate(st.plan.followers):
            i = host.heads.index((0, f.head))
            for which_kv, x in zip("kv", staged[layer]):
                rows, scales = np.asarray(getattr(host, which_kv))[i], np.asarray(getattr(host, f"{which_kv}_scales"))[i]
                q, s = quantize(jnp.asarray(x[0, f.head, :L]), kv_dtype)
                np.testing.assert_array_equal(rows[:L], np.asarray(q))
                np.testing.assert_array_equal(scales[:L], np.asarray(s))
                check_scheme(x[0, f.head, :L], dequantized(rows[:L], scales[:L]), scales[:L], kv_dtype)
                # the region's positions hold the host rows and scales of the slots ``held`` names
                start, count = int(st.region_start[0, n]), int(st.region_count[0, n])
                held = np.asarray(st.held)[0, n, :count]
                got_rows, got_scales = pool_rows(st.paged, 0, f.head, which_kv)
                np.testing.assert_array_equal(got_rows[start:start + count], rows[held])
                np.testing.assert_array_equal(got_scales[start:start + count], scales[held])
            moved |= not np.array_equal(np.asarray(st.held)[0, n], initial[layer][0, n])
    assert moved  # the recalls brought other tokens than the prefill's choice

    # one more step of layer 0 on its own: every head's output is attention over its dequantized pages
    st = cache.layers[0]
    D, Hq, Hkv = st.paged.k_pages.shape[-1], cache.spec.num_heads, cache.spec.num_kv_heads
    G = Hq // Hkv
    q, k, v = (jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in [(1, 1, Hq, D), (1, 1, Hkv, D),
                                                                                  (1, 1, Hkv, D)])
    ctx = AttendContext(start=cache.length, pad=cache.pad, positions=jnp.array([[L + 2]]), layers=cache.layers, layer=0)
    before = [[pool_rows(st.paged, 0, h, x) for x in "kv"] for h in range(Hkv)]
    lengths = np.asarray(st.paged.lengths)[0]
    out, after = method.decode_attend(st, q, k, v, ctx)
    for h in range(Hkv):
        n = int(lengths[h])
        (kr, ks), (vr, vs) = before[h]
        (kn, kns), (vn, vns) = (pool_rows(after.paged, 0, h, x) for x in "kv")  # the new token, quantized
        for new, new_s, x in ((kn[n], kns[n], k), (vn[n], vns[n], v)):
            want, want_s = quantize(x[0, 0, h], kv_dtype)
            np.testing.assert_array_equal(new, np.asarray(want))
            np.testing.assert_allclose(new_s, float(want_s), rtol=1e-6)  # in the decode program: within an ulp
        keys = np.concatenate([dequantized(kr[:n], ks[:n]), dequantized(kn[n:n + 1], kns[n:n + 1])])
        vals = np.concatenate([dequantized(vr[:n], vs[:n]), dequantized(vn[n:n + 1], vns[n:n + 1])])
        ref = ref_attention(np.asarray(q)[0, 0, h * G:(h + 1) * G], keys, vals)
        np.testing.assert_allclose(np.asarray(out)[0, 0, h * G:(h + 1) * G], ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("multiply_reduce", [False, True])
def test_leader_scores_read_dequantized_keys(kv_dtype, multiply_reduce):
    """The leaders' logits over a quantized pool are those over its dequantized keys (float64 numpy), for two queries
    (a question) and one (a decode step; the multiply-reduce of a GPU and the matmul of a CPU)."""
    rng = np.random.default_rng(9)
    B, H, S, D, G = 2, 2, 20, 16, 2
    k = rng.standard_normal((B, H, S, D)).astype(np.float32) * rng.uniform(0.1, 10, (B, H, S, 1)).astype(np.float32)
    lengths = jnp.asarray([[S, 13], [9, S]], jnp.int32)
    keep = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, H, S))
    paged = build_paged(jnp.asarray(k), jnp.asarray(k), keep, lengths, (S, S), 4, 8, kv_dtype=kv_dtype)
    assert paged.quantized
    heads = (1, 0)
    for T in (2, 1):
        qg = jnp.asarray(rng.standard_normal((B, T, len(heads), G, D)).astype(np.float32))
        got = np.asarray(leader_query_logits(paged, heads, qg, multiply_reduce=multiply_reduce and T == 1))
        for b in range(B):
            for n, h in enumerate(heads):
                m = int(lengths[b, h])
                keys = dequantized(*pool_rows(paged, b, h))[:m]
                want = np.asarray(qg, np.float64)[b, :, n] @ keys.T / np.sqrt(D)  # [T, G, m]
                np.testing.assert_allclose(got[b, n, :, :, :m], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["heterocache", "synckv"])
def test_bytes_count_the_stored_rows_and_their_scales(tiny, which):
    """Pools, host copy, bytes recalled, fetched per step and read per step: int8 rows and a float32 scale per token
    and KV head, counted by hand from the plan's capacities; the rest of the device state is the float32 cache's."""
    rng = np.random.default_rng(5)
    B, page_size = 2, 16
    tokens = rng.integers(0, 97, size=(B, L + 2)).astype(np.int32)
    stats = {}
    for kv_dtype in ("float32", "int8"):
        method, art = method_and_artifact(which, tiny)
        _, cache = staged_then_compressed(tiny, method, tokens[:, :L], art, kv_dtype)
        for t in range(L, L + 2):
            _, _, cache = decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, t]), cache,
                                      jax.random.PRNGKey(0))
        stats[kv_dtype] = s = cache.stats()
        D = cache.layers[0].paged.k_pages.shape[-1]
        row = D * 4 if kv_dtype == "float32" else D + 4  # one key (or value) and its scale
        pages = sum(B * sum(-(-(c + ROOM) // page_size) for c in st.plan.capacities) for st in cache.layers)
        assert s["page_pool_bytes"] == 2 * pages * page_size * row
        host_heads = sum(B * len(st.plan.followers) for st in cache.layers)  # one slot per follower, one device
        padded = -(-L // page_size) * page_size
        assert s["host_bytes"] == 2 * host_heads * padded * row
        assert s["rows_recalled"] > 0 and s["bytes_recalled"] == 2 * s["rows_recalled"] * row
        assert s["bytes_fetched_per_step"] == 2 * s["rows_fetched_per_step"] * row
        held = sum(int(np.asarray(st.paged.lengths).sum()) for st in cache.layers)
        leaders = sum(int(np.asarray(st.paged.lengths)[:, list(st.plan.leaders)].sum()) for st in cache.layers)
        assert s["kv_bytes_read_per_step"] == (2 * held + leaders) * row
    f32, i8 = stats["float32"], stats["int8"]
    assert i8["device_bytes"] - i8["page_pool_bytes"] == f32["device_bytes"] - f32["page_pool_bytes"]


GENERATION_CASES = [("heterocache", "whole"), ("synckv", "spread"), ("heterocache", "pipelined")]


def test_generation_cases_cover_every_schedule_and_method():
    assert {s for _, s in GENERATION_CASES} == set(RECALL_SCHEDULES)
    assert {w for w, _ in GENERATION_CASES} == {"heterocache", "synckv"}


@pytest.mark.parametrize("which,schedule", GENERATION_CASES)
def test_int8_generation_compiles_once_and_stays_close_to_float32(tiny, which, schedule):
    """int8 caches of every recall schedule (each once, both methods): the decode loop compiles once for two caches, holds no host callback,
    recalls, and the log-probabilities of a teacher-forced continuation stay within ``TOLERANCE`` of the float32
    cache's (module docstring of the tolerance below)."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 97, size=(2, L + 6)).astype(np.int32)
    method, art = method_and_artifact(which, tiny, schedule, every=2)
    before = TRACE_COUNTS["decode_loop"]
    for _ in range(2):
        _, cache = staged_then_compressed(tiny, method, tokens[:, :L], art, "int8")
        _, _, cache = decode_loop(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, L]), cache,
                                  jax.random.PRNGKey(0), max_new_tokens=6)
        assert cache.stats()["recall_events"] > 0
    assert TRACE_COUNTS["decode_loop"] - before == 1
    _, cache = staged_then_compressed(tiny, method, tokens[:, :L], art, "int8")
    text = decode_loop_jit.lower(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, L]), cache,
                                 jax.random.PRNGKey(0), max_new_tokens=6).as_text()
    assert "callback" not in text.lower()

    logprobs = {}
    for kv_dtype in ("float32", "int8"):
        _, cache = staged_then_compressed(tiny, method, tokens[:, :L], art, kv_dtype)
        steps = []
        for t in range(L, L + 6):
            _, logits, cache = decode_step(tiny.graphdef, tiny.params, jnp.asarray(tokens[:, t]), cache,
                                           jax.random.PRNGKey(0))
            steps.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)))
        logprobs[kv_dtype] = np.stack(steps)
    np.testing.assert_allclose(logprobs["int8"], logprobs["float32"], atol=TOLERANCE)


# int8 stores each key and value within half a step of its own scale (absmax / 127: 0.4 % of the token's range). On the
# tiny model (2 layers, D = 16, 6 teacher-forced steps; both methods under every schedule) that moved the
# log-probabilities by at most 0.0010 nats (jax 0.10.2, CPU); the tolerance is ten times that, so a cache whose recalled rows or scales
# were wrong is caught where it changes the outputs by more than the quantization does.
TOLERANCE = 0.01
