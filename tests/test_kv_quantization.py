"""Quantized page pools (``kv_dtype``): the per-token scheme against a float64 reference, attention over quantized pages
within the scheme's error bound, unchanged tokens at the model's dtype, device bytes with scales, errors."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.api import generate_tokens
from kvjax.cache import CacheSpec
from kvjax.cli import main as cli_main
from kvjax.kv_quantization import QMAX, dequantize, quantize
from kvjax.methods import H2O, ChunkedEviction, FullCache, HCAttention, KVzip, Locret, SnapKV
from kvjax.methods.kvzip import ReconstructionPrompt
from kvjax.paged import PagedKV, append, build_paged, paged_attention, paged_chunk_attention
from tests.test_methods_e2e import EVERY, NAMES

RECONSTRUCTION = ReconstructionPrompt(prefix=3, first=(11, 12, 13, 14, 15), later=(21, 22, 23), suffix=(31, 32))
FP8_RELATIVE = 2.0**-4  # e4m3: 3 mantissa bits, half a unit in the last place
FP8_SUBNORMAL_STEP = 2.0**-9  # e4m3fn's smallest subnormal, in units of the scale


def rows_with_edges(seed: int = 0, D: int = 16) -> np.ndarray:
    """Random rows plus a zero row, constant rows and a row with one outlier."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(12, D)).astype(np.float32)
    x[0] = 0.0
    x[1] = 3.5
    x[2] = -0.25
    x[3, 5] = 1e4  # an outlier: only its own token's scale grows
    x[4] *= 1e-6  # a tiny-range token keeps its own relative precision
    return x


def reference(x: np.ndarray, kv_dtype: str):
    """(dequantized values, scales) of the scheme in float64 numpy."""
    x = x.astype(np.float64)
    s = np.abs(x).max(axis=-1) / QMAX[kv_dtype]
    y = x / np.where(s > 0, s, 1.0)[:, None]
    if kv_dtype == "int8":
        q = np.clip(np.round(y), -127, 127)
    else:
        q = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return q * s[:, None], s


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_quantize_matches_float64_reference(kv_dtype):
    x = rows_with_edges()
    q, s = quantize(jnp.asarray(x), kv_dtype)
    assert q.dtype == jnp.dtype(kv_dtype) and s.dtype == jnp.float32 and s.shape == (x.shape[0],)
    got = np.asarray(dequantize(q, s, jnp.float32), np.float64)
    ref, ref_s = reference(x, kv_dtype)
    np.testing.assert_allclose(np.asarray(s), ref_s, rtol=1e-6)
    assert (np.abs(got - ref) <= 1e-6 * (np.abs(ref) + ref_s[:, None])).all()
    assert not np.isnan(got).any() and (got[0] == 0).all() and float(s[0]) == 0.0  # a zero row: zeros, no NaN
    np.testing.assert_allclose(got[1:3], x[1:3], rtol=1e-6)  # a constant row is its own absmax: exact
    err = np.abs(got - x)
    bound = (ref_s[:, None] / 2 if kv_dtype == "int8"
             else FP8_RELATIVE * np.abs(x) + FP8_SUBNORMAL_STEP * ref_s[:, None])
    assert (err <= bound * (1 + 1e-5) + 1e-12).all()
    # per-token scales: the outlier's row alone is coarse, the tiny-range row keeps its relative precision
    assert err[4].max() <= np.abs(x[4]).max() * (0.5 / 127 * 1.01 if kv_dtype == "int8" else 0.07)


def test_bfloat16_is_a_cast():
    x = jnp.asarray(rows_with_edges())
    q, s = quantize(x, "bfloat16")
    assert s is None and q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dequantize(q, s, jnp.float32)), np.asarray(x.astype(jnp.bfloat16), np.float32))


def random_pages(kv_dtype, seed=0, B=2, Hkv=2, S=24, D=16, page_size=8, room=6):
    """A paged layer of random keys/values (ragged lengths, per-head capacities), then 3 appended tokens."""
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.normal(size=(B, Hkv, S, D)).astype(np.float32) * rng.uniform(0.1, 10, size=(B, Hkv, S, 1)))
    v = jnp.asarray(rng.normal(size=(B, Hkv, S, D)).astype(np.float32))
    idx = jnp.asarray(np.stack([np.stack([np.sort(rng.permutation(S)[:20]) for _ in range(Hkv)]) for _ in range(B)]),
                      jnp.int32)
    lengths = jnp.asarray([[20, 12], [7, 17]], jnp.int32)
    paged = build_paged(k, v, idx, lengths, (20, 17), room, page_size, kv_dtype=kv_dtype)
    new = jnp.asarray(rng.normal(size=(2, B, 3, Hkv, D)).astype(np.float32))
    return append(paged, new[0], new[1])


def dequantized_layer(paged: PagedKV) -> PagedKV:
    """The same layer with float pools holding the dequantized values."""
    return paged.replace(k_pages=dequantize(paged.k_pages, paged.k_scales, jnp.float32),
                         v_pages=dequantize(paged.v_pages, paged.v_scales, jnp.float32), k_scales=None, v_scales=None)


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_attention_over_int8_pages(implementation):
    """Attention over int8 pages equals attention over their dequantized float pages, and stays within the scheme's
    bound of attention over the unquantized pages.

    Bound: per element ``|k - deq(k)| <= s_k / 2`` (int8), so a logit moves by at most
    ``delta = ||q||_1 * max s_k / 2 / sqrt(D)``; the softmax weights then move by at most ``e^(2 delta) - 1`` in L1
    norm, and an output element by at most ``(e^(2 delta) - 1) * max |deq(v)| + max s_v / 2``.
    """
    q8, f32 = random_pages("int8"), random_pages(None)
    assert q8.k_pages.dtype == jnp.int8 and q8.k_scales.shape == q8.k_pages.shape[:2] and f32.k_scales is None
    B, Hkv, _ = q8.block_table.shape
    D = q8.k_pages.shape[-1]
    q = jnp.asarray(np.random.default_rng(1).normal(size=(B, 2 * Hkv, D)).astype(np.float32))
    got = np.asarray(paged_attention(q, q8, implementation=implementation))
    np.testing.assert_allclose(got, np.asarray(paged_attention(q, dequantized_layer(q8), implementation="xla")),
                               atol=2e-6, rtol=1e-5)
    exact = np.asarray(paged_attention(q, f32, implementation="xla"))
    delta = float(jnp.abs(q).sum(-1).max()) * float(q8.k_scales.max()) / 2 / np.sqrt(D)
    v_max = float(jnp.abs(dequantized_layer(q8).v_pages).max())
    bound = (np.exp(2 * delta) - 1) * v_max + float(q8.v_scales.max()) / 2
    assert np.abs(got - exact).max() <= bound
    assert np.abs(got - exact).max() > 0  # the comparison above is not vacuous
    # a multi-token call (question prefill) reads the same dequantized pages
    qt = jnp.asarray(np.random.default_rng(2).normal(size=(B, 3, 2 * Hkv, D)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(paged_chunk_attention(qt, q8)),
                               np.asarray(paged_chunk_attention(qt, dequantized_layer(q8))), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("backend, kw", [("gpu", {}), ("gpu", dict(pages_per_block=2, num_splits=2)), ("tpu", {})],
                         ids=["gpu", "gpu-blocks", "tpu"])
def test_kernel_forms_read_quantized_pools(kv_dtype, backend, kw):
    """The kernel with quantized pools and their scales (the GPU form dequantizes each block it reads, the TPU form
    gets the pools dequantized before the call) equals the reference over the dequantized float pools."""
    from kvjax.pallas_kernels import paged_decode_attention

    paged = random_pages(kv_dtype)
    B, Hkv, _ = paged.block_table.shape
    q = jnp.asarray(np.random.default_rng(1).normal(size=(B, 2 * Hkv, 16)).astype(np.float32))
    got = paged_decode_attention(q, paged.k_pages, paged.v_pages, paged.block_table, paged.lengths,
                                 k_scales=paged.k_scales, v_scales=paged.v_scales, implementation="pallas_interpret",
                                 backend=backend, **kw)
    ref = dequantized_layer(paged)
    want = paged_decode_attention(q, ref.k_pages, ref.v_pages, ref.block_table, ref.lengths, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="k_pages dtype int8 not supported"):
        paged_decode_attention(q, *(x.astype(jnp.int8) for x in (ref.k_pages, ref.v_pages)), ref.block_table,
                               ref.lengths, implementation="xla")
    with pytest.raises(ValueError, match="k_scales must be float32"):
        paged_decode_attention(q, paged.k_pages, paged.v_pages, paged.block_table, paged.lengths,
                               k_scales=paged.k_scales[:1], v_scales=paged.v_scales, implementation="xla")


def test_bfloat16_pages_are_read_as_stored():
    """A bfloat16 pool under a float32 query goes to the kernel as stored (no scales); kernel and XLA agree up to
    bfloat16 rounding (the GPU form multiplies in the pools' dtype, the XLA path in float32)."""
    bf16 = random_pages("bfloat16")
    assert bf16.k_pages.dtype == jnp.bfloat16 and bf16.k_scales is None
    q = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4, 16)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(paged_attention(q, bf16, implementation="pallas_interpret")),
                               np.asarray(paged_attention(q, bf16, implementation="xla")), atol=2e-2, rtol=2e-2)


def test_append_quantizes_like_build():
    """Appended tokens get their own per-token scales: the pool equals quantizing each stored vector."""
    q8, f32 = random_pages("int8"), random_pages(None)
    k, s = quantize(f32.k_pages, "int8")
    np.testing.assert_array_equal(np.asarray(q8.k_pages), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(q8.k_scales), np.asarray(s))


@pytest.fixture(scope="module")
def tiny(tiny_llama3):
    return tiny_llama3


@pytest.mark.parametrize("make", EVERY, ids=NAMES)
def test_model_kv_dtype_at_budget_one_equals_full_cache(tiny, make):
    """``kv_dtype`` = the model's dtype changes nothing: budget 1.0 still generates the full cache's tokens on a
    left-padded ragged batch with and without chunk padding (the rows of ``test_methods_e2e``'s budget-1.0 test)."""
    rng = np.random.default_rng(11)
    rows = [list(rng.integers(0, 97, size=40)), list(rng.integers(0, 97, size=20))]
    full, _, _, _ = generate_tokens(tiny, rows, method=FullCache(block=16), max_new_tokens=6, kv_dtype="float32")
    for chunk in (None, 32):
        got, _, _, _ = generate_tokens(tiny, rows, method=make(1.0), max_new_tokens=6, chunk_size=chunk,
                                       kv_dtype=tiny.dtype)
        np.testing.assert_array_equal(got, full, err_msg=f"chunk_size={chunk}")


@pytest.mark.parametrize("kv_dtype, itemsize, scale_bytes", [("float32", 4, 0), ("bfloat16", 2, 0), ("int8", 1, 4),
                                                             ("float8_e4m3fn", 1, 4)])
def test_device_bytes_count_stored_dtype_and_scales(tiny, kv_dtype, itemsize, scale_bytes):
    """SnapKV(0.5) on a 48-token prompt, 6 new tokens: 24 kept + 6 room per head -> 4 pages of 8 = 32 slots per
    (row, KV head, layer); each slot stores D values of K and of V in ``kv_dtype`` and, quantized, one f32 scale each."""
    cfg = tiny.config
    rows = [list(np.random.default_rng(3).integers(0, 97, size=48))]
    _, _, cache, _ = generate_tokens(tiny, rows, method=SnapKV(budget=0.5, window=4, block=16, page_size=8),
                                     max_new_tokens=6, kv_dtype=kv_dtype)
    slots = cfg.num_layers * cfg.num_kv_heads * 32
    pools = slots * 2 * (cfg.head_dim * itemsize + scale_bytes)
    tables = cfg.num_layers * cfg.num_kv_heads * (4 + 1) * 4  # block table (4 pages) and lengths, int32
    stats = cache.stats()
    assert stats["page_pool_bytes"] == pools
    assert stats["device_bytes"] == pools + tables + 4 + 4  # + the slot counter and the row's padding
    assert all(st.k_pages.dtype == jnp.dtype(kv_dtype) for st in cache.layers)


@pytest.mark.parametrize("make", [lambda: SnapKV(budget=0.5, window=4, block=16),
                                  lambda: ChunkedEviction(budget=24, chunk=16, local=4, window=4),
                                  lambda: KVzip(budget=0.5, chunk=32, block=16)],
                         ids=["snapkv", "chunked_eviction", "kvzip"])
def test_quantized_cache_generates(tiny, make):
    """An int8 / fp8 cache (evict-after-prefill, bounded prefill, KVzip's reconstruction) runs prefill, a question
    and decoding."""
    rng = np.random.default_rng(4)
    rows = [list(rng.integers(0, 97, size=40)), list(rng.integers(0, 97, size=28))]
    question = [list(rng.integers(0, 97, size=3)) for _ in rows]
    for kv_dtype in ("int8", "float8_e4m3fn"):
        got, count, cache, _ = generate_tokens(tiny, rows, method=make(), max_new_tokens=4, question_rows=question,
                                               kv_dtype=kv_dtype, reconstruction=RECONSTRUCTION)
        assert got.shape == (2, 4) and (np.asarray(count) == 4).all()
        assert cache.layers[0].k_pages.dtype == jnp.dtype(kv_dtype) and cache.layers[0].k_scales is not None
        assert int(cache.layers[0].lengths.max()) == cache.layers[0].capacities[0] + 3 + 3  # kept, question, 3 fed back


def spec(kv_dtype, dtype="float32"):
    return CacheSpec(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, batch=1, prompt_slots=40, longest_row=40,
                     room=4, dtype=dtype, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype, dtype", [("int4", "float32"), ("float16", "float32"), ("float32", "bfloat16"),
                                             ("fp8", "float32")])
def test_bad_kv_dtype(kv_dtype, dtype):
    with pytest.raises(ValueError, match=f"kv_dtype='{kv_dtype}' is not supported; allowed: {dtype}, "):
        spec(kv_dtype, dtype)
    assert spec(None, dtype).kv_dtype == dtype and spec("bfloat16", dtype).kv_dtype == "bfloat16"


def test_bad_kv_dtype_on_the_command_line(capsys):
    assert cli_main(["generate", "--prompt", "hi", "--kv-dtype", "int4"]) == 2  # before any model loads
    assert "kv_dtype='int4' is not supported; allowed: float32, bfloat16, int8, float8_e4m3fn" in capsys.readouterr().err


@pytest.mark.parametrize("method", [
    H2O(budget=16, evict_during_decode=True), Locret(budget=16, evict_during_decode=True),
], ids=lambda m: m.name)
@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_methods_without_page_pools_reject_another_kv_dtype(method, kv_dtype):
    with pytest.raises(ValueError, match=f"kv_dtype={kv_dtype} is not supported by {method.name}"):
        method.init_cache(spec(kv_dtype))


MESH_SCRIPT = """
import json
import numpy as np
from kvjax.api import generate_tokens
from kvjax.methods import Quest, SnapKV
from kvjax.models.sharding import shard_model
from tests.mesh_worker import CONFIG_D16, tiny_model

base = tiny_model(CONFIG_D16)
rng = np.random.default_rng(0)
rows = [list(rng.integers(1, 128, size=n)) for n in (40, 33, 28, 40)]
out = {}
for mesh in ("one device", "data=2,model=2"):
    model = base if mesh == "one device" else shard_model(base, mesh)
    for impl in ("xla", "pallas_interpret"):
        for method in (SnapKV(budget=0.5, window=4, block=16, implementation=impl),
                       Quest(budget=16, page_size=8, implementation=impl)):  # 2 of each head's 4-6 pages read
            tokens, _, cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=4, chunk_size=16,
                                                  kv_dtype="int8")
            st = cache.layers[0]
            paged = st.paged if method.name == "quest" else st
            out[f"{method.name} {mesh} {impl}"] = {
                "tokens": np.asarray(tokens).tolist(), "bytes": cache.stats()["device_bytes"],
                "scale_shards": [list(s.data.shape) for s in paged.k_scales.addressable_shards],
                "pool_shards": [list(s.data.shape) for s in paged.k_pages.addressable_shards]}
print(json.dumps(out))
"""


def test_quantized_pools_split_over_a_mesh():
    """On a (data=2, model=2) mesh of 4 simulated CPU devices the scales are split by page like the pools, and the
    int8 cache generates the one-device tokens (XLA, and the Pallas kernel per device under ``shard_map``): SnapKV's
    pools, and Quest's pages read through its page selection."""
    import itertools
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
               JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for name, impl in itertools.product(("snapkv", "quest"), ("xla", "pallas_interpret")):
        one, split = out[f"{name} one device {impl}"], out[f"{name} data=2,model=2 {impl}"]
        assert split["tokens"] == one["tokens"], (name, impl)
        assert split["bytes"] == one["bytes"]
        assert len(split["scale_shards"]) == 4 and len(split["pool_shards"]) == 4
        pages = one["pool_shards"][0][0]
        assert [s[0] for s in split["scale_shards"]] == [pages // 4] * 4  # by page, one block per device
        assert [s[0] for s in split["pool_shards"]] == [pages // 4] * 4
