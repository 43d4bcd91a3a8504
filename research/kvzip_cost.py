"""KVzip's extra prefill cost, measured in one run: the full cache's prefill against KVzip's prefill plus its
reconstruction passes, at batch 1, steady state (each stage compiled and run once before it is timed).

For each ``--lengths`` prompt (random token ids of the model's vocabulary after the chat template's prefix; the
time does not depend on the text), the script times ``--repeats`` runs of: the full cache's chunked prefill
(``--chunk-size``), KVzip's prefill (the same chunks into its staging) and :func:`kvjax.methods.kvzip.reconstruct`
(the passes), and reports the smallest of each and the ratio the paper states as 2-3x: (KVzip's prefill +
reconstruction) / the full cache's prefill.

Beside each measurement it counts the work (multiply-adds, analytically; not XLA's cost analysis, which counts a
``while`` loop's body once): the projections and MLP of every token, the attention pairs of the prefill (each chunk's
queries against the prompt up to themselves) and of the passes (each pass's queries against the whole context and the pass up
to themselves), and the passes' second softmax over the sinks, the chunk and the pass. The same count for
Llama-3.1-8B's shapes says how the ratio moves with a model whose projections dominate its attention.

Run: ``python -m research.kvzip_cost [--lengths 4096,8192] [--repeats 2] [--out docs/results/kvzip_cost]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the work count needs of a model."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int


LLAMA_31_8B = Shapes("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128)


def shapes_of(name: str, config) -> Shapes:
    return Shapes(name, config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                  config.num_kv_heads, config.head_dim)


def token_macs(s: Shapes) -> int:
    """Multiply-adds of one token's projections (q, k, v, o) and gated MLP in one layer."""
    qkvo = s.hidden * (2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim)
    return qkvo + 3 * s.hidden * s.intermediate


def work(s: Shapes, length: int, chunk_size: int, kvzip_chunk: int, pass_extra: int, sinks: int) -> dict:
    """Multiply-adds (all layers) of the prefill and of the reconstruction passes of a ``length``-token context.

    Attention pairs cost ``2 * heads * head_dim`` multiply-adds (scores and values); the passes' second softmax
    costs ``heads * head_dim`` per (query, key) pair over ``sinks + chunk + pass`` keys.
    """
    pair = 2 * s.heads * s.head_dim
    prefill_pairs = sum(min(chunk_size, length - c) * (c + (min(chunk_size, length - c) + 1) / 2)
                        for c in range(0, length, chunk_size))
    proj = s.layers * length * token_macs(s)
    prefill_attn = s.layers * prefill_pairs * pair
    passes, recon_proj, recon_attn, recon_scores = 0, 0, 0, 0
    for lo in range(0, length, kvzip_chunk):
        n = min(kvzip_chunk, length - lo)
        t = n + pass_extra  # the pass's tokens: its request, the template's end of turn, the chunk
        passes += 1
        recon_proj += s.layers * t * token_macs(s)
        recon_attn += s.layers * t * (length + (t + 1) / 2) * pair
        recon_scores += s.layers * t * (sinks + kvzip_chunk + t) * s.heads * s.head_dim
    return {"model": s.name, "length": length, "passes": passes,
            "prefill_proj_gmac": proj / 1e9, "prefill_attn_gmac": prefill_attn / 1e9,
            "recon_proj_gmac": recon_proj / 1e9, "recon_attn_gmac": recon_attn / 1e9,
            "recon_scores_gmac": recon_scores / 1e9,
            "ratio": (proj + prefill_attn + recon_proj + recon_attn + recon_scores) / (proj + prefill_attn)}


def measure(model, tok, length: int, chunk_size: int, repeats: int, seed: int) -> dict:
    """Smallest of ``repeats`` timed runs (after one untimed) of each stage, seconds."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.cache import CacheSpec
    from kvjax.decoding import prefill_prompt
    from kvjax.methods import get_method
    from kvjax.methods.kvzip import reconstruct
    from kvjax.models.tokenizer import reconstruction_prompt

    prompt = reconstruction_prompt(tok, chat=True)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(100, min(model.config.vocab_size, len(tok)) - 100, size=(1, length)).astype(np.int32)
    spec = CacheSpec.for_model(model.config, 1, length, 64, model.dtype)
    full, kvzip = get_method("full"), get_method("kvzip")
    times = {"full_prefill_s": [], "kvzip_prefill_s": [], "reconstruct_s": []}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        logits, cache = prefill_prompt(model.graphdef, model.params, jnp.asarray(tokens), full.init_cache(spec),
                                       chunk_size=chunk_size)
        jax.block_until_ready(logits)
        t_full = time.perf_counter() - t0
        del cache
        t0 = time.perf_counter()
        logits, cache = prefill_prompt(model.graphdef, model.params, jnp.asarray(tokens), kvzip.init_cache(spec),
                                       chunk_size=chunk_size)
        jax.block_until_ready(logits)
        t_kvzip = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache = reconstruct(model.graphdef, model.params, cache, tokens, prompt)
        jax.block_until_ready(cache)
        t_recon = time.perf_counter() - t0
        del cache
        log(f"[kvzip_cost] L={length} run {i}{' (warm-up)' if i == 0 else ''}: full prefill {t_full:.2f} s, "
            f"kvzip prefill {t_kvzip:.2f} s, reconstruction {t_recon:.2f} s")
        if i:
            times["full_prefill_s"].append(t_full)
            times["kvzip_prefill_s"].append(t_kvzip)
            times["reconstruct_s"].append(t_recon)
    row = {"length": length, **{k: min(v) for k, v in times.items()}, "runs": times}
    row["ratio"] = (row["kvzip_prefill_s"] + row["reconstruct_s"]) / row["full_prefill_s"]
    row["reconstruct_over_prefill"] = row["reconstruct_s"] / row["full_prefill_s"]
    return row


def render(report: dict) -> str:
    from kvjax.reports import number, table

    lines = [
        "# KVzip's prefill cost against the full cache's",
        "",
        f"Made with `{report['command']}` on {report['date']} ({report['device']}, jax {report['jax']}, "
        f"{report['model']} in {report['dtype']}, batch 1, prefill chunks of {report['chunk_size']} tokens, KVzip's "
        f"defaults: chunk {report['kvzip_chunk']}, {report['sinks']} sinks). Smallest of {report['repeats']} timed "
        "runs after one untimed run of each stage.",
        "",
        "## Measured",
        "",
        *table(["prompt tokens", "full cache prefill s", "KVzip prefill s", "reconstruction s",
               "reconstruction ÷ prefill", "(KVzip prefill + reconstruction) ÷ full prefill"],
              [[r["length"], number(r["full_prefill_s"]), number(r["kvzip_prefill_s"]), number(r["reconstruct_s"]),
                number(r["reconstruct_over_prefill"], "{:.2f}×"), number(r["ratio"], "{:.2f}×")]
               for r in report["measured"]], "rrrrrr"),
        "",
        "## Counted (multiply-adds, all layers)",
        "",
        "Projections and MLP per token; attention pairs (scores and values) of the chunked prefill and of the passes "
        "(each pass's queries against the whole context and the pass up to themselves); the passes' second softmax "
        "over the sinks, the chunk and the pass. `ratio` = (prefill + passes) ÷ prefill in multiply-adds.",
        "",
        *table(["model", "prompt tokens", "passes", "prefill proj. G", "prefill attn. G", "passes proj. G",
               "passes attn. G", "passes 2nd softmax G", "ratio"],
              [[w["model"], w["length"], w["passes"], number(w["prefill_proj_gmac"], "{:.0f}"),
                number(w["prefill_attn_gmac"], "{:.0f}"), number(w["recon_proj_gmac"], "{:.0f}"),
                number(w["recon_attn_gmac"], "{:.0f}"), number(w["recon_scores_gmac"], "{:.0f}"),
                number(w["ratio"], "{:.2f}×")] for w in report["counted"]], "lrrrrrrrr"),
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model name or path (default: kvjax's default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count-only", action="store_true", help="the work count alone, no model run")
    p.add_argument("--out", default=None, help="folder for README.md + report.json (default: print)")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.repeats < 1 or any(n <= 0 for n in lengths):
        p.error("--repeats and --lengths must be positive")

    import jax

    from kvjax.methods.kvzip import KVzip
    from kvjax.reports import write_report
    from kvjax.models import DEFAULT_MODEL, load_model
    from kvjax.models.tokenizer import reconstruction_prompt

    name = args.model or DEFAULT_MODEL
    model = load_model(name, args.dtype)
    tok = model.tokenizer
    defaults = KVzip()
    prompt = reconstruction_prompt(tok, chat=True)
    pass_extra = max(len(prompt.later) + defaults.carry, len(prompt.first)) + len(prompt.suffix)
    counted = [work(s, n, args.chunk_size, defaults.chunk, pass_extra, defaults.sinks)
               for s in (shapes_of(name, model.config), LLAMA_31_8B) for n in lengths]
    measured = [] if args.count_only else [measure(model, tok, n, args.chunk_size, args.repeats, args.seed)
                                          for n in lengths]
    report = {"command": "python -m research.kvzip_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "device": f"{platform.machine()} CPU, {os.cpu_count()} cores",
              "jax": jax.__version__, "model": name, "dtype": args.dtype, "chunk_size": args.chunk_size,
              "kvzip_chunk": defaults.chunk, "sinks": defaults.sinks, "repeats": args.repeats,
              "measured": measured, "counted": counted}
    text = render(report)
    if args.out:
        write_report(os.path.join(args.out, "README.md"), text, report)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
