"""Decode at the papers' scale: every method's decode loop from caches built directly at the length, batch 1 and the
largest batch that fits, against the full cache and against the plan compiled on the CPU.

``python -m research.bench_scale [--model llama-3.1-8b] [--methods ...] [--budgets 0.1,0.25] [--lengths 131008]
[--batches 1,max] [--plan docs/results/plan/...json] [--out FILE.md]``

The model is shape-only (random bf16 weights made on the device, :func:`kvjax.models.llama.random_params`). Each cache is
built without a prefill (:func:`kvjax.evals.synthetic.replicated_cache`: one row's prefill-stage state filled with random
values, the method's own ``finish_prefill``, the row tiled to the batch), then the jitted decode loop runs ``--steps``
tokens once to compile and warm up and once timed (the loop returns its cache; the timed run continues from it).
``max`` batches come from the plan (``--plan``: the largest batch whose step the compiled program fits), else from
the same rule on this device's memory. Every row reports ms per step, tokens/s, the ratio to the full cache at the same
length and batch kind, the step against its bandwidth limit (bytes the plan counted / the device's nominal bandwidth
and / the copy bandwidth measured in the same run) and the plan's projected step time against the measured one.

``--compare-prefill`` (a small case, any machine): the same decode loop timed from a cache made by a real prefill and
from the synthetic one, to check that decode time does not depend on how the cache was made.

What random data cannot reproduce: HeteroCache's drift trigger rate (give it as ``heterocache:tau_drift=0.0``: never
triggers, or ``tau_drift=1.0``: triggers at nearly every check, every ``window`` steps); which tokens are kept. SyncKV's
anticipation runs every ``stride`` steps whatever the data.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time

from kvjax.reports import number, table, write_report

# HeteroCache twice: drift never triggers (tau_drift=0) and triggers at nearly every check (tau_drift=1, every window)
DEFAULT_METHODS = ("full,snapkv,hbw,locret,hcattention,heterocache:tau_drift=0.0,heterocache:tau_drift=1.0,"
                   "synckv:num_representatives=1")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def plan_rows(paths: str | None) -> dict:
    """``{(method, budget, length): plan row}`` of plan JSON files (``kvjax.evals.plan``; comma-separated paths), each
    file's first target; {} without one."""
    out = {}
    for path in filter(None, (paths or "").split(",")):
        with open(path) as f:
            report = json.load(f)
        rows = next(iter(report["targets"].values()))
        out.update({(r["method"], r["budget"], r["length"]): r for r in rows if "error" not in r})
    return out


def time_decode(model, cache, steps: int, repeats: int = 1, seed: int = 0) -> tuple[float, float]:
    """(compile + first run seconds, best of ``repeats`` timed runs' seconds per step) of ``steps`` decode steps from
    ``cache`` (each run continues from the cache the previous one returned: the cache needs room for them all)."""
    import jax
    import jax.numpy as jnp

    from kvjax.decoding import decode_loop

    B = cache.pad.shape[0]
    first = jax.random.randint(jax.random.PRNGKey(seed), (B,), 0, model.config.vocab_size, jnp.int32)
    key = jax.random.PRNGKey(seed + 1)
    t = time.perf_counter()
    tokens, _, cache = decode_loop(model.graphdef, model.params, first, cache, key, max_new_tokens=steps + 1)
    jax.block_until_ready(tokens)
    warm = time.perf_counter() - t
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        tokens, _, cache = decode_loop(model.graphdef, model.params, tokens[:, -1], cache, key,
                                       max_new_tokens=steps + 1)
        jax.block_until_ready(tokens)
        best = min(best, time.perf_counter() - t)
    return warm, best / steps


def shape_model(name: str, dtype: str):
    """A ``LoadedModel`` of ``name``'s shapes with random weights made on the device."""
    from kvjax.models import load_model

    return load_model(name, dtype, tokenizer=False, random_weights=True)


def measure(args, save=lambda partial: None) -> dict:
    """Every (length, method, budget, batch) cell, in that order, until the time budget is spent; ``save`` gets the
    report so far after each cell (an interrupted run keeps what it measured)."""
    import jax

    from research.bench_kernels import copy_bandwidth
    from kvjax.evals.bench_methods import parse_methods
    from kvjax.evals.plan import TARGETS
    from kvjax.evals.synthetic import replicated_cache, synthetic_artifact
    from kvjax.cache import CacheSpec
    from kvjax.methods import get_method

    start = time.perf_counter()
    model = shape_model(args.model, args.dtype)
    device = jax.devices()[0]
    target = next((t for t in TARGETS.values() if t.platform == "cuda" and t.name.upper() in device.device_kind.upper()),
                  None)
    nominal = target.bandwidth if target else None
    probe = copy_bandwidth(1 << 30, 10) if jax.default_backend() != "cpu" else None
    plan = plan_rows(args.plan)
    names = parse_methods(args.methods)
    cells = [(L, n, b) for L in args.lengths for n in names for b in ([None] if n == "full" else args.budgets)]
    rows = []
    for L, name, budget in cells:
        for kind in args.batches:
            row = {"method": name, "budget": budget, "length": L, "batch_kind": kind}
            if time.perf_counter() - start > args.time_budget_s:
                row["error"] = "skipped: time budget spent"
                rows.append(row)
                continue
            p = plan.get((name, budget, L)) or plan.get((name.split(":")[0], budget, L))  # a variant: its method's row
            batch = 1 if kind == "1" else (p or {}).get("max_batch") or 0
            row["batch"] = batch
            if not batch:
                row["error"] = "no largest batch (no plan row, or nothing fits)"
                rows.append(row)
                continue
            try:
                method = get_method(name) if budget is None else get_method(name, budget=budget)
                spec = CacheSpec.for_model(model.config, batch, L, (args.repeats + 1) * (args.steps + 1), args.dtype)
                artifact = synthetic_artifact(method, CacheSpec.for_model(model.config, 1, L, 8, args.dtype))
                t = time.perf_counter()
                cache = replicated_cache(method, spec, artifact)
                jax.block_until_ready(cache)
                row["build_s"] = time.perf_counter() - t
                row["compile_s"], step = time_decode(model, cache, args.steps, args.repeats)
                del cache
                row.update(step_ms=step * 1e3, tokens_per_s=batch / step)
                if p:
                    projected = p["step_s_b1"] if kind == "1" else p.get("step_s_max")
                    moved = p["traffic_b1"] if kind == "1" else p.get("traffic_max")
                    if projected:
                        row["plan_step_ms"] = projected * 1e3
                    if moved and nominal:
                        row["limit_nominal_ms"] = moved / nominal * 1e3
                    if moved and probe:
                        row["limit_probe_ms"] = moved / probe * 1e3
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                row["error"] = f"{type(e).__name__}: {e}".replace("|", "/").replace("\n", " ")[:300]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            jax.clear_caches()
            save({"rows": rows, "device": device.device_kind, "nominal_bandwidth": nominal, "probe_bandwidth": probe,
                  "seconds": time.perf_counter() - start})
    return {"rows": rows, "device": device.device_kind, "nominal_bandwidth": nominal, "probe_bandwidth": probe,
            "seconds": time.perf_counter() - start}


def compare_prefill(args) -> dict:
    """Decode time from a real prefill's cache and from the synthetic one, per method, at ``args.lengths[0]``."""
    import jax
    import jax.numpy as jnp

    from kvjax.evals.bench_methods import parse_methods
    from kvjax.evals.synthetic import filled_cache, synthetic_artifact
    from kvjax.cache import CacheSpec, new_cache
    from kvjax.decoding import compress, prefill_prompt
    from kvjax.methods import get_method

    model = shape_model(args.model, args.dtype)
    L = args.lengths[0]
    rows = []
    for name in parse_methods(args.methods):
        for budget in ([None] if name == "full" else args.budgets):
            method = get_method(name) if budget is None else get_method(name, budget=budget)
            spec = CacheSpec.for_model(model.config, 1, L, (args.repeats + 1) * (args.steps + 1), args.dtype)
            artifact = synthetic_artifact(method, spec)
            tokens = jax.random.randint(jax.random.PRNGKey(0), (1, L), 0, model.config.vocab_size, jnp.int32)
            real = new_cache(method, model.config, 1, L, spec.room, args.dtype, artifact=artifact)
            _, real = prefill_prompt(model.graphdef, model.params, tokens, real, chunk_size=min(L, 1024))
            real = compress(real)
            row = {"method": name, "budget": budget, "length": L}
            row["prefill_warm_s"], row["prefill_step_ms"] = time_decode(model, real, args.steps, args.repeats)
            del real
            synthetic = filled_cache(method, spec, artifact)
            row["synthetic_warm_s"], row["synthetic_step_ms"] = time_decode(model, synthetic, args.steps, args.repeats)
            row["prefill_step_ms"] *= 1e3
            row["synthetic_step_ms"] *= 1e3
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return {"rows": rows, "device": jax.devices()[0].device_kind}


def render(report: dict) -> str:
    """The Markdown table."""
    a = report["args"]
    lines = [f"# Decode at scale: `{a['model']}` ({a['dtype']}, random weights), caches built directly", "",
             f"- command: `{report['command']}`",
             f"- device: {report['device']}; jax {report['jax']}; {report['date']}; best of {a['repeats']} runs of {a['steps']} "
             "decode steps after a warm run", ""]
    if report.get("compare_prefill"):
        lines += ["Decode ms/step from a cache made by a real prefill and from the synthetic cache "
                  "(`kvjax.evals.synthetic.filled_cache`), same method, length and shapes.", ""]
        lines += table(["method", "budget", "prompt", "real prefill ms/step", "synthetic ms/step", "synthetic ÷ real"],
                       [[r["method"], r["budget"], r["length"], f"{r['prefill_step_ms']:.2f}", f"{r['synthetic_step_ms']:.2f}",
                         f"{r['synthetic_step_ms'] / r['prefill_step_ms']:.2f}"] for r in report["rows"]], align="llrrrr")
        return "\n".join(lines) + "\n"

    def f2(x, fmt="{:.2f}"):
        return number(x, fmt, missing="")

    lines += [f"- nominal HBM bandwidth {f2(report['nominal_bandwidth'] and report['nominal_bandwidth'] / 1e12)} TB/s, "
              f"copy probe {f2(report['probe_bandwidth'] and report['probe_bandwidth'] / 1e12)} TB/s; plan: "
              f"`{a['plan'] or '-'}`", ""]
    full = {(r["length"], r["batch_kind"]): r for r in report["rows"] if r["method"] == "full" and "step_ms" in r}
    rows = []
    for r in report["rows"]:
        if "error" in r:
            rows.append([r["method"], r["budget"], r["length"], r.get("batch", ""), r["error"]] + [""] * 9)
            continue
        f = full.get((r["length"], r["batch_kind"]))
        rows.append([
            r["method"], r["budget"], r["length"], r["batch"], f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.0f}",
            f2(f and f["step_ms"] / r["step_ms"], "{:.2f}×"), f2(f and r["tokens_per_s"] / f["tokens_per_s"], "{:.2f}×"),
            f2(r.get("limit_nominal_ms") and r["step_ms"] / r["limit_nominal_ms"]),
            f2(r.get("limit_probe_ms") and r["step_ms"] / r["limit_probe_ms"]), f2(r.get("plan_step_ms")),
            f2(r.get("plan_step_ms") and r["step_ms"] / r["plan_step_ms"]), f"{r['build_s']:.1f}", f"{r['compile_s']:.1f}"])
    head = ["method", "budget", "prompt", "batch", "ms/step", "tokens/s", "vs full (speed)", "vs full (tokens/s)",
            "÷ limit (nominal)", "÷ limit (probe)", "plan ms/step", "measured ÷ plan", "build s", "compile s"]
    return "\n".join(lines + table(head, rows, align="ll" + "r" * 12)) + "\n"


def main(argv=None) -> int:
    """Run the benchmark (or ``--compare-prefill``) and write Markdown + JSON."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m research.bench_scale", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--budgets", default="0.1,0.25")
    p.add_argument("--lengths", default="131008")
    p.add_argument("--batches", default="1,max", help="'1', 'max' (the plan's largest batch) or both")
    p.add_argument("--plan", default=None,
                   help="plan JSON file(s) of kvjax.evals.plan for this device, comma-separated (largest batches, projections)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    p.add_argument("--repeats", type=int, default=2, help="timed runs (best reported), after one warm run")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--time-budget-s", type=float, default=1e9, help="start no new cell after this many seconds")
    p.add_argument("--compare-prefill", action="store_true", help="real prefill vs synthetic cache, first length")
    p.add_argument("--out", required=True, help="Markdown report (JSON beside it)")
    args = p.parse_args(argv)
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.batches = [b.strip() for b in args.batches.split(",")]
    if any(b not in ("1", "max") for b in args.batches):
        p.error(f"--batches takes 1, max or both, got {args.batches}")
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1")
    import jax

    report = {"command": "python -m research.bench_scale " + shlex.join(argv), "args": vars(args), "jax": jax.__version__,
              "date": _now(), "compare_prefill": args.compare_prefill}

    def save(part):
        report.update(part)
        write_report(args.out, render(report), report)

    save(compare_prefill(args) if args.compare_prefill else measure(args, save))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
