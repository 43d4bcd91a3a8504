"""``kvjax bench locret-memory``: Locret's prefill memory is bounded by ``b + n_loc + B``; the full cache's grows.

For each prompt length, the compiled prefill step (one chunk of ``B`` tokens, the last chunk of the
prompt: the most the cache ever holds) and the compression step are lowered and compiled for the
full cache and for Locret at a fixed budget and chunk, and XLA's memory analysis is read:
the cache's own device bytes (the step's donated argument), the step's temporaries and its
outputs. Nothing is executed, so 32K prompts cost only compile time on a CPU. On a GPU/TPU, add
``--measure`` to also run each prefill and read the device's peak memory (``memory_stats``): each
(method, length) runs in a process of its own, since the allocator's peak is a high-water mark of
the whole process that jax cannot reset. The peak includes the weights (reported beside it).

Prints and writes a Markdown table and JSON (``--out``), with the command that made them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp


def _analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return {k: int(getattr(m, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                                            "alias_size_in_bytes") if hasattr(m, k)}


def measure(model, method, length: int, chunk: int, artifact=None) -> dict:
    """Memory facts of ``method``'s prefill of a ``length``-token prompt in chunks of ``chunk`` (compiled, not run)."""
    from kvjax.cache import new_cache
    from kvjax.generate import compress_jit, prefill_jit

    cache = new_cache(method, model.config, 1, length, 64, model.dtype, artifact=artifact)
    cache_bytes = cache.device_bytes()
    tokens = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    step = prefill_jit.lower(model.graphdef, model.params, tokens, cache).compile()
    with warnings.catch_warnings():  # buffers the compressed layout does not reuse: expected (as kvjax.generate.compress)
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        fin = compress_jit.lower(cache).compile()
    from kvjax.cache import bytes_by_memory_kind

    return {"method": method.name, "length": length, "cache_device_bytes_during_prefill": cache_bytes,
            "artifact_device_bytes": bytes_by_memory_kind(cache.artifact)[0],
            "prefill_step": _analysis(step), "compress_step": _analysis(fin)}


def run_and_read_peak(model, method, length: int, chunk: int) -> dict:
    """Run ``method``'s chunked prefill and compression of a ``length``-token prompt; the device's peak bytes
    in use (None where the backend keeps no statistics, e.g. CPU) and the weights' bytes. The peak is a
    high-water mark of the whole process: meaningful only as the first run of a fresh process."""
    from kvjax.cache import new_cache
    from kvjax.generate import compress, prefill_prompt

    cache = new_cache(method, model.config, 1, length, 64, model.dtype)
    _, cache = prefill_prompt(model.graphdef, model.params, jnp.zeros((1, length), jnp.int32), cache, chunk_size=chunk)
    jax.block_until_ready(compress(cache))
    stats = jax.devices()[0].memory_stats() or {}
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    return {"peak_device_bytes_measured": stats.get("peak_bytes_in_use"), "weights_device_bytes": weights}


def _peak_in_a_fresh_process(args, method: str, length: int) -> dict:
    """:func:`run_and_read_peak` in a child process (``--peak-of``), so no earlier run's peak counts."""
    cmd = [sys.executable, "-m", "evals.locret_memory", "--peak-of", method, "--model", args.model, "--lengths", str(length),
           "--budget", str(args.budget), "--chunk", str(args.chunk), "--heads", args.heads]
    if args.random_weights:
        cmd.append("--random-weights")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # the parent holds the weights too
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
    p.add_argument("--measure", action="store_true", help="also run the prefills and read the device's peak memory")
    p.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    p.add_argument("--random-weights", action="store_true",
                   help="the model's architecture with random weights (no weight files needed): bytes and times only")
    p.add_argument("--peak-of", choices=["full", "locret"], help=argparse.SUPPRESS)  # the child of --measure
    args = p.parse_args(argv)
    if args.measure:  # before jax starts its backend: the children of --measure need device memory too
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from kvjax.methods import FullCache, Locret
    from models import load_model

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
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".md").write_text(md)
        Path(args.out + ".json").write_text(json.dumps({"command": cmd, "device": jax.devices()[0].device_kind,
                                                        "rows": rows}, indent=1))
    return 0


def table(rows, cmd: str, device: str) -> str:
    """The Markdown report: per length, cache bytes and the compiled steps' temporaries, Locret / full ratios."""
    def mib(x):
        return "-" if x is None else f"{x / 2**20:.1f}"

    measured = any("peak_device_bytes_measured" in r for r in rows)

    lines = [f"# Locret: prefill memory vs prompt length ({device})", "", f"Command: `{cmd}`", "",
             "Cache = the cache's device bytes while prefilling (the donated argument of every chunk step); "
             "temp = XLA's temporaries of the compiled chunk step / compression step (memory analysis, not a run). "
             "MiB.", "",
             "| tokens | full: cache | full: chunk temp | full: compress temp | Locret: cache | Locret: chunk temp | "
             "Locret: compress temp | Locret/full (cache + chunk temp) |"
             + (" peak measured full / Locret |" if measured else ""),
             "|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if measured else "")]
    heads = max((r.get("artifact_device_bytes", 0) for r in rows if r["method"] == "locret"), default=0)
    if heads:
        lines.insert(5, f"Locret's cache includes its retaining heads ({mib(heads)} MiB, the same at every length). ")
    weights = max((r.get("weights_device_bytes") or 0 for r in rows), default=0)
    if weights:
        lines.insert(5, f"Measured peaks (`--measure`): the device's peak bytes in use of one process per (method, length) "
                        f"running the chunked prefill and compression, the model's weights ({mib(weights)} MiB) included "
                        "(accelerators only: the CPU backend keeps no statistics). ")
    by = {}
    for r in rows:
        by.setdefault(r["length"], {})[r["method"]] = r
    for n, d in sorted(by.items()):
        f, lo = d["full"], d["locret"]

        def tot(r):
            return r["cache_device_bytes_during_prefill"] + r["prefill_step"].get("temp_size_in_bytes", 0)

        line = (f"| {n} | {mib(f['cache_device_bytes_during_prefill'])} | {mib(f['prefill_step'].get('temp_size_in_bytes'))} | "
                f"{mib(f['compress_step'].get('temp_size_in_bytes'))} | {mib(lo['cache_device_bytes_during_prefill'])} | "
                f"{mib(lo['prefill_step'].get('temp_size_in_bytes'))} | {mib(lo['compress_step'].get('temp_size_in_bytes'))} | "
                f"{tot(lo) / tot(f):.2f} |")
        if measured:
            line += f" {mib(f.get('peak_device_bytes_measured'))} / {mib(lo.get('peak_device_bytes_measured'))} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
