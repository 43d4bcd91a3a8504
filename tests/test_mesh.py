"""Meshes: parsing and errors here; generation on 8 simulated CPU devices in a separate process (tests/mesh_worker.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.api import generate_tokens
from kvjax.cache import CacheSpec
from kvjax.decoding import prefill_prompt
from kvjax.methods import FullCache
from kvjax.paged import page_layout
from kvjax.sharding import make_mesh, parse_mesh
from kvjax.models import LoadedModel
from kvjax.models.config import ModelConfig
from kvjax.models.llama import abstract_model, random_model
from kvjax.models.sharding import interleave_rows, tensor_parallel_params
from tests.mesh_worker import ONE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 8
# The worker processes run tiny models, where compiling dominates: XLA's CPU backend without LLVM optimisation
# compiles ~25% faster here and generates the same tokens (measured on the mesh worker's part 1).
FAST_COMPILE = "--xla_backend_optimization_level=0"


def test_parse_mesh_and_its_errors():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh("model=8") == {"data": 1, "model": 8}
    assert parse_mesh(" data = 2 , ") == {"data": 2, "model": 1}
    for text, message in [("pipeline=2", "unknown mesh axis 'pipeline'"), ("data=0", "size >= 1"),
                          ("data", "name=size"), ("data=2,data=2", "given twice"), ("model=x", "integer size")]:
        with pytest.raises(ValueError, match=message):
            parse_mesh(text)


def test_make_mesh_refuses_more_devices_than_there_are():
    with pytest.raises(ValueError, match=r"needs 4096 devices; 1 available"):
        make_mesh("data=64,model=64")
    with pytest.raises(ValueError, match="unknown mesh axes"):
        make_mesh({"data": 1, "expert": 1})
    mesh = make_mesh("data=1,model=1")
    assert mesh.axis_names == ("data", "model") and mesh.size == 1


def test_interleave_rows_hand_computed():
    # q has 4 rows, k and v 2 each; 2 blocks: [q0 q1 k0 v0 | q2 q3 k1 v1]
    x = jnp.arange(8)[:, None] * jnp.ones((1, 3), jnp.int32)
    out = interleave_rows(x, (4, 2, 2), 2)
    np.testing.assert_array_equal(np.asarray(out[:, 0]), [0, 1, 4, 6, 2, 3, 5, 7])
    assert interleave_rows(x, (4, 2, 2), 1) is x


def test_tensor_parallel_row_order_gives_the_same_logits_on_one_device():
    """The reordered fused projections read back by a ``tensor_parallel=4`` model compute the same function."""
    config = ModelConfig(architecture="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True, max_position_embeddings=128)
    graphdef, params = nnx.split(random_model(config, seed=3))
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 100))
    params = jax.tree_util.tree_map(lambda x: x * 20 if x.ndim == 2 else x + 0.5 * jax.random.normal(next(keys), x.shape),
                                    params)
    tp_graphdef, _ = nnx.split(abstract_model(config, jnp.float32, tensor_parallel=4))
    tp_params = tensor_parallel_params(params, config, 4)
    assert not np.allclose(np.asarray(params["layers"][0]["self_attn"]["qkv_proj"]["weight"][...]),
                           np.asarray(tp_params["layers"][0]["self_attn"]["qkv_proj"]["weight"][...]))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 20)), jnp.int32)
    logits = []
    for g, p in ((graphdef, params), (tp_graphdef, tp_params)):
        spec = CacheSpec.for_model(config, 2, 20, 4, jnp.float32)
        out, _ = prefill_prompt(g, p, tokens, FullCache(block=32).init_cache(spec))
        logits.append(np.asarray(out))
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    a = generate_tokens(LoadedModel(config, graphdef, params, None, "", jnp.float32), [[1, 2, 3], [4, 5]],
                        max_new_tokens=5)[0]
    b = generate_tokens(LoadedModel(config, tp_graphdef, tp_params, None, "", jnp.float32), [[1, 2, 3], [4, 5]],
                        max_new_tokens=5)[0]
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def mesh_run():
    """Generations of every method on one device (the unsharded model) and on meshes (2,4) and (1,8) of 8
    simulated CPU devices."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES} {FAST_COMPILE}", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.mesh_worker", str(DEVICES), str(part)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for part in (0, 1)]
    parts = []
    try:
        for p in procs:  # the two parts run at once
            out, err = p.communicate(timeout=1200)
            assert p.returncode == 0, err[-4000:]
            parts.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    merged = parts[0]
    for key, value in parts[1].items():
        if isinstance(value, dict):
            merged[key].update(value)
    return merged


def test_every_method_generates_the_same_tokens_on_every_mesh(mesh_run):
    one = mesh_run["meshes"][ONE_DEVICE]
    reference = {name: run["tokens"] for name, run in one.items()}
    assert len({json.dumps(t) for t in reference.values()}) > 1  # the methods do differ on this model
    for name, tokens in reference.items():
        assert len({tuple(row) for row in tokens}) > 1, name  # rows differ: a batch mix-up would show
    for mesh, runs in mesh_run["meshes"].items():
        assert set(runs) == set(reference)
        for name, run in runs.items():
            assert run["tokens"] == reference[name], (mesh, name)
        # followers were refreshed from their host copies (same count as on one device: the same picks)
        assert runs["heterocache"]["recall_events"] == one["heterocache"]["recall_events"] > 0
        assert runs["synckv"]["recall_events"] == one["synckv"]["recall_events"] > 0
        assert runs["synckv_spread"]["rows_recalled"] == one["synckv_spread"]["rows_recalled"] > 0
        assert runs["synckv_pipelined"]["rows_recalled"] == one["synckv_pipelined"]["rows_recalled"] > 0
    # SyncKV with a question after compression (rehearsed, then run): the same tokens and recalls on every mesh
    questions = mesh_run["questions"]
    assert set(questions) == set(mesh_run["meshes"])
    for mesh, run in questions.items():
        assert run == questions[ONE_DEVICE], mesh
    assert questions[ONE_DEVICE]["recall_events"] > one["synckv"]["recall_events"]


def test_caches_are_split_by_row_and_kv_head(mesh_run):
    meshes = mesh_run["meshes"]
    one = meshes[ONE_DEVICE]
    # hand-computed: the full cache's K is [8 rows, 8 KV heads, 160 slots, 8]
    assert one["full"]["layout"][".k"] == [[8, 8, 160, 8]]
    assert meshes["data=2,model=4"]["full"]["layout"][".k"] == [[4, 2, 160, 8]] * DEVICES
    assert meshes["data=1,model=8"]["full"]["layout"][".k"] == [[8, 1, 160, 8]] * DEVICES
    assert meshes["data=2,model=4"]["full"]["layout"]["pad"] == [[4]] * DEVICES
    # SnapKV: 40 + 6 slots per head -> 3 pages of 16; 8 rows x 8 heads x 3 = 192 pages, 24 per device
    assert one["snapkv"]["layout"][".k_pages"] == [[192, 16, 8]]
    assert meshes["data=2,model=4"]["snapkv"]["layout"][".k_pages"] == [[24, 16, 8]] * DEVICES
    assert meshes["data=2,model=4"]["snapkv"]["layout"][".block_table"] == [[4, 2, 3]] * DEVICES
    # HeteroCache: heads of different capacities, device blocks padded to the largest (page_layout)
    pool = meshes["data=2,model=4"]["heterocache"]["layout"][".paged.k_pages"]
    assert len(pool) == DEVICES and all(s == pool[0] for s in pool)
    # every array of every method's layer state is split 8 ways on every multi-device mesh (nothing replicated),
    # except what is indexed by leader head (HeteroCache/SyncKV: a follower on any device reads its leader's
    # choice), split by row only, and scalar counters
    by_row_only = {".picks", ".version", ".prompt_len", ".anchor_picks", ".anchor_at", ".tracker.overlap", ".tracker.ref",
                   ".tracker.static", ".tracker.static_rows", ".tracker.keep_rows"}
    # padded per device block: pools of unequal capacities, follower slots (host copies and per-slot arrays)
    padded = {".paged.k_pages", ".paged.v_pages", ".host.k", ".host.v", ".region_start", ".region_count", ".applied",
              ".held"}
    recall_methods = ("heterocache", "synckv", "synckv_spread", "synckv_pipelined")
    for mesh in ("data=2,model=4", "data=1,model=8"):
        rows = parse_mesh(mesh)["data"]
        for name, run in meshes[mesh].items():
            for key, shards in run["layout"].items():
                if key in ("pad", "memory_kinds"):  # not a layer array: split by row only
                    continue
                whole = one[name]["layout"][key][0]
                if not whole:  # scalars (counters) are replicated
                    continue
                assert len(shards) == DEVICES and all(s == shards[0] for s in shards), (mesh, name, key)
                if name in recall_methods and key in by_row_only:
                    assert math.prod(shards[0]) * rows == math.prod(whole), (mesh, name, key, shards[0], whole)
                elif name in recall_methods and key in padded:
                    assert math.prod(shards[0]) * DEVICES >= math.prod(whole), (mesh, name, key)  # padded blocks
                else:
                    assert math.prod(shards[0]) * DEVICES == math.prod(whole), (mesh, name, key, shards[0], whole)


def test_stats_report_the_bytes_each_device_holds(mesh_run):
    for mesh, runs in mesh_run["meshes"].items():
        for name in ("full", "snapkv", "quest"):
            total, per_device = runs[name]["device_bytes"], runs[name]["device_bytes_per_device"]
            if mesh == ONE_DEVICE:
                assert per_device == total
            else:  # layer arrays split 8 ways; the slot counter and padding are a few replicated bytes
                assert abs(per_device - total / DEVICES) <= 64, (mesh, name, per_device, total)


def test_host_memory_stays_host_memory_on_every_mesh(mesh_run):
    for mesh, runs in mesh_run["meshes"].items():
        assert runs["hcattention"]["layout"]["memory_kinds"] == ["device", "pinned_host"], mesh
        assert runs["hcattention_pq"]["layout"]["memory_kinds"] == ["device", "pinned_host"], mesh
        assert runs["full"]["layout"]["memory_kinds"] == ["device"], mesh
    # HCAttention's prompt values [8 rows x 8 heads, 128 slots, 8] in pinned_host, 8 (row, head) pairs per device
    assert mesh_run["meshes"]["data=2,model=4"]["hcattention"]["layout"][".values"] == [[8, 128, 8]] * DEVICES
    # HeteroCache's layer 0 satellites are heads 1, 4 and 6: one slot per head block of 2 (4 slots, one of them
    # padding) or of 1 (8 slots, 5 of them padding)
    for mesh, shape in [("data=2,model=4", [4, 128, 8]), ("data=1,model=8", [8, 128, 8])]:
        run = mesh_run["meshes"][mesh]["heterocache"]
        assert run["layout"]["memory_kinds"] == ["device", "pinned_host"]
        assert run["layout"][".host.k"] == [shape] * DEVICES, mesh
    assert mesh_run["meshes"][ONE_DEVICE]["heterocache"]["layout"][".host.k"] == [[24, 128, 8]]


INT8_MESHES = (ONE_DEVICE, "data=2,model=4")


def int8_host_values_run() -> dict:
    """Run in a process of 8 simulated CPU devices (``python -m tests.test_mesh``): HCAttention with exact keys and its
    host values stored as int8 (a float32 scale per token and KV head), on the host path and on the device path,
    on one device and on the meshes of :data:`INT8_MESHES`; per mesh and path the tokens and the first layer's layout,
    dtypes and memory kinds."""
    from kvjax.methods import HCAttention
    from kvjax.models.sharding import shard_model
    from tests.mesh_worker import CHUNK, CONFIG, LENGTHS, NEW_TOKENS, layout, tiny_model

    assert len(jax.devices()) == DEVICES, len(jax.devices())
    base = tiny_model()
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(1, CONFIG.vocab_size, size=n)) for n in LENGTHS]
    result = {}
    for mesh in INT8_MESHES:
        model = base if mesh == ONE_DEVICE else shard_model(base, mesh)
        for path in ("host", "device"):
            out, _, cache, _ = generate_tokens(model, rows, method=HCAttention(groups=0, tau=0.9, value_path=path),
                                               max_new_tokens=NEW_TOKENS, chunk_size=CHUNK, kv_dtype="int8")
            first = cache.layers[0]
            result[f"{mesh} {path}"] = {
                "tokens": np.asarray(out).tolist(), "layout": layout(cache),
                "dtypes": [None if x is None else x.dtype.name for x in (first.values, first.value_scales)],
                "kinds": [None if x is None else x.sharding.memory_kind for x in (first.values, first.value_scales)],
                "host_value_dtype": cache.stats()["host_value_dtype"]}
    return result


@pytest.fixture(scope="module")
def int8_run():
    """:func:`int8_host_values_run` in a process of 8 simulated CPU devices."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES} {FAST_COMPILE}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.test_mesh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hcattention_int8_host_values_on_a_mesh(int8_run):
    """HCAttention's int8 host values and their float32 scales stay in ``pinned_host`` memory on the (2, 4) mesh, split by
    device block like the float values ([8 rows x 8 heads, 128 slots, 8] -> 8 (row, head) pairs per device), and
    both value paths generate the tokens they generate on one device."""
    assert set(int8_run) == {f"{mesh} {path}" for mesh in INT8_MESHES for path in ("host", "device")}
    for key, run in int8_run.items():
        mesh, path = key.rsplit(" ", 1)
        assert run["tokens"] == int8_run[f"{ONE_DEVICE} {path}"]["tokens"], key
        assert len({tuple(row) for row in run["tokens"]}) > 1, key  # rows differ: a batch mix-up would show
        assert run["dtypes"] == ["int8", "float32"] and run["host_value_dtype"] == "int8", key
        assert run["kinds"] == ["pinned_host", "pinned_host"] and run["layout"]["memory_kinds"] == ["device", "pinned_host"]
        shards = 1 if mesh == ONE_DEVICE else DEVICES
        pairs = 8 * 8 // shards
        assert run["layout"][".values"] == [[pairs, 128, 8]] * shards, key
        assert run["layout"][".value_scales"] == [[pairs, 128, 1]] * shards, key


def test_pallas_paged_kernel_per_device_under_shard_map(mesh_run):
    assert len(mesh_run["kernel"]) == 5
    for mesh, error in mesh_run["kernel"].items():
        assert error < 1e-5, (mesh, error)


def test_pallas_pq_kernel_per_device_under_shard_map(mesh_run):
    """HCAttention's PQ scoring by the interpreted Pallas kernel per device on a mesh against numpy table lookups."""
    assert len(mesh_run["pq_kernel"]) == 2
    for mesh, error in mesh_run["pq_kernel"].items():
        assert error < 1e-3, (mesh, error)


def test_full_cache_kernel_per_device_under_shard_map(mesh_run):
    """The full cache's one-token attention through the paged kernel (the contiguous cache read as pages, each row's
    left padding skipped) per device on a mesh, against numpy dense attention over the row's slots."""
    assert len(mesh_run["contiguous_kernel"]) == 3
    for mesh, error in mesh_run["contiguous_kernel"].items():
        assert error < 1e-5, (mesh, error)


def test_leader_scores_kernel_per_device_under_shard_map(mesh_run):
    """The recall leaders' scores through the paged-scores kernel (interpreted) per device on a mesh, each device
    scoring the leaders among its own KV heads, against XLA's scores on one device (numpy-checked in
    ``tests/test_heterocache_synckv.py``)."""
    assert len(mesh_run["leader_scores"]) == 3
    for mesh, error in mesh_run["leader_scores"].items():
        assert error < 1e-6, (mesh, error)


def test_page_layout_blocks_hand_computed():
    # 4 rows x 2 heads, one page each, in 2 x 2 blocks: (rows 0-1, head 0), (rows 0-1, head 1), (rows 2-3, head 0), ...
    table, pages = page_layout(4, [5, 5], 8, blocks=(2, 2))
    assert pages == 8
    np.testing.assert_array_equal(table[:, :, 0], [[0, 2], [1, 3], [4, 6], [5, 7]])
    table, _ = page_layout(4, [5, 5], 8)  # one block: row by row, head by head
    np.testing.assert_array_equal(table[:, :, 0], [[0, 1], [2, 3], [4, 5], [6, 7]])
    with pytest.raises(ValueError, match="must divide"):
        page_layout(4, [5, 5, 5], 8, blocks=(1, 2))
    # heads of 2, 1, 1, 3 pages in 2 head blocks: block 0 needs 3 pages a row, block 1 needs 4; both get 4
    # (2 rows per row block -> 8 pages per block, 32 in all); block 0's last 2 pages are padding
    table, pages = page_layout(4, [20, 3, 16, 40], 16, blocks=(2, 2))
    assert pages == 32
    np.testing.assert_array_equal(table[0, 0], [0, 1, 1])
    np.testing.assert_array_equal(table[1, 1], [5, 5, 5])  # row 1 starts at 3; head 1 at 3 + 2
    np.testing.assert_array_equal(table[0, 3], [9, 10, 11])  # block (0, 1) starts at 8; head 3 after head 2's page
    np.testing.assert_array_equal(table[3, 2], [28, 28, 28])  # block (1, 1) starts at 24; row 3 at 24 + 4


def test_weights_are_tensor_parallel_on_the_model_axis(mesh_run):
    params = mesh_run["params"]
    # qkv_proj [(16 + 2 * 8) * 8 = 256, 64] split by rows; down_proj [64, 64] by columns
    assert params[ONE_DEVICE] == {"qkv_proj": [[256, 64]], "down_proj": [[64, 64]]}
    assert params["data=2,model=4"] == {"qkv_proj": [[64, 64]] * DEVICES, "down_proj": [[64, 16]] * DEVICES}
    assert params["data=1,model=8"] == {"qkv_proj": [[32, 64]] * DEVICES, "down_proj": [[64, 8]] * DEVICES}


def test_decode_loop_compiles_once_per_mesh(mesh_run):
    assert len(mesh_run["meshes"]) == 3  # one device and two meshes
    assert mesh_run["compiles"] == {mesh: 1 for mesh in mesh_run["meshes"]}


def test_clear_errors_for_bad_meshes_and_unsplit_methods(mesh_run):
    bad = mesh_run["bad"]
    assert "must divide the KV heads (8)" in bad["model axis not dividing the KV heads"]
    assert "unknown mesh axis 'pipeline'" in bad["unknown axis"]
    assert f"needs {2 * DEVICES} devices; {DEVICES} available" in bad["mesh larger than the devices"]
    assert "must divide the batch (3 rows)" in bad["batch not divisible by data"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_generate_together_like_one():
    """Two processes joined by ``kvjax.distributed`` (localhost coordinator, gloo) split one model over a
    mesh spanning both and generate what a single process does."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    port = str(_free_port())
    cmd = [sys.executable, "-m", "tests.distributed_worker"]
    procs = [subprocess.Popen(cmd + [str(i), port], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        finally:
            for q in procs:
                if q.poll() is None and p.returncode is None:
                    q.kill()
        assert p.returncode == 0, err[-4000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    single = subprocess.run(cmd + ["single"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-4000:]
    expected = json.loads(single.stdout.strip().splitlines()[-1])
    assert sorted(o.pop("process_index") for o in outputs) == [0, 1]
    expected.pop("process_index")
    assert outputs[0] == outputs[1] == expected


def test_distributed_settings_need_all_three_and_sane_values(monkeypatch):
    from kvjax.distributed import initialize, settings

    for var in ("KVJAX_COORDINATOR", "KVJAX_NUM_PROCESSES", "KVJAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert settings() is None
    assert initialize() is False  # one process: nothing to join
    assert settings("h:1", 2, 1) == {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}
    monkeypatch.setenv("KVJAX_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("KVJAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("KVJAX_PROCESS_ID", "3")
    assert settings() == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    monkeypatch.delenv("KVJAX_PROCESS_ID")
    with pytest.raises(ValueError, match=r"missing: --process-id \(KVJAX_PROCESS_ID\)"):
        settings()
    with pytest.raises(ValueError, match="0 <= process_id < num_processes"):
        settings("h:1", 2, 2)
    with pytest.raises(ValueError, match="host:port"):
        settings("localhost", 2, 0)


def test_cli_refuses_a_bad_mesh_before_loading(capsys):
    from kvjax.cli import main

    assert main(["generate", "--prompt", "hi", "--mesh", "pipeline=2"]) == 2
    assert "unknown mesh axis 'pipeline'" in capsys.readouterr().err
    assert main(["eval", "--mesh", "data=0", "--tasks", "passkey"]) == 2
    assert "size >= 1" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--coordinator", "h:1"]) == 2
    assert "missing: --num-processes" in capsys.readouterr().err


if __name__ == "__main__":
    print(json.dumps(int8_host_values_run()))
