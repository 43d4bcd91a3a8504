"""Runs in its own process with simulated CPU devices (``tests/test_mesh.py`` starts it): generations of a
tiny 8-KV-head model on several meshes, printed as one JSON object on the last line of stdout.

``python -m tests.mesh_worker DEVICES PART`` (XLA_FLAGS must already ask for DEVICES host devices): part 0
runs the one-device reference (the model unsharded), the (2, 4) mesh and the bad inputs; part 1 the (1, 8) mesh
and the kernel checks (the test runs both parts at once, one per core). The data-only mesh (8, 1) is in the kernel
checks; generating on it too added a fourth full run of every method for a layout (2, 4) and (1, 8) bracket.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.api import generate_tokens
from kvjax.artifacts import Artifact, model_identity
from kvjax.decoding import TRACE_COUNTS
from kvjax.methods import (H2O, HBW, ChunkedEviction, FullCache, HCAttention, HeteroCache, Locret, PyramidKV, Quest,
                           SnapKV, StreamingLLM, SyncKV)
from kvjax.retaining_heads import random_heads_artifact
from kvjax.sharding import shard_shapes
from kvjax.models import LoadedModel
from kvjax.models.config import ModelConfig
from kvjax.models.llama import random_model
from kvjax.models.sharding import shard_model

CONFIG = ModelConfig(architecture="qwen2", vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2,
                     num_heads=16, num_kv_heads=8, head_dim=8, attention_bias=True, max_position_embeddings=512,
                     name="tiny-mesh")
CONFIG_D16 = dataclasses.replace(CONFIG, head_dim=16, name="tiny-mesh-d16")  # the paged kernel's GPU form needs D >= 16
ONE_DEVICE = "one device"  # the unsharded model: the reference every mesh must reproduce
MESHES = (ONE_DEVICE, "data=2,model=4", "data=1,model=8")
PARTS = (MESHES[:2], MESHES[2:])
LENGTHS = (100, 124, 93, 120, 124, 110, 105, 124)  # ragged: rows are left-padded
NEW_TOKENS = 6
CHUNK = 32  # chunked prefill for every method (prompt padded to a multiple: chunk padding)


def tiny_model(config: ModelConfig = CONFIG) -> LoadedModel:
    """Random weights scaled up so attention is peaked and greedy tokens vary; random q/k/v biases."""
    graphdef, params = nnx.split(random_model(config, seed=1))
    keys = iter(jax.random.split(jax.random.PRNGKey(7), 1000))
    params = jax.tree_util.tree_map(
        lambda x: x * 50 if x.ndim == 2 else x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), params)
    return LoadedModel(config, graphdef, params, None, "random", jnp.float32)


def recall_artifacts(config: ModelConfig = CONFIG):
    """Hand-built HeteroCache and SyncKV artifacts for the 2 x 8 KV heads: followers spread unevenly over the
    head blocks of every mesh (some blocks have none), leaders on other devices and in the other layer."""
    model_id = model_identity(config)
    roles = (("pivot", "satellite", "anchor", "volatile", "satellite", "pivot", "satellite", "anchor"),
             ("satellite", "anchor", "satellite", "pivot", "anchor", "satellite", "volatile", "anchor"))
    none = (-1, -1)
    pivot_of = ((none, (0, 0), none, none, (0, 0), none, (0, 5), none),
                ((0, 0), none, (1, 3), none, none, (0, 5), none, none))
    stability = ((0.9, 0.3, 0.7, 0.2, 0.5, 0.8, 0.4, 0.6), (0.35, 0.75, 0.45, 0.85, 0.55, 0.25, 0.1, 0.65))
    hetero = Artifact(arrays={}, kind="heterocache", model_id=model_id,
                      meta=(("roles", roles), ("pivot_of", pivot_of), ("stability", stability), ("group_layers", 2)))
    sk_roles = tuple(tuple("R" if r == "pivot" else "NR" for r in row) for row in roles)
    lead = ((none, (0, 0), (0, 0), (0, 5), (0, 0), none, (0, 5), (0, 5)),
            ((0, 0), (1, 3), (1, 3), none, (0, 5), (0, 5), (1, 3), (0, 0)))
    sync = Artifact(arrays={}, kind="synckv", model_id=model_id,
                    meta=(("clusters", ((3, sk_roles, lead),)), ("group_layers", 2)))
    return hetero, sync


def codebooks() -> Artifact:
    """Random HCAttention codebooks for the tiny model: 4 groups of 2 dims, 8 centroids (fitting is tested elsewhere)."""
    shape = (CONFIG.num_layers, CONFIG.num_kv_heads, 4, 8, CONFIG.head_dim // 4)
    cb = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    return Artifact(arrays={"codebooks": jnp.asarray(cb)}, kind="hcattention", model_id=model_identity(CONFIG),
                    meta=(("groups", 4), ("centroids", 8)))


def methods():
    """Every method, sized for 100-token prompts."""
    heads = random_heads_artifact(model_identity(CONFIG), CONFIG.num_layers, CONFIG.num_heads, CONFIG.num_kv_heads,
                                  CONFIG.head_dim, 16, 0)
    hetero, sync = recall_artifacts()
    return {
        "full": (FullCache(block=32), None),
        "snapkv": (SnapKV(budget=40, window=8), None),
        "pyramidkv": (PyramidKV(budget=40, window=8), None),
        "streaming_llm": (StreamingLLM(budget=40), None),
        "h2o": (H2O(budget=40, evict_during_decode=True), None),
        "hbw": (HBW(budget=48, window=8), None),
        "quest": (Quest(budget=32, page_size=8, dense_layers=1), None),
        "locret": (Locret(budget=48, chunk=CHUNK, local=8, stabilizers=4), heads),
        "chunked_eviction": (ChunkedEviction(budget=48, chunk=CHUNK, local=8, window=8), None),
        "hcattention": (HCAttention(groups=0, tau=0.9), None),  # exact keys
        "hcattention_pq": (HCAttention(groups=4, centroids=8, tau=0.9), codebooks()),  # PQ codes, XLA scoring
        # drift forced at every check (tau_drift 1), anticipation every 2 steps: recalls happen on every mesh
        "heterocache": (HeteroCache(budget=0.5, window=2, tau_drift=1.0, block=32), hetero),
        "synckv": (SyncKV(budget=0.5, stride=2, num_representatives=3, block=32), sync),
        # a fixed number of moves per step, gathered and written in the layer's call
        "synckv_spread": (SyncKV(budget=0.5, stride=2, num_representatives=3, block=32, recall_schedule="spread"), sync),
        # the same moves gathered one call after they are chosen, written the call after
        "synckv_pipelined": (SyncKV(budget=0.5, stride=2, num_representatives=3, block=32, recall_schedule="pipelined"),
                             sync),
    }


def kernel_errors() -> dict:
    """Max |error| of the Pallas paged kernel (interpreted) run per device under ``shard_map`` on each mesh,
    against the XLA reference on one device, with equal and with different per-head capacities (device blocks padded)."""
    from jax.sharding import PartitionSpec as P

    from kvjax.paged import build_paged, paged_attention, paged_partition
    from kvjax.sharding import make_mesh, named

    B, H, Hq, S, D = 8, 8, 16, 40, 16  # D >= 16: interpreting on CPU runs the GPU (Triton) form
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.normal(size=(B, H, S, D)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, Hq, D)), jnp.float32)
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, H, S))
    errors = {}
    for mesh_text, caps in [("data=2,model=4", (S,) * H), ("data=8,model=1", (S,) * H), ("data=1,model=8", (S,) * H),
                            ("data=4,model=1", (40, 24, 40, 8, 16, 40, 32, 40)),
                            ("data=2,model=4", (40, 24, 40, 8, 16, 40, 32, 40))]:
        lengths = jnp.minimum(jnp.asarray(rng.integers(1, S, size=(B, H)), jnp.int32), jnp.asarray(caps)[None])
        reference = paged_attention(q, build_paged(k, v, idx, lengths, caps, 3, 8), implementation="xla")
        mesh = make_mesh(mesh_text)
        state = build_paged(k, v, idx, lengths, caps, 3, 8, mesh)
        shardings = jax.tree_util.tree_map(lambda p: named(mesh, p), paged_partition(state),
                                           is_leaf=lambda x: isinstance(x, P))
        state, q_mesh = jax.device_put(state, shardings), jax.device_put(q, named(mesh, P("data", "model")))
        out = jax.jit(lambda q, s, m=mesh: paged_attention(q, s, implementation="pallas_interpret", mesh=m))(q_mesh, state)
        errors[mesh_text + (" unequal capacities" if len(set(caps)) > 1 else "")] = float(jnp.abs(out - reference).max())
    return errors


def pq_kernel_errors() -> dict:
    """Max |error| of the Pallas PQ kernel (interpreted) run per device under ``shard_map`` (as HCAttention calls it)
    against the numpy sum of table lookups ``sum_g q_g . C[g, P[j, g]]`` on one device."""
    from kvjax.methods.hcattention import kernel_scores
    from kvjax.sharding import make_mesh

    B, H, G, S, g, c, D = 8, 8, 2, 40, 4, 8, 8
    rng = np.random.default_rng(3)
    q = rng.normal(size=(B, H * G, D)).astype(np.float32)
    cb = rng.normal(size=(H, g, c, D // g)).astype(np.float32)
    codes = rng.integers(0, c, size=(B, H, S, g)).astype(np.uint8)
    keys = np.stack([np.concatenate([cb[h, gi, codes[:, h, :, gi]] for gi in range(g)], -1) for h in range(H)], 1)
    reference = np.einsum("bhgd,bhsd->bhgs", q.reshape(B, H, G, D), keys).reshape(B, H * G, S) * D**-0.5
    errors = {}
    for mesh_text in ("data=2,model=4", "data=1,model=8"):
        mesh = make_mesh(mesh_text)
        out = jax.jit(lambda q, cb, p, m=mesh: kernel_scores(q, cb, p, "pallas_interpret", m))(q, cb, codes)
        errors[mesh_text] = float(np.abs(np.asarray(out) - reference).max())
    return errors


def leader_score_errors() -> dict:
    """Max |error| of the recall leaders' scores of one query through the paged-scores kernel (its TPU form
    interpreted) per device under ``shard_map`` on each mesh, against the XLA scores on one device; leaders on
    several devices (not head 0), unequal capacities."""
    from jax.sharding import PartitionSpec as P

    from kvjax.methods.recall.scores import leader_probs
    from kvjax.paged import build_paged, paged_partition
    from kvjax.sharding import make_mesh, named

    B, H, G, S, D, leaders = 8, 8, 2, 40, 16, (6, 1, 3)
    caps = (40, 24, 40, 8, 16, 40, 32, 40)
    rng = np.random.default_rng(7)
    k = jnp.asarray(rng.normal(size=(B, H, S, D)), jnp.float32)
    qg = jnp.asarray(rng.normal(size=(B, 1, len(leaders), G, D)), jnp.float32)
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, H, S))
    lengths = jnp.minimum(jnp.asarray(rng.integers(1, S, size=(B, H)), jnp.int32), jnp.asarray(caps)[None])
    reference = leader_probs(build_paged(k, k, idx, lengths, caps, 3, 8), leaders, qg, 3, "max")
    errors = {}
    for mesh_text in ("data=2,model=4", "data=1,model=8", "data=8,model=1"):
        mesh = make_mesh(mesh_text)
        state = build_paged(k, k, idx, lengths, caps, 3, 8, mesh)
        shardings = jax.tree_util.tree_map(lambda p: named(mesh, p), paged_partition(state),
                                           is_leaf=lambda x: isinstance(x, P))
        out = jax.jit(lambda s, q, m=mesh: leader_probs(s, leaders, q, 3, "max", implementation="pallas_interpret",
                                                        mesh=m))(jax.device_put(state, shardings), qg)
        same_inf = bool((jnp.isinf(out) == jnp.isinf(reference)).all())
        errors[mesh_text] = float(jnp.abs(jnp.where(jnp.isinf(reference), 0, out - reference)).max()) if same_inf \
            else float("inf")
    return errors


def contiguous_kernel_errors() -> dict:
    """Max |error| of the full cache's one-token attention through the paged kernel (interpreted; the contiguous cache
    read as pages, left padding skipped) per device under ``shard_map`` on each mesh, against numpy dense attention
    over each row's slots ``pad .. length - 1`` on one device."""
    from jax.sharding import PartitionSpec as P

    from kvjax.attention import KERNEL_PAGE, contiguous_decode_attention
    from kvjax.sharding import make_mesh, named

    B, H, Hq, S, D = 8, 8, 16, 2 * KERNEL_PAGE, 16
    rng = np.random.default_rng(5)
    k, v = (rng.normal(size=(B, H, S, D)).astype(np.float32) for _ in range(2))
    q = rng.normal(size=(B, Hq, D)).astype(np.float32)
    pad, length = rng.integers(0, 70, size=B).astype(np.int32), 100
    want = np.zeros((B, Hq, D))
    for b in range(B):
        for hq in range(Hq):
            h = hq // (Hq // H)
            s = k[b, h, pad[b]:length] @ q[b, hq] * D**-0.5
            p = np.exp(s - s.max())
            want[b, hq] = p @ v[b, h, pad[b]:length] / p.sum()
    errors = {}
    for mesh_text in ("data=2,model=4", "data=1,model=8", "data=8,model=1"):
        mesh = make_mesh(mesh_text)
        kv = named(mesh, P("data", "model"))
        out = jax.jit(lambda q, k, v, pad, m=mesh: contiguous_decode_attention(
            q, k, v, length=jnp.int32(length), pad=pad, implementation="pallas_interpret", mesh=m))(
            jax.device_put(q, kv), jax.device_put(k, kv), jax.device_put(v, kv),
            jax.device_put(pad, named(mesh, P("data"))))
        errors[mesh_text] = float(np.abs(np.asarray(out) - want).max())
    return errors


def layout(cache) -> dict:
    """Per-device shard shapes of the first layer's arrays and of the cache's padding."""
    leaves = jax.tree_util.tree_leaves_with_path(cache.layers[0])
    out = {jax.tree_util.keystr(path): [list(s) for s in shard_shapes(x)] for path, x in leaves}
    out["pad"] = [list(s) for s in shard_shapes(cache.pad)]
    out["memory_kinds"] = sorted({x.sharding.memory_kind or "device" for _, x in leaves})
    return out


def run_meshes(result: dict, base, rows, other_rows, meshes) -> None:
    """Generate with every method on each of ``meshes`` (``ONE_DEVICE``: the unsharded model); tokens, layouts,
    weight shards, compilations into ``result``."""
    for mesh in meshes:
        model = base if mesh == ONE_DEVICE else shard_model(base, mesh)
        qkv = model.params["layers"][0]["self_attn"]["qkv_proj"]["weight"]
        down = model.params["layers"][0]["mlp"]["down_proj"]["weight"]
        result["params"][mesh] = {"qkv_proj": [list(s) for s in shard_shapes(qkv[...])],
                                  "down_proj": [list(s) for s in shard_shapes(down[...])]}
        result["meshes"][mesh] = {}
        for name, (method, artifact) in methods().items():
            before = TRACE_COUNTS["decode_loop"]
            out, count, cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=NEW_TOKENS,
                                                   chunk_size=CHUNK, artifact=artifact)
            if name == "full":  # a second batch of the same shapes reuses the compiled loop
                generate_tokens(model, other_rows, method=method, max_new_tokens=NEW_TOKENS, chunk_size=CHUNK)
                result["compiles"][mesh] = TRACE_COUNTS["decode_loop"] - before
            stats = cache.stats()
            result["meshes"][mesh][name] = {"tokens": np.asarray(out).tolist(), "layout": layout(cache),
                                            "device_bytes": stats["device_bytes"],
                                            "device_bytes_per_device": stats["device_bytes_per_device"],
                                            "recall_events": stats.get("recall_events"),
                                            "rows_recalled": stats.get("rows_recalled")}
        # a question after compression: SyncKV rehearses it (re-anchoring recalls every follower's kept set)
        method, artifact = methods()["synckv"]
        questions = [list(range(3 + b, 8 + b)) for b in range(len(rows))]
        out, _, cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=NEW_TOKENS, chunk_size=CHUNK,
                                           artifact=artifact, question_rows=questions)
        result["questions"][mesh] = {"tokens": np.asarray(out).tolist(), "recall_events": cache.stats()["recall_events"]}


def main() -> None:
    devices, part = int(sys.argv[1]), int(sys.argv[2])
    assert len(jax.devices()) == devices, (len(jax.devices()), devices)
    base = tiny_model()
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(1, CONFIG.vocab_size, size=n)) for n in LENGTHS]
    other_rows = [list(rng.integers(1, CONFIG.vocab_size, size=n)) for n in LENGTHS]
    result = {"meshes": {}, "params": {}, "compiles": {}, "bad": {}, "kernel": {}, "pq_kernel": {}, "questions": {},
              "contiguous_kernel": {}, "leader_scores": {}}
    if part == 1:
        run_meshes(result, base, rows, other_rows, PARTS[1])
        result["kernel"] = kernel_errors()
        result["pq_kernel"] = pq_kernel_errors()
        result["contiguous_kernel"] = contiguous_kernel_errors()
        result["leader_scores"] = leader_score_errors()
        print(json.dumps(result))
        return
    run_meshes(result, base, rows, other_rows, PARTS[0])
    bad = {"model axis not dividing the KV heads": lambda: shard_model(base, "data=1,model=3"),
           "unknown axis": lambda: shard_model(base, "data=2,pipeline=4"),
           "mesh larger than the devices": lambda: shard_model(base, f"data={devices},model=2"),
           "batch not divisible by data": lambda: generate_tokens(shard_model(base, "data=2,model=1"), rows[:3],
                                                                  max_new_tokens=2)}
    for what, call in bad.items():
        try:
            call()
            result["bad"][what] = None
        except ValueError as e:
            result["bad"][what] = str(e)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
