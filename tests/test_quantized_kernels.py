"""The TPU and Mosaic GPU forms of the paged decode kernel over int8 / float8_e4m3fn pages: dequantized in the kernel.

* Interpreted on the CPU (``pltpu.InterpretParams``, which fills uninitialised VMEM with NaN; Mosaic GPU's
  interpreter): attention over quantized
  pages against a float64 numpy reference, random pools with ragged lengths (an empty head, partial pages, a start past
  0), a zero token (scale 0), an outlier token and NaN scales past a head's length.
* Compiled for a TPU v5e-8 slice with libtpu as a compiler only (``.aot-tpu/`` or ``KVJAX_AOT_TPU``, in a subprocess:
  ``python -m tests.test_quantized_kernels``): the kernel under ``shard_map`` lowers and compiles (Mosaic's layout
  passes and code generation included), its operands are the quantized pools and their scales, and the program holds
  no float copy of a pool, beside a control that dequantizes the pools before the kernel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.kv_quantization import quantize
from kvjax.pallas_kernels.paged_attention import paged_decode_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS32 = float(np.finfo(np.float32).eps)
# Bound on |x - dequantized x| per element, in terms of |x| and the token's scale s (kvjax.kv_quantization):
# int8 rounds to the nearest multiple of s; e4m3 keeps 3 mantissa bits (half an ulp: 2^-4 relative) and below its
# normal range rounds to a multiple of its smallest subnormal, 2^-9 s (error 2^-10 s).
ELEMENT_BOUND = {"int8": lambda x, s: np.broadcast_to(s / 2, np.shape(x)),
                 "float8_e4m3fn": lambda x, s: 2.0**-4 * np.abs(x) + 2.0**-10 * s}


def quantized_case(kv_dtype: str, seed: int = 0, *, batch=3, kv_heads=2, group=3, head_dim=32, page_size=8,
                   max_pages=6):
    """Random quantized pools in a shuffled block table with ragged lengths; returns the kernel's arguments and the
    unquantized K/V (float64)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([[0, 5], [17, 48], [31, 1]], np.int32)[:batch, :kv_heads]  # empty, partial, full, one token
    starts = np.zeros_like(lengths)
    starts[1, 0] = 3  # tokens 3..16 of that head
    num_pages = batch * kv_heads * max_pages + 3  # 3 pages no head uses
    table = rng.permutation(num_pages)[:batch * kv_heads * max_pages].reshape(batch, kv_heads, max_pages)
    shape = (num_pages, page_size, head_dim)
    # per-token ranges over orders of magnitude: what a per-token scale is for
    k = rng.normal(size=shape) * 10.0 ** rng.uniform(-2, 0.3, size=shape[:2] + (1,))
    v = rng.normal(size=shape) * 10.0 ** rng.uniform(-3, 1, size=shape[:2] + (1,))
    page, slot = table[1, 1, 2], 3  # a used token of head (1, 1): zeros in K and V (scale 0)
    k[page, slot] = 0.0
    v[page, slot] = 0.0
    k[table[1, 1, 0], 1, 4] = 40.0  # an outlier element: only its own token's scale grows
    kq, ks = quantize(jnp.asarray(k, jnp.float32), kv_dtype)
    vq, vs = quantize(jnp.asarray(v, jnp.float32), kv_dtype)
    ks, vs = np.array(ks), np.array(vs)
    # stale scales past a head's length (the rest of its last page): never read into the output
    for b in range(batch):
        for h in range(kv_heads):
            n = int(lengths[b, h])
            if n % page_size:
                last = table[b, h, n // page_size]
                ks[last, n % page_size:] = np.nan
                vs[last, n % page_size:] = np.nan
    q = rng.normal(size=(batch, kv_heads * group, head_dim)).astype(np.float32)
    args = dict(q=jnp.asarray(q), k_pages=kq, v_pages=vq, block_table=jnp.asarray(table, jnp.int32),
                lengths=jnp.asarray(lengths), starts=jnp.asarray(starts), k_scales=jnp.asarray(ks),
                v_scales=jnp.asarray(vs))
    return args, k.astype(np.float32).astype(np.float64), v.astype(np.float32).astype(np.float64)


def dequantized64(pages, scales) -> np.ndarray:
    """``pages * scales`` in float64 (the scheme's dequantization, exactly)."""
    return np.asarray(pages).astype(np.float64) * np.asarray(scales, np.float64)[..., None]


def attention64(q, k_pages, v_pages, table, lengths, starts):
    """Decode attention in float64 numpy over pools ``[num_pages, page_size, D]``: per (row, KV head) the tokens
    ``starts .. lengths - 1`` of its pages, softmax over them, zeros for a head with none."""
    q = np.asarray(q, np.float64)
    table, lengths, starts = (np.asarray(x) for x in (table, lengths, starts))
    batch, kv_heads, max_pages = table.shape
    group, head_dim = q.shape[1] // kv_heads, q.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(kv_heads):
            k = k_pages[table[b, h]].reshape(-1, head_dim)[starts[b, h]:lengths[b, h]]
            v = v_pages[table[b, h]].reshape(-1, head_dim)[starts[b, h]:lengths[b, h]]
            if not len(k):
                continue
            qg = q[b, h * group:(h + 1) * group]
            s = qg @ k.T * head_dim**-0.5
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[b, h * group:(h + 1) * group] = (p / p.sum(axis=1, keepdims=True)) @ v
    return out


def per_head(x, table, lengths, starts):
    """``x[num_pages, page_size, ...]`` gathered per (row, KV head) over its attended tokens."""
    return {(b, h): x[table[b, h]].reshape((-1,) + x.shape[2:])[starts[b, h]:lengths[b, h]]
            for b in range(table.shape[0]) for h in range(table.shape[1])}


# the TPU form; the Mosaic GPU form with 8-token pages in 64-token blocks and with 128-token pages read as 64-token
# sub-pages (under Mosaic GPU's interpreter, which skips the register-layout casts the compiled form makes)
FORMS = [("tpu", {}), ("mosaic_gpu", {}), ("mosaic_gpu", dict(page_size=128, max_pages=3))]


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("backend, case", FORMS, ids=["tpu", "mosaic_gpu", "mosaic_gpu-subpages"])
def test_kernel_forms_dequantize_quantized_pages_in_the_kernel(kv_dtype, backend, case):
    """The TPU and Mosaic GPU forms over quantized pages against float64 attention on the same dequantized K/V.

    Tolerance: the kernel computes the same function in float32 (key scales applied to the logits, value scales to the
    softmax weights), so per (row, KV head) a logit is off by at most ``(D + 2) eps32 |q| max_t |k_t|`` (dot products
    of D terms, then the two scalings) and the output by at most ``(2 e_logit + (T + 4) eps32) max_t |v_t|_inf`` (the
    weights' relative error, the sums over T tokens), with a factor 4 of slack. On a GPU the Mosaic GPU form runs
    compiled (``scripts/gpu_checks.sh kernels``)."""
    if backend == "mosaic_gpu" and jax.default_backend() == "tpu":
        pytest.skip("the Mosaic GPU form on a TPU")
    implementation = "pallas" if backend == "mosaic_gpu" and jax.default_backend() == "gpu" else "pallas_interpret"
    args, _, _ = quantized_case(kv_dtype, **case)
    got = np.asarray(paged_decode_attention(**args, implementation=implementation, backend=backend), np.float64)
    assert np.isfinite(got).all()
    k_hat = dequantized64(args["k_pages"], np.nan_to_num(args["k_scales"]))
    v_hat = dequantized64(args["v_pages"], np.nan_to_num(args["v_scales"]))
    table, lengths, starts = (np.asarray(args[n]) for n in ("block_table", "lengths", "starts"))
    ref = attention64(args["q"], k_hat, v_hat, table, lengths, starts)
    D = k_hat.shape[-1]
    group = got.shape[1] // table.shape[1]
    ks, vs = per_head(k_hat, table, lengths, starts), per_head(v_hat, table, lengths, starts)
    q = np.asarray(args["q"], np.float64)
    for (b, h), k in ks.items():
        rows = slice(h * group, (h + 1) * group)
        if not len(k):
            assert (got[b, rows] == 0).all()  # an empty head: zeros
            continue
        logit = (D + 2) * EPS32 * np.linalg.norm(q[b, rows], axis=1).max() * np.linalg.norm(k, axis=1).max() * D**-0.5
        tol = 4 * (2 * logit + (len(k) + 4) * EPS32) * np.abs(vs[b, h]).max()
        np.testing.assert_allclose(got[b, rows], ref[b, rows], rtol=0, atol=tol, err_msg=f"head {(b, h)}")


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_tpu_form_is_within_the_schemes_bound_of_unquantized_attention(kv_dtype):
    """Against float64 attention on the unquantized K/V, within the bound the scheme gives.

    With ``|k - k^| <= b(k)`` and ``|v - v^| <= b(v)`` per element (int8: ``s / 2``; e4m3: ``2^-4 |x| + 2^-10 s``),
    every logit moves by at most ``d = D^-0.5 sum_d |q_d| b(k_td)``, so the softmax weights move by at most
    ``e^(2 max_t d) - 1`` in L1 and each output element by at most ``max_t b(v_td) + (e^(2 max_t d) - 1) max_t |v^_t|``
    (plus float32 rounding, ``1e-5`` relative here)."""
    args, k, v = quantized_case(kv_dtype, seed=1)
    got = np.asarray(paged_decode_attention(**args, implementation="pallas_interpret", backend="tpu"), np.float64)
    table, lengths, starts = (np.asarray(args[n]) for n in ("block_table", "lengths", "starts"))
    ref = attention64(args["q"], k, v, table, lengths, starts)
    D = k.shape[-1]
    group = got.shape[1] // table.shape[1]
    bound = ELEMENT_BOUND[kv_dtype]
    ks_ = np.nan_to_num(np.asarray(args["k_scales"], np.float64))[..., None]
    vs_ = np.nan_to_num(np.asarray(args["v_scales"], np.float64))[..., None]
    bk = per_head(bound(k, ks_), table, lengths, starts)
    bv = per_head(bound(v, vs_), table, lengths, starts)
    v_hat = per_head(dequantized64(args["v_pages"], np.nan_to_num(args["v_scales"])), table, lengths, starts)
    q = np.abs(np.asarray(args["q"], np.float64))
    for (b, h), ek in bk.items():
        if not len(ek):
            continue
        rows = slice(h * group, (h + 1) * group)
        d = (q[b, rows] @ ek.T * D**-0.5).max(axis=1, keepdims=True)  # [G, 1]
        tol = bv[b, h].max(axis=0) + np.expm1(2 * d) * np.abs(v_hat[b, h]).max() + 1e-5 * np.abs(ref[b, rows]).max()
        err = np.abs(got[b, rows] - ref[b, rows])
        assert (err <= tol).all(), (b, h, float((err / tol).max()))
    if kv_dtype == "int8":  # the bound is not vacuous: the int8 output is close
        assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_quantized_tpu_form_page_size_and_scales_errors():
    """Compiled, a quantized pool's block is converted to float32 before the [tokens, D] reshape, so its page size
    must be a multiple of 8 (float32 sublanes), not of int8's 32; scales must come in pairs, float32, one per token."""
    args, _, _ = quantized_case("int8")
    args["k_pages"], args["v_pages"] = (jnp.zeros((7, 12, 32), jnp.int8),) * 2
    args["k_scales"], args["v_scales"] = (jnp.zeros((7, 12), jnp.float32),) * 2
    args["block_table"] = jnp.zeros(args["block_table"].shape, jnp.int32)
    args["lengths"] = args["starts"] = jnp.zeros(args["lengths"].shape, jnp.int32)
    with pytest.raises(ValueError, match="multiple of 8 for int8 K/V"):
        jax.eval_shape(lambda a: paged_decode_attention(**a, implementation="pallas", backend="tpu"), args)
    with pytest.raises(ValueError, match="give both k_scales and v_scales"):
        paged_decode_attention(**dict(args, v_scales=None), implementation="pallas_interpret", backend="tpu")
    with pytest.raises(ValueError, match="k_scales must be float32"):
        paged_decode_attention(**dict(args, k_scales=args["k_scales"][:, :4]), implementation="pallas_interpret",
                               backend="tpu")


# ----------------------------------------------------------------------------------------------- compiled for a TPU

COMPILE_CASES = [("int8", 16), ("int8", 32), ("float8_e4m3fn", 16)]
TOKENS = 65536  # per (row, KV head): pools of 8 MiB (int8, D = 128) per device, too large to sit in VMEM


def compile_case(kv_dtype: str, page_size: int, dequantize_first: bool = False) -> dict:
    """Compile (libtpu, v5e:2x4) one decode attention of a quantized paged layer under ``shard_map`` on a (2, 4) mesh;
    ``dequantize_first``: the control, the pools dequantized to bfloat16 before the kernel. Returns the kernel's
    operand types, the float arrays of a local pool's shape anywhere in the program, and its memory."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding

    from kvjax.evals.hlo import custom_call_operands
    from kvjax.kv_quantization import dequantize
    from kvjax.paged import PagedKV, sharded_paged_attention
    from kvjax.sharding import AXES, BY_DEVICE, ROWS_HEADS

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices
    mesh = Mesh(np.array(devices).reshape(2, 4), AXES)
    batch, kv_heads, group, head_dim = 2, 4, 4, 128
    max_pages = TOKENS // page_size
    num_pages = batch * kv_heads * max_pages
    S = jax.ShapeDtypeStruct

    def sharded(shape, dtype, spec):
        return S(shape, dtype, sharding=NamedSharding(mesh, spec))

    pool = sharded((num_pages, page_size, head_dim), kv_dtype, BY_DEVICE)
    scales = sharded((num_pages, page_size), jnp.float32, BY_DEVICE)
    q = sharded((batch, kv_heads * group, head_dim), jnp.bfloat16, ROWS_HEADS)
    table = sharded((batch, kv_heads, max_pages), jnp.int32, ROWS_HEADS)
    lengths = sharded((batch, kv_heads), jnp.int32, ROWS_HEADS)

    def step(q, k, v, table, lengths, ks, vs):
        if dequantize_first:
            k, v, ks, vs = dequantize(k, ks, q.dtype), dequantize(v, vs, q.dtype), None, None
        state = PagedKV(k, v, table, lengths, ks, vs, page_size=page_size, capacities=(TOKENS,) * kv_heads)
        return sharded_paged_attention(q, state, table, lengths, mesh, "pallas")

    real = jax.default_backend
    jax.default_backend = lambda: "tpu"  # trace the kernels' TPU forms
    try:
        lowered = jax.jit(step).lower(q, pool, pool, table, lengths, scales, scales)
    finally:
        jax.default_backend = real
    compiled = lowered.compile()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    local = f"{num_pages // mesh.size},{page_size},{head_dim}"
    floats = sorted(set(re.findall(rf"\b((?:f32|bf16|f16)\[{local}\])", text)))
    return {"kernel_operands": custom_call_operands(text, "tpu_custom_call"), "float_pools": floats,
            "local_pool": f"[{local}]", "argument_bytes": int(mem.argument_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes), "bytes_accessed": float(cost["bytes accessed"]),
            "pool_bytes": num_pages * page_size * head_dim // mesh.size}


def _libtpu_dir() -> str:
    path = os.environ.get("KVJAX_AOT_TPU") or os.path.join(ROOT, ".aot-tpu")
    if not os.path.isdir(os.path.join(path, "libtpu")):
        if os.environ.get("KVJAX_AOT_TPU"):
            pytest.fail(f"KVJAX_AOT_TPU={path} holds no libtpu (scripts/setup_env.sh installs it)")
        pytest.skip("libtpu is not in .aot-tpu/ (scripts/setup_env.sh installs it)")
    return path


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_libtpu_dir(), ROOT]), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.test_quantized_kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kv_dtype,page_size", COMPILE_CASES)
def test_quantized_kernel_compiles_for_v5e_under_shard_map(compiled, kv_dtype, page_size):
    """On each of the 8 chips the Mosaic kernel takes that chip's quantized pools (1 byte per element) and float32
    scales as they are stored: no float copy of a pool anywhere in the program, and the arguments are the quantized
    pools' bytes, not a float pool's. The control (pools dequantized before the kernel) shows the copy the check
    would see."""
    case = compiled[f"{kv_dtype}/{page_size}"]
    local = case["local_pool"]
    name = {"int8": "s8", "float8_e4m3fn": "f8e4m3fn"}[kv_dtype]
    assert len(case["kernel_operands"]) == 1
    operands = case["kernel_operands"][0]
    assert operands.count(f"{name}{local}") == 2, operands  # K and V pools, quantized
    assert operands.count(f"f32{local[:local.rindex(',')]}]") == 2, operands  # their scales [pages, page_size]
    assert case["float_pools"] == [], case["float_pools"]
    pools = 2 * case["pool_bytes"]
    assert pools <= case["argument_bytes"] < pools * 1.25 + 2**20  # the quantized pools and their 4-byte scales
    assert case["temp_bytes"] < case["pool_bytes"]
    # XLA's count of the bytes moved outside the kernel (it does not count the kernel's own DMAs from HBM): less than
    # one pool, nothing touches the pools but the kernel
    assert case["bytes_accessed"] < case["pool_bytes"]
    control = compiled[f"control/{kv_dtype}/{page_size}"]
    assert f"bf16{local}" in control["float_pools"]
    assert control["kernel_operands"][0].count(f"bf16{local}") == 2
    # the control reads the quantized pools and writes bfloat16 copies for the kernel (XLA keeps them in VMEM here, so
    # temp_bytes does not see them): at least the pools' bytes plus twice as many
    assert control["bytes_accessed"] >= 3 * pools


def main() -> None:
    out = {}
    for kv_dtype, page_size in COMPILE_CASES:
        out[f"{kv_dtype}/{page_size}"] = compile_case(kv_dtype, page_size)
        out[f"control/{kv_dtype}/{page_size}"] = compile_case(kv_dtype, page_size, dequantize_first=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
