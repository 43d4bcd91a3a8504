"""Foundation benchmark: kvjax (full cache) vs ``transformers`` (PyTorch CPU) on the same weights.

For each dtype and prompt length it measures, for both frameworks in the same run:

* prefill tokens/s (kvjax: chunked prefill, ``--chunk-size``; transformers: one forward with
  ``use_cache=True, logits_to_keep=1``; both only compute the last token's logits),
* decode ms/token (greedy, ``--new-tokens`` N: the first token comes from the prefill, so N - 1
  decode forwards are timed; kvjax runs them in one jitted ``lax.while_loop``),
* memory: the process RSS after loading the weights and the peak RSS of the run after that
  (``ru_maxrss`` with the high-water mark reset once the weights are loaded, so weights and
  activations / cache are told apart), plus the peak of loading itself (in the JSON),
* kvjax's compile time (ahead-of-time ``lower`` + ``compile`` of the prefill chunk variant(s) and of
  the decode loop); transformers runs eagerly (its first, warm-up call is recorded in the JSON).

and the physical limit of one decode step: the bytes it must read (every weight matrix it uses,
i.e. all parameters except an *untied* input-embedding table, of which one row per step is
read; plus K and V of all cached tokens at the mean context of the decode, ``L + N/2``) divided
by the machine's read bandwidth, measured in the same run (best of ``jnp.sum`` jitted, numpy
``a.sum()`` and numpy summing in one thread per core, over a ``--bandwidth-mib`` f32 array).

Every (framework, dtype, length) runs in its own subprocess (``--worker``): the frameworks do not
share a process and each peak RSS belongs to one configuration. Prompts are random token ids
(``numpy.random.default_rng(--seed)``), identical for both frameworks (checked by a hash).

Usage::

    kvjax bench                                    # qwen2.5-coder-0.5b, 1K/4K/8K, f32 + bf16
    kvjax bench --model smollm2-135m --lengths 256 --dtypes float32 --out /tmp/b.md
    python -m kvjax.evals.bench_foundation --frameworks kvjax --lengths 1024

Results: a Markdown table at ``--out`` (default ``docs/results/foundation_bench.md``) and the
raw numbers as JSON next to it (same name, ``.json``). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvjax.evals.bench_machine import (GIB, MIB, effective_chunk, machine_info, peak_rss_kib, prompt_tokens, reset_peak_rss,
                                 rss_now_kib, versions, worker_bandwidth)
from kvjax.cache import new_cache as make_cache
from kvjax.reports import MISSING, number, table, write_report

DEFAULT_OUT = os.path.join("docs", "results", "foundation_bench.md")
FRAMEWORKS = ("kvjax", "transformers")
DTYPES = ("float32", "bfloat16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------
# small helpers (no jax / torch imports here: the parent process stays framework-free)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _choice_list(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(values))

    return parse


def _sha1(tokens: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# workers (each runs in its own subprocess)


def _memory_after_load() -> dict:
    gc.collect()
    mem = {"rss_after_load_kib": rss_now_kib(), "peak_load_kib": peak_rss_kib()}
    mem["peak_reset"] = reset_peak_rss()
    return mem


def _memory_at_end(mem: dict) -> dict:
    mem["peak_run_kib"] = peak_rss_kib()  # since the reset (or since start if the reset failed)
    mem["peak_overall_kib"] = max(mem["peak_load_kib"], mem["peak_run_kib"])
    mem["rss_end_kib"] = rss_now_kib()
    return mem


def worker_kvjax(args) -> dict:
    """kvjax: load, AOT-compile prefill + decode loop, warm up, time prefill and decode."""
    tag = f"[kvjax {args.dtype} L={args.length}]"
    L, N = args.length, args.new_tokens
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_compilation_cache", False)  # compile times are real compilations
    from kvjax.decoding import compress_jit, decode_compiler_options, decode_loop_jit, prefill_jit, prefill_prompt
    from kvjax.methods import FullCache
    from kvjax.models import load_model

    _log(f"{tag} loading {args.model}")
    model = load_model(args.path, args.dtype, tokenizer=False)
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0
    config = model.config
    if L + N > config.max_position_embeddings:
        raise ValueError(f"{L} prompt + {N} new tokens exceed the model's context of {config.max_position_embeddings}")

    leaves = jax.tree_util.tree_leaves(model.params)
    param_bytes = sum(int(x.size) * x.dtype.itemsize for x in leaves)
    embed = model.params["embed_tokens"]["embedding"]
    embed_bytes = int(embed.size) * embed.dtype.itemsize
    weights_read = param_bytes if config.tie_word_embeddings else param_bytes - embed_bytes
    kv_per_token = config.kv_bytes_per_token(jnp.dtype(model.dtype).itemsize)

    chunk = effective_chunk(L, args.chunk_size)
    tokens = prompt_tokens(config.vocab_size, L, args.seed)
    chunks = [jnp.asarray(tokens[:, i:i + chunk]) for i in range(0, L, chunk)]
    method = FullCache()

    def new_cache():
        return jax.block_until_ready(make_cache(method, config, 1, L, N, model.dtype))

    mem = _memory_after_load()

    # ahead-of-time compilation: the prefill chunk and the decode loop (on the compressed-stage cache,
    # which for the full cache is the staging buffer itself: compress moves no data)
    _log(f"{tag} compiling (prefill chunk {chunk}, decode loop of {N} tokens)")
    cache = new_cache()
    capacity = cache.capacity
    lower_s, compile_s = {}, {}
    t = time.perf_counter()
    lowered = prefill_jit.lower(model.graphdef, model.params, chunks[0], cache)
    lower_s["prefill_chunk"] = time.perf_counter() - t
    t = time.perf_counter()
    prefill_exe = lowered.compile()
    compile_s["prefill_chunk"] = time.perf_counter() - t
    first_spec = jnp.zeros((1,), jnp.int32)
    key = jax.random.PRNGKey(args.seed)
    t = time.perf_counter()
    lowered = decode_loop_jit.lower(model.graphdef, model.params, first_spec, jax.eval_shape(compress_jit, cache), key,
                                    max_new_tokens=N)
    lower_s["decode_loop"] = time.perf_counter() - t
    t = time.perf_counter()
    decode_exe = lowered.compile(compiler_options=decode_compiler_options() or None)
    compile_s["decode_loop"] = time.perf_counter() - t
    del cache

    argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))

    def run_prefill(cache, parts):
        logits, cache = prefill_prompt(model.graphdef, model.params, jnp.concatenate(parts, axis=1), cache,
                                       chunk_size=chunk, step=prefill_exe)
        cache = compress_jit(cache)
        first = argmax(logits)
        first.block_until_ready()
        return first, cache

    def run_decode(first, cache):
        cache, out, count = decode_exe(model.params, first, cache, key)
        out.block_until_ready()
        return out, count, cache

    # warm-up: every executable once (two chunks at most), then the decode loop
    _log(f"{tag} warm-up")
    t = time.perf_counter()
    first, cache = run_prefill(new_cache(), chunks[:1] if len(chunks) == 1 else chunks[:2])
    run_decode(first, cache)
    warmup_s = time.perf_counter() - t
    del cache

    _log(f"{tag} prefill x{args.prefill_repeats}")
    prefill_times = []
    for _ in range(args.prefill_repeats):
        cache = new_cache()
        t = time.perf_counter()
        first, cache = run_prefill(cache, chunks)
        prefill_times.append(time.perf_counter() - t)

    _log(f"{tag} decode x{args.repeats}")
    decode_times, generated = [], None
    for r in range(args.repeats):
        c = cache if r == args.repeats - 1 else jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, cache))
        t = time.perf_counter()
        out, count, _ = run_decode(first, c)
        decode_times.append(time.perf_counter() - t)
        if int(count[0]) != N:
            raise RuntimeError(f"decode loop produced {int(count[0])} tokens, expected {N}")
        generated = [int(v) for v in np.asarray(out)[0]]
    del cache, c

    prefill_s = min(prefill_times)
    decode_s = statistics.median(decode_times)
    steps = max(N - 1, 1)
    return {
        "framework": "kvjax", "dtype": args.dtype, "prompt_tokens": L, "new_tokens": N, "chunk": chunk,
        "prompt_sha1": _sha1(tokens), "load_s": load_s,
        "prefill_s": prefill_s, "prefill_times_s": prefill_times, "prefill_tok_s": L / prefill_s,
        "decode_times_s": decode_times, "decode_ms_per_token": 1000 * decode_s / steps,
        "decode_ms_per_token_best": 1000 * min(decode_times) / steps,
        "compile_s": sum(lower_s.values()) + sum(compile_s.values()),
        "lower_s": lower_s, "xla_compile_s": compile_s, "warmup_s": warmup_s,
        "generated": generated,
        "param_bytes": param_bytes, "embedding_bytes": embed_bytes, "tied_embeddings": bool(config.tie_word_embeddings),
        "weights_read_bytes": weights_read, "kv_bytes_per_token": kv_per_token,
        "cache_capacity_slots": capacity,
        "memory": _memory_at_end(mem),
        "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
    }


def worker_transformers(args) -> dict:
    """transformers: load the same weights, time one prefill forward and a greedy decode loop."""
    tag = f"[transformers {args.dtype} L={args.length}]"
    L, N = args.length, args.new_tokens
    t0 = time.perf_counter()
    import copy

    import torch

    torch.set_num_threads(args.torch_threads or os.cpu_count() or 1)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    _log(f"{tag} loading {args.model}")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if os.path.isdir(args.path):
        model = AutoModelForCausalLM.from_pretrained(args.path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(args.path) or ".", gguf_file=os.path.basename(args.path), dtype=dtype
        )
    model.eval()
    load_s = time.perf_counter() - t0
    cfg = model.config
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos and L + N > max_pos:
        raise ValueError(f"{L} prompt + {N} new tokens exceed the model's context of {max_pos}")

    params = list(model.parameters())  # shared (tied) tensors appear once
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    emb_in = model.get_input_embeddings().weight
    emb_out = model.get_output_embeddings().weight
    tied = emb_in.data_ptr() == emb_out.data_ptr()
    embed_bytes = emb_in.numel() * emb_in.element_size()
    weights_read = param_bytes if tied else param_bytes - embed_bytes
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES[args.dtype]

    tokens = prompt_tokens(int(emb_in.shape[0]), L, args.seed)
    ids = torch.from_numpy(tokens.astype(np.int64))
    mem = _memory_after_load()

    def run_prefill(x):
        out = model(x, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1), out.past_key_values

    def run_decode(nxt, past, steps):
        toks = [int(nxt[0])]
        for _ in range(steps):
            out = model(nxt[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)
            toks.append(int(nxt[0]))
        return toks

    with torch.inference_mode():
        _log(f"{tag} warm-up")
        t = time.perf_counter()
        nxt, past = run_prefill(ids[:, : min(L, 128)])
        run_decode(nxt, past, min(2, N - 1))
        warmup_s = time.perf_counter() - t
        del past

        _log(f"{tag} prefill x{args.prefill_repeats}")
        prefill_times = []
        for _ in range(args.prefill_repeats):
            past = None
            gc.collect()
            t = time.perf_counter()
            nxt, past = run_prefill(ids)
            prefill_times.append(time.perf_counter() - t)

        _log(f"{tag} decode x{args.repeats}")
        decode_times, generated = [], None
        for r in range(args.repeats):
            p = past if r == args.repeats - 1 else copy.deepcopy(past)
            t = time.perf_counter()
            generated = run_decode(nxt, p, N - 1)
            decode_times.append(time.perf_counter() - t)
            del p
        del past

    prefill_s = min(prefill_times)
    decode_s = statistics.median(decode_times)
    steps = max(N - 1, 1)
    return {
        "framework": "transformers", "dtype": args.dtype, "prompt_tokens": L, "new_tokens": N,
        "prompt_sha1": _sha1(tokens), "load_s": load_s,
        "prefill_s": prefill_s, "prefill_times_s": prefill_times, "prefill_tok_s": L / prefill_s,
        "decode_times_s": decode_times, "decode_ms_per_token": 1000 * decode_s / steps,
        "decode_ms_per_token_best": 1000 * min(decode_times) / steps,
        "compile_s": None, "warmup_s": warmup_s, "generated": generated,
        "param_bytes": param_bytes, "embedding_bytes": embed_bytes, "tied_embeddings": bool(tied),
        "weights_read_bytes": weights_read, "kv_bytes_per_token": kv_per_token,
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "torch_threads": torch.get_num_threads(),
        "memory": _memory_at_end(mem),
    }


WORKERS = {"bandwidth": worker_bandwidth, "kvjax": worker_kvjax, "transformers": worker_transformers}


def run_worker(args) -> int:
    """Entry point of a ``--worker`` subprocess: run it and write its JSON result to ``--result-file``."""
    try:
        result = WORKERS[args.worker](args)
        code = 0
    except Exception as e:  # reported in the table, the run goes on
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
        code = 1
    with open(args.result_file, "w") as f:
        json.dump(result, f)
    return code


# --------------------------------------------------------------------------------------------
# orchestration


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat), None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _stderr_fd():
    """The workers' stdout goes to our stderr (stdout holds only the report); inherit if it has no fd."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _spawn(kind: str, args, path: str, dtype: str | None = None, length: int | None = None) -> dict:
    fd, result_file = tempfile.mkstemp(prefix=f"kvjax-bench-{kind}-", suffix=".json")
    os.close(fd)
    cmd = [
        sys.executable, "-m", "kvjax.evals.bench_foundation", "--worker", kind, "--result-file", result_file,
        "--model", args.model, "--path", path, "--new-tokens", str(args.new_tokens),
        "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats),
        "--prefill-repeats", str(args.prefill_repeats), "--seed", str(args.seed),
        "--bandwidth-mib", str(args.bandwidth_mib), "--bandwidth-repeats", str(args.bandwidth_repeats),
        "--torch-threads", str(args.torch_threads),
    ]
    if dtype is not None:
        cmd += ["--dtype", dtype, "--length", str(length)]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    busy0, own0 = _busy_cpu_s(), _children_cpu_s()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=_stderr_fd(), stdin=subprocess.DEVNULL)
        try:
            with open(result_file) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {"error": f"worker exited with code {proc.returncode} and no result (see stderr)"}
        if proc.returncode and "error" not in result:
            result["error"] = f"worker exited with code {proc.returncode}"
    finally:
        os.unlink(result_file)
    wall = result["worker_wall_s"] = time.perf_counter() - t0
    busy1, own1 = _busy_cpu_s(), _children_cpu_s()
    # cores kept busy by other processes on average while this worker ran (contention)
    result["other_cores_busy"] = None if busy0 is None else max(0.0, (busy1 - busy0 - (own1 - own0)) / wall)
    return result


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def build_rows(args, results: dict, bandwidth: float | None) -> list[dict]:
    """One row per (dtype, prompt length): both frameworks, the ratios and the bandwidth limit."""
    rows = []
    N = args.new_tokens
    for dtype in args.dtypes:
        for L in args.lengths:
            row = {"dtype": dtype, "prompt_tokens": L, "new_tokens": N}
            ok = {}
            for fw in FRAMEWORKS:
                if fw in args.frameworks:
                    r = results.get((fw, dtype, L), {"error": "not run"})
                    row[fw] = r
                    if "error" not in r:
                        ok[fw] = r
            kj, tf = ok.get("kvjax"), ok.get("transformers")
            src = kj or tf
            if src is not None:
                kv_tokens = L + N / 2  # mean context over the N - 1 decode steps (L+1 .. L+N-1)
                step_bytes = src["weights_read_bytes"] + src["kv_bytes_per_token"] * kv_tokens
                row["decode_step_bytes"] = step_bytes
                row["decode_step_weight_bytes"] = src["weights_read_bytes"]
                row["decode_step_kv_bytes"] = src["kv_bytes_per_token"] * kv_tokens
                row["limit_ms_per_token"] = 1000 * step_bytes / bandwidth if bandwidth else None
            lim = row.get("limit_ms_per_token")
            row["prefill_speedup"] = _ratio(kj and kj["prefill_tok_s"], tf and tf["prefill_tok_s"])
            row["decode_speedup"] = _ratio(tf and tf["decode_ms_per_token"], kj and kj["decode_ms_per_token"])
            row["kvjax_over_limit"] = _ratio(kj and kj["decode_ms_per_token"], lim)
            row["transformers_over_limit"] = _ratio(tf and tf["decode_ms_per_token"], lim)
            if kj and tf:
                row["same_prompt"] = kj["prompt_sha1"] == tf["prompt_sha1"]
                a, b = kj["generated"], tf["generated"]
                match = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                row["greedy_tokens_agreeing"] = match
            rows.append(row)
    return rows


DECODE_LIMIT_TARGET = 1.3  # kvjax decode ms/token <= 1.3x the bandwidth limit
PREFILL_SPEEDUP_TARGET = 1.2  # kvjax prefill tok/s >= 1.2x transformers'


def target_lines(rows: list[dict]) -> list[str]:
    """One Markdown bullet per row saying whether kvjax meets the decode and prefill targets."""
    lines = []
    for row in rows:
        where = f"{row['dtype']} L={row['prompt_tokens']}"
        over, speedup = row.get("kvjax_over_limit"), row.get("prefill_speedup")
        decode = ("decode: not measured" if over is None else
                  f"decode {over:.2f}× limit ({'met' if over <= DECODE_LIMIT_TARGET else 'MISSED'}, "
                  f"target ≤ {DECODE_LIMIT_TARGET}×)")
        prefill = ("prefill: not measured" if speedup is None else
                   f"prefill {speedup:.2f}× transformers ({'met' if speedup >= PREFILL_SPEEDUP_TARGET else 'MISSED'}, "
                   f"target ≥ {PREFILL_SPEEDUP_TARGET}×)")
        lines.append(f"- {where}: {decode}; {prefill}.")
    return lines


def _gib(kib):
    return None if kib is None else kib * 1024 / GIB


def _cell(row, fw, key, fmt="{:.1f}"):
    r = row.get(fw)
    if r is None:
        return MISSING
    if "error" in r:
        return "error"
    return number(r.get(key), fmt)


def _mem_cell(row, fw):
    r = row.get(fw)
    if r is None:
        return MISSING
    if "error" in r:
        return "error"
    m = r["memory"]
    return f"{_gib(m['rss_after_load_kib']):.2f} / {_gib(m['peak_run_kib']):.2f}"


def render_markdown(report: dict) -> str:
    """The Markdown report: set-up, the main table, the limit's inputs, notes."""
    m, v, bw = report["machine"], report["versions"], report["bandwidth"]
    cfg = report["settings"]
    lines = [
        "# Foundation benchmark: kvjax vs transformers",
        "",
        f"Model `{cfg['model']}`, batch 1, random prompt ids (seed {cfg['seed']}), {cfg['new_tokens']} greedy new "
        f"tokens ({cfg['new_tokens'] - 1} timed decode steps), kvjax prefill chunk "
        f"{'min(' + str(cfg['chunk_size']) + ', prompt)' if cfg['chunk_size'] > 0 else 'none (whole prompt)'}, "
        f"{cfg['repeats']} decode run(s) (median), {cfg['prefill_repeats']} prefill run(s) (best), after warm-up.",
        "",
        f"- machine: {m['cpu']}, {m['usable_cores']} usable cores ({m['logical_cores']} logical), "
        f"{number(m['memory_bytes'] and m['memory_bytes'] / GIB, '{:.1f}')} GiB RAM, {m['os']}",
        f"- versions: python {m['python']}, " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- command: `{report['command']}`",
        f"- date: {report['date']}, total time {report['total_s'] / 60:.1f} min",
        f"- contention: other processes kept {number(report['other_cores_busy_max'])} cores busy on average "
        f"during the worst measurement (of {m['logical_cores']}; should be ~0 for clean numbers, torch's threads "
        "suffer most from it)",
        "",
    ]
    head = ["dtype", "prompt tokens", "kvjax prefill tok/s", "transformers prefill tok/s", "prefill speed-up",
            "kvjax decode ms/tok", "transformers decode ms/tok", "decode speed-up", "limit ms/tok", "kvjax ÷ limit",
            "transformers ÷ limit", "kvjax compile s", "kvjax RSS GiB (loaded / run peak)",
            "transformers RSS GiB (loaded / run peak)"]
    lines += table(head, [[
        row["dtype"], row["prompt_tokens"],
        _cell(row, "kvjax", "prefill_tok_s", "{:.0f}"), _cell(row, "transformers", "prefill_tok_s", "{:.0f}"),
        number(row.get("prefill_speedup"), "{:.2f}×"),
        _cell(row, "kvjax", "decode_ms_per_token"), _cell(row, "transformers", "decode_ms_per_token"),
        number(row.get("decode_speedup"), "{:.2f}×"),
        number(row.get("limit_ms_per_token"), "{:.1f}"),
        number(row.get("kvjax_over_limit")), number(row.get("transformers_over_limit")),
        _cell(row, "kvjax", "compile_s"),
        _mem_cell(row, "kvjax"), _mem_cell(row, "transformers"),
    ] for row in report["rows"]], align="l" + "r" * 13)

    lines += ["", "## Targets", ""] + target_lines(report["rows"])
    lines += ["", "## Decode limit", ""]
    if "error" in bw:
        lines.append(f"- bandwidth measurement failed: {bw['error']}")
    else:
        lines.append(
            f"- read bandwidth over a {bw['array_bytes'] / MIB:.0f} MiB f32 array (best of {bw['repeats']}): "
            f"jitted `jnp.sum` {bw['jax_sum'] / 1e9:.1f} GB/s, numpy `a.sum()` {bw['numpy_sum'] / 1e9:.1f} GB/s, "
            f"numpy in {bw['threads']} threads {bw['numpy_threaded_sum'] / 1e9:.1f} GB/s; "
            f"machine read bandwidth = the largest, {bw['machine'] / 1e9:.1f} GB/s."
        )
    seen = set()
    for row in report["rows"]:
        if "decode_step_bytes" not in row:
            continue
        src = next(row[fw] for fw in FRAMEWORKS if fw in row and "error" not in row[fw])
        if row["dtype"] not in seen:
            seen.add(row["dtype"])
            what = ("all parameters (tied embeddings: the table is read whole by the LM head)" if src["tied_embeddings"]
                    else f"all parameters except the untied input-embedding table ({src['embedding_bytes'] / MIB:.0f} MiB, "
                         "one row read per step; the separate LM head is counted)")
            lines.append(
                f"- {row['dtype']}: weights read per step {src['weights_read_bytes'] / MIB:.1f} MiB = {what}; "
                f"K+V {src['kv_bytes_per_token'] / 1024:.1f} KiB per token."
            )
    lines.append(
        "- bytes per step = weights read + K and V of the mean cached context `L + N/2` over all layers and KV "
        "heads; limit ms/tok = bytes / machine read bandwidth; `÷ limit` = measured ms/tok / limit (1.00 = at "
        "the memory-bandwidth limit). kvjax's dense cache attends its whole buffer, `L + N` rounded up to the "
        "256-slot attention block (`cache_capacity_slots` in the JSON), so it reads somewhat more K/V than counted."
    )
    for row in report["rows"]:
        if "decode_step_bytes" in row:
            lines.append(
                f"- {row['dtype']} L={row['prompt_tokens']}: {row['decode_step_bytes'] / MIB:.1f} MiB per step "
                f"({row['decode_step_kv_bytes'] / MIB:.1f} MiB K/V)."
            )

    lines += [
        "", "## Notes", "",
        "- speed-ups are kvjax ÷ transformers speed (> 1: kvjax faster): prefill tok/s ratio, decode "
        "transformers ms/tok ÷ kvjax ms/tok.",
        "- prefill: kvjax runs its jitted `prefill` chunk by chunk; transformers runs one forward over the whole "
        "prompt with `use_cache=True, logits_to_keep=1` (`torch.inference_mode`, "
        f"`torch.set_num_threads({cfg['torch_threads'] or m['logical_cores']})`). Both compute only the last token's logits and take the argmax.",
        "- decode: kvjax runs all steps in one jitted `lax.while_loop` (`decode_loop`); transformers calls the model "
        "once per token with `past_key_values` (eager, greedy argmax).",
        "- compile: kvjax's ahead-of-time `lower` + `compile` of the prefill executable(s) (one per chunk shape "
        "value used) and of the decode loop, persistent compilation cache off; transformers is eager (n/a; its "
        "warm-up call is `warmup_s` in the JSON).",
        "- memory: each (framework, dtype, length) in its own process; `loaded` = RSS after loading the weights, "
        "`run peak` = `ru_maxrss` with the high-water mark reset after loading (warm-up, compile, prefill, decode); "
        "the peak while loading is `peak_load_kib` in the JSON.",
    ]
    for row in report["rows"]:
        if "greedy_tokens_agreeing" in row:
            lines.append(
                f"- {row['dtype']} L={row['prompt_tokens']}: same prompt ids: {row['same_prompt']}; greedy tokens "
                f"agreeing before the first difference: {row['greedy_tokens_agreeing']}/{row['new_tokens']}."
            )
    for row in report["rows"]:
        for fw in FRAMEWORKS:
            if fw in row and "error" in row[fw]:
                lines.append(f"- {fw} {row['dtype']} L={row['prompt_tokens']} failed: {row[fw]['error']}")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """Options of ``kvjax bench`` (workers take hidden options)."""
    from kvjax.models.registry import DEFAULT_MODEL

    p = argparse.ArgumentParser(
        prog="kvjax bench foundation",
        description="Prefill tokens/s, decode ms/token, memory and compile time of kvjax vs transformers, "
        "and each decode step against the measured memory-bandwidth limit.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"ready model, HF directory or .gguf (default {DEFAULT_MODEL})")
    p.add_argument("--lengths", type=_int_list, default=[1024, 4096, 8192], help="prompt lengths (default 1024,4096,8192)")
    p.add_argument("--dtypes", type=_choice_list(DTYPES), default=list(DTYPES), help="default float32,bfloat16")
    p.add_argument("--frameworks", type=_choice_list(FRAMEWORKS), default=list(FRAMEWORKS),
                   help="default kvjax,transformers")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated (N - 1 decode steps timed)")
    p.add_argument("--chunk-size", type=int, default=1024, help="kvjax prefill chunk (0 = whole prompt at once)")
    p.add_argument("--repeats", type=int, default=3, help="timed decode runs (median reported)")
    p.add_argument("--prefill-repeats", type=int, default=1, help="timed prefill runs (best reported)")
    p.add_argument("--seed", type=int, default=0, help="prompt ids seed")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="array size of the bandwidth measurement")
    p.add_argument("--bandwidth-repeats", type=int, default=5)
    p.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (default 0 = os.cpu_count())")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"Markdown output; JSON next to it (default {DEFAULT_OUT})")
    # internal: one measurement in a subprocess
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=DTYPES, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    """``kvjax bench``: run every measurement in subprocesses, write the Markdown + JSON report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `kvjax bench -- --lengths ...` (argparse REMAINDER keeps the separator)
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    if args.worker:
        return run_worker(args)

    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (at least one timed decode step), got {args.new_tokens}")
    if args.repeats < 1 or args.prefill_repeats < 1 or args.bandwidth_repeats < 1 or args.bandwidth_mib < 1:
        raise ValueError("--repeats, --prefill-repeats, --bandwidth-repeats and --bandwidth-mib must be >= 1")
    for L in args.lengths:
        effective_chunk(L, args.chunk_size)
    from kvjax.models import resolve_model_path

    path = os.path.abspath(resolve_model_path(args.model))  # assembles a split ready model once, here

    start = time.perf_counter()
    jobs = [(fw, d, L) for d in args.dtypes for L in args.lengths for fw in args.frameworks]
    _log(f"[bench] {args.model}: bandwidth, then {len(jobs)} runs ({', '.join(args.frameworks)} x "
         f"{', '.join(args.dtypes)} x {', '.join(map(str, args.lengths))} tokens)")
    bandwidth = _spawn("bandwidth", args, path)
    if "error" not in bandwidth:
        _log(f"[bench] machine read bandwidth {bandwidth['machine'] / 1e9:.1f} GB/s ({bandwidth['machine_source']})")
    results = {}
    for i, (fw, d, L) in enumerate(jobs, 1):
        _log(f"[bench {i}/{len(jobs)}] {fw} {d} L={L} (elapsed {time.perf_counter() - start:.0f} s)")
        results[(fw, d, L)] = r = _spawn(fw, args, path, d, L)
        if "error" in r:
            _log(f"[bench {i}/{len(jobs)}] {fw} {d} L={L} FAILED: {r['error']}")
        else:
            _log(f"[bench {i}/{len(jobs)}] {fw} {d} L={L}: prefill {r['prefill_tok_s']:.0f} tok/s, "
                 f"decode {r['decode_ms_per_token']:.1f} ms/tok ({r['worker_wall_s']:.0f} s)")

    rows = build_rows(args, results, bandwidth.get("machine"))
    report = {
        "machine": machine_info(),
        "versions": versions(),
        "command": "kvjax bench foundation " + shlex.join(argv) if argv else "kvjax bench foundation",
        "process_argv": sys.argv,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {k: getattr(args, k) for k in (
            "model", "lengths", "dtypes", "frameworks", "new_tokens", "chunk_size", "repeats", "prefill_repeats",
            "seed", "bandwidth_mib", "bandwidth_repeats", "torch_threads")} | {"model_path": path},
        "bandwidth": bandwidth,
        "rows": rows,
        "total_s": time.perf_counter() - start,
        "other_cores_busy_max": max(
            (r["other_cores_busy"] for r in [bandwidth, *results.values()] if r.get("other_cores_busy") is not None),
            default=None),
    }
    md = render_markdown(report)
    _, json_path = write_report(args.out, md, report)
    print(md)
    _log(f"[bench] wrote {args.out} and {json_path} in {report['total_s'] / 60:.1f} min")
    failed = any("error" in r for r in results.values()) or "error" in bandwidth
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
