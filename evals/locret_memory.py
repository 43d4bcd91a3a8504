"""``kvjax bench locret-memory``: Locret's prefill memory is bounded by ``b + n_loc + B``; the full cache's grows.

For each prompt length, the compiled prefill step (one chunk of ``B`` tokens, the last chunk of the
prompt: the most the cache ever holds) and the compression step are lowered and compiled for the
full cache and for Locret at a fixed budget and chunk, and XLA's memory analysis is read:
the cache's own device bytes (the step's donated argument), the step's temporaries and its
outputs. Nothing is executed, so 32K prompts cost only compile time on a CPU. ``--measure`` also
runs each prefill in a process of its own and measures its peak memory: on a GPU/TPU the device's
peak bytes in use (``memory_stats``, a high-water mark of the whole process that jax cannot reset;
it includes the weights, reported beside it); on a CPU, whose device buffers are host memory, the
growth of the process's resident memory during the prefill (:func:`run_and_read_peak`).

Prints and writes a Markdown table and JSON (``--out``), with the command that made them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp

from kvjax.reports import number, write_report
from kvjax.reports import table as markdown_table


def _analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return {k: int(getattr(m, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                                            "alias_size_in_bytes") if hasattr(m, k)}


def measure(model, method, length: int, chunk: int, artifact=None) -> dict:
    """Memory facts of ``method``'s prefill of a ``length``-token prompt in chunks of ``chunk`` (compiled, not run)."""
    from kvjax.cache import new_cache
    from kvjax.decoding import compress_jit, prefill_jit

    cache = new_cache(method, model.config, 1, length, 64, model.dtype, artifact=artifact)
    cache_bytes = cache.device_bytes()
    tokens = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    step = prefill_jit.lower(model.graphdef, model.params, tokens, cache).compile()
    with warnings.catch_warnings():  # buffers the compressed layout does not reuse: expected (as kvjax.decoding.compress)
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        fin = compress_jit.lower(cache).compile()
    from kvjax.cache import bytes_by_memory_kind

    return {"method": method.name, "length": length, "cache_device_bytes_during_prefill": cache_bytes,
            "artifact_device_bytes": bytes_by_memory_kind(cache.artifact)[0],
            "prefill_step": _analysis(step), "compress_step": _analysis(fin)}


def run_and_read_peak(model, method, length: int, chunk: int) -> dict:
    """Run ``method``'s chunked prefill and compression of a ``length``-token prompt and read its peak memory.

    Accelerators: the device's peak bytes in use (``memory_stats``), a high-water mark of the whole process,
    meaningful only as the first run of a fresh process. CPU (no device statistics; device buffers are host
    memory): the chunk step is first compiled and run on one chunk, then the process's resident high-water
    mark is reset (Linux) and the whole prefill and compression run; the peak resident bytes and the resident
    bytes just before them give the run's own growth (cache, temporaries, outputs, and the compression step's
    compilation). Large buffers must be returned to the system when freed for this to see them: the parent
    starts the process with a fixed ``MALLOC_MMAP_THRESHOLD_``. The weights' bytes are reported beside both.
    """
    from kvjax.evals.bench_machine import proc_status_kib, reset_peak_rss
    from kvjax.cache import new_cache
    from kvjax.decoding import compress, prefill_prompt

    def prefill(tokens: int):
        """A ``length``-token cache prefilled with the first ``tokens`` tokens of a prompt of zeros."""
        cache = new_cache(method, model.config, 1, length, 64, model.dtype)
        return prefill_prompt(model.graphdef, model.params, jnp.zeros((1, tokens), jnp.int32), cache, chunk_size=chunk)[1]

    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    if jax.devices()[0].memory_stats() is not None:
        jax.block_until_ready(compress(prefill(length)))
        stats = jax.devices()[0].memory_stats() or {}
        return {"peak_device_bytes_measured": stats.get("peak_bytes_in_use"), "weights_device_bytes": weights}
    jax.block_until_ready(prefill(chunk))  # compile the chunk step outside the measurement
    gc.collect()
    before = proc_status_kib("VmRSS") * 1024 or None  # 0 where /proc is unavailable
    reset = reset_peak_rss()
    jax.block_until_ready(compress(prefill(length)))
    peak = proc_status_kib("VmHWM") * 1024 if reset and before is not None else None  # since the reset
    return {"peak_device_bytes_measured": None, "weights_device_bytes": weights, "rss_before_prefill_bytes": before,
            "peak_rss_bytes": peak}


def _peak_in_a_fresh_process(args, method: str, length: int) -> dict:
    """:func:`run_and_read_peak` in a child process (``--peak-of``), so no earlier run's peak counts."""
    cmd = [sys.executable, "-m", "kvjax.evals.locret_memory", "--peak-of", method, "--model", args.model, "--lengths", str(length),
           "--budget", str(args.budget), "--chunk", str(args.chunk), "--heads", args.heads]
    if args.random_weights:
        cmd.append("--random-weights")
    # the parent holds the weights too; on a CPU, buffers above 128 KiB are mapped and unmapped (glibc's adaptive
    # threshold would otherwise keep freed buffers for reuse, hiding a run's growth from the resident size)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", MALLOC_MMAP_THRESHOLD_="131072")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"measuring {method} at {length} tokens failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    """Entry point of ``kvjax bench locret-memory``."""
    p = argparse.ArgumentParser(prog="kvjax bench locret-memory", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--lengths", default="4096,8192,16384,32768")
    p.add_argument("--budget", type=int, default=1024, help="Locret's tokens per KV head (b + n_loc)")
    p.add_argument("--chunk", type=int, default=1024, help="B, the prefill chunk (the same for the full cache)")
    p.add_argument("--heads", default="trained", choices=["trained", "random"])
    p.add_argument("--measure", action="store_true", help="also run each prefill in a fresh process and measure its peak memory (device statistics; CPU: resident memory)")
    p.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    p.add_argument("--random-weights", action="store_true",
                   help="the model's architecture with random weights (no weight files needed): bytes and times only")
    p.add_argument("--peak-of", choices=["full", "locret"], help=argparse.SUPPRESS)  # the child of --measure
    args = p.parse_args(argv)
    if args.measure:  # before jax starts its backend: the children of --measure need device memory too
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from kvjax.methods import FullCache, Locret
    from kvjax.models import load_model

    model = load_model(args.model, "float32", tokenizer=False, random_weights=args.random_weights)
    lengths = [int(x) for x in args.lengths.split(",")]
    methods = {"full": FullCache(), "locret": Locret(budget=args.budget, chunk=args.chunk, heads=args.heads)}
    if args.peak_of:
        print(json.dumps(run_and_read_peak(model, methods[args.peak_of], lengths[0], args.chunk)))
        return 0
    too_long = [n for n in lengths if n > model.config.max_position_embeddings]
    if too_long:
        raise ValueError(f"{args.model} takes at most {model.config.max_position_embeddings} tokens; drop {too_long}")
    rows = []
    for n in lengths:
        for name, method in methods.items():
            rows.append(measure(model, method, n, args.chunk))
            if args.measure:
                rows[-1].update(_peak_in_a_fresh_process(args, name, n))
            print(json.dumps(rows[-1]), flush=True)
    cmd = "kvjax bench locret-memory " + " ".join(argv if argv is not None else sys.argv[1:])
    md = table(rows, cmd, str(jax.devices()[0].device_kind))
    print(md)
    if args.out:
        write_report(args.out + ".md", md, {"command": cmd, "device": jax.devices()[0].device_kind, "rows": rows})
    return 0


def table(rows, cmd: str, device: str) -> str:
    """The Markdown report: per length, cache bytes and the compiled steps' temporaries, Locret / full ratios."""
    def mib(x):
        return number(None if x is None else x / 2**20, "{:.1f}", missing="-")

    measured = any(r.get("peak_device_bytes_measured") is not None for r in rows)
    rss = not measured and any(r.get("peak_rss_bytes") is not None for r in rows)
    extra = ["peak measured full / Locret"] if measured else (["prefill's resident growth, measured: full / Locret"] if rss else [])

    lines = [f"# Locret: prefill memory vs prompt length ({device})", "", f"Command: `{cmd}`", "",
             "Cache = the cache's device bytes while prefilling (the donated argument of every chunk step); "
             "temp = XLA's temporaries of the compiled chunk step / compression step (memory analysis, not a run). "
             "MiB.", ""]
    heads = max((r.get("artifact_device_bytes", 0) for r in rows if r["method"] == "locret"), default=0)
    if heads:
        lines.insert(5, f"Locret's cache includes its retaining heads ({mib(heads)} MiB, the same at every length). ")
    weights = max((r.get("weights_device_bytes") or 0 for r in rows), default=0)
    if measured:
        lines.insert(5, f"Measured peaks (`--measure`): the device's peak bytes in use of one process per (method, length) "
                        f"running the chunked prefill and compression, the model's weights ({mib(weights)} MiB) included. ")
    elif rss:
        lines.insert(5, "Measured (`--measure`, CPU: the backend keeps no device statistics and device buffers are host "
                        "memory): one process per (method, length) compiles and runs the chunk step on one chunk, resets "
                        "its resident-memory high-water mark, then runs the whole chunked prefill and compression; the "
                        "column is that run's peak resident bytes minus the resident bytes just before it (the cache, "
                        "temporaries, outputs and the compression step's compilation; the weights, "
                        f"{mib(weights)} MiB, and the chunk step's compilation excluded). ")

    def growth(r):
        if r.get("peak_rss_bytes") is None or r.get("rss_before_prefill_bytes") is None:
            return None
        return r["peak_rss_bytes"] - r["rss_before_prefill_bytes"]

    def tot(r):
        return r["cache_device_bytes_during_prefill"] + r["prefill_step"].get("temp_size_in_bytes", 0)

    by = {}
    for r in rows:
        by.setdefault(r["length"], {})[r["method"]] = r
    cells = []
    for n, d in sorted(by.items()):
        f, lo = d["full"], d["locret"]
        cells.append([n] + [mib(x) for r in (f, lo) for x in (r["cache_device_bytes_during_prefill"],
                                                               r["prefill_step"].get("temp_size_in_bytes"),
                                                               r["compress_step"].get("temp_size_in_bytes"))]
                     + [f"{tot(lo) / tot(f):.2f}"])
        if measured:
            cells[-1].append(f"{mib(f.get('peak_device_bytes_measured'))} / {mib(lo.get('peak_device_bytes_measured'))}")
        elif rss:
            cells[-1].append(f"{mib(growth(f))} / {mib(growth(lo))}")
    head = ["tokens", "full: cache", "full: chunk temp", "full: compress temp", "Locret: cache", "Locret: chunk temp",
            "Locret: compress temp", "Locret/full (cache + chunk temp)"] + extra
    return "\n".join(lines + markdown_table(head, cells, align="r" * len(head))) + "\n"


if __name__ == "__main__":
    sys.exit(main())
