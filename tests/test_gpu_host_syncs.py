"""Data-dependent conditionals in the decode loop as lowered for a GPU or TPU (nothing is compiled or run).

XLA:GPU runs a ``conditional`` whose branch is chosen at run time as a ``ConditionalThunk``: it copies the
predicate to the host and waits for the stream (``xla/backends/gpu/runtime/conditional_thunk.cc``), so each one
in a decode step is a host synchronisation per step. No method's decode loop may have one: the full cache's, the
static methods', and HeteroCache's and SyncKV's under every recall schedule. XLA:CPU's decode attention keeps one per
layer on purpose (:func:`kvjax.attention.dense_causal_attention`: it avoids copies of the cache there);
``lax.platform_dependent`` keeps it out of the GPU and TPU lowerings.

Also here: what the recall's host-offloaded gathers wait for. A gather whose indices come from the same step's
attention cannot start before that attention is done; ``recall_schedule="pipelined"`` exists so that they come
from the loop carry instead.
"""

import jax
import pytest
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jaxlib.mlir import ir

from kvjax.cache import CacheSpec
from kvjax.decoding import compress, decode_loop_jit, prefill_prompt
from kvjax.methods import FullCache, HeteroCache, SnapKV, SyncKV
from kvjax.methods.recall import RECALL_SCHEDULES
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


def host_gathers_after_compute(text: str) -> list:
    """For each host-offloaded call (``_xla_compute_type = "host"``) directly in a loop body of a module, whether its
    operands depend on the same iteration's compute: a ``dot_general`` or ``custom_call`` (a kernel), or an op
    or callee containing one, reached backwards from the operands before a loop-carried value."""
    with mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        funcs = {ir.StringAttr(op.operation.attributes["sym_name"]).value: op.operation
                 for op in module.body.operations if op.operation.name == "func.func"}
        callees = {}

        def computes(op) -> bool:
            if op.name in ("stablehlo.dot_general", "stablehlo.custom_call"):
                return True
            if op.name == "func.call":
                name = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                if name not in callees:
                    callees[name] = computes(funcs[name])
                return callees[name]
            return any(computes(inner.operation) for r in op.regions for b in r.blocks for inner in b.operations)

        def on_host(op) -> bool:
            attrs = op.attributes
            return (op.name == "func.call" and "mhlo.frontend_attributes" in attrs
                    and '_xla_compute_type = "host"' in str(attrs["mhlo.frontend_attributes"]))

        def depends(op) -> bool:
            seen, stack = set(), list(op.operands)
            while stack:
                owner = stack.pop().owner
                if isinstance(owner, ir.Block):  # a loop-carried value
                    continue
                owner = owner.operation
                if owner in seen:
                    continue
                seen.add(owner)
                if computes(owner):
                    return True
                stack.extend(owner.operands)
            return False

        found = []

        def visit(op):
            if op.name == "stablehlo.while":
                found.extend(depends(inner.operation) for inner in op.regions[1].blocks[0].operations
                             if on_host(inner.operation))
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        return found


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


@pytest.mark.parametrize("schedule", RECALL_SCHEDULES)
def test_recall_decode_has_no_host_syncs(monkeypatch, schedule):
    """HeteroCache's drift check and SyncKV's anticipation run every step with their decision predicated, and every
    recall schedule's transfer has a fixed size: no conditional in either decode loop (2 layers, each with leaders and
    followers), re-anchoring on or off. SyncKV's re-anchoring is the method's default."""
    hetero, sync = recall_artifacts(CONFIG_D16)
    for method, artifact in ((HeteroCache(budget=0.5, block=32, window=2, recall_schedule=schedule), hetero),
                             (HeteroCache(budget=0.5, block=32, reanchor=True, recall_schedule=schedule), hetero),
                             (SyncKV(budget=0.5, num_representatives=3, block=32, recall_schedule=schedule), sync)):
        text = lowered_decode_loop(method, "cuda", monkeypatch, artifact, CONFIG_D16)
        assert dynamic_conditionals(text) == 0, method


def test_pipelined_recall_gathers_only_what_the_loop_carries(monkeypatch):
    """``recall_schedule="pipelined"``: HeteroCache's and SyncKV's per-step host gather (one for every layer with
    followers, outside any conditional) takes its indices from the loop carry, so on a GPU it can start when the
    step starts. With ``"spread"`` the gathers (one per layer) depend on the same step's attention (the leader's
    choice), which the check sees: it can fail."""
    hetero, sync = recall_artifacts(CONFIG_D16)

    def gathers(schedule):
        out = []
        for method, artifact in ((HeteroCache(budget=0.5, block=32, recall_schedule=schedule), hetero),
                                 (SyncKV(budget=0.5, num_representatives=3, block=32, recall_schedule=schedule), sync)):
            out.append(host_gathers_after_compute(lowered_decode_loop(method, "cuda", monkeypatch, artifact, CONFIG_D16)))
        return out

    assert gathers("pipelined") == [[False]] * 2
    assert gathers("spread") == [[True] * CONFIG_D16.num_layers] * 2
