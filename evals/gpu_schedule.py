"""Where XLA:GPU schedules a decode step's host recalls, and what it launches per step, read from the program compiled
for an H100 or H200 without one.

``python -m kvjax.evals.gpu_schedule [--methods ...] [--length 30720] [--target h100] [--out FILE.md]``

A recall's host gather (HeteroCache, SyncKV, HCAttention: :mod:`kvjax.host_tier`) is a host-offloaded computation.
XLA:GPU runs it as a ``custom-call-start`` / ``custom-call-done`` pair (``HostExecute``): the device work scheduled
between the two runs while the host gathers and copies; nothing scheduled between them means nothing overlaps. This
tool compiles each method's jitted decode loop with XLA:GPU's own compiler for the target GPU (deviceless
ahead-of-time compilation, jax's CUDA plugin on a machine without a GPU), reads the scheduled HLO and reports, for
every host call of the loop's body, how many device operations (fusions, kernels, copies, conditionals) come before
its start, between its start and its done, and after its done, and how many conditionals the step holds (each a host
synchronisation on a GPU). It does so twice: with kvjax's decode options
(:func:`kvjax.decoding.decode_compiler_options`, as :func:`kvjax.decoding.decode_loop` compiles on a GPU) and with
XLA's defaults. For each method it also compiles the one-token step and reads what XLA:GPU's runtime launches per
step: its thunk sequence, where XLA groups kernels into command buffers (CUDA graphs), so that a graph's kernels cost
no launch of their own (:func:`command_buffers`).

It shows the schedule, not the time: how long the step's device work between start and done takes against the gather
is for a GPU to measure (``scripts/gpu_checks.sh bench``). The compilation runs XLA:GPU's passes without the device,
so without autotuning (and with a fallback sort where XLA lacks data for CUB): fusion choices and the scheduler's cost
estimates may differ somewhat from a compilation on the GPU.

Needs jax's CUDA plugin at jax's version, for its compiler only (no GPU, driver or CUDA libraries):
``scripts/setup_env.sh`` puts its two wheels in ``.aot-gpu/``, so run ``PYTHONPATH=.aot-gpu:. python -m
kvjax.evals.gpu_schedule``. The tool runs JAX on the CPU (:func:`compile_only_cuda`). jax exposes deviceless compilation
only in part: the compile step uses jax internals (``jax._src``), checked with jax 0.10.2 and 0.11.2.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import glob
import os
import re
import shlex
import sys
import tempfile
import time

from kvjax.evals.hlo import branch_computations, loop_bodies, parse_module, shape_bytes
from kvjax.reports import table, write_report

DEFAULT_METHODS = ("full,synckv:recall_schedule=whole,synckv:recall_schedule=spread,"
                   "synckv:recall_schedule=pipelined,heterocache:recall_schedule=whole,heterocache:recall_schedule=spread,"
                   "heterocache:recall_schedule=pipelined")
DEFAULT_OUT = "docs/results/gpu_schedule_{target}/report_jax{jax}.md"

# XLA's description of each target (xla.stream_executor.GpuTargetConfigProto, text format): the SXM parts' published
# figures (132 SMs, 50 MiB L2, 3.35 / 4.8 TB/s), compute capability 9.0, CUDA 12.8 / cuDNN 9.7.
_GPU_INFO = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{name}"
"""
TARGETS = {
    "h100": _GPU_INFO.format(bandwidth=3352320000000, memory=84929347584, name="NVIDIA H100 80GB HBM3"),
    "h200": _GPU_INFO.format(bandwidth=4800000000000, memory=150754820096, name="NVIDIA H200"),
}

# HLO operations that launch nothing on the device (bookkeeping, or the async pair's own halves)
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "custom-call-start", "custom-call-done",
         "after-all", "opt-barrier", "partition-id", "replica-id", "iota"}
def host_call_windows(hlo: str) -> list[dict]:
    """Every ``HostExecute`` start/done pair of a scheduled HLO module, in program order: its computation, whether
    that computation is a loop body (``loop_body``) or a conditional's branch (``in_branch``), the device operations
    of the computation before the start, between start and done, after the done and in all, and the bytes the call
    returns."""
    bodies, branches = loop_bodies(hlo), branch_computations(hlo)
    found = []
    for computation, ops in parse_module(hlo).items():
        starts = {}
        device = [i.op not in _FREE for i in ops]
        for k, i in enumerate(ops):
            if i.op == "custom-call-start" and 'custom_call_target="HostExecute"' in i.tail:
                starts[i.name] = k
            elif i.op == "custom-call-done" and i.operands and i.operands[0] in starts:
                s = starts.pop(i.operands[0])
                found.append({"computation": computation, "loop_body": computation in bodies,
                              "in_branch": computation in branches, "before": sum(device[:s]),
                              "between": sum(device[s + 1:k]), "after": sum(device[k + 1:]), "total": sum(device),
                              "bytes": shape_bytes(i.shape)})
    return found


def loop_conditionals(hlo: str) -> int:
    """``conditional`` operations in the loop bodies of a scheduled HLO module (a decode step's; those nested in a
    branch are not counted). On a GPU each one copies its predicate to the host and waits for it: a host
    synchronisation per step."""
    bodies = loop_bodies(hlo)
    return sum(i.op == "conditional" for name, ops in parse_module(hlo).items() if name in bodies for i in ops)


def compile_only_cuda() -> None:
    """Run JAX on the CPU, with the CUDA plugin only as a compiler: call it before anything starts a JAX backend
    (the plugin then checks for no GPU)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # in case a platform list names cuda after all


def gpu_topology(target: str):
    """jax's deviceless topology of one ``target`` GPU (``TARGETS``); a clear error without the CUDA plugin."""
    import jax
    from jax.experimental import topologies

    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        raise SystemExit(
            "kvjax.evals.gpu_schedule needs jax's CUDA plugin to compile for a GPU (no GPU needed): scripts/setup_env.sh "
            "installs it in .aot-gpu/; run PYTHONPATH=.aot-gpu:. python -m kvjax.evals.gpu_schedule") from None
    return topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target], topology="1x1x1")


def gpu_executable(module_text: str, topology, options: dict):
    """XLA:GPU's executable of a StableHLO module (one device of ``topology``) compiled with the XLA ``options``:
    its ``hlo_modules()`` and ``get_compiled_memory_stats()`` are readable, it cannot run."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jaxlib.mlir import ir

    device = topology.devices[0]
    compile_options = compiler.get_compile_options(num_replicas=1, num_partitions=1, device_assignment=[device],
                                                   env_options_overrides=options)
    with mlir.make_ir_context():
        module = ir.Module.parse(module_text)
    return device.client.compile(module, executable_devices=xla_client.DeviceList((device,)),
                                 compile_options=compile_options)


def compile_for_gpu(module_text: str, topology, options: dict) -> str:
    """XLA:GPU's scheduled HLO of a StableHLO module (one device of ``topology``) compiled with the XLA ``options``."""
    return gpu_executable(module_text, topology, options).hlo_modules()[0].to_string()


def compile_with_thunks(module_text: str, topology, options: dict) -> tuple[str, str]:
    """:func:`compile_for_gpu`, and the program's thunk sequence: the commands XLA:GPU's runtime issues, after its
    thunk passes have grouped kernels into command buffers (CUDA graphs). XLA writes it only to a dump directory
    (``xla_dump_to``, here a temporary one); read it with :func:`command_buffers`."""
    with tempfile.TemporaryDirectory(prefix="kvjax-thunks-") as d:
        hlo = compile_for_gpu(module_text, topology, {**options, "xla_dump_to": d})
        found = sorted(glob.glob(os.path.join(d, "*thunk_sequence_after_thunk_passes.txt")))
        if len(found) != 1:
            raise RuntimeError(f"expected one thunk sequence in XLA's dump, found {len(found)}: this XLA:GPU does not "
                               "write *thunk_sequence_after_thunk_passes.txt under xla_dump_to")
        with open(found[0]) as f:
            return hlo, f.read()


def step_launches(module_text: str, topology, options: dict) -> tuple[str, dict]:
    """:func:`compile_with_thunks`, and what the runtime launches per run of the program: :func:`command_buffers` of
    its thunks, with the device kernels :func:`kvjax.evals.plan.kernel_launches` counts in its HLO (``kernels``)."""
    from kvjax.evals.plan import kernel_launches

    hlo, thunks = compile_with_thunks(module_text, topology, options)
    return hlo, {**command_buffers(thunks), "kernels": kernel_launches(hlo)}


_THUNK = re.compile(r"^( *)\d+: (k\w+)")


def command_buffers(thunks: str) -> dict:
    """What the host launches per run of a program, from its thunk sequence (:func:`compile_with_thunks`): the
    top-level thunks in order (``top``, their kinds; each ``kCommandBuffer`` is one CUDA graph launch), the command
    buffers among them (``graphs``), the operations recorded inside them (``in_graphs``: the innermost thunks, so a
    loop or conditional in a graph counts by its body's operations) and the top-level thunks that are not command
    buffers (``outside``: kernels launched one by one, copies, host-call starts and waits)."""
    lines = [(len(m[1]), m[2]) for m in map(_THUNK.match, thunks.splitlines()) if m]
    top = [kind for indent, kind in lines if indent == 0]
    in_graphs, graph = 0, False
    for k, (indent, kind) in enumerate(lines):
        if indent == 0:
            graph = kind == "kCommandBuffer"
        elif graph and not (k + 1 < len(lines) and lines[k + 1][0] > indent):
            in_graphs += 1
    return {"top": top, "graphs": top.count("kCommandBuffer"), "in_graphs": in_graphs,
            "outside": len(top) - top.count("kCommandBuffer")}


@contextlib.contextmanager
def gpu_lowering():
    """Trace as on a GPU: ``jax.default_backend()`` says ``"gpu"`` (kvjax picks the kernels' GPU forms from it) and,
    where jax has abstract devices, an abstract H100 mesh names the GPU model the Triton lowering needs (jax >= 0.11
    asks the device otherwise; compute capability 9.0, also the H200's). Yields the mesh the inputs' shardings must use (that one, else the CPU's)."""
    import jax

    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        if hasattr(jax.sharding, "AbstractDevice"):
            device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda")
            mesh = jax.sharding.AbstractMesh((1,), ("_",), abstract_device=device)
            with jax.sharding.use_abstract_mesh(mesh):
                yield mesh
        else:
            yield jax.sharding.Mesh(jax.devices("cpu")[:1], ("_",))
    finally:
        jax.default_backend = real


def export_for_gpu(fn, *args, donate_argnums=()):
    """``jax.export`` of ``jax.jit(fn)`` for ``cuda`` as on a GPU (:func:`gpu_lowering`): ``args`` are abstract
    (``jax.ShapeDtypeStruct``), placed replicated on the GPU lowering's mesh with their memory kinds (``pinned_host``
    host tiers stay there); the Pallas kernels' custom calls (Triton, Mosaic GPU) are allowed."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvjax.pallas_kernels.backend import MOSAIC_GPU_CUSTOM_CALL, TRITON_CUSTOM_CALL

    def kind(x):
        sharding = getattr(x, "sharding", None)
        return getattr(sharding, "memory_kind", None) or "device"

    with gpu_lowering() as mesh:  # a NamedSharding's memory kind reaches the traced value's type
        placed = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, P(), memory_kind=kind(x))), args)
        return jax.export.export(jax.jit(fn, donate_argnums=donate_argnums), platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c)
                                                  for c in (TRITON_CUSTOM_CALL, MOSAIC_GPU_CUSTOM_CALL)])(
            *placed)


def _decode_inputs(model, method, length: int, room: int, artifact):
    """Shapes of a decode call's ``(params, first tokens, compressed cache, key)`` for one row after a ``length``-token
    prompt with ``room`` tokens to decode (the cache from :func:`kvjax.evals.synthetic.abstract_compressed_cache`)."""
    import jax
    import jax.numpy as jnp

    from kvjax.evals.synthetic import abstract_compressed_cache, cpu_mesh
    from kvjax.cache import CacheSpec

    spec = CacheSpec.for_model(model.config, 1, length, room, model.dtype)
    cache = abstract_compressed_cache(method, spec, cpu_mesh(), artifact)
    params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.params)
    return params, jax.ShapeDtypeStruct((1,), jnp.int32), cache, jax.eval_shape(lambda: jax.random.PRNGKey(0))


def decode_module(model, method, length: int, new_tokens: int, artifact=None) -> str:
    """StableHLO of ``method``'s decode loop for one row after a ``length``-token prompt, lowered for ``cuda``
    (``artifact``: the method's calibration, default the one shipped for the model). Only shapes are needed: the
    compressed cache's come from :func:`kvjax.evals.synthetic.abstract_compressed_cache` (traced, not run)."""
    import jax

    from kvjax.decoding import decode_loop_jit

    inputs = _decode_inputs(model, method, length, new_tokens, artifact)

    def loop(params, first, cache, key):
        return decode_loop_jit(model.graphdef, params, first, cache, key, max_new_tokens=new_tokens)

    jax.clear_caches()  # the kernels' form is chosen at trace time: trace again, as on a GPU
    return export_for_gpu(loop, *inputs).mlir_module()


def step_module(model, method, length: int, artifact=None) -> str:
    """StableHLO of ``method``'s one-token decode step (:func:`kvjax.decoding.decode_step_jit`, the cache donated) for
    one row after a ``length``-token prompt, lowered for ``cuda``; shapes only, as :func:`decode_module`."""
    import jax

    from kvjax.decoding import decode_step_jit

    inputs = _decode_inputs(model, method, length, 1, artifact)

    def step(params, tokens, cache, key):
        return decode_step_jit(model.graphdef, params, tokens, cache, key)

    jax.clear_caches()  # as decode_module
    return export_for_gpu(step, *inputs, donate_argnums=(2,)).mlir_module()


def summarize(windows: list[dict]) -> dict:
    """The loop body's host calls (outside conditionals) of one compilation, as one table row."""
    calls = [w for w in windows if w["loop_body"] and not w["in_branch"]]
    if not calls:
        return {"calls": 0}
    return {"calls": len(calls), "before": [w["before"] for w in calls], "between": [w["between"] for w in calls],
            "after": [w["after"] for w in calls], "total": calls[0]["total"],
            "mib": sum(w["bytes"] for w in calls) / 2**20}


def render(report: dict) -> str:
    """The Markdown report."""
    a = report["args"]
    lines = [
        f"# Where XLA:GPU schedules the decode step's host recalls ({a['target'].upper()}, compiled without one)",
        "",
        f"- command: `{report['command']}`",
        f"- jax {report['jax']}, CUDA plugin {report['plugin']}, {report['date']}; model `{a['model']}` ({a['dtype']}, "
        f"its shapes with random weights), prompt {a['length']} tokens, budget {a['budget']}, decode loop of "
        f"{a['new_tokens']} tokens",
        f"- kvjax's decode options on a GPU: {report['kvjax_options']}",
        "",
        "Per decode step (the `while` body), the host-offloaded calls outside conditionals (a recall's gathers; XLA "
        "merges a step's calls whose operands are ready together) and, for each, the device operations of the step "
        "before its start, between its start and its done (what can overlap the gather and its copy), and after its "
        "done. `in conditionals`: host calls inside a conditional's branch (taken only on some steps). `conditionals "
        "/ step`: conditionals in the loop body, each a host synchronisation on a GPU (it reads its predicate on the "
        "host).",
        "",
    ]
    head = ["method", "XLA options", "host calls / step", "ops before start", "ops between start and done",
            "ops after done", "ops in the step", "MiB returned / step", "in conditionals", "conditionals / step",
            "compile s"]
    rows = []
    for row in report["rows"]:
        if "error" in row:
            rows.append([row["method"], row["options"], f"error: {row['error']}"] + [""] * 8)
            continue
        s = row["summary"]
        calls = ([", ".join(map(str, s[k])) for k in ("before", "between", "after")] + [s["total"], f"{s['mib']:.2f}"]
                 if s["calls"] else [""] * 5)
        rows.append([row["method"], row["options"], s["calls"], *calls, row["in_branches"], row["conditionals"],
                     f"{row['compile_s']:.1f}"])
    lines += table(head, rows, align="llrlllrrrrr")
    if report.get("graphs"):
        lines += ["", "## CUDA graphs per decode step", "",
                  "The one-token step (`kvjax.decoding.decode_step_jit`) compiled with kvjax's options, as XLA:GPU's "
                  "runtime issues it: its thunk sequence after XLA's thunk passes (`compile_with_thunks`), where "
                  "kernels run inside command buffers (CUDA graphs: one launch each, the graph's kernels without a "
                  "launch of their own). `host launches / step`: the top-level thunks (each graph one); `operations in "
                  "graphs`: the kernels, copies and memsets recorded in them; `outside`: the other top-level thunks by "
                  "kind; `kernels (HLO)`: the step's device kernels as `kvjax.evals.plan.kernel_launches` counts them "
                  "from the HLO (the cost model's count; it leaves out copies of zero-sized arrays, which XLA keeps as "
                  "copy commands in a graph).", ""]
        grows = []
        for g in report["graphs"]:
            if "error" in g:
                grows.append([g["method"], f"error: {g['error']}", "", "", "", ""])
                continue
            outside = collections.Counter(kind for kind in g["top"] if kind != "kCommandBuffer")
            grows.append([g["method"], len(g["top"]), g["graphs"], g["in_graphs"],
                          ", ".join(f"{n} × {k}" for k, n in outside.items()) or "none", g["kernels"]])
        lines += table(["method", "host launches / step", "CUDA graphs", "operations in graphs", "outside",
                        "kernels (HLO)"], grows, align="lrrrlr")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Compile every method's decode loop for the target GPU with kvjax's options and XLA's defaults; write the report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m kvjax.evals.gpu_schedule",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="ready model or HF directory (its shapes only)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated methods, as `kvjax bench --methods`")
    p.add_argument("--length", type=int, default=30720, help="prompt tokens (default 30720, as the GPU bench)")
    p.add_argument("--budget", type=float, default=0.25, help="fraction of the prompt kept (default 0.25)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens of the decode loop (its shapes; default 8)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--target", default="h100", choices=sorted(TARGETS))
    p.add_argument("--out", default=None, help=f"Markdown report (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    compile_only_cuda()

    import importlib.metadata

    import jax
    from tqdm import tqdm

    from kvjax.evals.bench_methods import make_methods, parse_methods
    from kvjax.decoding import GPU_DECODE_COMPILER_OPTIONS
    from kvjax.models import load_model

    topology = gpu_topology(args.target)
    args.out = args.out or DEFAULT_OUT.format(target=args.target, jax=jax.__version__)
    model = load_model(args.model, args.dtype, tokenizer=False, random_weights=True)
    names = parse_methods(args.methods)
    methods = make_methods(names, args.budget)
    schedules = {"kvjax": dict(GPU_DECODE_COMPILER_OPTIONS), "xla-default": {}}
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    rows, graphs = [], []
    with tqdm(total=len(methods) * (len(schedules) + 1), desc="compile for " + args.target, unit="program",
              file=sys.stderr) as bar:
        for name, method in methods.items():
            try:
                module = decode_module(model, method, args.length, args.new_tokens)
            except Exception as e:  # noqa: BLE001 - recorded in the report, the run goes on
                rows += [{"method": name, "options": o, "error": f"{type(e).__name__}: {e}"[:300]} for o in schedules]
                bar.update(len(schedules) + 1)
                continue
            for label, options in schedules.items():
                bar.set_postfix_str(f"{name} {label}")
                t = time.perf_counter()
                hlo = compile_for_gpu(module, topology, options)
                seconds = time.perf_counter() - t
                windows = host_call_windows(hlo)
                rows.append({"method": name, "options": label, "compile_s": seconds, "summary": summarize(windows),
                             "in_branches": sum(w["in_branch"] for w in windows), "conditionals": loop_conditionals(hlo),
                             "windows": windows})
                bar.update()
            bar.set_postfix_str(f"{name} step")
            try:
                _, launches = step_launches(step_module(model, method, args.length), topology,
                                            dict(GPU_DECODE_COMPILER_OPTIONS))
                graphs.append({"method": name, **launches})
            except Exception as e:  # noqa: BLE001 - recorded in the report, the run goes on
                graphs.append({"method": name, "error": f"{type(e).__name__}: {e}"[:300]})
            bar.update()
    report = {
        "command": "python -m kvjax.evals.gpu_schedule " + shlex.join(argv), "args": vars(args), "rows": rows,
        "graphs": graphs,
        "jax": jax.__version__, "plugin": importlib.metadata.version("jax-cuda12-plugin"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kvjax_options": ", ".join(f"`{k}={v}`" for k, v in GPU_DECODE_COMPILER_OPTIONS.items()),
    }
    md = render(report)
    write_report(args.out, md, report)
    print(md)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
