"""Plan on the CPU: compile every method's decode step for an H100 and for TPU v5e / v5p / v6e slices, without them.

``python -m kvjax.evals.plan [--model llama-3.1-8b] [--targets h100,v5e-8] [--methods ...] [--budgets 0.1,0.25]
[--lengths 32768,131072] [--kv-dtype int8] [--out FILE.md]``

For each target, method, budget and prompt length this compiles the jitted one-token decode step
(:func:`kvjax.decoding.decode_step`, with kvjax's compiler options for the platform) over the compressed cache built
by the method's own ``init_cache`` + ``compress`` (traced, never allocated: :func:`kvjax.evals.synthetic.abstract_compressed_cache`)
and the model's parameters (random bf16 of the real shapes, abstract), with XLA's compiler for the target:

* H100 / H200: jax's CUDA plugin as a compiler only (deviceless, :mod:`kvjax.evals.gpu_schedule`);
* TPU: the ``libtpu`` wheel jax pins (``jax[tpu]``) and ``jax.experimental.topologies.get_topology_desc``, on a
  ``(data, model)`` mesh of the slice (model axis: the most chips that divide the KV heads), Pallas kernels under
  ``shard_map`` as on a real slice.

From each compiled program: ``memory_analysis()`` (bytes of arguments, outputs, temporaries, per device, device and
host memory), hence the largest batch that fits in the target's memory (the parameters and the method's artifact are
fixed; the rest of the memory compiled at the smallest batch grows with the rows; the step is compiled again at that
batch to check it fits); the bytes a step moves through device memory, counted from the compiled HLO by
:func:`hlo_bytes` (each kernel's operands and outputs in device memory, only the slices a fusion reads of an operand it
slices, only the update of an in-place update or scatter; on a TPU an async slice or copy into on-chip memory counts
its HBM side once), and on a TPU also XLA's ``cost_analysis()['bytes accessed']`` beside it (which counts the on-chip
side of those copies and the host computations' operands too; the GPU compiler gives no cost analysis without a
device); the bytes-only step time at the target's nominal HBM bandwidth and, on a GPU, the modelled step time
(:mod:`kvjax.evals.cost_model`: bytes at the measured bandwidth, a cost per kernel, the host link's bytes at its
measured bandwidth), and tokens per second at the largest batch. ``--remodel PLAN.json`` adds the modelled columns to a
committed plan from the counts it recorded, without compiling. ``--kv-dtype`` plans the caches stored in that dtype
(``CacheSpec.kv_dtype``: the full cache and the page pools, int8 / float8_e4m3fn with float32 per-token scales; a
method without a quantized layout reports its ValueError in its cell). The floor column is the bytes a step reading everything it holds cannot avoid: the weights it reads plus the
compressed cache's device bytes (Quest and HCAttention select what they read, so their floor is lower than this).

Needs jax's CUDA plugin (``.aot-gpu/``) and ``libtpu`` (``.aot-tpu/``), both put there by ``scripts/setup_env.sh``
outside the virtual environment: run ``PYTHONPATH=.aot-gpu:.aot-tpu:. python -m kvjax.evals.plan``. jax runs on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import re
import shlex
import sys
import time

from kvjax.evals import cost_model
from kvjax.evals.hlo import Instruction, memory_bytes, parse_module, shape_bytes
from kvjax.reports import number, table, write_report

DEFAULT_METHODS = ("full,snapkv,streaming_llm,h2o,pyramidkv,hbw,quest,chunked_eviction,locret,hcattention,heterocache,"
                   "synckv,synckv:num_representatives=1")
DEFAULT_OUT = "docs/results/plan_{model}{kv}_jax{jax}.md"  # {kv}: "_" + the --kv-dtype when given
VERIFY_ATTEMPTS = 4  # compilations at most per cell to find the largest batch that fits
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to plan for: its platform, the topology jax compiles for, chips, memory per chip, HBM bandwidth and the
    host link's bandwidth per direction (the vendors' nominal figures; None where not stated here)."""

    name: str
    platform: str  # "cuda" | "tpu"
    topology: str  # TPU topology name, or the GPU target key of kvjax.evals.gpu_schedule.TARGETS
    chips: int
    memory_bytes: int  # per chip
    bandwidth: float  # bytes/s per chip
    host_bandwidth: float | None = None  # host -> device bytes/s per chip

    @property
    def backend(self) -> str:
        """``jax.default_backend()`` on the target (kvjax picks its kernels' forms from it)."""
        return "gpu" if self.platform == "cuda" else "tpu"


TARGETS = {
    # H100 SXM 80 GB (as CUDA reports it); both GPUs' host links are PCIe Gen5 x16, 64 GB/s per direction
    "h100": Target("h100", "cuda", "h100", 1, 84_929_347_584, 3.35e12, 64e9),
    "h200": Target("h200", "cuda", "h200", 1, 150_754_820_096, 4.8e12, 64e9),
    "v5e-8": Target("v5e-8", "tpu", "v5e:2x4", 8, 16 * GIB, 8.19e11),
    "v5p-8": Target("v5p-8", "tpu", "v5p:2x2x1", 4, 95 * GIB, 2.765e12),
    "v6e-8": Target("v6e-8", "tpu", "v6e:2x4", 8, 32 * GIB, 1.64e12),
}


def mesh_shape(target: Target, config) -> tuple[int, int]:
    """``(data, model)``: the model axis is the most chips that divide the KV heads, the query heads and the MLP."""
    model = max(m for m in range(1, target.chips + 1) if target.chips % m == 0 and config.num_kv_heads % m == 0
                and config.num_heads % m == 0 and config.intermediate_size % m == 0)
    return target.chips // model, model


def target_mesh(target: Target, config):
    """The target's devices (deviceless: a jax topology) as a ``(data, model)`` mesh. Several processes may compile for
    a TPU at once (``ALLOW_MULTIPLE_LIBTPU_LOAD``: they never run on one)."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from kvjax.sharding import AXES

    if target.platform == "cuda":
        from kvjax.evals.gpu_schedule import gpu_topology

        devices = gpu_topology(target.topology).devices
    else:
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        try:
            devices = topologies.get_topology_desc(platform="tpu", topology_name=target.topology).devices
        except Exception as e:  # noqa: BLE001 - no libtpu: say how to get it
            raise SystemExit(f"compiling for {target.name} needs libtpu ({type(e).__name__}: {e}); "
                             "scripts/setup_env.sh installs it in .aot-tpu/: run with PYTHONPATH=.aot-gpu:.aot-tpu:.")
    return Mesh(np.array(devices).reshape(mesh_shape(target, config)), AXES)


@contextlib.contextmanager
def lowering_for(target: Target):
    """Trace as on a TPU target: ``jax.default_backend()`` names its platform, so kvjax builds its kernels' forms for
    it. (GPU targets trace through :func:`kvjax.evals.gpu_schedule.export_for_gpu`.)"""
    import jax

    if target.platform != "tpu":
        raise ValueError(f"lowering_for is for TPU targets; {target.name} exports through kvjax.evals.gpu_schedule")
    real = jax.default_backend
    jax.default_backend = lambda: target.backend
    try:
        yield None
    finally:
        jax.default_backend = real


# ----------------------------------------------------------------------------------------------- bytes from HLO
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
              "partition-id", "replica-id", "custom-call-done", "while", "conditional", "call", "copy-done",
              "send-done", "recv-done", "async-done", "slice-done", "add-dependency", "domain"}  # *-done: its start counts
_SLICING = {"dynamic-slice", "slice", "gather"}


# In-place fusion roots (the output aliases operand 0) and the operand holding what they write.
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}


def _reads_through_bitcasts(users: dict, name: str) -> list:
    """``(instruction, the name it reads)`` for each use of ``name`` in a fused computation, looking through bitcasts
    (a reshape that moves no data)."""
    out = []
    for u in users.get(name, []):
        out += _reads_through_bitcasts(users, u.name) if u.op == "bitcast" else [(u, name)]
    return out


def _fusion_bytes(comps: dict, shapes: dict, callee: str, operands: list, out_shape: str) -> tuple[int, int]:
    """(device, host) bytes a fusion reads and writes: an operand that the fused computation only slices or gathers
    (directly or through bitcasts) counts the slices; an in-place root (``dynamic-update-slice``, ``scatter``: a cache
    append) writes its update and neither reads nor rewrites its target."""
    insts = comps.get(callee, [])
    params = {i.name: int(i.args.strip() or 0) for i in insts if i.op == "parameter"}
    users: dict = {}
    for i in insts:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    root = next((i for i in insts if i.root), insts[-1] if insts else None)
    in_place = root is not None and root.op in _IN_PLACE and len(root.operands) > _IN_PLACE[root.op]
    by_index = {idx: name for name, idx in params.items()}
    dev = host = 0
    for k, operand in enumerate(operands):
        pname = by_index.get(k)
        full = memory_bytes(shapes.get(operand, ""))
        uses = users.get(pname, [])
        if in_place and root.operands[0] == pname and all(u is root for u in uses):
            continue  # updated in place: neither read nor rewritten
        reads = _reads_through_bitcasts(users, pname)
        if reads and all(u.op in _SLICING and u.operands and u.operands[0] == via for u, via in reads):
            part = sum(shape_bytes(u.shape) for u, _ in reads)  # the slices, read where the operand lies
            dev += min(part, full[0])
            host += min(part, full[1])
        else:
            dev += full[0]
            host += full[1]
    if in_place:
        written = root.operands[_IN_PLACE[root.op]]
        update = next((i for i in insts if i.name == written), None)
        out = memory_bytes(update.shape) if update is not None else (0, 0)
    else:
        out = memory_bytes(out_shape)
    return dev + out[0], host + out[1]


def _instruction_own_bytes(comps: dict, shapes: dict, i: Instruction) -> tuple[int, int]:
    if i.op == "slice-start":  # a TPU's async slice ((operand), slice, context): reads the slice where it lies
        found = re.match(r"\(\((.*)\), (.*), [su]32\[\]", i.shape)
        if found:
            src = memory_bytes(found.group(1))
            size = shape_bytes(found.group(2))
            read = (size, 0) if src[0] else (0, size if src[1] else 0)  # read where the operand lies
            dst = memory_bytes(found.group(2))  # written: nothing when on-chip (S(1))
            return read[0] + dst[0], read[1] + dst[1]
    if i.op == "copy-start":  # (destination, source, context): each side in device or host memory, once
        found = re.match(r"\((\S+), (\S+), [su]32\[\]", i.shape)
        if found:
            dst, src = memory_bytes(found.group(1)), memory_bytes(found.group(2))
            return dst[0] + src[0], dst[1] + src[1]
    if i.op in _IN_PLACE and len(i.operands) > _IN_PLACE[i.op]:  # unfused (a TPU's): updates its operand in place
        d = h = 0
        for o in i.operands[1:]:
            od, oh = memory_bytes(shapes.get(o, ""))
            d, h = d + od, h + oh
        ud, uh = memory_bytes(shapes.get(i.operands[_IN_PLACE[i.op]], ""))
        return d + ud, h + uh
    callee = re.search(r"calls=%([\w.\-]+)", i.tail)
    if i.op == "fusion" and callee:
        return _fusion_bytes(comps, shapes, callee.group(1), i.operands, i.shape)
    aliasing = re.search(r"output_to_operand_aliasing=\{(.*?)\}\s*(?:,\s*[a-z_]+=|$)", i.tail)
    if aliasing:  # an in-place kernel: reads its other operands and writes as much (the rows it writes)
        aliased = {int(k) for k in re.findall(r"\}:\s*\((\d+),", aliasing.group(1))}
        d = h = 0
        for k, o in enumerate(i.operands):
            if k not in aliased:
                od, oh = memory_bytes(shapes.get(o, ""))
                d, h = d + 2 * od, h + 2 * oh
        return d, h
    d, h = memory_bytes(i.shape)
    for o in i.operands:
        od, oh = memory_bytes(shapes.get(o, ""))
        d, h = d + od, h + oh
    return d, h


def _walk(comps: dict, shapes: dict, comp: str, times: int, on_host: bool, stack: tuple = ()):
    """Instructions of ``comp`` that launch work, each ``(name, op name, device bytes, host bytes, device launches,
    instruction, times it runs, whether on the host)``, bytes and launches multiplied by the times the computation runs; loop bodies by their known trip count, the largest branch of a
    conditional, host computations' traffic as host traffic (and no device launch)."""
    if comp in stack:  # a recursive reference would be malformed HLO; never loop on it
        return
    stack = stack + (comp,)
    for i in comps.get(comp, []):
        if i.op == "while":
            trip = re.search(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)', i.tail)
            n = times * (int(trip.group(1)) if trip else 1)
            for part in re.findall(r"\b(?:body|condition)=%([\w.\-]+)", i.tail):
                yield from _walk(comps, shapes, part, n, on_host, stack)
            continue
        if i.op == "conditional":
            names = re.search(r"branch_computations=\{([^}]*)\}", i.tail)
            branches = ([n.strip().lstrip("%") for n in names.group(1).split(",")] if names else
                        re.findall(r"(?:true|false)_computation=%([\w.\-]+)", i.tail))
            walked = [list(_walk(comps, shapes, b, times, on_host, stack)) for b in branches]
            if walked:
                yield from max(walked, key=lambda rows: sum(r[2] + r[3] for r in rows))
            continue
        if i.op == "call":
            for part in re.findall(r"to_apply=%([\w.\-]+)", i.tail):
                yield from _walk(comps, shapes, part, times, on_host, stack)
            continue
        if i.op in _NO_KERNEL:
            continue
        d, h = _instruction_own_bytes(comps, shapes, i)
        op_name = re.search(r'op_name="([^"]*)"', i.tail)
        launches = 0 if on_host or d + h == 0 else times  # zero-sized arrays: nothing to launch
        yield (i.name, op_name.group(1) if op_name else i.op, (0 if on_host else d) * times,
               (d + h if on_host else h) * times, launches, i, times, on_host)
        if 'async_execution_thread="host"' in i.tail:
            called = re.search(r"called_computations=\{([^}]*)\}", i.tail)
            for part in (called.group(1).split(",") if called else []):
                yield from _walk(comps, shapes, part.strip().lstrip("%"), times, True, stack)


def _walk_entry(hlo: str):
    """:func:`_walk` from a compiled (optimized) HLO module's entry computation (nothing without one)."""
    comps = parse_module(hlo)
    shapes = {i.name: i.shape for insts in comps.values() for i in insts}
    entry = re.search(r"^ENTRY %(\S+) \(", hlo, re.M)
    return _walk(comps, shapes, entry.group(1), 1, False) if entry else iter(())


def instruction_bytes(hlo: str):
    """``(instruction name, its jax op name or HLO opcode, device bytes, host bytes)`` of every instruction of a
    compiled (optimized) HLO module that launches work, as often as it runs (see :func:`hlo_bytes`)."""
    for name, op, d, h, *_ in _walk_entry(hlo):
        yield name, op, d, h


def walked_instructions(hlo: str):
    """``(instruction, times it runs per run of the module, whether a host computation runs it, the host-memory bytes
    it reads and writes as :func:`hlo_bytes` counts them (times included), the HLO module's instructions by name)``
    for every instruction of a compiled (optimized) HLO module that launches work, as :func:`instruction_bytes` walks
    them (:mod:`kvjax.evals.cost_model` counts host transfers from them)."""
    comps = parse_module(hlo)
    by_name = {i.name: i for insts in comps.values() for i in insts}
    for _, _, _, h, _, inst, times, on_host in _walk_entry(hlo):
        yield inst, times, on_host, h, by_name


def kernel_launches(hlo: str) -> int:
    """Device kernels a compiled (optimized) HLO module launches per run: the instructions :func:`instruction_bytes`
    walks, loop bodies times their trip count, a conditional's largest branch, none for a host computation's work or
    for an instruction over zero-sized arrays."""
    return sum(r[4] for r in _walk_entry(hlo))


def hlo_bytes(hlo: str) -> dict:
    """Bytes a compiled (optimized) HLO module moves, counted per kernel as XLA's cost analysis does.

    Every instruction that launches work (a fusion, a custom call such as a Pallas kernel, a copy...) reads its operands
    and writes its output, in the computations that run, as often as they run: the entry; a loop's body and condition
    times its known trip count (once when XLA does not know it); of a conditional's branches the one that moves the
    most (an upper bound); what a host computation (a ``compute_on`` region, run by the host thread) reads and writes
    counts as host traffic, the arrays it is handed and returns as their memory says. A fusion that only slices or
    gathers from an operand (directly or through bitcasts) reads those slices; a fusion whose root updates its first
    operand in place (``dynamic-update-slice``, ``scatter``) writes the update only; a custom call whose outputs alias
    operands (an in-place kernel such as :func:`kvjax.pallas_kernels.row_write.write_rows`) reads its other operands and
    writes as much; so does an unfused ``dynamic-update-slice`` or ``scatter`` (a TPU updates a cache in place so). A
    TPU's async slice reads its slice where the operand lies and an async copy moves its array once on each side,
    nothing on a side in on-chip memory (``S(1)``). Arrays in host memory (``S(5)``) count as host traffic. Returns
    ``{"device": bytes, "host": bytes}``.
    """
    dev = host = 0
    for _, _, d, h in instruction_bytes(hlo):
        dev += d
        host += h
    return {"device": dev, "host": host}


# ------------------------------------------------------------------------------------------------ compiling
def abstract_params(config, dtype, mesh):
    """(graphdef, abstract parameters placed on ``mesh``: tensor parallel on its model axis, as
    :func:`kvjax.models.sharding.shard_model` lays them out)."""
    import jax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from kvjax.sharding import MODEL, axis_size, named
    from kvjax.models.llama import abstract_model
    from kvjax.models.sharding import param_partition

    blocks = axis_size(mesh, MODEL)
    graphdef, params = nnx.split(abstract_model(config, dtype, tensor_parallel=blocks))
    specs = param_partition(params)
    shardings = jax.tree_util.tree_map(lambda s: named(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    params = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
    return graphdef, params


def shard_bytes(x) -> int:
    """Bytes of one device's shard of an abstract array placed on a mesh."""
    return int(math.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


def weights_read(config, params) -> int:
    """Weight bytes one decode step reads on one chip: its shard of every parameter (abstract, placed on the mesh),
    except one row of an untied input embedding."""
    import jax

    total = sum(shard_bytes(x) for x in jax.tree_util.tree_leaves(params))
    return total if config.tie_word_embeddings else total - shard_bytes(params["embed_tokens"]["embedding"])


def compile_step(target: Target, mesh, config, dtype: str, method, batch: int, length: int, room: int, artifact=None,
                 *, graphdef=None, params=None, kv_dtype: str | None = None) -> dict:
    """Compile ``method``'s one-token decode step for ``target`` at ``batch`` rows after ``length`` prompt tokens, its
    cache stored in ``kv_dtype`` (None: the model's ``dtype``; :class:`kvjax.cache.CacheSpec`).

    Returns the compiled program's memory (per device: ``device_bytes`` = arguments + outputs - donated aliases +
    temporaries; ``host_bytes`` likewise for host memory), the bytes it moves (``device_traffic``, ``host_traffic``:
    :func:`hlo_bytes`; ``xla_bytes_accessed``: XLA's own count where the compiler gives one),
    the bytes floor per device (``floor_bytes``: the chip's weights read + its share of the cache's device bytes), the
    bytes the step moves over the host link (``host_to_device``: a recall's gathered rows; ``device_to_host``: the
    indices it sends; :func:`kvjax.evals.cost_model.host_transfers`; GPU targets only, else None), the compile time
    and the compiled object (``compiled``)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvjax.evals.synthetic import abstract_compressed_cache, cpu_mesh
    from kvjax.cache import CacheSpec, bytes_by_memory_kind
    from kvjax.decoding import decode_compiler_options, decode_step_jit
    from kvjax.sharding import DATA, is_split

    spec = CacheSpec.for_model(config, batch, length, room, dtype, mesh=mesh if is_split(mesh) else None,
                               kv_dtype=kv_dtype)
    if graphdef is None:
        graphdef, params = abstract_params(config, jnp.dtype(dtype), mesh)
    t = time.perf_counter()
    # shapes only, traced as on the CPU; a deviceless GPU reports no memory kinds, so a GPU's cache is described on a
    # CPU device first (its host tiers in pinned_host), then moved to the GPU lowering's mesh below
    cache = abstract_compressed_cache(method, spec, cpu_mesh() if target.platform == "cuda" else mesh, artifact)
    jax.clear_caches()  # kernels' forms and host regions are chosen at trace time: trace the step afresh for the target
    options = decode_compiler_options(target.backend)
    if target.platform == "cuda":  # deviceless GPU: export for cuda, compile with XLA:GPU (kvjax.evals.gpu_schedule)
        from kvjax.evals.cost_model import host_transfers
        from kvjax.evals.gpu_schedule import export_for_gpu, gpu_executable, gpu_topology

        def step(params, tokens, cache, key):
            return decode_step_jit(graphdef, params, tokens, cache, key)

        exported = export_for_gpu(step, params, jax.ShapeDtypeStruct((batch,), jnp.int32), cache,
                                  jax.ShapeDtypeStruct((2,), jnp.uint32), donate_argnums=(2,))
        executable = gpu_executable(exported.mlir_module(), gpu_topology(target.topology), options)
        mem = executable.get_compiled_memory_stats()
        hlo, cost = executable.hlo_modules()[0].to_string(), None
        compiled = executable
        link = host_transfers(hlo)
        host_to_device, device_to_host = link["host_to_device"], link["device_to_host"]
    else:
        with lowering_for(target):
            rows = NamedSharding(mesh, P(DATA) if is_split(mesh) else P())
            tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
            key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))
            lowered = decode_step_jit.lower(graphdef, params, tokens, cache, key)
        compiled = lowered.compile(compiler_options=options)
        mem, hlo, cost = compiled.memory_analysis(), compiled.as_text(), compiled.cost_analysis()
        host_to_device = device_to_host = None  # a TPU's host transfers are not read from its HLO here
    seconds = time.perf_counter() - t
    device = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    host = (mem.host_argument_size_in_bytes + mem.host_output_size_in_bytes - mem.host_alias_size_in_bytes
            + mem.host_temp_size_in_bytes)
    counted = hlo_bytes(hlo)
    kernels = kernel_launches(hlo)
    if isinstance(cost, list):  # older jax: one dict per program
        cost = cost[0] if cost else None
    # XLA's own count (a TPU gives one): it also counts the on-chip (VMEM) side of the TPU's copies and slices and the
    # host computations' operands, so it is reported beside the HLO count, not used for the projection
    xla = float(cost["bytes accessed"]) if cost and "bytes accessed" in cost else None
    # the cache's device bytes: what a step reading everything it holds reads (Quest and HCAttention read less)
    floor = weights_read(config, params) + bytes_by_memory_kind(cache)[0] / mesh.size
    return {"device_bytes": int(device), "host_bytes": int(host), "temp_bytes": int(mem.temp_size_in_bytes),
            "artifact_bytes": bytes_by_memory_kind(cache.artifact)[0],
            "device_traffic": float(counted["device"]), "xla_bytes_accessed": xla,
            "host_traffic": counted["host"], "host_to_device": host_to_device, "device_to_host": device_to_host,
            "floor_bytes": floor,
            "kernels": kernels, "compile_s": seconds, "compiled": compiled}


def plan_cell(target: Target, mesh, config, dtype: str, method, length: int, room: int, artifact, graphdef, params,
              *, verify: bool = True, kv_dtype: str | None = None) -> dict:
    """One row of the plan: the step compiled at the smallest batch (the mesh's data axis), the largest batch that fits
    (the parameters and the artifact are fixed, the rest of the compiled memory grows with the rows), compiled again at that batch to
    check it fits (unless ``verify`` is False); projected step times and tokens/s at both batches. ``kv_dtype``: the
    dtype the cache stores (None: the model's ``dtype``)."""
    import jax

    from kvjax.sharding import DATA, axis_size

    b1 = axis_size(mesh, DATA)
    one = compile_step(target, mesh, config, dtype, method, b1, length, room, artifact, graphdef=graphdef, params=params,
                       kv_dtype=kv_dtype)
    # fixed: each chip's shards of the parameters (the embedding and the LM head are replicated) and the artifact
    # (replicated: trained heads, codebooks)
    fixed = sum(shard_bytes(x) for x in jax.tree_util.tree_leaves(params)) + one["artifact_bytes"]
    per_row = (one["device_bytes"] - fixed) / b1
    row = {"batch1": b1, "fixed_bytes": fixed, "per_row_bytes": per_row, "device_bytes_b1": one["device_bytes"],
           "host_bytes_b1": one["host_bytes"], "traffic_b1": one["device_traffic"],
           "xla_bytes_accessed_b1": one["xla_bytes_accessed"], "host_traffic_b1": one["host_traffic"],
           "host_to_device_b1": one["host_to_device"], "device_to_host_b1": one.get("device_to_host"),
           "kernels_b1": one["kernels"],
           "floor_b1": one["floor_bytes"], "compile_s": one["compile_s"]}
    fits = int((target.memory_bytes - fixed) // per_row) if per_row > 0 else 0
    row["max_batch"] = max(0, fits - fits % b1)
    row["step_s_b1"] = one["device_traffic"] / target.bandwidth
    row["floor_s_b1"] = one["floor_bytes"] / target.bandwidth
    row["tokens_per_s_b1"] = b1 / row["step_s_b1"]
    B = row["max_batch"]
    if verify and B > b1:
        # the estimate is linear in the rows; temporaries need not be: compile at the estimate and, when XLA refuses
        # it or it does not fit, at smaller batches (a quarter less each time, at most VERIFY_ATTEMPTS compilations)
        row["max_batch_estimate"], row["verify_failures"] = B, []
        big = None
        for _ in range(VERIFY_ATTEMPTS):
            try:
                big = compile_step(target, mesh, config, dtype, method, B, length, room, artifact, graphdef=graphdef,
                                   params=params, kv_dtype=kv_dtype)
            except Exception as e:  # noqa: BLE001 - XLA refusing a batch (RESOURCE_EXHAUSTED) is an answer
                row["verify_failures"].append({"batch": B, "error": f"{type(e).__name__}: {e}"[:200]})
                big = None
            else:
                row["compile_s"] += big["compile_s"]
                if big["device_bytes"] <= target.memory_bytes:
                    break
                row["verify_failures"].append({"batch": B, "device_bytes": big["device_bytes"]})
                big = None
            smaller = (B * 3 // 4) - (B * 3 // 4) % b1
            if smaller <= b1:
                break
            B = smaller
        if big is None:  # nothing above one step's rows was shown to fit
            row.update(max_batch=b1, fits_checked=one["device_bytes"] <= target.memory_bytes,
                       step_s_max=row["step_s_b1"], tokens_per_s_max=row["tokens_per_s_b1"],
                       host_bytes_max=one["host_bytes"])
        else:
            row.update(max_batch=B, device_bytes_max=big["device_bytes"], fits_checked=True,
                       host_bytes_max=big["host_bytes"], traffic_max=big["device_traffic"],
                       step_s_max=big["device_traffic"] / target.bandwidth, kernels_max=big["kernels"],
                       host_to_device_max=big.get("host_to_device"), device_to_host_max=big.get("device_to_host"))
            row["tokens_per_s_max"] = B / row["step_s_max"]
    elif B == b1:
        row.update(fits_checked=one["device_bytes"] <= target.memory_bytes, step_s_max=row["step_s_b1"],
                   tokens_per_s_max=row["tokens_per_s_b1"], host_bytes_max=one["host_bytes"])
    return model_row(target, row)


def model_row(target: Target, row: dict) -> dict:
    """Add the cost model's step (:mod:`kvjax.evals.cost_model`) to a plan row where the target has measured
    constants: ``model_s_b1`` (and ``model_s_max``, ``model_tokens_per_s_max`` at the largest batch compiled) from
    the row's counted bytes, kernels and host-link bytes; a row from a plan that did not count the device -> host
    bytes models them as none (``model_d2h_counted``: False). Returns the row."""
    device = cost_model.DEVICES.get(target.name)
    if device is None or row.get("kernels_b1") is None:
        return row
    for suffix, traffic in (("b1", "traffic_b1"), ("max", "traffic_max")):
        if row.get(traffic) is None or row.get(f"kernels_{suffix}") is None:
            continue
        counts = cost_model.StepCounts(row[traffic], row[f"kernels_{suffix}"], row.get(f"host_to_device_{suffix}") or 0,
                                       row.get(f"device_to_host_{suffix}") or 0)
        row[f"model_s_{suffix}"] = cost_model.step_time(counts, device)["step_s"]
    row["model_d2h_counted"] = "device_to_host_b1" in row
    if "model_s_max" in row:
        row["model_tokens_per_s_max"] = row["max_batch"] / row["model_s_max"]
    elif row.get("max_batch") == row.get("batch1") and "model_s_b1" in row:
        row["model_tokens_per_s_max"] = row["batch1"] / row["model_s_b1"]
    return row


# ------------------------------------------------------------------------------------------------ report
def _gib(x) -> str:
    return number(None if x is None else x / GIB, missing="")


PLAN_COLUMNS = ["method", "budget", "prompt", "GiB/chip at batch 1", "GiB/row", "host GiB at batch 1", "max batch", "fits",
                "bytes moved/step, GiB (batch 1)", "floor GiB", "bytes-only ms/step (batch 1)", "÷ floor",
                "vs full, bytes-only (batch 1)", "modelled ms/step (batch 1)", "modelled ÷ bytes-only",
                "vs full, modelled (batch 1)", "host → device MiB/step (batch 1)", "device → host MiB/step (batch 1)",
                "kernels/step (batch 1)", "tokens/s at max batch, bytes-only", "vs full (max batch)",
                "modelled tokens/s at max batch", "compile s"]


def render(report: dict) -> str:
    """The Markdown plan: one table per target."""
    a = report["args"]
    lines = [
        f"# Decode plan: `{a['model']}` compiled for {', '.join(a['targets'])} on a CPU",
        "",
        f"- command: `{report['command']}`",
        f"- jax {report['jax']}, libtpu {report.get('libtpu') or '-'}, CUDA plugin {report.get('plugin') or '-'}, "
        f"{report['date']}; {a['dtype']} weights (random, the model's shapes), decode room {a['room']} tokens; "
        + (f"KV stored in {a['kv_dtype']} (`kv_dtype`: the full cache and the page pools, with a float32 scale per "
           "token and KV head for int8 / float8_e4m3fn: `kvjax.kv_quantization`)" if a.get("kv_dtype") else
           f"KV stored in the model's dtype ({a['dtype']})"),
        "- one-token decode step (`kvjax.decoding.decode_step`) over the method's compressed cache (`init_cache` + "
        "`compress`, traced: `kvjax.evals.synthetic.abstract_compressed_cache`), compiled by XLA for the target without it",
        "- memory per chip from `memory_analysis()` (arguments + outputs - donated + temporaries); `max batch`: the "
        "largest batch whose step fits the chip's memory, estimated linearly (the parameters and the artifact fixed, "
        "the rest of the compiled memory per row) and compiled at that batch; when XLA refuses it or it does not fit, "
        f"compiled again a quarter smaller, up to {VERIFY_ATTEMPTS} times: the largest batch that compiled and fit, "
        "with the estimate in parentheses (`fits`: whether one did); bytes-only step = bytes moved / "
        "nominal HBM bandwidth per chip (a bound: no kernel costs, host transfers hidden); "
        "floor = (a chip's share of the weights read + the cache's device bytes / chips) / bandwidth",
        f"- {cost_model.ASSUMPTIONS} ([back-test](../cost_model_backtest.md)); none for TPU targets (no measured "
        "constants)" + (f"; added to this plan by `{report['remodel']['command']}` ({report['remodel']['date']}) from "
        "the counts its compile recorded" + ("" if report["remodel"].get("d2h_counted") else
                                             ", device → host bytes not counted then (modelled as none)")
                        if report.get("remodel") else ""),
        "- bytes moved: counted from the compiled HLO per kernel, device memory only (`kvjax.evals.plan.hlo_bytes`: "
        "operands and outputs; a sliced operand's slices, through bitcasts too; an in-place update's update; a loop "
        "body times its known trip count; a conditional's largest branch; a host computation's work as host "
        "traffic; a kernel's whole operands, so Quest's selected pages count as all, except an in-place kernel's "
        "(outputs aliased to operands: its other operands, read and written once); a TPU's async slices and copies "
        "into on-chip memory (VMEM) count their HBM side once); on a TPU, XLA's "
        "`cost_analysis()['bytes accessed']` in parentheses, which also counts the on-chip side of those copies "
        "and the host computations' operands",
        "- host → device / device → host: the bytes the step moves over the host link (GPU targets; "
        "`kvjax.evals.cost_model.host_transfers`: a host call's results / its device operands, copies between host "
        "and device memory, device kernels reading or writing host memory)",
        "- kernels/step: the compiled step's instructions that launch work, as often as they run (fusions, custom "
        "calls, copies; `kvjax.evals.plan.kernel_launches`)",
        "",
    ]
    for tname, rows in report["targets"].items():
        t = TARGETS[tname]
        lines += [f"## {tname}: {t.chips} chip(s), {t.memory_bytes / GIB:.0f} GiB and {t.bandwidth / 1e12:.2f} TB/s "
                  f"per chip, mesh (data, model) = {tuple(report['meshes'][tname])}", ""]
        full = {r["length"]: r for r in rows if r["method"] == "full" and "error" not in r}
        cells = []
        for r in rows:
            if "error" in r:
                cells.append([r["method"], r["budget"], r["length"], r["error"]] + [""] * (len(PLAN_COLUMNS) - 4))
                continue
            f = full.get(r["length"])
            speed = f"{f['step_s_b1'] / r['step_s_b1']:.2f}×" if f else ""
            tps = r.get("tokens_per_s_max")
            tps_ratio = f"{tps / f['tokens_per_s_max']:.2f}×" if f and tps and f.get("tokens_per_s_max") else ""
            fits = {True: "yes", False: "no"}.get(r.get("fits_checked"), "")
            batch = str(r["max_batch"])
            if r.get("max_batch_estimate", r["max_batch"]) != r["max_batch"]:  # the linear estimate did not compile or fit
                batch += f" (est. {r['max_batch_estimate']})"
            h2d = r.get("host_to_device_b1")  # absent in plans made before it was counted
            d2h = r.get("device_to_host_b1")
            xla = f" (XLA {_gib(r['xla_bytes_accessed_b1'])})" if r.get("xla_bytes_accessed_b1") is not None else ""
            model = r.get("model_s_b1")
            model_speed = f"{f['model_s_b1'] / model:.2f}×" if f and model and f.get("model_s_b1") else ""
            cells.append([
                r["method"], r["budget"], r["length"], _gib(r["device_bytes_b1"]), _gib(r["per_row_bytes"] * r["batch1"]),
                _gib(r["host_bytes_b1"]), batch, fits, _gib(r["traffic_b1"]) + xla, _gib(r["floor_b1"]),
                f"{r['step_s_b1'] * 1e3:.2f}", f"{r['step_s_b1'] / r['floor_s_b1']:.2f}", speed,
                number(None if model is None else model * 1e3, missing=""),
                number(None if model is None else model / r["step_s_b1"], missing=""), model_speed,
                number(None if h2d is None else h2d / 2**20, "{:.1f}", missing=""),
                number(None if d2h is None else d2h / 2**20, "{:.2f}", missing=""), r.get("kernels_b1", ""),
                number(tps, "{:.0f}", missing=""), tps_ratio,
                number(r.get("model_tokens_per_s_max"), "{:.0f}", missing=""), f"{r['compile_s']:.0f}"])
        lines += table(PLAN_COLUMNS, cells, align="llrrrrrl" + "r" * (len(PLAN_COLUMNS) - 8)) + [""]
    return "\n".join(lines)


def remodel(path: str, out: str | None, command: str) -> int:
    """Re-render the plan JSON at ``path`` with the cost model's columns (:func:`model_row`) from the counts its
    compile recorded; Markdown and JSON to ``out`` (default: over ``path``'s Markdown and JSON)."""
    import json

    with open(path) as f:
        report = json.load(f)
    for tname, rows in report["targets"].items():
        for r in rows:
            if "error" not in r:
                model_row(TARGETS[tname], r)
    report["remodel"] = {"command": command,
                         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         "d2h_counted": all("device_to_host_b1" in r for rows in report["targets"].values()
                                            for r in rows if "error" not in r)}
    out = out or os.path.splitext(path)[0] + ".md"
    write_report(out, render(report), report)
    print(render(report))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    """Compile every (target, method, budget, length) and write the plan (Markdown + JSON)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m kvjax.evals.plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b", help="ready or shape-only model (its shapes; random weights)")
    p.add_argument("--targets", default="h100,v5e-8", help=f"comma-separated, of {','.join(TARGETS)}")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated methods (specs allowed)")
    p.add_argument("--budgets", default="0.1,0.25", help="comma-separated budgets (fractions kept)")
    p.add_argument("--lengths", default="32768,131008", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--room", type=int, default=64, help="decode room per head (tokens)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "int8", "float8_e4m3fn"],
                   help="dtype the cache stores (the full cache and the page pools; default: --dtype); methods "
                        "without a quantized layout report the error in their cell")
    p.add_argument("--no-verify", action="store_true", help="skip compiling at the largest batch")
    p.add_argument("--out", default=None, help=f"Markdown report (default {DEFAULT_OUT}; JSON beside it)")
    p.add_argument("--remodel", default=None, metavar="PLAN.json",
                   help="add the cost model's columns to a committed plan from the counts it recorded (no compile); "
                        "rewrites it, or writes --out")
    args = p.parse_args(argv)
    if args.remodel:
        return remodel(args.remodel, args.out, "python -m kvjax.evals.plan " + shlex.join(argv))
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in args.targets if t not in TARGETS]
    if bad:
        p.error(f"unknown target(s) {bad}; allowed: {', '.join(TARGETS)}")
    from kvjax.evals.gpu_schedule import compile_only_cuda

    compile_only_cuda()
    import importlib.metadata

    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from kvjax.evals.bench_methods import parse_methods
    from kvjax.evals.synthetic import synthetic_artifact
    from kvjax.cache import CacheSpec
    from kvjax.methods import get_method
    from kvjax.models import model_architecture

    config, _ = model_architecture(args.model)
    names = parse_methods(args.methods)
    budgets = [float(b) for b in args.budgets.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    args.out = args.out or DEFAULT_OUT.format(model=args.model, kv=f"_{args.kv_dtype}" if args.kv_dtype else "",
                                              jax=jax.__version__)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    cells = [(n, b) for n in names for b in ([None] if n == "full" else budgets)]
    report = {"command": "python -m kvjax.evals.plan " + shlex.join(argv), "args": vars(args), "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "targets": {},
              "meshes": {}}
    for dist in ("libtpu", "jax-cuda12-plugin"):
        try:
            report["libtpu" if dist == "libtpu" else "plugin"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    with tqdm(total=len(args.targets) * len(cells) * len(lengths), desc="plan", unit="cell", file=sys.stderr) as bar:
        for tname in args.targets:
            target = TARGETS[tname]
            mesh = target_mesh(target, config)
            report["meshes"][tname] = tuple(mesh.devices.shape)
            graphdef, params = abstract_params(config, jnp.dtype(args.dtype), mesh)
            rows = report["targets"].setdefault(tname, [])
            for L in lengths:
                for name, budget in cells:
                    bar.set_postfix_str(f"{tname} {name} {budget} L={L}")
                    row = {"method": name, "budget": budget, "length": L}
                    try:
                        method = get_method(name) if budget is None else get_method(name, budget=budget)
                        spec = CacheSpec.for_model(config, 1, L, args.room, args.dtype, kv_dtype=args.kv_dtype)
                        artifact = synthetic_artifact(method, spec)
                        row.update(plan_cell(target, mesh, config, args.dtype, method, L, args.room, artifact,
                                             graphdef, params, verify=not args.no_verify, kv_dtype=args.kv_dtype))
                    except Exception as e:  # noqa: BLE001 - an infeasible or failing cell is reported, the plan goes on
                        row["error"] = f"{type(e).__name__}: {e}".replace("|", "/").replace("\n", " ")[:240]
                    rows.append(row)
                    bar.update()
                    write_report(args.out, render(report), report)
    print(render(report))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
