"""Cross-lowering: every Pallas kernel configuration the library uses lowers for ``cuda``
(Triton) and ``tpu`` (Mosaic) on a machine without an accelerator (nothing is compiled or run).

Each case exports ``jax.jit(op)`` with ``jax.export.export(..., platforms=[p])`` and then opens
the kernel inside the exported StableHLO:

* cuda / Triton: the ``__gpu$xla.gpu.triton`` custom call carries the Triton (``tt``) MLIR
  module as bytecode; it is parsed and verified, every ``tt.dot`` must have input precision
  IEEE (not TF32), and no single ``tt.load`` may produce more than ``_GPU_MAX_BLOCK_BYTES``
  (a proxy for shared memory).  Triton's own compiler (TTIR -> PTX, shared-memory allocation)
  runs only inside XLA's GPU backend and is not exercised here.  The only safety check
  disabled for the export is the one for that custom-call target (it has no compatibility
  guarantee).  Without a GPU, jax >= 0.11 lowers Triton kernels only for a named abstract
  device (an H100 here, see ``_target``); checked on CPU with jax 0.10.2 and 0.11.2.
* tpu / Mosaic: the ``tpu_custom_call`` carries the serialised Mosaic module; it is
  deserialised and verified, SMEM operands must fit the kernel's prefetch budget, and the paged
  kernel's matmuls must use fp32 contract precision.  Mosaic's layout passes and code
  generation run inside libtpu and are not exercised, so the TPU-only constraints (page size
  and ``block_s`` tiling, SMEM size) are validated by the kernels and tested below.

Opt-in (``KVJAX_TRITON_COMPILE=1`` with the ``triton`` package installed, checked with triton
3.9 and jax 0.10.2): ``test_triton_compiles_for_sm90`` also compiles every Triton module to PTX
for sm_90 and bounds its shared memory.
"""

import base64
import contextlib
import itertools
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir
from jax._src.lib import tpu as tpu_dialect
from jax._src.lib.triton import dialect as tt_dialect
from jaxlib.mlir import ir
from jaxlib.mlir.passmanager import PassManager

from kvjax.pallas_kernels import paged_attention as paged_mod
from kvjax.pallas_kernels.backend import TRITON_CUSTOM_CALL
from kvjax.pallas_kernels.paged_attention import paged_decode_attention
from kvjax.pallas_kernels.pq_attention import pq_scores

S = jax.ShapeDtypeStruct
PLATFORMS = ["cuda", "tpu"]
# (H_q, H_kv, D): Qwen2.5-0.5B, SmolLM2-135M, the tests' small GQA, Llama-3-8B.
HEADS = [(14, 2, 64), (9, 3, 64), (4, 2, 16), (32, 8, 128)]
DTYPES = [jnp.float32, jnp.bfloat16]


# ---------------------------------------------------------------------------------------------
# Export and open the kernels
# ---------------------------------------------------------------------------------------------


def _target(platform):
    """Context for lowering to ``platform``.  jax >= 0.11 reads the GPU model for Triton from
    the device (jax 0.10 falls back to sm_90): without a GPU, name an H100 as the abstract
    device of an abstract mesh."""
    if platform != "cuda" or jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                         platform="cuda")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("_",), abstract_device=device))


def export_for(fn, args, platform):
    """``jax.export`` of ``jax.jit(fn)(*args)`` for one platform (the Triton custom call allowed on cuda)."""
    checks = ([jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
              if platform == "cuda" else [])
    with _target(platform):
        return jax.export.export(jax.jit(fn), platforms=[platform],
                                 disabled_checks=checks)(*args)


def _ops(op, name):
    """The operations named ``name`` nested in ``op`` (MLIR's own walk: a Python recursion over the
    bindings takes tens of seconds on kernels of ~100k operations)."""
    found = []

    def visit(child):
        if child.name == name:
            found.append(child)
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    return found


_TENSOR = re.compile(r"tensor<((?:\d+x)+)(f32|bf16|f16|i64|i32|i16|i8|i1)>")
_BITS = {"f32": 32, "bf16": 16, "f16": 16, "i64": 64, "i32": 32, "i16": 16, "i8": 8, "i1": 8}
_SMEM = re.compile(r"memref<((?:\d+x)*)(i32|f32)(?:, [^>]*)?, #tpu\.memory_space<smem>>")


def _size(dims: str) -> int:
    n = 1
    for d in dims.strip("x").split("x"):
        if d:
            n *= int(d)
    return n


def _triton_kernel(call):
    """Parse and verify a Triton custom call's module: its dot precisions and largest load."""
    config = ir.DictAttr(call.attributes["mhlo.backend_config"])
    module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
    assert module.operation.verify()
    precisions = []
    for dot in _ops(module.operation, "tt.dot"):
        if "inputPrecision" in dot.attributes:
            precisions.append(ir.IntegerAttr(dot.attributes["inputPrecision"]).value)
        else:  # absent = the op's default, IEEE
            precisions.append(int(tt_dialect.InputPrecision.IEEE))
    load_bytes = [0]
    for load in _ops(module.operation, "tt.load"):
        m = _TENSOR.fullmatch(str(load.results[0].type))
        if m:
            load_bytes.append(_size(m.group(1)) * _BITS[m.group(2)] // 8)
    return dict(precisions=precisions, max_load_bytes=max(load_bytes), text=str(module))


def _mosaic_kernel(call):
    """Deserialise and verify a tpu_custom_call's Mosaic module: SMEM operand bytes of the
    kernel function and the precision of its matmuls."""
    config = json.loads(ir.StringAttr(call.attributes["backend_config"]).value)
    module = ir.Module.parse(base64.b64decode(config["custom_call_config"]["body"]))
    PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
    assert module.operation.verify()
    funcs = [f for f in _ops(module.operation, "func.func")
             if not ir.StringAttr(f.attributes["sym_name"]).value.startswith("transform_")]
    assert len(funcs) == 1, [str(f.attributes["sym_name"]) for f in funcs]
    inputs = ir.FunctionType(ir.TypeAttr(funcs[0].attributes["function_type"]).value).inputs
    smem = sum(_size(m.group(1)) * 4 for t in inputs if (m := _SMEM.fullmatch(str(t))))
    matmuls = [str(mm.attributes["precision"]) if "precision" in mm.attributes else None
               for mm in _ops(module.operation, "tpu.matmul")]
    return dict(smem_bytes=smem, matmul_precisions=matmuls, text=str(module))


def lower_kernels(fn, args, platform):
    """Export ``fn(*args)`` for ``platform`` and return one summary per Pallas kernel call."""
    return exported_kernels(export_for(fn, args, platform), platform)


def exported_kernels(exported, platform):
    """One summary per Pallas kernel call in an export for ``platform``."""
    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    tpu_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True  # Mosaic bytecode may name other dialects
    with ctx, ir.Location.unknown():
        module = ir.Module.parse(exported.mlir_module())
        calls = _ops(module.operation, "stablehlo.custom_call")
        targets = [ir.StringAttr(c.attributes["call_target_name"]).value for c in calls]
        if platform == "cuda":
            kernels = [_triton_kernel(c) for c, t in zip(calls, targets) if t == TRITON_CUSTOM_CALL]
        else:
            kernels = [_mosaic_kernel(c) for c, t in zip(calls, targets) if t == "tpu_custom_call"]
    assert kernels, f"no Pallas kernel in the {platform} lowering; custom calls: {targets}"
    return kernels


def _check(kernels, platform, *, f32_matmuls):
    ieee = int(tt_dialect.InputPrecision.IEEE)
    for k in kernels:
        if platform == "cuda":
            assert all(p == ieee for p in k["precisions"]), k["precisions"]  # never TF32
            assert k["max_load_bytes"] <= paged_mod._GPU_MAX_BLOCK_BYTES, k["max_load_bytes"]
        else:
            assert 0 < k["smem_bytes"] <= paged_mod._TPU_SMEM_PREFETCH_BYTES, k["smem_bytes"]
            if f32_matmuls:
                assert k["matmul_precisions"], "no tpu.matmul in the kernel"
                assert all(p and "fp32" in p for p in k["matmul_precisions"]), \
                    k["matmul_precisions"]


# ---------------------------------------------------------------------------------------------
# Paged decode attention
# ---------------------------------------------------------------------------------------------


def _paged_args(batch, heads, dtype, page_size, tokens):
    num_q_heads, num_kv_heads, head_dim = heads
    max_pages = tokens // page_size
    num_pages = batch * num_kv_heads * max_pages
    return (S((batch, num_q_heads, head_dim), dtype),
            S((num_pages, page_size, head_dim), dtype),
            S((num_pages, page_size, head_dim), dtype),
            S((batch, num_kv_heads, max_pages), jnp.int32),
            S((batch, num_kv_heads), jnp.int32))


def _paged(platform, **kw):
    backend = "gpu" if platform == "cuda" else "tpu"
    return lambda *a: paged_decode_attention(*a, implementation="pallas", backend=backend, **kw)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
def test_paged_lowers(heads, dtype, page_size, platform):
    """Default block / split choices, as kvjax.paged calls the op."""
    args = _paged_args(2, heads, dtype, page_size, tokens=2048)
    kernels = lower_kernels(_paged(platform), args, platform)
    _check(kernels, platform, f32_matmuls=True)
    if platform == "cuda":
        ieee = int(tt_dialect.InputPrecision.IEEE)
        assert len(kernels[0]["precisions"]) == 2 and set(kernels[0]["precisions"]) == {ieee}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_paged_lowers_with_quantized_pools(kv_dtype, page_size, platform):
    """int8 / fp8 pools with per-token f32 scales (``kv_dtype``): the GPU form gathers the quantized pages and their
    scales and dequantizes in the kernel (f32 matmuls, blocks sized for f32); the TPU form DMAs the quantized pages and
    their scale rows and dequantizes in the kernel (compiled for a v5e in ``tests/test_quantized_kernels.py``)."""
    q, k, v, table, lengths = _paged_args(2, (14, 2, 64), jnp.float32, page_size, tokens=2048)
    args = (q, S(k.shape, kv_dtype), S(v.shape, kv_dtype), table, lengths, S(k.shape[:2], jnp.float32),
            S(k.shape[:2], jnp.float32))
    backend = "gpu" if platform == "cuda" else "tpu"
    kernels = lower_kernels(lambda q, k, v, t, n, ks, vs: paged_decode_attention(
        q, k, v, t, n, k_scales=ks, v_scales=vs, implementation="pallas", backend=backend), args, platform)
    _check(kernels, platform, f32_matmuls=True)


def test_paged_tpu_splits_large_block_tables():
    """B=8, H_kv=8, 32K tokens in 16-token pages: 512 KiB of block table (with each head's length and start) is
    prefetched in several calls of at most the SMEM budget (one call would need all of it)."""
    args = _paged_args(8, (32, 8, 128), jnp.bfloat16, 16, tokens=32768)
    kernels = lower_kernels(_paged("tpu"), args, "tpu")
    assert len(kernels) == 5
    _check(kernels, "tpu", f32_matmuls=True)
    assert sum(k["smem_bytes"] for k in kernels) == 8 * 8 * (2048 + 2) * 4
    # the GPU form takes the block table as an ordinary (blocked) input
    _check(lower_kernels(_paged("cuda"), args, "cuda"), "cuda", f32_matmuls=True)


def test_paged_tpu_rejects_head_table_over_smem_budget():
    """40000 pages of one head cannot be prefetched by any split: clear error up front."""
    args = _paged_args(1, (4, 2, 64), jnp.float32, 16, tokens=16 * 40000)
    with pytest.raises(ValueError, match=r"exceeds the 131072-byte SMEM budget"):
        export_for(_paged("tpu"), args, "tpu")


@pytest.mark.parametrize("dtype,page_size,sublanes", [(jnp.float32, 4, 8), (jnp.float32, 12, 8),
                                                      (jnp.bfloat16, 8, 16)])
def test_paged_tpu_rejects_unaligned_page_size(dtype, page_size, sublanes):
    """Compiled TPU form: page_size must be a multiple of the sublane tiling of the K/V dtype."""
    args = _paged_args(1, (4, 2, 64), dtype, page_size, tokens=page_size * 8)
    with pytest.raises(ValueError, match=f"page_size to be a multiple of {sublanes} .*"
                                         f"got page_size={page_size}"):
        export_for(_paged("tpu"), args, "tpu")


def test_paged_gpu_rejects_block_over_shared_memory_budget():
    """GPU form: an explicit block over 32 KiB of K is an error; a single big page is split."""
    args = _paged_args(1, (4, 2, 128), jnp.float32, 16, tokens=1024)
    with pytest.raises(ValueError, match=r"16 \* 16 tokens exceeds 64.*pages_per_block <= 4"):
        export_for(_paged("cuda", pages_per_block=16), args, "cuda")
    # one page per block is always accepted: a 256-token f32 page is split into 64-token ones
    args = _paged_args(1, (4, 2, 128), jnp.float32, 256, tokens=1024)
    kernels = lower_kernels(_paged("cuda", pages_per_block=1), args, "cuda")
    assert "tensor<64x128xf32>" in kernels[0]["text"]
    _check(kernels, "cuda", f32_matmuls=True)


# ---------------------------------------------------------------------------------------------
# PQ scores
# ---------------------------------------------------------------------------------------------


def _pq_cases():
    for (num_q_heads, num_kv_heads, _), head_dim, centroids, dtype in itertools.product(
            HEADS, [64, 128], [256, 1024], DTYPES):
        for groups in sorted({head_dim // 2, head_dim // 4, 32, 16}):
            yield num_q_heads, num_kv_heads, head_dim, groups, centroids, dtype


PQ_CASES = list(_pq_cases())


def _pq_args(batch, num_q_heads, num_kv_heads, head_dim, groups, centroids, dtype, seq):
    code_dtype = jnp.uint8 if centroids <= 256 else jnp.uint16
    return (S((batch, num_q_heads, head_dim), dtype),
            S((num_kv_heads, groups, centroids, head_dim // groups), dtype),
            S((batch, num_kv_heads, seq, groups), code_dtype),
            S((batch, num_kv_heads), jnp.int32))


def _pq(platform, **kw):
    backend = "gpu" if platform == "cuda" else "tpu"
    return lambda *a: pq_scores(*a, implementation="pallas", backend=backend, return_stats=True,
                                **kw)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(
    "hq,hkv,d,g,c,dtype", PQ_CASES,
    ids=[f"{hq}x{hkv}_d{d}_g{g}_c{c}_{jnp.dtype(dt).name}" for hq, hkv, d, g, c, dt in PQ_CASES])
def test_pq_lowers(hq, hkv, d, g, c, dtype, platform):
    """Default block_s; an odd sequence length (1000) so the last tile is partial."""
    args = _pq_args(2, hq, hkv, d, g, c, dtype, seq=1000)
    kernels = lower_kernels(_pq(platform), args, platform)
    assert len(kernels) == 1
    _check(kernels, platform, f32_matmuls=False)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("new_tokens", [1, 48])
def test_pq_lowers_as_hcattention_calls_it(platform, new_tokens):
    """HCAttention's call: every query head of every new token (a decoded token, or a question of 48
    tokens prefilled onto the compressed cache) in one call, no lengths, no stats; the default model's
    shape (14 query heads, 2 KV heads, D = 64) at g = D/2 and D/4, c = 256."""
    backend = "gpu" if platform == "cuda" else "tpu"
    for groups in (32, 16):
        q, cb, codes, _ = _pq_args(1, 14 * new_tokens, 2, 64, groups, 256, jnp.float32, seq=4001)
        kernels = lower_kernels(lambda q, cb, codes: pq_scores(q, cb, codes, implementation="pallas", backend=backend),
                                (q, cb, codes), platform)
        assert len(kernels) == 1
        _check(kernels, platform, f32_matmuls=False)


def test_pq_tpu_rejects_block_s_not_multiple_of_128():
    """Compiled TPU form: block_s lies on the lane axis, so it must be a multiple of 128."""
    args = _pq_args(1, 4, 2, 64, 16, 256, jnp.float32, seq=1000)
    with pytest.raises(ValueError, match="block_s to be a multiple of 128.*got block_s=64"):
        export_for(_pq("tpu", block_s=64), args, "tpu")
    lower_kernels(_pq("tpu", block_s=256), args, "tpu")


# ---------------------------------------------------------------------------------------------
# Opt-in: Triton's own compiler on the lowered modules
# ---------------------------------------------------------------------------------------------

A100_MAX_SHARED_BYTES = 163 * 1024  # dynamic shared memory per block: sm_80 163 KiB, sm_90 227


@pytest.mark.skipif(os.environ.get("KVJAX_TRITON_COMPILE") != "1",
                    reason="set KVJAX_TRITON_COMPILE=1 (needs the triton package)")
def test_triton_compiles_for_sm90(tmp_path):
    """Every GPU-form configuration above compiles with Triton (TTIR -> PTX for sm_90) and
    needs at most A100's shared memory per program."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    cases = [(_paged("cuda"), _paged_args(2, h, dt, ps, tokens=2048))
             for h, dt, ps in itertools.product(HEADS, DTYPES, [16, 256])]
    cases += [(_pq("cuda"), _pq_args(2, hq, hkv, d, g, c, jnp.float32, seq=1000))
              for hq, hkv, d, g, c, dt in PQ_CASES if dt == jnp.float32]
    for i, (fn, args) in enumerate(cases):
        for j, kernel in enumerate(lower_kernels(fn, args, "cuda")):
            path = tmp_path / f"k{i}_{j}.ttir"
            path.write_text(kernel["text"])
            compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=4, num_stages=2))
            assert compiled.asm["ptx"]
            assert compiled.metadata.shared <= A100_MAX_SHARED_BYTES, (
                args, compiled.metadata.shared)


# ---------------------------------------------------------------------------------------------
# Whole decode loops: the kernels as the methods call them, next to pinned_host arrays
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["hcattention", "heterocache"])
def host_tier_decode(request):
    """``(name, model, first tokens, cache)``: a host-tier method's cache after the prefill of two 96-token
    rows, built on CPU (XLA path), for lowering its decode loop."""
    from kvjax.cache import CacheSpec
    from kvjax.decoding import compress, prefill_prompt
    from kvjax.methods import HCAttention, HeteroCache
    from tests.mesh_worker import CONFIG_D16, codebooks, recall_artifacts, tiny_model

    if request.param == "hcattention":
        model, method, artifact = tiny_model(), HCAttention(groups=4, centroids=8, tau=0.9), codebooks()
    else:  # the paged kernel's GPU form needs head_dim >= 16; recalls forced (tau_drift 1)
        model, artifact = tiny_model(CONFIG_D16), recall_artifacts(CONFIG_D16)[0]
        method = HeteroCache(budget=0.5, window=2, tau_drift=1.0, block=32)
    spec = CacheSpec.for_model(model.config, 2, 96, 8, model.dtype)
    cache = method.init_cache(spec, artifact)
    _, cache = prefill_prompt(model.graphdef, model.params, jnp.arange(2 * 96, dtype=jnp.int32).reshape(2, 96) % 120 + 1,
                              cache, chunk_size=32)
    cache = compress(cache)
    assert cache.stats()["host_bytes"] > 0
    return request.param, model, jnp.array([5, 7], jnp.int32), cache


@pytest.mark.parametrize("platform", PLATFORMS)
def test_decode_loop_with_host_tier_lowers(host_tier_decode, platform, monkeypatch):
    """The whole jitted decode loop of a host-tier method with ``implementation="auto"`` (what a GPU or
    TPU runs): HCAttention's PQ kernel with prompt values in ``pinned_host``, HeteroCache's paged
    kernel with satellites recalled from ``pinned_host``. Only the loop is lowered, with
    ``jax.default_backend()`` reporting the target so "auto" picks Pallas and the kernel's form as
    it would there; the host placement survives the lowering."""
    from kvjax.decoding import decode_loop_jit

    name, model, first, cache = host_tier_decode
    jax.clear_caches()  # the loop traced for another platform would be reused: the kernel form is chosen at trace time
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu" if platform == "cuda" else "tpu")
    loop = lambda params, tokens, cache: decode_loop_jit(model.graphdef, params, tokens, cache, jax.random.PRNGKey(0),
                                                         max_new_tokens=4)
    exported = export_for(loop, (model.params, first, cache), platform)
    _check(exported_kernels(exported, platform), platform, f32_matmuls=name == "heterocache")
    assert "pinned_host" in exported.mlir_module()
