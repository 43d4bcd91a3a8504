"""Methods benchmark: latency and memory vs context length for every KV-cache method, against the full cache.

For one model and dtype, each prompt length ``L`` and each batch ``B`` (``--batch``, default 1: ``B`` rows of
exactly ``L`` random token ids, row ``b`` = ``prompt_tokens(vocab, L, --seed + b)``, so row 0 is the batch-1 prompt;
the content does not change the cost), it measures in one process, for the full cache and each requested method
(``kvjax.methods.METHODS``):

* **prefill**: the full cache prefills into its own ``FullCache().init_cache`` (chunked jitted
  ``prefill``), and so does every method that runs its own prefill (``recording()`` is None: Locret
  and ``chunked_eviction`` evict while prefilling). The static methods share prefills (:mod:`kvjax.shared_prefill`): one staging cache
  per distinct *staging kind* ``(observation window, accumulate)`` is prefilled and timed once
  (SnapKV / PyramidKV / HBW-KV record a 32-query window, H2O accumulates attention, StreamingLLM and
  Quest record nothing), and every method of that kind derives its cache from it
  (``cache_for``). A method's ``prefill_s`` = its staging prefill time + its own ``compress`` time
  (the latter also reported alone as ``compress_s``);
* **decode**: ``decode_loop(..., max_new_tokens=N, eos_ids=())`` (no EOS: all N tokens are
  generated; the first comes from the prefill logits, so N - 1 decode steps are timed), best of
  ``--repeats`` runs, each on a freshly derived cache (``decode_loop`` donates it). All ``B`` rows decode
  together: ms per step (= ms per token of each row), and tokens/s = B x (N - 1) / the best run's seconds;
* **compile**: ahead-of-time ``lower`` + ``compile`` of the prefill executables (one per
  chunk shape, per staging kind), of ``compress`` and of the decode loop per method,
  with the persistent compilation cache off; every executable then runs once (warm-up) before
  anything is timed. Timings use ``jax.block_until_ready``;
* **cache bytes**: ``cache.stats()["device_bytes"]`` / ``["host_bytes"]`` of the compressed cache
  before decoding (of the prefilled cache for the full cache): every array the cache holds;
* **peak RSS**: the process's resident-set high-water mark (``ru_maxrss``), reset
  (``/proc/self/clear_refs``) right before the timed staging prefill and again right before a
  method's timed compress + decode. It covers everything alive in the process then: the weights,
  the staging cache of the method's kind (kept for the other methods of the kind), the compressed
  cache, activations, and memory the allocator has not handed back to the OS. On an accelerator
  the caches live in device memory, which RSS does not see;
* **bandwidth limit** of a decode step: bytes read per step = the weights read per step (all
  parameters except an *untied* input-embedding table, of which one row per step is read, as in
  ``evals/bench_foundation.py``) + the K/V the method reads per step at the mean decode context
  (full: K and V of ``L + N/2`` tokens in every layer and KV head; eviction methods: their kept
  tokens per head ``cache.stats()["kept_tokens_per_head"]`` + N/2 decoded ones; Quest: its own
  ``kv_bytes_read_per_step``, averaged over the cache before and after decoding, which counts the
  pages selected per step and the page bounds read to score them). The limit in ms = bytes / the
  machine's read bandwidth measured in the same run (``bench_machine.worker_bandwidth``, best of
  jitted ``jnp.sum`` and numpy sums over a ``--bandwidth-mib`` array);
* **ratios** vs the full cache of the same run at the same (length, batch): decode speed-up (full ms/step ÷
  method ms/step, = the tokens/s ratio), device-bytes ratio (method ÷ full), prefill ratio (method prefill s ÷ full
  prefill s).

A method spec's own ``budget=`` (``synckv:budget=0.25``) wins over ``--budget``, so one run can give methods
different budgets.

``--kv-dtype D`` (``bfloat16``, ``int8`` or ``float8_e4m3fn``; docs/QUANTIZATION.md) stores every listed method's
compressed cache in ``D``: its device bytes are the stored bytes (int8 / fp8 values and their float32 per-token
scales), and the bandwidth limit reads them. The full-cache reference stays in the model's dtype (every ratio is
against it), and ``full`` listed in ``--methods`` adds the full cache stored in ``D`` as its own row
``full:kv_dtype=D`` (:func:`kvjax.evals.records.stored_full_name`, as ``kvjax eval`` names it), which prefills on
its own as the reference does. A method that cannot store ``D`` (Quest, HCAttention, HeteroCache, SyncKV, eviction
during decode) is refused with the settings, before anything is measured.

``--memory-budget GIB`` switches to the throughput mode (:mod:`kvjax.evals.bench_throughput`): no prefill; the largest
batch each method's decode loop fits in that memory and its tokens/s there, from caches built without a prefill.

Usage::

    python -m kvjax.evals.bench_methods                       # qwen2.5-coder-0.5b, all methods, 1K..8K (kvjax bench)
    python -m kvjax.evals.bench_methods --model smollm2-135m --lengths 256,512 --methods snapkv,quest \\
        --new-tokens 8 --chunk-size 256 --out /tmp/m.md
    kvjax bench --lengths 8192,16384 --batch 1,4,16 --methods snapkv,synckv:budget=0.25   # throughput at batch
    kvjax bench --lengths 8192 --memory-budget 16 --methods snapkv                     # largest batch in 16 GiB

Results: Markdown at ``--out`` (default ``docs/results/bench_methods_<model>.md``; rewritten after each (length, batch)
cell, so an interrupted run keeps what it measured), the raw numbers as JSON and a plot (decode ms/token and device KV bytes vs context length) next to it
(same stem, ``.json`` / ``.png``; with several batches tokens/s and device bytes vs length per batch), written by
:mod:`kvjax.evals.bench_methods_report`, which also derives the limits and ratios from the measured rows. Progress (a tqdm bar and ``[bench]`` lines) goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import re
import shlex
import sys
import time
import traceback

import numpy as np

from kvjax.evals.bench_machine import (MIB, effective_chunk, machine_info, peak_rss_kib, prompt_tokens,
                                       real_compilations, reset_peak_rss, rss_now_kib, versions, worker_bandwidth)
from kvjax.evals.bench_methods_report import REFERENCE, add_derived, full_cache_row, write_report
from kvjax.evals.records import stored_full_name
from kvjax.budgets import parse_budget
from kvjax.cache import new_cache, unstorable
from kvjax.distributed import add_mesh_args, setup_devices
from kvjax.kv_quantization import KV_DTYPES, check_kv_dtype, stored_vector_bytes
from kvjax.sharding import place_cache

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)  # 16384 by --lengths: the defaults fit in ~20 min on 2 cores
DEFAULT_PROG = "kvjax bench"


def _log(msg: str) -> None:
    """A progress line on stderr that does not break the tqdm bar."""
    try:
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm is a dependency
        print(msg, file=sys.stderr, flush=True)
    sys.stderr.flush()


# --------------------------------------------------------------------------------------------
# argument parsing


def registered_methods() -> tuple[str, ...]:
    """Names of the registered KV-cache methods (``kvjax.methods.METHODS``), registry order."""
    from kvjax.methods import METHODS

    return tuple(METHODS)


def listed_methods(text: str) -> list[str]:
    """``"snapkv,quest,snapkv"`` -> ``["snapkv", "quest"]``: the listed known names (or specs such as
    ``synckv:stride=10``), no duplicates, in order; ``full`` kept where listed (with ``--kv-dtype`` it adds the full
    cache stored in that dtype: :func:`method_rows`)."""
    from kvjax.methods import parse_method_spec

    allowed = registered_methods()
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if parse_method_spec(v)[0] not in allowed]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {', '.join(map(repr, bad)) or repr(text)}; allowed: a comma-separated subset of "
            f"{','.join(allowed)}"
        )
    options = [v for v in names if v != REFERENCE and parse_method_spec(v)[0] == REFERENCE]
    if options:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, options))}: the full cache takes no options; "
                                         "list 'full' with --kv-dtype D for the full cache stored in D "
                                         "(row full:kv_dtype=D)")
    return list(dict.fromkeys(names))


def parse_methods(text: str) -> list[str]:
    """``"snapkv,quest"`` -> ``["full", "snapkv", "quest"]``: known names (or specs such as
    ``synckv:stride=10``), no duplicates, the full cache first."""
    return method_rows(listed_methods(text))


def method_rows(listed, kv_dtype: str | None = None) -> list[str]:
    """The rows a bench measures for the ``listed`` methods: the full cache (the reference, in the model's dtype)
    first, then with a ``kv_dtype`` (other than the model's) the full cache stored in it,
    ``stored_full_name(kv_dtype)``, when ``full`` is listed (as ``kvjax eval`` does), then the other methods in order.
    A name already resolved (``full:kv_dtype=D``) is kept, so resolving twice changes nothing."""
    stored = [stored_full_name(kv_dtype)] if kv_dtype is not None and REFERENCE in listed else []
    return list(dict.fromkeys([REFERENCE] + stored + [n for n in listed if n != REFERENCE]))


def storage_dtype(name: str, kv_dtype: str | None) -> str | None:
    """The ``kv_dtype`` row ``name``'s cache is stored in: None (the model's dtype) for the reference full cache,
    else ``kv_dtype``."""
    return None if name == REFERENCE else kv_dtype


def parse_lengths(text: str) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]``: positive integers, duplicates dropped, order kept."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths: expected comma-separated integers, got {text!r}") from None
    bad = [v for v in values if v <= 0]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--lengths: prompt lengths must be integers > 0, got {text!r}")
    return list(dict.fromkeys(values))


def parse_batches(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``: rows decoded together per cell, duplicates dropped, order kept; ValueError
    unless every entry is an integer >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--batch: expected comma-separated integers >= 1 (rows per cell), got {text!r}")
    return list(dict.fromkeys(values))


def batch_prompt_tokens(vocab_size: int, length: int, seed: int, batch: int) -> np.ndarray:
    """Random prompt ids int32 [batch, length]: row ``b`` is ``prompt_tokens(vocab_size, length, seed + b)`` (row 0 is
    the batch-1 prompt)."""
    return np.concatenate([prompt_tokens(vocab_size, length, seed + b) for b in range(batch)])


def default_out(model: str) -> str:
    """``docs/results/bench_methods_<model>.md`` (a path's last component, unsafe characters replaced)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(os.path.normpath(model))) or "model"
    return os.path.join("docs", "results", f"bench_methods_{stem}.md")


def parse_compiler_option(text: str) -> tuple[str, bool | int | float | str]:
    """``KEY=VALUE`` -> (key, value), the value read as a method spec's (:func:`kvjax.methods.parse_value`)."""
    from kvjax.methods import parse_value

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (an XLA option, e.g. xla_gpu_enable_latency_hiding_scheduler=false), got {text!r}")
    if value.strip().lower() == "none":
        raise argparse.ArgumentTypeError(f"an XLA option needs a value, got {text!r}")
    return key.strip(), parse_value(value.strip())


def decode_options(args) -> dict:
    """XLA options the decode loop is compiled with: kvjax's own for this backend, then ``--compiler-option``."""
    from kvjax.decoding import decode_compiler_options

    return decode_compiler_options() | dict(args.compiler_option or ())


def build_parser(prog: str = DEFAULT_PROG) -> argparse.ArgumentParser:
    """Options of the methods benchmark."""
    methods = ",".join(registered_methods())
    p = argparse.ArgumentParser(
        prog=prog,
        description="Prefill s, decode ms/token, KV bytes, peak RSS and compile time of each KV-cache method vs the "
        "full cache, per context length, with each decode step against the measured memory-bandwidth limit.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"ready model, HF directory or .gguf (default {DEFAULT_MODEL}); with --random-weights also a "
                        "shape-only model (llama-3.1-8b, qwen2.5-7b)")
    p.add_argument("--methods", type=listed_methods, default=listed_methods(methods),
                   help=f"comma-separated methods (default {methods}); the full cache is always measured as the "
                        "reference; 'full' listed with --kv-dtype D adds the full cache stored in D as the row "
                        "full:kv_dtype=D")
    p.add_argument("--budget", type=parse_budget, default=0.1,
                   help="KV budget of the compressing methods: an int = tokens per KV head per layer, a float in (0, 1] "
                   "= fraction of the prompt kept (default 0.1)")
    p.add_argument("--lengths", type=parse_lengths, default=list(DEFAULT_LENGTHS),
                   help=f"prompt lengths in tokens (default {','.join(map(str, DEFAULT_LENGTHS))})")
    p.add_argument("--batch", default="1", metavar="B[,B...]",
                   help="rows per cell, decoded together, e.g. 1,4,16 (default 1): prefilled from different random "
                        "prompts, or built without a prefill with --no-prefill")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="throughput mode: no prefill; the largest batch each method's decode loop fits in GIB GiB "
                        "(weights + cache + temporaries, from the compiled program) and its tokens/s there, from a "
                        "cache built without a prefill (kvjax.evals.bench_throughput); --batch is not used")
    p.add_argument("--no-prefill", action="store_true",
                   help="every (length, batch) cell's caches built without a prefill (random contents, the method's own "
                        "selection and layout; kvjax.evals.bench_throughput) and their decode timed at each --batch: "
                        "tokens/s and bytes at sizes a prefill on this machine cannot reach; no prefill columns "
                        "(default out docs/results/bench_batch_synthetic_<model>.md). --memory-budget implies it")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run, >= 2 (N - 1 decode steps timed; default 64)")
    p.add_argument("--chunk-size", type=int, default=1024,
                   help="prefill chunk in tokens; prompt lengths must be multiples of it (0 = whole prompt; default 1024)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and cache dtype")
    p.add_argument("--kv-dtype", default=None, metavar="D",
                   help=f"storage dtype of every listed method's compressed cache: the --dtype (default), "
                        f"{', '.join(KV_DTYPES)} (int8 and fp8 with a float32 scale per token and KV head; "
                        "docs/QUANTIZATION.md); device bytes are the stored bytes, scales included. The full-cache "
                        "reference keeps the --dtype (ratios are against it); 'full' in --methods adds the full cache "
                        "stored in D as the row full:kv_dtype=D. A method that cannot store D is refused before "
                        "anything is measured")
    p.add_argument("--repeats", type=int, default=1, help="timed decode (and compress) runs per method, best reported (default 1)")
    p.add_argument("--seed", type=int, default=0, help="prompt ids seed")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="array size of the bandwidth measurement (MiB)")
    p.add_argument("--bandwidth-repeats", type=int, default=5, help="bandwidth measurement runs (best reported)")
    p.add_argument("--out", default=None,
                   help="Markdown output; JSON and PNG next to it, same stem (default docs/results/bench_methods_<model>.md)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed runs, run each method's decode loop once more under jax.profiler.trace, "
                        "writing DIR/<method>-<length>/ (untimed; view with TensorBoard or Perfetto)")
    p.add_argument("--random-weights", action="store_true",
                   help="the model's architecture with random weights (no weight files needed, e.g. on a machine "
                        "without the model's packages): timings and bytes only, recall rates are not the model's")
    p.add_argument("--compiler-option", type=parse_compiler_option, action="append", metavar="KEY=VALUE",
                   help="an XLA option for the decode loop's compilation, over kvjax's own for the backend "
                        "(kvjax.decoding.decode_compiler_options); repeatable. E.g. "
                        "xla_gpu_enable_latency_hiding_scheduler=false times XLA's default schedule on a GPU")
    add_mesh_args(p)
    return p


def check_args(args) -> None:
    """Reject values argparse cannot check alone (ValueError naming the value and what is allowed); ``--batch``'s
    text becomes its list of batches, ``--kv-dtype`` its dtype's name (None for the model's dtype) and ``--methods``
    the rows measured (:func:`method_rows`)."""
    if isinstance(args.batch, str):
        args.batch = parse_batches(args.batch)
    try:
        kv = check_kv_dtype(args.kv_dtype, args.dtype)
    except ValueError as e:
        raise ValueError(f"--kv-dtype: {e}") from None
    args.kv_dtype = None if kv == args.dtype else kv
    args.methods = method_rows(args.methods, args.kv_dtype)
    if args.memory_budget is not None and not args.memory_budget > 0:
        raise ValueError(f"--memory-budget must be > 0 GiB, got {args.memory_budget}")
    if args.profile and (args.no_prefill or args.memory_budget is not None):
        raise ValueError("--profile traces the prefilled runs' decode loops; --no-prefill and --memory-budget have none")
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (the first token comes from the prefill), got {args.new_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.bandwidth_mib < 1 or args.bandwidth_repeats < 1:
        raise ValueError(f"--bandwidth-mib and --bandwidth-repeats must be >= 1, got {args.bandwidth_mib}, {args.bandwidth_repeats}")
    if args.chunk_size < 0:
        raise ValueError(f"--chunk-size must be >= 0 (0 = whole prompt), got {args.chunk_size}")
    for L in args.lengths:
        effective_chunk(L, args.chunk_size)


def make_methods(names, budget) -> dict:
    """Method instances by name: the full cache (the reference and ``full:kv_dtype=D``, the same method stored
    otherwise) as is, the others with ``budget`` unless their spec has its own (ValueError when it is invalid)."""
    from kvjax.methods import get_method, parse_method_spec

    return {n: get_method(REFERENCE) if full_cache_row(n)
            else get_method(n) if "budget" in parse_method_spec(n)[1] else get_method(n, budget=budget)
            for n in names}


def method_budget(name: str, budget):
    """The budget ``name`` runs with: its spec's own ``budget=``, else ``budget`` (None for the full cache)."""
    from kvjax.methods import parse_method_spec

    return None if full_cache_row(name) else parse_method_spec(name)[1].get("budget", budget)


def bench_artifacts(methods: dict, config, random_weights: bool) -> tuple[dict, dict]:
    """``(artifact to pass per method, its source per method)``. A method that finds its own artifact (shipped for the
    model, or named by its options) gets None to pass and the source ``"own"``; one without an artifact None and
    None. With random weights and nothing to find (a shape-only model): a synthetic artifact of the real shapes and
    classes (:func:`kvjax.evals.synthetic.synthetic_artifact`: calibrated on nothing, so it holds and moves the bytes a
    calibration would), source ``"synthetic"``. Real weights with nothing to find keep the method's own error."""
    from kvjax.evals.synthetic import synthetic_artifact
    from kvjax.cache import CacheSpec

    spec = CacheSpec.for_model(config, 1, 1, 1, "float32")
    artifacts, sources = {}, {}
    for name, m in methods.items():
        try:
            artifacts[name], sources[name] = None, None if m.artifact_for(spec, None) is None else "own"
        except ValueError:
            if not random_weights:
                raise
            artifacts[name], sources[name] = synthetic_artifact(m, spec), "synthetic"
    return artifacts, sources


def check_methods_fit(methods: dict, config, lengths, new_tokens: int, artifacts: dict | None = None,
                      kv_dtype: str | None = None, dtype="float32") -> None:
    """Every (method, length) must be feasible: budget vs prompt, model context, and every method but the reference
    must store its cache in ``kv_dtype`` (``dtype``: the model's); one ValueError naming every problem."""
    others = {name: m for name, m in methods.items() if name != REFERENCE}
    problems = []
    for L in lengths:
        if L + new_tokens > config.max_position_embeddings:
            problems.append(f"L={L}: {L} prompt + {new_tokens} new tokens exceed the model's context of "
                            f"{config.max_position_embeddings} tokens")
            continue
        problems += [f"{name} at L={L}: {why}" for name, why in unstorable(
            others, config, L, new_tokens, dtype, kv_dtype=kv_dtype, artifacts=artifacts).items()]
    if problems:
        raise ValueError("infeasible benchmark settings:\n  " + "\n  ".join(problems))


# --------------------------------------------------------------------------------------------
# byte accounting


def weights_read_bytes(model) -> dict:
    """Parameter bytes and the bytes of weights one decode step reads (``bench_foundation``'s rule).

    Every parameter is read once per step except an untied input-embedding table (one row is
    gathered); with tied embeddings the LM head reads the whole table.
    """
    import jax

    leaves = jax.tree_util.tree_leaves(model.params)
    param_bytes = sum(int(x.size) * x.dtype.itemsize for x in leaves)
    embed = model.params["embed_tokens"]["embedding"]
    embed_bytes = int(embed.size) * embed.dtype.itemsize
    tied = bool(model.config.tie_word_embeddings)
    return {
        "param_bytes": param_bytes, "embedding_bytes": embed_bytes, "tied_embeddings": tied,
        "weights_read_bytes": param_bytes if tied else param_bytes - embed_bytes,
    }


def kv_read_bytes_per_step(name: str, stats_before: dict, stats_after: dict | None, config, prompt_len: int,
                           new_tokens: int, itemsize: int, batch: int = 1, vector_bytes: int | None = None) -> float:
    """K/V bytes one decode step reads at the mean decode context (see the module docstring); ``vector_bytes``: one
    stored K or V vector's bytes (:func:`stored_vector_bytes`; default ``head_dim`` values of ``itemsize``)."""
    vector = config.head_dim * itemsize if vector_bytes is None else vector_bytes
    if full_cache_row(name):
        return batch * 2 * config.num_layers * config.num_kv_heads * vector * (prompt_len + new_tokens / 2)
    kept = stats_before.get("kept_tokens_per_head")
    # Quest (selected pages + page bounds) and methods without a kept-token count (HeteroCache, SyncKV,
    # HCAttention): the method's own account (``method.bytes_read_per_step``), mean of before and after decoding
    if kept is None or stats_before.get("saves", "").startswith("bandwidth"):
        before = stats_before["kv_bytes_read_per_step"]
        after = stats_after.get("kv_bytes_read_per_step", before) if stats_after else before
        return (before + after) / 2
    grow = 0 if stats_before.get("evicts_during_decode") else new_tokens / 2  # H2O with eviction: fixed capacity
    tokens = sum(c + grow for layer in kept for c in layer)  # over layers and KV heads
    return batch * 2 * vector * tokens


# --------------------------------------------------------------------------------------------
# measurement


def staging_kind(method) -> tuple[int, bool]:
    """What a method's staging records: (observation window, accumulate). Equal kinds share a prefill."""
    rec = method.recording()
    return rec.window, rec.accumulate


def staging_kinds(methods: dict) -> list[dict]:
    """The distinct stagings of the static methods: ``{"window", "accumulate", "shared_by": [names]}``, in order."""
    kinds: dict[tuple, list[str]] = {}
    for name, m in methods.items():
        if not full_cache_row(name) and m.recording() is not None:  # the others run their own prefill
            kinds.setdefault(staging_kind(m), []).append(name)
    return [{"window": w, "accumulate": acc, "shared_by": names} for (w, acc), names in kinds.items()]


def _memory_stats() -> dict | None:
    """Device allocator stats (bytes in use / peak) where the backend has them (not on CPU)."""
    import jax

    try:
        s = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - optional information
        return None
    if not s:
        return None
    return {k: s[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in s}


def _error(e: BaseException) -> str:
    traceback.print_exc(file=sys.stderr)
    return f"{type(e).__name__}: {e}"


def _greedy(logits):
    """First generated token [B] from the prefill logits (greedy), jitted once."""
    global _GREEDY
    if _GREEDY is None:
        import jax
        import jax.numpy as jnp

        _GREEDY = jax.jit(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))
    return _GREEDY(logits)


_GREEDY = None


def _peak_since_reset(base_kib: int, reset: bool) -> dict:
    """Peak RSS since the last reset, never below the RSS at the reset (the kernel's counters lag a little)."""
    return {"rss_base_kib": base_kib, "peak_kib": max(peak_rss_kib(), rss_now_kib(), base_kib), "peak_reset": reset}


class _Prefiller:
    """AOT-compiled chunked prefill of one cache kind (the full cache or one staging kind) for one length."""

    def __init__(self, model, new_cache, chunks):
        from kvjax.decoding import prefill_jit

        self.model, self.new_cache, self.chunks = model, new_cache, chunks
        self.compile_s = {}
        spec = new_cache()
        t = time.perf_counter()
        self.exe = prefill_jit.lower(model.graphdef, model.params, chunks[0], spec).compile()
        self.compile_s["prefill_chunk"] = time.perf_counter() - t
        del spec

    def run(self, chunks, cache=None):
        """Prefill ``chunks`` into ``cache`` (default a fresh one): (first tokens [1], cache), everything finished."""
        import jax
        import jax.numpy as jnp

        from kvjax.decoding import prefill_prompt

        cache = self.new_cache() if cache is None else cache
        tokens = jnp.concatenate(chunks, axis=1)
        logits, cache = prefill_prompt(self.model.graphdef, self.model.params, tokens, cache,
                                       chunk_size=chunks[0].shape[1], step=self.exe)
        first = _greedy(logits)
        jax.block_until_ready((first, cache))
        return first, cache

    def measure(self):
        """Warm up (at most two chunks: every executable once), then time the whole prompt with its peak RSS."""
        self.run(self.chunks[:2])
        gc.collect()
        cache = self.new_cache()  # allocated before the clock starts (in the peak: it is alive)
        reset = reset_peak_rss()
        base = rss_now_kib()
        t = time.perf_counter()
        first, cache = self.run(self.chunks, cache)
        seconds = time.perf_counter() - t
        return first, cache, seconds, _peak_since_reset(base, reset)


def profile_dir(root: str, name: str, L: int) -> str:
    """Where ``--profile`` writes the trace of method ``name`` at length ``L``: ``root/<name>-<L>``, every character of
    the name but letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``."""
    return os.path.join(root, f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)}-{L}")


def profile_decode(*, exe, params, first, key, cache, log_dir: str) -> None:
    """Run the compiled decode loop once more under ``jax.profiler.trace(log_dir)`` (a TensorBoard / Perfetto trace)."""
    import jax

    jax.block_until_ready(cache)
    with jax.profiler.trace(log_dir):
        jax.block_until_ready(exe(params, first, cache, key))
    _log(f"profile of the decode loop written to {log_dir}")


def measure_method(model, name: str, derive, first, key, args, L: int) -> dict:
    """Compress + decode one method; ``derive(final)`` returns a fresh uncompressed cache (``final``: last use).

    Returns timings (``tokens_per_s``: every row's N - 1 decoded tokens ÷ the best decode time), compile times, cache
    stats before/after decoding, row 0's generated tokens and the peak RSS of the timed part.
    """
    import jax

    from kvjax.decoding import compress_jit, decode_loop_jit

    N = args.new_tokens
    t = time.perf_counter()
    compress_exe = compress_jit.lower(derive(False)).compile()
    compile_compress = time.perf_counter() - t
    warm = compress_exe(derive(False))
    jax.block_until_ready(warm)
    t = time.perf_counter()
    decode_exe = decode_loop_jit.lower(model.graphdef, model.params, first, warm, key, max_new_tokens=N,
                                       eos_ids=()).compile(compiler_options=decode_options(args) or None)
    compile_decode = time.perf_counter() - t
    jax.block_until_ready(decode_exe(model.params, first, warm, key))  # warm-up (donates `warm`)
    del warm
    gc.collect()

    reset = reset_peak_rss()
    base = rss_now_kib()
    compress_times, decode_times = [], []
    stats_before = stats_after = generated = None
    for r in range(args.repeats):
        uncompressed = derive(r == args.repeats - 1 and not args.profile)
        t = time.perf_counter()
        cache = compress_exe(uncompressed)
        jax.block_until_ready(cache)
        compress_times.append(time.perf_counter() - t)
        del uncompressed
        if stats_before is None:
            stats_before = cache.stats()
        t = time.perf_counter()
        cache, out, count = decode_exe(model.params, first, cache, key)
        jax.block_until_ready((out, count, cache))
        decode_times.append(time.perf_counter() - t)
        counts = np.asarray(count)
        if (counts != N).any():
            raise RuntimeError(f"{name}: the decode loop produced {counts.tolist()} tokens per row, expected {N}")
        generated = [int(v) for v in np.asarray(out)[0]]  # row 0's
        if r == args.repeats - 1:
            stats_after = cache.stats()
        del cache, out, count
    memory = _peak_since_reset(base, reset)
    if args.profile:  # one more run, untimed, under the profiler
        profile_decode(exe=decode_exe, params=model.params, first=first, key=key, cache=compress_exe(derive(True)),
                       log_dir=profile_dir(args.profile, name, L))
    return {
        "compress_s": min(compress_times), "compress_times_s": compress_times,
        "decode_times_s": decode_times, "decode_ms_per_token": 1000 * min(decode_times) / (N - 1),
        "tokens_per_s": tokens_per_second(int(first.shape[0]), N - 1, min(decode_times)),
        "compile_compress_s": compile_compress, "compile_decode_s": compile_decode,
        "stats_before": stats_before, "stats_after": stats_after, "generated": generated,
        "decode_memory": memory,
    }


def tokens_per_second(batch: int, steps: int, seconds: float) -> float:
    """Decode throughput: ``batch`` rows x ``steps`` decoded tokens each ÷ the loop's ``seconds``."""
    return batch * steps / seconds


def measure_length(model, L: int, methods: dict, args, bar=None, artifacts: dict | None = None,
                   batch: int = 1) -> list[dict]:
    """One row per method (full cache first) at prompt length ``L`` and ``batch`` rows, each with its artifact
    (``artifacts``, default the shipped ones) and stored in ``args.kv_dtype`` (the reference full cache in the
    model's dtype); a failing method gets an ``error`` row."""
    import jax
    import jax.numpy as jnp

    from kvjax.cache import CacheSpec
    from kvjax.shared_prefill import cache_for, init_shared_cache

    config, N = model.config, args.new_tokens
    artifacts = artifacts or {}
    chunk = effective_chunk(L, args.chunk_size)
    B = batch
    tokens = batch_prompt_tokens(config.vocab_size, L, args.seed, B)
    chunks = [jnp.asarray(tokens[:, i:i + chunk]) for i in range(0, L, chunk)]  # [B, chunk] each
    key = jax.random.PRNGKey(args.seed)
    kv_dtype = args.kv_dtype
    model_dtype = jnp.dtype(model.dtype).name
    rows = {name: {"prompt_tokens": L, "batch": B, "method": name, "new_tokens": N, "chunk": chunk,
                   "budget": method_budget(name, args.budget),
                   "kv_dtype": storage_dtype(name, kv_dtype) or model_dtype} for name in methods}
    where = f"L={L}" if B == 1 else f"L={L} B={B}"

    def done(name, result=None, error=None):
        row = rows[name]
        if error is not None:
            row["error"] = error
            _log(f"[bench] {where} {name} FAILED: {error}")
        else:
            row.update(result)
            _log(f"[bench] {where} {name}: prefill {row['prefill_s']:.2f} s (compress {row['compress_s'] * 1000:.1f} ms), "
                 f"decode {row['decode_ms_per_token']:.2f} ms/step ({row['tokens_per_s']:.1f} tokens/s), "
                 f"device KV {row['device_bytes'] / MIB:.1f} MiB")
        row["device_memory"] = _memory_stats()
        jax.clear_caches()  # drop traced/compiled functions (the AOT executables are gone already): RSS per method
        gc.collect()
        if bar is not None:
            bar.update()

    def finish(name, staging, result):
        """Merge the staging prefill with the method's measurement into a row."""
        before = result.pop("stats_before")
        after = result.pop("stats_after")
        return {
            "staging": staging["kind"], "staging_prefill_s": staging["seconds"],
            "prefill_s": staging["seconds"] + result["compress_s"],
            "compile_prefill_s": staging["compile_s"], "compile_s": {
                "prefill": sum(staging["compile_s"].values()), "compress": result["compile_compress_s"],
                "decode": result["compile_decode_s"]},
            "prefill_memory": staging["memory"],
            "device_bytes": before["device_bytes"], "host_bytes": before["host_bytes"],
            "cache_stats": before, "cache_stats_after_decode": after,
            "kv_read_bytes_per_step": kv_read_bytes_per_step(
                name, before, after, config, L, N, jnp.dtype(model.dtype).itemsize, batch=B,
                vector_bytes=stored_vector_bytes(config.head_dim, storage_dtype(name, kv_dtype) or model.dtype)),
            **result,
        }

    def own_prefill(name):
        """A method with its own prefill (the full cache, stored or not; methods evicting while prefilling): measured
        alone."""
        try:
            method = methods[name]
            _log(f"[bench] {where} {name}: compiling and prefilling {L} tokens in chunks of {chunk} (own prefill)")
            pf = _Prefiller(model, lambda: jax.block_until_ready(new_cache(method, config, B, L, N, model.dtype,
                                                                           artifact=artifacts.get(name),
                                                                           mesh=model.mesh,
                                                                           kv_dtype=storage_dtype(name, kv_dtype))),
                            chunks)
            first, cache, seconds, memory = pf.measure()
            staging = {"kind": "own prefill", "seconds": seconds, "compile_s": pf.compile_s, "memory": memory}
            del pf
            holder = [cache]

            def derive(final):
                if final:
                    c, holder[0] = holder[0], None
                    return c
                return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, holder[0]))

            result = measure_method(model, name, derive, first, key, args, L)
            del cache, holder
            done(name, finish(name, staging, result))
        except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
            done(name, error=_error(e))
        gc.collect()

    for name in methods:
        if full_cache_row(name) or methods[name].recording() is None:
            own_prefill(name)

    # static methods: one measured staging prefill per kind
    for kind in staging_kinds(methods):
        names, window, accumulate = kind["shared_by"], kind["window"], kind["accumulate"]
        group = [methods[n] for n in names]
        try:
            _log(f"[bench] {where} staging (window {window}, accumulate {accumulate}) for {', '.join(names)}")
            # the staging in the model's dtype; each method's compressed cache in kv_dtype
            spec = CacheSpec.for_model(config, B, L, N, model.dtype, mesh=model.mesh, kv_dtype=kv_dtype)
            arts = [artifacts.get(n) for n in names]
            pf = _Prefiller(model, lambda: jax.block_until_ready(place_cache(init_shared_cache(group, spec, arts))),
                            chunks)
            first, staged, seconds, memory = pf.measure()
            staging = {"kind": kind, "seconds": seconds, "compile_s": pf.compile_s, "memory": memory}
            del pf
        except Exception as e:  # noqa: BLE001
            err = f"staging prefill failed: {_error(e)}"
            for n in names:
                done(n, error=err)
            continue
        for n in names:
            try:
                m = methods[n]
                result = measure_method(model, n, lambda final, m=m, a=artifacts.get(n): cache_for(staged, m, a),
                                        first, key, args, L)
                done(n, finish(n, staging, result))
            except Exception as e:  # noqa: BLE001
                done(n, error=_error(e))
            gc.collect()
        del staged
        gc.collect()
    return [rows[n] for n in methods]


# --------------------------------------------------------------------------------------------
# entry point


def main(argv=None, prog: str = DEFAULT_PROG) -> int:
    """Run the methods benchmark; write the Markdown, JSON and PNG reports. Returns 0 when every row succeeded.

    ``prog`` is the command the report says produced it (``<prog> <options>``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    args = build_parser(prog).parse_args(argv)
    check_args(args)
    if args.memory_budget is not None:
        from kvjax.evals.bench_throughput import run as run_throughput

        return run_throughput(args, argv, prog)
    if args.no_prefill:
        from kvjax.evals.bench_throughput import run_batches

        return run_batches(args, argv, prog)
    mesh = setup_devices(args)
    methods = make_methods(args.methods, args.budget)
    out = args.out or default_out(args.model)

    import jax
    from tqdm import tqdm

    from kvjax.decoding import TRACE_COUNTS
    from kvjax.models import load_model, model_architecture

    # the settings checked on the model's architecture (no weights read) before anything is measured: budgets vs
    # prompts, context, and every method storing its cache in --kv-dtype
    config, _ = model_architecture(args.model)
    artifacts, artifact_sources = bench_artifacts(methods, config, args.random_weights)
    check_methods_fit(methods, config, args.lengths, args.new_tokens, artifacts, args.kv_dtype, args.dtype)

    start = time.perf_counter()
    with real_compilations():
        _log(f"[bench] {args.model} {args.dtype}" + (f", KV stored in {args.kv_dtype}" if args.kv_dtype else "")
             + f": bandwidth, then {len(args.lengths)} lengths x {len(methods)} methods ({', '.join(methods)})")
        try:
            bandwidth = worker_bandwidth(args)
            _log(f"[bench] machine read bandwidth {bandwidth['machine'] / 1e9:.1f} GB/s ({bandwidth['machine_source']})")
        except Exception as e:  # noqa: BLE001
            bandwidth = {"error": _error(e)}
        gc.collect()

        _log(f"[bench] loading {args.model} ({args.dtype})")
        t = time.perf_counter()
        model = load_model(args.model, args.dtype, tokenizer=False, mesh=mesh, random_weights=args.random_weights)
        jax.block_until_ready(model.params)
        load_s = time.perf_counter() - t
        weights = weights_read_bytes(model)
        traces0 = dict(TRACE_COUNTS)

        rows = []
        cells = [(L, B) for L in args.lengths for B in args.batch]

        def report_so_far() -> dict:
            add_derived(rows, weights, bandwidth.get("machine"))
            return {
                "command": f"{prog} {shlex.join(argv)}" if argv else prog,
                "args": {k: getattr(args, k) for k in (
                    "model", "methods", "budget", "lengths", "batch", "new_tokens", "chunk_size", "dtype", "kv_dtype",
                    "repeats", "seed", "bandwidth_mib", "bandwidth_repeats", "random_weights")}
                | {"out": out, "model_path": model.path},
                "machine": machine_info(),
                "versions": versions(),
                "backend": jax.default_backend(),
                "decode_compiler_options": decode_options(args),
                "devices": [str(d) for d in jax.devices()],
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "bandwidth": bandwidth,
                "weights": weights,
                "load_s": load_s,
                "method_configs": {n: repr(m) for n, m in methods.items()},
                "artifacts": artifact_sources,
                "staging_kinds": staging_kinds(methods),
                "trace_counts": {k: TRACE_COUNTS[k] - traces0.get(k, 0) for k in TRACE_COUNTS},
                "rows": rows,
                "cells_done": len(rows) // len(methods), "cells": len(cells),
                "total_s": time.perf_counter() - start,
            }

        with tqdm(total=len(cells) * len(methods), desc="bench (length, batch, method)", unit="run",
                  file=sys.stderr) as bar:
            for i, (L, B) in enumerate(cells):
                bar.set_postfix_str(f"L={L} B={B}")
                rows += measure_length(model, L, methods, args, bar, artifacts, batch=B)
                gc.collect()
                if i + 1 < len(cells):  # an interrupted run keeps the cells it measured
                    write_report(report_so_far(), out, with_plot=False)
        report = report_so_far()

    md, written = write_report(report, out, with_plot=not args.no_plot)
    print(md)
    _log(f"[bench] wrote {', '.join(written)} in {report['total_s'] / 60:.1f} min")
    failed = any("error" in r for r in rows) or "error" in bandwidth
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
