"""Throughput mode of the methods benchmark (``kvjax bench --memory-budget GIB``): the largest batch each method decodes
in a given memory, and its tokens/s at that batch, against the full cache at its own largest batch.

Compressing the KV cache pays most where memory bounds the batch: a 10% cache fits several times the rows, and a
decode step reads the weights once for all of them. This mode measures that without any prefill. For each prompt
length ``L`` and method (the same ``--methods`` / ``--budget`` / ``--lengths`` / ``--new-tokens`` as the bench):

* **memory of a batch**: the jitted decode loop (``decode_loop_jit``, ``--new-tokens`` tokens, no EOS, kvjax's
  compiler options for the backend) compiled for ``B`` rows over the method's compressed cache described without
  allocating it (:func:`kvjax.evals.synthetic.abstract_compressed_cache`: ``init_cache`` + ``compress`` traced at the
  real shapes) and the model's parameters. Its ``memory_analysis()``: arguments + outputs - donated (aliased) buffers
  + temporaries, i.e. the weights, the artifact, the cache and the step's temporaries (logits, activations, attention
  scratch) as XLA's buffer assignment sizes them. Not in it: the runtime, compiled code, the allocator's slack and the
  Python process, so the resident set is larger (the budget is for what the decode program holds). On the CPU the host
  tiers (``pinned_host``) are in the same RAM and ``memory_analysis()`` counts them among the arguments; on an
  accelerator their host bytes are reported apart and the budget is the device's memory;
* **largest batch**: compiled at 1 and 2 rows, the memory is extrapolated linearly to the budget, then checked by
  compiling at the estimate and one row more, searching (doubling, then bisecting) when the estimate is off
  (:func:`largest_batch`): the largest ``B`` whose compiled memory is at most the budget, every answer compiled;
* **tokens/s** at that batch: the cache built directly (:func:`kvjax.evals.synthetic.replicated_cache`: one row's
  prefill-stage state filled with random values, the method's own ``finish_prefill`` (its real selection and layout),
  the row tiled to ``B`` rows), the decode loop compiled ahead of time, run once to warm up and ``--repeats`` times
  timed, each run continuing from the cache the previous one returned (the cache has room for all of them: room =
  (repeats + 1) x N tokens, the same room the memory was compiled with). Timing a decode step needs no real prefill:
  the cache's contents do not change what a step computes and reads (the same shapes, the same kernels; decode from a
  synthetic cache takes 0.94-1.19x the time from a real prefill's on this CPU, ``python -m research.bench_scale
  --compare-prefill``). tokens/s = B x (N - 1) ÷ the best timed run's seconds.

Data-dependent behaviour is what random contents cannot reproduce (HeteroCache's drift trigger rate, which tokens are
kept); see :mod:`kvjax.evals.synthetic`. A method with no artifact for the model gets a synthetic one only with
``--random-weights`` (as in the bench). One device only (``replicated_cache`` lays out one device's pages).

``--kv-dtype D`` as in the bench: every listed method's compressed cache stored in ``D`` (its memory and cache bytes
the stored ones, scales included), the full-cache reference in the model's dtype, ``full`` listed adds the row
``full:kv_dtype=D``; a method that cannot store ``D`` is refused before anything is compiled.

Results: Markdown at ``--out`` (default ``docs/results/bench_throughput_<model>_<GIB>gib.md``), JSON and a plot (largest
batch and tokens/s vs length per method) next to it.

**Fixed batches without a prefill** (``kvjax bench --no-prefill --batch 1,4,16``): the same cache construction and
timing at each given batch instead of the largest one, for every (length, batch) cell, each method's tokens/s and
bytes against the full cache's in the same cell (:func:`run_batches`). On a machine that prefills a few hundred tokens
a second this reaches the cells a prefilled ``--batch`` run cannot (16 rows of 30K tokens are 0.5M prefilled tokens per
prefill, and a cell prefills up to four times). Results: ``docs/results/bench_batch_synthetic_<model>.md`` by default, rewritten after each cell.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import shlex
import sys
import time

import numpy as np

from kvjax.evals.bench_machine import GIB, MIB, machine_info, real_compilations, versions
from kvjax.evals.bench_methods import (bench_artifacts, check_methods_fit, decode_options, make_methods, method_budget,
                                       storage_dtype, tokens_per_second)
from kvjax.evals.bench_methods_report import REFERENCE, kv_storage_line, length_axes, plot_batches
from kvjax.reports import MISSING, figure, number, save_figure, table
from kvjax.reports import write_report as write_files

SEARCH_LIMIT = 24  # compilations at most per cell while searching the largest batch


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_stem(model: str) -> str:
    """A model's name in a report's file name: a path's last component, unsafe characters replaced."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(os.path.normpath(model))) or "model"


def default_out(model: str, memory_gib: float) -> str:
    """``docs/results/bench_throughput_<model>_<GIB>gib.md``."""
    return os.path.join("docs", "results", f"bench_throughput_{model_stem(model)}_{memory_gib:g}gib.md")


def default_batch_out(model: str) -> str:
    """``docs/results/bench_batch_synthetic_<model>.md``: the fixed-batch mode's report."""
    return os.path.join("docs", "results", f"bench_batch_synthetic_{model_stem(model)}.md")


def largest_batch(memory_of, budget: int, limit: int = SEARCH_LIMIT) -> tuple[int, dict]:
    """The largest batch ``B >= 1`` with ``memory_of(B) <= budget`` (0 when one row does not fit), and every probed
    batch's memory. Memory is assumed to grow with the batch: from ``memory_of(1)`` and ``memory_of(2)`` the budget's
    batch is extrapolated linearly, then the estimate and the batch above it are probed, doubling up or bisecting down
    until a fitting batch sits right below a non-fitting one (at most ``limit`` probes, else RuntimeError)."""
    probes: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in probes:
            if len(probes) >= limit:
                raise RuntimeError(f"no largest batch after {limit} compilations (probed {sorted(probes)})")
            probes[b] = int(memory_of(b))
        return probes[b] <= budget

    if not fits(1):
        return 0, probes
    if not fits(2):
        return 1, probes
    per_row = probes[2] - probes[1]
    estimate = max(3, 2 + (budget - probes[2]) // per_row) if per_row > 0 else 4
    lo, hi = 2, estimate  # lo fits, hi does not (once probed)
    if fits(estimate):
        lo = hi = estimate + 1
        if not fits(hi):
            return estimate, probes
        while fits(hi):  # the estimate was low: double
            lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, probes


def compiled_memory(compiled) -> dict:
    """``memory_analysis()`` of a compiled program: ``device_bytes`` (arguments + outputs - aliased + temporaries),
    ``host_bytes`` likewise in host memory, ``temp_bytes``."""
    m = compiled.memory_analysis()
    return {
        "device_bytes": int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                            + m.temp_size_in_bytes),
        "host_bytes": int(m.host_argument_size_in_bytes + m.host_output_size_in_bytes - m.host_alias_size_in_bytes
                          + m.host_temp_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
    }


def room_tokens(new_tokens: int, repeats: int) -> int:
    """Slots a throughput cell's cache has after the prompt: a warm-up run and ``repeats`` timed runs of
    ``new_tokens`` each, one continuing from the other."""
    return (repeats + 1) * new_tokens


def decode_memory(model, method, L: int, room: int, batch: int, new_tokens: int, artifact=None,
                  options: dict | None = None, kv_dtype: str | None = None) -> dict:
    """Compile the decode loop for ``batch`` rows of ``method``'s compressed cache after ``L`` prompt tokens with
    ``room`` slots, stored in ``kv_dtype`` (None: the model's dtype; described abstractly, nothing allocated):
    :func:`compiled_memory` of it, plus the cache's own bytes (``cache_device_bytes``, ``cache_host_bytes``) and the
    compile seconds."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from kvjax.cache import CacheSpec, bytes_by_memory_kind
    from kvjax.decoding import decode_loop_jit
    from kvjax.evals.synthetic import abstract_compressed_cache
    from kvjax.sharding import AXES

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), AXES)
    spec = CacheSpec.for_model(model.config, batch, L, room, model.dtype, kv_dtype=kv_dtype)
    cache = abstract_compressed_cache(method, spec, mesh, artifact)
    t = time.perf_counter()
    compiled = decode_loop_jit.lower(model.graphdef, model.params, jax.ShapeDtypeStruct((batch,), jnp.int32), cache,
                                     jax.ShapeDtypeStruct((2,), jnp.uint32), max_new_tokens=new_tokens,
                                     eos_ids=()).compile(compiler_options=options or None)
    out = compiled_memory(compiled)
    device, host = bytes_by_memory_kind(cache)
    return out | {"cache_device_bytes": device, "cache_host_bytes": host, "compile_s": time.perf_counter() - t}


def time_decode(model, cache, new_tokens: int, repeats: int, options: dict | None = None, seed: int = 0) -> dict:
    """Compile the decode loop ahead of time for ``cache``, run it once (warm-up) and ``repeats`` times timed, each
    run continuing from the cache the previous one returned: compile seconds, every timed run's seconds, ms per step
    and tokens/s of the best run (B rows x (N - 1) steps), and the compiled program's memory (``compiled``)."""
    import jax
    import jax.numpy as jnp

    from kvjax.decoding import decode_loop_jit

    B = int(cache.pad.shape[0])
    first = jax.random.randint(jax.random.PRNGKey(seed), (B,), 0, model.config.vocab_size, jnp.int32)
    key = jax.random.PRNGKey(seed + 1)
    t = time.perf_counter()
    exe = decode_loop_jit.lower(model.graphdef, model.params, first, cache, key, max_new_tokens=new_tokens,
                                eos_ids=()).compile(compiler_options=options or None)
    compile_s = time.perf_counter() - t
    cache, out, count = exe(model.params, first, cache, key)
    jax.block_until_ready((cache, out, count))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        cache, out, count = exe(model.params, out[:, -1], cache, key)
        jax.block_until_ready((cache, out, count))
        times.append(time.perf_counter() - t)
    counts = np.asarray(count)
    if (counts != new_tokens).any():
        raise RuntimeError(f"the decode loop produced {counts.tolist()} tokens per row, expected {new_tokens}")
    best = min(times)
    return {"compile_decode_s": compile_s, "decode_times_s": times, "ms_per_step": 1000 * best / (new_tokens - 1),
            "tokens_per_s": tokens_per_second(B, new_tokens - 1, best), "compiled": compiled_memory(exe)}


def measure_cell(model, name: str, method, L: int, args, budget_bytes: int, artifact=None) -> dict:
    """One row: the largest batch of ``method`` at length ``L`` in ``budget_bytes``, its memory and its tokens/s."""
    import jax

    from kvjax.cache import CacheSpec

    N, room = args.new_tokens, room_tokens(args.new_tokens, args.repeats)
    options = decode_options(args)
    kv_dtype = storage_dtype(name, args.kv_dtype)  # the reference in the model's dtype, the others in --kv-dtype
    row = {"prompt_tokens": L, "method": name, "budget": method_budget(name, args.budget), "new_tokens": N,
           "room": room, "kv_dtype": kv_dtype or np.dtype(model.dtype).name}
    details: dict[int, dict] = {}

    def memory_of(b):
        details[b] = decode_memory(model, method, L, room, b, N, artifact, options, kv_dtype)
        jax.clear_caches()
        return details[b]["device_bytes"]

    B, probes = largest_batch(memory_of, budget_bytes)
    row.update(max_batch=B, probed_batches={str(b): m for b, m in sorted(probes.items())},
               compile_memory_s=sum(d["compile_s"] for d in details.values()),
               memory_b1=probes[1], per_row_bytes=probes[2] - probes[1] if 2 in probes else None)
    if B == 0:
        row["fits"] = False
        return row
    at = details[B]
    row.update(fits=True, memory_bytes=at["device_bytes"], host_memory_bytes=at["host_bytes"],
               temp_bytes=at["temp_bytes"], cache_device_bytes=at["cache_device_bytes"],
               cache_host_bytes=at["cache_host_bytes"])
    spec = CacheSpec.for_model(model.config, B, L, room, model.dtype, kv_dtype=kv_dtype)
    timed = timed_cache(model, method, spec, artifact, args, options)
    row.update({k: v for k, v in timed.items() if k not in ("cache_device_bytes", "cache_host_bytes", "compiled")})
    row["built_device_bytes"] = timed["cache_device_bytes"]  # equal to the described cache's
    return row


def timed_cache(model, method, spec, artifact, args, options: dict | None) -> dict:
    """Build ``spec.batch`` rows of ``method``'s compressed cache without a prefill
    (:func:`kvjax.evals.synthetic.replicated_cache`) and time its decode loop (:func:`time_decode`): the build seconds,
    the cache's device and host bytes, the timed program's compiled memory (``compiled``: :func:`compiled_memory`)
    and the timings."""
    import jax

    from kvjax.cache import bytes_by_memory_kind
    from kvjax.evals.synthetic import replicated_cache

    t = time.perf_counter()
    cache = replicated_cache(method, spec, artifact, args.seed)
    jax.block_until_ready(cache)
    out = {"build_s": time.perf_counter() - t}
    out["cache_device_bytes"], out["cache_host_bytes"] = bytes_by_memory_kind(cache)
    out.update(time_decode(model, cache, args.new_tokens, args.repeats, options, args.seed))
    del cache
    return out


def measure_batch_cell(model, name: str, method, L: int, B: int, args, artifact=None) -> dict:
    """One row of the fixed-batch mode: ``B`` rows of ``method``'s cache after ``L`` prompt tokens built without a
    prefill, its bytes, the timed program's compiled memory and its tokens/s."""
    from kvjax.cache import CacheSpec

    room = room_tokens(args.new_tokens, args.repeats)
    kv_dtype = storage_dtype(name, args.kv_dtype)  # the reference in the model's dtype, the others in --kv-dtype
    spec = CacheSpec.for_model(model.config, B, L, room, model.dtype, kv_dtype=kv_dtype)
    timed = timed_cache(model, method, spec, artifact, args, decode_options(args))
    compiled = timed.pop("compiled")
    return {"prompt_tokens": L, "batch": B, "method": name, "budget": method_budget(name, args.budget),
            "new_tokens": args.new_tokens, "room": room, "kv_dtype": kv_dtype or np.dtype(model.dtype).name,
            "memory_bytes": compiled["device_bytes"], "host_memory_bytes": compiled["host_bytes"],
            "temp_bytes": compiled["temp_bytes"], **timed}


def add_batch_ratios(rows: list[dict]) -> None:
    """Each row's tokens/s and cache device bytes ÷ the full cache's in the same (length, batch) cell."""
    full = {(r["prompt_tokens"], r["batch"]): r for r in rows if r["method"] == REFERENCE and "error" not in r}
    for r in rows:
        f = full.get((r["prompt_tokens"], r["batch"]))
        if "error" in r or f is None:
            continue
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / f["tokens_per_s"]
        r["cache_device_bytes_ratio"] = r["cache_device_bytes"] / f["cache_device_bytes"]


def add_ratios(rows: list[dict]) -> None:
    """Each fitting row's largest batch and tokens/s ÷ the full cache's at the same length (its own largest batch)."""
    full = {r["prompt_tokens"]: r for r in rows if r["method"] == REFERENCE and r.get("tokens_per_s")}
    for r in rows:
        f = full.get(r["prompt_tokens"])
        r["batch_ratio"] = r["max_batch"] / f["max_batch"] if f and "max_batch" in r else None
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / f["tokens_per_s"] if f and r.get("tokens_per_s") else None


def param_bytes(params) -> int:
    """Bytes of every parameter array."""
    import jax

    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def check_budget(budget_bytes: int, weights_bytes: int) -> None:
    """ValueError when the memory budget cannot even hold the weights."""
    if budget_bytes <= weights_bytes:
        raise ValueError(f"--memory-budget {budget_bytes / GIB:g} GiB is not more than the model's weights "
                         f"({weights_bytes / GIB:.3f} GiB): no batch fits")


def prepare(args, flag: str, budget_bytes: int | None = None):
    """What both modes load and check before measuring: one device (ValueError naming ``flag`` on a multi-device
    mesh), the methods, the model (its weights within ``budget_bytes`` when given), the methods' artifacts and their
    sources, every method fitting the lengths and the room. Returns ``(methods, model, artifacts, sources)``."""
    from kvjax.distributed import setup_devices
    from kvjax.models import load_model
    from kvjax.sharding import is_split

    if is_split(setup_devices(args)):
        raise ValueError(f"{flag} builds one device's cache: run it without a multi-device --mesh")
    methods = make_methods(args.methods, args.budget)
    model = load_model(args.model, args.dtype, tokenizer=False, random_weights=args.random_weights)
    if budget_bytes is not None:
        check_budget(budget_bytes, param_bytes(model.params))
    artifacts, sources = bench_artifacts(methods, model.config, args.random_weights)
    room = room_tokens(args.new_tokens, args.repeats)
    check_methods_fit(methods, model.config, args.lengths, room, artifacts, args.kv_dtype, args.dtype)
    return methods, model, artifacts, sources


def report_fields(args, argv: list[str], prog: str, mode: str, batch_arg: str, out: str, model, methods: dict,
                  sources: dict) -> dict:
    """The report fields both modes share: command, mode, the arguments (``batch_arg``: the mode's own, ``batch`` or
    ``memory_budget``), weights, machine, versions, devices, compiler options, date, method configurations and
    artifacts' sources."""
    import jax

    keys = ("model", "methods", "budget", "lengths", batch_arg, "new_tokens", "dtype", "kv_dtype", "repeats", "seed",
            "random_weights")
    return {
        "command": f"{prog} {shlex.join(argv)}" if argv else prog,
        "mode": mode,
        "args": {k: getattr(args, k) for k in keys} | {"out": out, "model_path": model.path},
        "weights_bytes": param_bytes(model.params),
        "machine": machine_info(), "versions": versions(), "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()], "decode_compiler_options": decode_options(args),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method_configs": {n: repr(m) for n, m in methods.items()}, "artifacts": sources,
    }


def run(args, argv: list[str], prog: str) -> int:
    """The throughput mode for parsed bench ``args`` (``--memory-budget`` given): measure, write the reports, print the
    Markdown. Returns 0 when every cell was measured (a method fitting no row is a result, not a failure)."""
    import jax

    start = time.perf_counter()
    budget_bytes = int(args.memory_budget * GIB)
    out = args.out or default_out(args.model, args.memory_budget)
    methods, model, artifacts, sources = prepare(args, "--memory-budget", budget_bytes)
    rows = []
    with real_compilations():
        for L in args.lengths:
            for name, method in methods.items():
                _log(f"[throughput] L={L} {name}: largest batch in {args.memory_budget:g} GiB")
                try:
                    row = measure_cell(model, name, method, L, args, budget_bytes, artifacts.get(name))
                except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
                    row = {"prompt_tokens": L, "method": name, "error": f"{type(e).__name__}: {e}"[:400]}
                _log(f"[throughput] L={L} {name}: " + (row.get("error") or
                     f"batch {row['max_batch']}" + (f", {row['tokens_per_s']:.1f} tokens/s" if row.get("fits") else "")))
                rows.append(row)
                jax.clear_caches()
                gc.collect()
    add_ratios([r for r in rows if "error" not in r])
    report = report_fields(args, argv, prog, "throughput", "memory_budget", out, model, methods, sources) | {
        "memory_budget_bytes": budget_bytes, "rows": rows, "total_s": time.perf_counter() - start}
    md, written = write_report(report, out, with_plot=not args.no_plot)
    print(md)
    _log(f"[throughput] wrote {', '.join(written)} in {report['total_s'] / 60:.1f} min")
    return 1 if any("error" in r for r in rows) else 0


def run_batches(args, argv: list[str], prog: str) -> int:
    """The fixed-batch mode for parsed bench ``args`` (``--no-prefill`` without ``--memory-budget``): every (length,
    batch) cell, every method's decode timed from a cache built without a prefill; the report rewritten after each
    cell (a stopped run keeps the cells it finished). Returns 0 when every row was measured."""
    import jax
    from tqdm import tqdm

    start = time.perf_counter()
    out = args.out or default_batch_out(args.model)
    methods, model, artifacts, sources = prepare(args, "--no-prefill")
    cells = [(L, B) for L in args.lengths for B in args.batch]
    rows: list[dict] = []

    def report() -> dict:
        add_batch_ratios(rows)
        return report_fields(args, argv, prog, "batches", "batch", out, model, methods, sources) | {
            "rows": rows, "cells_done": len(rows) // len(methods), "cells": len(cells),
            "total_s": time.perf_counter() - start}

    with real_compilations():
        with tqdm(total=len(cells) * len(methods), desc="bench --no-prefill (length, batch, method)", unit="run",
                  file=sys.stderr) as bar:
            for i, (L, B) in enumerate(cells):
                for name, method in methods.items():
                    bar.set_postfix_str(f"L={L} B={B} {name}")
                    try:
                        row = measure_batch_cell(model, name, method, L, B, args, artifacts.get(name))
                    except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
                        row = {"prompt_tokens": L, "batch": B, "method": name,
                               "error": f"{type(e).__name__}: {e}"[:400]}
                    rows.append(row)
                    jax.clear_caches()
                    gc.collect()
                    bar.update()
                if i + 1 < len(cells):
                    write_report(report(), out, with_plot=False)
    final = report()
    md, written = write_report(final, out, with_plot=not args.no_plot)
    print(md)
    _log(f"[bench --no-prefill] wrote {', '.join(written)} in {final['total_s'] / 60:.1f} min")
    return 1 if any("error" in r for r in rows) else 0


# --------------------------------------------------------------------------------------------------------- report
def _cells(r: dict) -> list:
    head = [r["prompt_tokens"], r["method"]]
    if "error" in r:
        return head + ["error"] + [MISSING] * 10
    if not r["fits"]:
        return head + [0] + [MISSING] * 10
    return head + [
        r["max_batch"], number(r["batch_ratio"], "{:.2f}×"), number(r["memory_bytes"] / GIB, "{:.3f}"),
        number(r["per_row_bytes"] and r["per_row_bytes"] / MIB, "{:.2f}"),
        number(r["cache_device_bytes"] / MIB, "{:.1f}"), number(r["cache_host_bytes"] / MIB, "{:.1f}"),
        number(r["ms_per_step"]), number(r["tokens_per_s"], "{:.1f}"), number(r["tokens_per_s_ratio"], "{:.2f}×"),
        f"{r['compile_memory_s']:.1f} ({len(r['probed_batches'])}) / {r['compile_decode_s']:.1f}",
    ]


def setup_lines(report: dict) -> list[str]:
    """The set-up list both modes' reports share: command, machine, versions, date, storage, compiler options, random
    weights and synthetic artifacts."""
    a, m = report["args"], report["machine"]
    lines = [
        f"- command: `{report['command']}`",
        f"- machine: {m['cpu']}, {m['usable_cores']} usable cores ({m['logical_cores']} logical), "
        f"{number(m['memory_bytes'] and m['memory_bytes'] / GIB, '{:.1f}')} GiB RAM, {m['os']}; "
        f"JAX backend {report['backend']} ({', '.join(report['devices'])})",
        f"- versions: python {m['python']}, " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
        f"- date: {report['date']}, total time {report['total_s'] / 60:.1f} min",
        kv_storage_line(a),
    ]
    options = report.get("decode_compiler_options")
    lines.append("- decode loop compiled with XLA options " + (", ".join(f"`{k}={v}`" for k, v in options.items())
                                                            if options else "none (XLA's defaults)"))
    if a.get("random_weights"):
        lines.append("- **random weights** (`--random-weights`): the model's shapes, not its trained weights")
    synthetic = [n for n, s in report.get("artifacts", {}).items() if s == "synthetic"]
    if synthetic:
        lines.append(f"- **synthetic artifacts** for {', '.join(f'`{n}`' for n in synthetic)} "
                     "(`kvjax.evals.synthetic.synthetic_artifact`)")
    return lines


def budget_text(budget) -> str:
    """The method budget as the reports say it."""
    return f"{budget} tokens per KV head" if isinstance(budget, int) else f"{budget:g} of the prompt's KV"


def render_markdown(report: dict) -> str:
    """The report of either mode (``report["mode"]``): set-up, one table and what each column is."""
    if report.get("mode") == "batches":
        return render_batches_markdown(report)
    a = report["args"]
    lines = [
        "# KV-cache methods: largest batch and decode throughput in a memory budget",
        "",
        f"Model `{a['model']}` ({a['dtype']}), memory budget {a['memory_budget']:g} GiB "
        f"(weights {report['weights_bytes'] / GIB:.3f} GiB), method budget {budget_text(a['budget'])} (a spec's own "
        f"`budget=` wins), {a['new_tokens']} new tokens per run ({a['new_tokens'] - 1} timed decode steps, no EOS), "
        f"best of {a['repeats']} timed run(s) after a warm-up run; caches built without a prefill (random contents, "
        "`kvjax.evals.synthetic.replicated_cache`).",
        "",
    ] + setup_lines(report)
    lines += ["", f"## {a['model']} {a['dtype']}, {a['memory_budget']:g} GiB", ""]
    head = ["L", "method", "largest batch", "÷ full's batch", "memory GiB (compiled)", "MiB per row",
            "cache device MiB", "cache host MiB", "ms/step", "tokens/s", "tokens/s ÷ full",
            "compile s (memory (batches probed) / decode)"]
    lines += table(head, [_cells(r) for r in report["rows"]], align="rl" + "r" * 10)
    lines += [
        "", "## Columns", "",
        "- **largest batch**: the most rows whose compiled decode loop (`memory_analysis()`: arguments + outputs − "
        "donated + temporaries: weights, artifact, cache, the step's temporaries) fits in the memory budget, every "
        "answer compiled (the batch fits, one more row does not); 0: one row does not fit. The runtime, compiled "
        "code, the allocator's slack and Python are not counted. **÷ full's batch**: ÷ the full cache's at the "
        "same L.",
        "- **memory GiB (compiled)**: that memory at the largest batch. **MiB per row**: compiled memory at 2 rows − "
        "at 1 row. **cache device / host MiB**: the compressed cache's arrays at the largest batch (on the CPU the "
        "host tier is in the same RAM and counted in the memory).",
        "- **ms/step**: the best timed `decode_loop` run ÷ (N − 1) steps, every row one token per step (each row's "
        "ms per token). **tokens/s**: largest batch × (N − 1) ÷ that run's seconds. **tokens/s ÷ full**: ÷ the full "
        "cache's tokens/s at its own largest batch, same L.",
        "- Timed from a cache built without a prefill: the cache's contents do not change what a decode step "
        "computes and reads; data-dependent behaviour (HeteroCache's drift triggers, which tokens are kept) is "
        "not the model's.",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"- L={r['prompt_tokens']} {r['method']} failed: {r['error']}")
    return "\n".join(lines) + "\n"


def _batch_cells(r: dict) -> list:
    head = [r["prompt_tokens"], r["batch"], r["method"]]
    if "error" in r:
        return head + ["error"] + [MISSING] * 9
    return head + [
        number(r["cache_device_bytes"] / MIB, "{:.1f}"), number(r.get("cache_device_bytes_ratio"), "{:.3f}"),
        number(r["cache_host_bytes"] / MIB, "{:.1f}"), number(r["memory_bytes"] / GIB, "{:.3f}"),
        number(r["ms_per_step"]), number(r["tokens_per_s"], "{:.1f}"), number(r.get("tokens_per_s_ratio"), "{:.2f}×"),
        f"{r['build_s']:.1f}", f"{r['compile_decode_s']:.1f}",
    ]


def render_batches_markdown(report: dict) -> str:
    """The fixed-batch mode's report: set-up, one table (a row per length, batch and method), the columns."""
    a = report["args"]
    partial = report.get("cells_done", report.get("cells")) != report.get("cells")
    lines = [
        "# KV-cache methods: decode throughput at fixed batches, caches built without a prefill",
        "",
        f"Model `{a['model']}` ({a['dtype']}, weights {report['weights_bytes'] / GIB:.3f} GiB), batches "
        f"{', '.join(map(str, a['batch']))}, method budget {budget_text(a['budget'])} (a spec's own `budget=` wins), "
        f"{a['new_tokens']} new tokens per run ({a['new_tokens'] - 1} timed decode steps, no EOS), best of "
        f"{a['repeats']} timed run(s) after a warm-up run; every cache built without a prefill (random contents, one "
        "row's selection tiled to the batch: `kvjax.evals.synthetic.replicated_cache`).",
        "",
    ] + setup_lines(report)
    if partial:
        lines.append(f"- **partial**: {report['cells_done']} of {report['cells']} (length, batch) cells measured")
    lines += ["", f"## {a['model']} {a['dtype']}", ""]
    head = ["L", "B", "method", "cache device MiB", "÷ full bytes", "cache host MiB", "memory GiB (compiled)",
            "ms/step", "tokens/s", "tokens/s ÷ full", "build s", "compile s"]
    lines += table(head, [_batch_cells(r) for r in report["rows"]], align="rrl" + "r" * 9)
    lines += [
        "", "## Columns", "",
        "- **cache device / host MiB**: the compressed cache's arrays for all B rows (on the CPU the host tier is in "
        "the same RAM). **÷ full bytes**: ÷ the full cache's device bytes in the same (L, B) cell.",
        "- **memory GiB (compiled)**: the timed decode loop's `memory_analysis()` (arguments + outputs − donated + "
        "temporaries: weights, artifact, cache, the step's temporaries).",
        "- **ms/step**: the best timed `decode_loop` run ÷ (N − 1) steps (each row's ms per token). **tokens/s**: B × "
        "(N − 1) ÷ that run's seconds. **tokens/s ÷ full**: ÷ the full cache's in the same (L, B) cell.",
        "- **build s**: building the B-row cache without a prefill; **compile s**: the decode loop's compilation.",
        "- Timed from a cache built without a prefill: the cache's contents do not change what a decode step "
        "computes and reads; data-dependent behaviour (HeteroCache's drift triggers, which tokens are kept) is "
        "not the model's.",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"- L={r['prompt_tokens']} B={r['batch']} {r['method']} failed: {r['error']}")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    """PNG: the largest batch and tokens/s at it vs context length, one line per method."""
    rows = [r for r in report["rows"] if r.get("fits")]
    a = report["args"]
    fig = figure((12, 4.8))
    ax1, ax2 = fig.subplots(1, 2)
    for name in a["methods"]:
        rs = sorted((r for r in rows if r["method"] == name), key=lambda r: r["prompt_tokens"])
        if rs:
            x = [r["prompt_tokens"] for r in rs]
            ax1.plot(x, [r["max_batch"] for r in rs], marker="o", label=name)
            ax2.plot(x, [r["tokens_per_s"] for r in rs], marker="o", label=name)
    ax1.set(xlabel="context length (tokens)", ylabel="largest batch", title=f"rows in {a['memory_budget']:g} GiB")
    ax2.set(xlabel="context length (tokens)", ylabel="decode tokens / s", title="throughput at the largest batch")
    lengths = sorted({r["prompt_tokens"] for r in rows})
    for ax in (ax1, ax2):
        ax.set_yscale("log")
        length_axes(ax, lengths)
    fig.suptitle(f"{a['model']} {a['dtype']}")
    fig.tight_layout()
    save_figure(fig, path, dpi=120, tight=False)


def write_report(report: dict, out: str, with_plot: bool = True) -> tuple[str, list[str]]:
    """Write the Markdown at ``out``, the JSON (and the PNG plot) next to it with the same stem: (Markdown, paths)."""
    md = render_markdown(report)
    written = write_files(out, md, report)
    if with_plot:
        png = os.path.splitext(out)[0] + ".png"
        if report.get("mode") == "batches":
            a = report["args"]
            plot_batches(report, png, bytes_key="cache_device_bytes",
                         title=f"{a['model']} {a['dtype']}, caches built without a prefill")
        else:
            plot(report, png)
        written.append(png)
    return md, written
