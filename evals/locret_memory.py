"""``kvjax bench locret-memory``: Locret's prefill memory is bounded by ``b + n_loc + B``; the full cache's grows.

For each prompt length, the compiled prefill step (one chunk of ``B`` tokens, the last chunk of the
prompt: the most the cache ever holds) and the compression step are lowered and compiled for the
full cache and for Locret at a fixed budget and chunk, and XLA's memory analysis is read:
the cache's own device bytes (the step's donated argument), the step's temporaries and its
outputs. Nothing is executed, so 32K prompts cost only compile time on a CPU. On a GPU/TPU, add
``--measure`` to also run each prefill and read the device's peak memory (``memory_stats``).

Prints and writes a Markdown table and JSON (``--out``), with the command that made them.
"""

from __future__ import annotations

import argparse
import json
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


def measure(model, method, length: int, chunk: int, artifact=None, run: bool = False) -> dict:
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

    row = {"method": method.name, "length": length, "cache_device_bytes_during_prefill": cache_bytes,
           "artifact_device_bytes": bytes_by_memory_kind(cache.artifact)[0],
           "prefill_step": _analysis(step), "compress_step": _analysis(fin)}
    if run:
        from kvjax.generate import compress, prefill_prompt

        dev = jax.devices()[0]
        ids = jnp.zeros((1, length), jnp.int32)
        _, cache = prefill_prompt(model.graphdef, model.params, ids, cache, chunk_size=chunk)
        cache = compress(cache)
        jax.block_until_ready(cache)
        stats = dev.memory_stats() or {}
        row["peak_device_bytes_measured"] = stats.get("peak_bytes_in_use")
    return row


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
    args = p.parse_args(argv)
    from kvjax.methods import FullCache, Locret
    from models import load_model

    model = load_model(args.model, "float32", tokenizer=False)
    lengths = [int(x) for x in args.lengths.split(",")]
    too_long = [n for n in lengths if n > model.config.max_position_embeddings]
    if too_long:
        raise ValueError(f"{args.model} takes at most {model.config.max_position_embeddings} tokens; drop {too_long}")
    rows = []
    for n in lengths:
        for method in (FullCache(), Locret(budget=args.budget, chunk=args.chunk, heads=args.heads)):
            if args.measure:
                jax.clear_caches()
            rows.append(measure(model, method, n, args.chunk, run=args.measure))
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

    lines = [f"# Locret: prefill memory vs prompt length ({device})", "", f"Command: `{cmd}`", "",
             "Cache = the cache's device bytes while prefilling (the donated argument of every chunk step); "
             "temp = XLA's temporaries of the compiled chunk step / compression step (memory analysis, not a run). "
             "MiB.", "",
             "| tokens | full: cache | full: chunk temp | full: compress temp | Locret: cache | Locret: chunk temp | "
             "Locret: compress temp | Locret/full (cache + chunk temp) |"
             + (" peak measured full / Locret |" if any("peak_device_bytes_measured" in r for r in rows) else ""),
             "|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if any("peak_device_bytes_measured" in r for r in rows) else "")]
    heads = max((r.get("artifact_device_bytes", 0) for r in rows if r["method"] == "locret"), default=0)
    if heads:
        lines.insert(5, f"Locret's cache includes its retaining heads ({mib(heads)} MiB, the same at every length). ")
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
        if "peak_device_bytes_measured" in f:
            line += f" {mib(f.get('peak_device_bytes_measured'))} / {mib(lo.get('peak_device_bytes_measured'))} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
