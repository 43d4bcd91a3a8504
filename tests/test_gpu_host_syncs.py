"""Data-dependent conditionals in the decode loop as lowered for a GPU or TPU (nothing is compiled or run).

XLA:GPU runs a ``conditional`` whose branch is chosen at run time as a ``ConditionalThunk``: it copies the
predicate to the host and waits for the stream (``xla/backends/gpu/runtime/conditional_thunk.cc``), so each one
in a decode step is a host synchronisation per step. The full cache's and the static methods' decode loops must
have none. XLA:CPU's decode attention keeps one per layer on purpose (:func:`kvjax.attention.dense_causal_attention`:
it avoids copies of the cache there); ``lax.platform_dependent`` keeps it out of the GPU and TPU lowerings.
HeteroCache and SyncKV have them by design today (:mod:`kvjax.head_recall`, "Timing"): counted, not forbidden.
"""

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jaxlib.mlir import ir

from kvjax.cache import CacheSpec
from kvjax.generate import compress, decode_loop_jit, prefill_prompt
from kvjax.methods import FullCache, SnapKV, SyncKV
from tests.mesh_worker import CONFIG, CONFIG_D16, recall_artifacts, tiny_model
from tests.test_kernel_lowering import export_for

PROMPT, NEW = 64, 3


def dynamic_conditionals(text: str) -> int:
    """``stablehlo.case`` ops of a module whose branch index is not a constant (a constant index, or one chosen
    by another constant-index case, is what ``platform_dependent`` leaves for one platform: XLA folds it)."""
    def static(value) -> bool:
        owner = value.owner
        name = getattr(owner, "name", None)  # a block argument's owner is a Block
        if name == "stablehlo.constant":
            return True
        return name == "stablehlo.case" and static(owner.operands[0])

    found = []

    def visit(op):
        if op.name == "stablehlo.case":
            found.append(op)
        return ir.WalkResult.ADVANCE

    with mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        module.operation.walk(visit)
        return sum(not static(op.operands[0]) for op in found)


def lowered_decode_loop(method, platform, monkeypatch, artifact=None, config=CONFIG) -> str:
    """StableHLO of ``method``'s jitted decode loop (one row, after a chunked prefill on CPU) for ``platform``."""
    model = tiny_model(config)
    spec = CacheSpec.for_model(model.config, 1, PROMPT, NEW + 1, model.dtype)
    cache = method.init_cache(spec, artifact)
    prompt = (jnp.arange(PROMPT, dtype=jnp.int32) % 120 + 1)[None]
    _, cache = prefill_prompt(model.graphdef, model.params, prompt, cache, chunk_size=32)
    cache = compress(cache)
    jax.clear_caches()  # "auto" picks the kernel's form at trace time: trace again for this platform
    backend = {"cuda": "gpu", "tpu": "tpu", "cpu": "cpu"}[platform]
    monkeypatch.setattr(jax, "default_backend", lambda: backend)

    def loop(params, tokens, cache):
        return decode_loop_jit(model.graphdef, params, tokens, cache, jax.random.PRNGKey(0), max_new_tokens=NEW)

    return export_for(loop, (model.params, jnp.array([5], jnp.int32), cache), platform).mlir_module()


def test_full_cache_decode_has_no_host_syncs(monkeypatch):
    """The full cache's decode loop (dense attention, batch 1) has no data-dependent conditional on a GPU. (A TPU
    runs conditionals on the device; its lowering takes the same branch.)"""
    assert dynamic_conditionals(lowered_decode_loop(FullCache(), "cuda", monkeypatch)) == 0


def test_cpu_lowering_keeps_the_copy_avoiding_conditional(monkeypatch):
    """On CPU the same loop has one such conditional per layer (the copy-avoiding form), so the count above can
    fail: it sees conditionals where they are."""
    assert dynamic_conditionals(lowered_decode_loop(FullCache(), "cpu", monkeypatch)) == CONFIG.num_layers


def test_static_method_decode_has_no_host_syncs(monkeypatch):
    """SnapKV's decode (the paged kernel) has none on a GPU."""
    text = lowered_decode_loop(SnapKV(budget=0.5, block=32), "cuda", monkeypatch, config=CONFIG_D16)
    assert dynamic_conditionals(text) == 0


def test_synckv_decode_conditionals_are_counted(monkeypatch):
    """SyncKV's anticipation, re-anchoring check and recall are per-layer conditionals today (a known cost on a
    GPU, see :mod:`kvjax.head_recall`): 3 per layer of the tiny model (2 layers, each with an R-head and
    followers); the spread schedule has no recall conditional (2 per layer), nor have the ahead and pipelined
    schedules (their rows written one or two calls later); without anticipation there are none."""
    artifact = recall_artifacts(CONFIG_D16)[1]

    def count(**kw):
        method = SyncKV(budget=0.5, num_representatives=3, block=32, **kw)
        return dynamic_conditionals(lowered_decode_loop(method, "cuda", monkeypatch, artifact, CONFIG_D16))

    assert count() == 3 * CONFIG_D16.num_layers
    assert count(recall_schedule="spread") == 2 * CONFIG_D16.num_layers
    assert count(recall_schedule="ahead") == 2 * CONFIG_D16.num_layers
    assert count(recall_schedule="pipelined") == 2 * CONFIG_D16.num_layers
    assert count(anticipation=False) == 0

