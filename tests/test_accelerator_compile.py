"""Every method's decode step compiles for an H100 and for a TPU v5e-8 slice, on this CPU, with its Pallas kernels
(:mod:`kvjax.evals.plan`), some also with int8 pages, and the planner's byte counting
(:func:`kvjax.evals.plan.hlo_bytes`) on a hand-written program.

The compiled checks need jax's CUDA plugin and libtpu (compilers only, no accelerator): ``scripts/setup_env.sh``
installs them into ``.aot-gpu/`` and ``.aot-tpu/``, which only the worker process puts on its path;
``scripts/test.sh`` sets ``KVJAX_AOT_GPU`` / ``KVJAX_AOT_TPU`` so that a missing compiler fails there instead of skipping.
"""

import json
import os
import subprocess
import sys

import pytest

from kvjax.evals.plan import TARGETS, hlo_bytes, kernel_launches, mesh_shape
from kvjax.methods import METHODS
from tests.mesh_worker import CONFIG_D16

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A module by hand: an in-place cache update (writes one row), a fusion that slices one row of a large operand and
# reads a small one whole, a Pallas-like custom call, a copy to host memory, a conditional, a loop of known trip count
# and a host computation.
HLO = """HloModule m

%fused_dus (p0: bf16[1024,128], p1: bf16[1,128], p2: s32[]) -> bf16[1024,128] {
  %p0 = bf16[1024,128]{1,0} parameter(0)
  %p1 = bf16[1,128]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = bf16[1024,128]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
}

%fused_slice (q0: f32[4096,64], q1: f32[64], q2: s32[]) -> f32[64] {
  %q0 = f32[4096,64]{1,0} parameter(0)
  %q1 = f32[64]{0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %q0b = f32[64,64,64]{2,1,0} bitcast(%q0)
  %row = f32[1,1,64]{2,1,0} dynamic-slice(%q0b, %q2, %z, %z), dynamic_slice_sizes={1,1,64}
  %r = f32[64]{0} reshape(%row)
  ROOT %a = f32[64]{0} add(%r, %q1)
}

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %z = bf16[] add(%x, %y)
}

%fused_scatter (s0: bf16[512,64], s1: s32[1,1], s2: bf16[1,64]) -> bf16[512,64] {
  %s0 = bf16[512,64]{1,0} parameter(0)
  %s1 = s32[1,1]{1,0} parameter(1)
  %s2 = bf16[1,64]{1,0} parameter(2)
  ROOT %sc = bf16[512,64]{1,0} scatter(%s0, %s1, %s2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

%branch_a (a: f32[64]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  ROOT %n = f32[64]{0} negate(%a)
}

%branch_b (b: f32[64]) -> f32[64] {
  %b = f32[64]{0} parameter(0)
  ROOT %e = f32[64]{0} exponential(%b)
}

%wbody (w: (s32[], f32[64])) -> (s32[], f32[64]) {
  %w = (s32[], f32[64]{0}) parameter(0)
  %w0 = s32[] get-tuple-element(%w), index=0
  %w1 = f32[64]{0} get-tuple-element(%w), index=1
  %one = s32[] constant(1)
  %w2 = s32[] add(%w0, %one)
  %w3 = f32[64]{0} negate(%w1)
  ROOT %wt = (s32[], f32[64]{0}) tuple(%w2, %w3)
}

%wcond (c: (s32[], f32[64])) -> pred[] {
  %c = (s32[], f32[64]{0}) parameter(0)
  %c0 = s32[] get-tuple-element(%c), index=0
  %lim = s32[] constant(4)
  ROOT %lt = pred[] compare(%c0, %lim), direction=LT
}

%hostcomp (hp: f32[64]) -> f32[64] {
  %hp = f32[64]{0} parameter(0)
  ROOT %hn = f32[64]{0} negate(%hp)
}

ENTRY %main (cache: bf16[1024,128], new: bf16[1,128], i: s32[], big: f32[4096,64], small: f32[64], pool: bf16[512,64], ids: s32[1,1], row: bf16[1,64]) -> f32[64] {
  %cache = bf16[1024,128]{1,0} parameter(0)
  %new = bf16[1,128]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %big = f32[4096,64]{1,0} parameter(3)
  %small = f32[64]{0} parameter(4)
  %pool = bf16[512,64]{1,0} parameter(5)
  %ids = s32[1,1]{1,0} parameter(6)
  %row = bf16[1,64]{1,0} parameter(7)
  %appended = bf16[512,64]{1,0} fusion(%pool, %ids, %row), kind=kInput, calls=%fused_scatter
  %upd = bf16[1024,128]{1,0} fusion(%cache, %new, %i), kind=kLoop, calls=%fused_dus
  %sl = f32[64]{0} fusion(%big, %small, %i), kind=kLoop, calls=%fused_slice
  %k = f32[64]{0} custom-call(%sl, %small), custom_call_target="__gpu$xla.gpu.triton"
  %written = (bf16[512,64]{1,0}, bf16[1024,128]{1,0}) custom-call(%ids, %row, %appended, %upd), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{0}: (2, {}), {1}: (3, {})}
  %h = f32[64]{0:S(5)} copy(%k)
  %none = s32[1,0]{1,0} constant({ {  } })
  %nocopy = s32[1,0]{1,0} copy(%none)
  %init = (s32[], f32[64]{0}) tuple(%i, %k)
  %loop = (s32[], f32[64]{0}) while(%init), condition=%wcond, body=%wbody, backend_config={"known_trip_count":{"n":"4"}}
  %hs = ((f32[64]{0}), f32[64]{0}, u32[]) custom-call-start(%k), async_execution_thread="host", custom_call_target="HostExecute", called_computations={%hostcomp}
  %hd = f32[64]{0} custom-call-done(%hs)
  ROOT %c = f32[64]{0} conditional(%i, %k, %k), branch_computations={%branch_a, %branch_b}
}
"""


def test_hlo_bytes_of_a_hand_written_program():
    """Hand-counted: the in-place update reads its one new row (256 B) and the index (4 B) and writes the row, not the
    1024-row cache; the slicing fusion reads one row of ``big`` (256 B, sliced through a bitcast), all of ``small``
    (256 B) and the index, and writes 256 B; the custom call reads 2 x 256 and writes 256; the copy to host reads 256
    on the device and writes 256 to the host; the in-place kernel writing one row into each of two pools (its
    outputs alias them) reads the row and its index (4 + 128 B) and writes as much, not the pools; of the
    conditional's two branches (each reads and writes 256) one
    counts; the scatter appending one 128-byte row to a 64 KiB pool in place reads the row and its index (4 B) and
    writes the row; the loop runs its known 4 trips, each a counter increment (3 x 4 B), a negation (2 x 256) and the
    condition's compare (2 x 4 + 1); the host call's start hands 256 over and holds its operand, output and a 4-byte
    token (772 on the device), and the host computation's negation moves 512 host bytes."""
    counted = hlo_bytes(HLO)
    dus = 256 + 4 + 256
    sliced = 256 + 256 + 4 + 256
    kernel = 3 * 256
    in_place = 2 * (4 + 128)
    copy = 256
    branch = 256 + 256
    scatter = 4 + 128 + 128
    loop = 4 * (12 + 512 + 9)
    host_start = 256 + (256 + 256 + 4)
    assert counted == {"device": dus + sliced + kernel + in_place + copy + branch + scatter + loop + host_start,
                       "host": 256 + 512}
    # launches: the scatter, the update, the slice, the two custom calls, the copy, 4 x 3 in the loop, the host call's
    # start and one branch; the host computation's negation runs on the host; the copy of an empty array launches none
    assert kernel_launches(HLO) == 6 + 12 + 1 + 1


TPU_HLO = """
HloModule tpu_copies

%fused_add (x: f32[256,128], y: f32[256,128]) -> f32[256,128] {
  %x = f32[256,128]{1,0} parameter(0)
  %y = f32[256,128]{1,0} parameter(1)
  ROOT %z = f32[256,128]{1,0} add(%x, %y)
}

ENTRY %main (w: f32[1024,128], h: f32[256,128], kv: bf16[4096,128], new: bf16[1,128], at: s32[]) -> f32[256,128] {
  %w = f32[1024,128]{1,0:T(8,128)} parameter(0)
  %h = f32[256,128]{1,0:T(8,128)} parameter(1)
  %kv = bf16[4096,128]{1,0:T(8,128)(2,1)} parameter(2)
  %new = bf16[1,128]{1,0:T(8,128)(2,1)} parameter(3)
  %at = s32[] parameter(4)
  %zero = s32[] constant(0)
  %appended = bf16[4096,128]{1,0:T(8,128)(2,1)} dynamic-update-slice(%kv, %new, %at, %zero)
  %ss = ((f32[1024,128]{1,0:T(8,128)}), f32[256,128]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:256], [0:128]}
  %sd = f32[256,128]{1,0:T(8,128)S(1)} slice-done(%ss)
  %cs = (f32[256,128]{1,0:T(8,128)S(1)}, f32[256,128]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%h)
  %cd = f32[256,128]{1,0:T(8,128)S(1)} copy-done(%cs)
  %sum = f32[256,128]{1,0:T(8,128)S(1)} fusion(%sd, %cd), kind=kLoop, calls=%fused_add
  %back = (f32[256,128]{1,0:T(8,128)}, f32[256,128]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%sum)
  ROOT %out = f32[256,128]{1,0:T(8,128)} copy-done(%back)
}
"""


def test_hlo_bytes_of_a_tpu_program_with_on_chip_copies():
    """Hand-counted: the async slice of a quarter of ``w`` into on-chip memory (``S(1)``) reads that quarter (128 KiB)
    from HBM, not the whole operand; the async copy of ``h`` into on-chip memory reads ``h`` once (128 KiB); the
    fusion over on-chip operands into on-chip memory moves nothing through HBM; the copy back writes 128 KiB; the
    unfused in-place append of one 256-byte row to a 1 MiB cache reads the row and its two indices and writes the
    row."""
    quarter = 256 * 128 * 4
    append = 256 + 2 * 4 + 256
    assert hlo_bytes(TPU_HLO) == {"device": 3 * quarter + append, "host": 0}


def test_mesh_shapes_of_the_targets():
    """The model axis takes the most chips that divide the heads: 8 KV heads on 8 chips, 4 on (2, 4), one GPU (1, 1)."""
    from kvjax.models import model_architecture

    llama, _ = model_architecture("llama-3.1-8b")
    qwen, _ = model_architecture("qwen2.5-7b")
    assert mesh_shape(TARGETS["v5e-8"], llama) == (1, 8)
    assert mesh_shape(TARGETS["v5e-8"], qwen) == (2, 4)
    assert mesh_shape(TARGETS["v5p-8"], llama) == (1, 4)
    assert mesh_shape(TARGETS["h100"], llama) == (1, 1)


def _compiler_dirs():
    dirs = []
    for env, default, marker, what in (("KVJAX_AOT_GPU", ".aot-gpu", "jax_plugins", "jax's CUDA plugin"),
                                       ("KVJAX_AOT_TPU", ".aot-tpu", "libtpu", "libtpu")):
        path = os.environ.get(env) or os.path.join(ROOT, default)
        if not os.path.isdir(os.path.join(path, marker)):
            if os.environ.get(env):
                pytest.fail(f"{env}={path} holds no {what} (scripts/setup_env.sh installs it)")
            pytest.skip(f"{what} is not in {default}/ (scripts/setup_env.sh installs it)")
        dirs.append(path)
    return dirs


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(_compiler_dirs() + [ROOT]), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.accelerator_compile_worker", "h100,v5e-8"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", ["h100", "v5e-8"])
def test_every_decode_step_compiles_for_the_target(compiled, target):
    """Every registered method's one-token decode step compiles (XLA for the target, not only lowered), and
    HCAttention's with 16-bit codes; every method runs a Pallas kernel in it (Triton custom call on the GPU, Mosaic on
    the TPU), not the XLA fallback (the full cache's one-token step reads its contiguous cache with the paged kernel
    too); the compiled memory holds at least the cache's keys and values, counted by hand."""
    from tests.accelerator_compile_worker import EXTRA

    rows = compiled[target]["methods"]
    assert set(rows) == set(METHODS) | set(EXTRA)
    errors = {m: r["error"] for m, r in rows.items() if "error" in r}
    assert not errors, errors
    assert all(r["kernel"] for r in rows.values()), {m: r["kernel"] for m, r in rows.items()}
    data, model = compiled[target]["mesh"]
    c = CONFIG_D16
    from tests.accelerator_compile_worker import PROMPT, ROOM

    kv_per_chip = 2 * c.num_layers * c.num_kv_heads * (PROMPT + ROOM) * c.head_dim * 4 * data // (data * model)
    assert rows["full"]["device_bytes"] >= kv_per_chip, (rows["full"], kv_per_chip)
    assert 0 < rows["snapkv"]["device_bytes"] < rows["full"]["device_bytes"] + 2 * kv_per_chip
    assert rows["heterocache"]["host_bytes"] > 0 and rows["full"]["host_bytes"] == 0
    # the recall methods' leaders score their pages with the paged-scores kernel on the TPU (XLA's page gather
    # kept whole pools in on-chip memory there); on the GPU XLA fuses the gather into their multiply-reduce
    for name in ("heterocache", "synckv"):
        assert ("paged_scores_tpu" in rows[name]["pallas_calls"]) == (target == "v5e-8"), rows[name]["pallas_calls"]


@pytest.mark.parametrize("target", ["h100", "v5e-8"])
def test_int8_decode_steps_compile_for_the_target(compiled, target):
    """The full cache's, SnapKV's, Quest's, HeteroCache's and SyncKV's one-token decode steps with int8 pages compile
    for the target with the paged decode kernel; the program takes every layer's key and value pools as int8 (and the
    recall methods' host copies: a second pair per layer). On the H100 the int8 programs need less device memory than
    the float32 ones, and the recall methods' host copies less host memory on both targets. (On the v5e-8 the scale
    pools' layout, lanes padded to 128, outweighs int8's saving at this model's sizes: its device bytes are not
    compared; docs/QUANTIZATION.md.)"""
    from tests.accelerator_compile_worker import INT8

    floats, rows = compiled[target]["methods"], compiled[target]["int8"]
    assert set(rows) == set(INT8)
    errors = {m: r["error"] for m, r in rows.items() if "error" in r}
    assert not errors, errors
    rows = {m: r for m, r in rows.items() if m != "hcattention"}  # no pages: its host values have their own test
    kernel = "paged_decode_attention_gpu" if target == "h100" else "paged_decode_attention_tpu"
    assert all(kernel in r["pallas_calls"] for r in rows.values()), {m: r["pallas_calls"] for m, r in rows.items()}
    layers = CONFIG_D16.num_layers
    for name, r in rows.items():
        recall = name in ("heterocache", "synckv")
        assert r["int8_arguments"] == (4 if recall else 2) * layers, (name, r["int8_arguments"])
        assert floats[name]["int8_arguments"] == 0, name
        if recall:
            assert 0 < r["host_bytes"] < floats[name]["host_bytes"], (name, r["host_bytes"], floats[name]["host_bytes"])
        if target == "h100":
            assert r["device_bytes"] < floats[name]["device_bytes"], (name, r["device_bytes"], floats[name]["device_bytes"])


@pytest.mark.parametrize("target", ["h100", "v5e-8"])
def test_hcattention_int8_host_values_compile_for_the_target(compiled, target):
    """HCAttention's decode step with int8 host values compiles for the target with its Pallas kernel; per layer the
    program takes the chip's values as int8 ``[pairs, 512, 16]`` and their float32 scales ``[pairs, 512, 1]`` in host
    memory ((row, KV head) pairs: 8 on the H100, 1 on each chip of the v5e-8's (1, 8) mesh), and its host memory is
    exactly theirs, counted by hand."""
    run = compiled[target]["int8"]["hcattention"]
    c = CONFIG_D16
    data, model = compiled[target]["mesh"]
    pairs = c.num_kv_heads // model  # the step's batch is one row per data block
    from tests.accelerator_compile_worker import PROMPT

    assert run["kernel"]
    assert run["host_arguments"] == sorted([f"s8[{pairs},{PROMPT},{c.head_dim}]", f"f32[{pairs},{PROMPT},1]"]
                                           * c.num_layers), run["host_arguments"]
    assert run["host_bytes"] == c.num_layers * pairs * PROMPT * (c.head_dim + 4), run["host_bytes"]


def test_plan_finds_the_largest_batch_that_compiles_when_the_estimate_does_not(monkeypatch):
    """The linear estimate of the largest batch is checked by compiling it; when XLA refuses it (temporaries need
    not grow linearly), the plan compiles a quarter smaller until one fits, and reports that batch with the
    estimate beside it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvjax.evals import plan
    from kvjax.evals.synthetic import cpu_mesh

    GIB_ = plan.GIB
    target = plan.Target("toy", "tpu", "none", 1, 100 * GIB_, 1e12)
    mesh = cpu_mesh()
    params = [jax.ShapeDtypeStruct((GIB_ // 4,), jnp.float32, sharding=NamedSharding(mesh, P()))]  # 1 GiB fixed
    compiled = []

    def fake_compile(target, mesh, config, dtype, method, batch, length, room, artifact=None, **_):
        compiled.append(batch)
        if batch > 40:  # XLA refuses: temporaries grow faster than the rows
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        device = GIB_ + batch * 2 * GIB_ + (batch > 30) * 60 * GIB_  # fits up to 30 rows
        return {"device_bytes": device, "host_bytes": 0, "artifact_bytes": 0, "device_traffic": 1e9 * batch,
                "xla_bytes_accessed": None, "host_traffic": 0, "host_to_device": None, "floor_bytes": 1e9,
                "kernels": 7, "compile_s": 1.0}

    monkeypatch.setattr(plan, "compile_step", fake_compile)
    row = plan.plan_cell(target, mesh, None, "bfloat16", None, 1024, 64, None, None, params)
    # estimate (100 - 1) / 2 = 49 rows; 49 is refused, 36 does not fit, 27 fits
    assert compiled == [1, 49, 36, 27]
    assert (row["max_batch"], row["max_batch_estimate"], row["fits_checked"]) == (27, 49, True)
    assert [f["batch"] for f in row["verify_failures"]] == [49, 36]
    assert "RESOURCE_EXHAUSTED" in row["verify_failures"][0]["error"]
    assert row["tokens_per_s_max"] == pytest.approx(27 / (27e9 / 1e12))
    assert row["kernels_b1"] == 7
    table = plan.render({"args": {"model": "toy", "targets": ["h100"], "dtype": "bfloat16", "room": 64},
                         "command": "c", "jax": "0", "date": "d", "meshes": {"h100": [1, 1]},
                         "targets": {"h100": [dict(row, method="m", budget=0.1, length=1024)]}})
    header, _, line = ([c.strip() for c in r.strip("|").split("|")] for r in table.splitlines()[-3:])
    assert line[header.index("kernels/step (batch 1)")] == "7"


