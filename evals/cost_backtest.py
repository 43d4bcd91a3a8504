"""Back-test of :mod:`kvjax.evals.cost_model` against every committed GPU decode-step timing it can pair with a program.

``PYTHONPATH=.aot-gpu:.aot-tpu:. python -m kvjax.evals.cost_backtest [--out docs/results/cost_model_backtest.md]``

Each row of the committed ``kvjax bench`` runs on an H100 / H200 (:data:`RUNS`: the default model's shapes, random
bf16 weights, batch 1, 30,720 prompt tokens) is paired with the same method's one-token decode step compiled now for
that GPU on this CPU (:func:`kvjax.evals.plan.compile_step`: same method spec, budget, prompt length and decode room),
whose bytes, kernels and host transfers the model counts. A method the code no longer has (the ``ahead`` schedule) is
listed unpaired. The per-kernel cost is fitted per GPU by least relative squares on that GPU's rows whose compiled step
moves nothing over the host link and whose measured program had no structure the current one lacks
(:data:`STRUCTURE_CHANGES`); each GPU's rows are then modelled with its own fit and with the other GPU's (the
out-of-sample check). Bandwidth and host link are the measured constants of :data:`kvjax.evals.cost_model.DEVICES`.
Every timing predates later code: each row says how many commits have touched the decode path since its file was
committed and which of :data:`STRUCTURE_CHANGES` it predates.

``python -m kvjax.evals.cost_backtest --cpu [--out docs/results/cost_model_backtest_cpu.md]`` runs the same model on
this CPU (:func:`cpu_main`): every committed CPU decode timing of :data:`CPU_RUNS` (batch 1, float32 unless the row says
otherwise) paired with the same method's one-token step compiled now for the CPU (abstract weights of the model's
shapes, the synthetic compressed cache, kvjax's CPU compiler options), memory bytes and XLA:CPU kernels counted from its
HLO as for a GPU; the per-op cost fitted on one model's ``kvjax bench`` rows and checked on the other's (and the
reverse), the table's constant fitted on both.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys

from kvjax.evals import cost_model
from kvjax.reports import number, table, write_report

RUNS = {
    "h100": ["docs/results/bench_heterocache_synckv_recall_qwen2.5-coder-0.5b_h100.json",
             "docs/results/bench_locret_qwen2.5-coder-0.5b_h100.json",
             "docs/results/bench_recall_spread_qwen2.5-coder-0.5b_h100.json",
             "docs/results/bench_recall_spread_sorted_qwen2.5-coder-0.5b_h100.json",
             "docs/results/bench_recall_schedules_qwen2.5-coder-0.5b_h100.json",
             "docs/results/bench_recall_without_reanchor_qwen2.5-coder-0.5b_h100.json",
             "docs/results/bench_recall_scheduler_qwen2.5-coder-0.5b_h100.json",
             "docs/results/bench_recall_xla_default_qwen2.5-coder-0.5b_h100.json"],
    "h200": ["docs/results/bench_heterocache_synckv_recall_qwen2.5-coder-0.5b_h200.json",
             "docs/results/bench_locret_qwen2.5-coder-0.5b_h200.json"],
}
# the code a decode step's program comes from
CODE_PATHS = ["kvjax/decoding.py", "kvjax/attention.py", "kvjax/cache.py", "kvjax/paged.py", "kvjax/host_tier.py",
              "kvjax/selection.py", "kvjax/methods", "pallas_kernels", "models"]
# (commit, which rows, what the measured program held that the one compiled now does not)
STRUCTURE_CHANGES = [
    ("fbc39f7", "full", "the dense attention's per-layer `lax.cond` (a host sync each on a GPU), CPU-only since"),
    ("1deabac", "recall", "per-layer recall conditionals, none in the decode step since"),
]


def _git(*args) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.strip()


def provenance(path: str, code_paths: list[str] = CODE_PATHS) -> dict:
    """The commit that added a measurement file, the decode-path commits since, and the later structure changes."""
    added = _git("log", "--diff-filter=A", "--format=%h", "--", path).splitlines()
    commit = added[-1] if added else None
    since = int(_git("rev-list", "--count", f"{commit}..HEAD", "--", *code_paths) or 0) if commit else None
    later = [c for c, _, _ in STRUCTURE_CHANGES
             if commit and subprocess.run(["git", "merge-base", "--is-ancestor", commit, c],
                                          capture_output=True).returncode == 0 and commit != c]
    return {"commit": commit, "code_commits_since": since, "predates": later}


def is_recall(method: str) -> bool:
    """Whether a method spec recalls from the host tier."""
    return method.split(":")[0] in ("heterocache", "synckv") and not any(
        off in method for off in ("retrieval=false", "anticipation=false"))


def measured_rows() -> list[dict]:
    """Every committed GPU decode timing of :data:`RUNS`, with its file's provenance."""
    rows = []
    for device, paths in RUNS.items():
        for path in paths:
            with open(path) as f:
                run = json.load(f)
            prov = provenance(path)
            for r in run["rows"]:
                after = r.get("cache_stats_after_decode") or {}
                steps = max(after.get("decode_steps") or 1, 1)
                notes = [text for c, which, text in STRUCTURE_CHANGES
                         if c in prov["predates"] and (r["method"] == "full" if which == "full" else is_recall(r["method"]))]
                rows.append({"device": device, "file": path, "date": run["date"][:10], "method": r["method"],
                             "budget": None if r["method"] == "full" else run["args"]["budget"],
                             "length": r["prompt_tokens"], "room": run["args"]["new_tokens"],
                             "measured_s": r["decode_ms_per_token"] / 1e3,
                             "recalled_bytes_per_step": after.get("bytes_recalled", 0) / steps if after else 0,
                             "options": run.get("decode_compiler_options") or {}, "probe": run["bandwidth"]["machine"],
                             **prov, "structure": notes})
    return rows


def compile_counts(keys, model: str = "qwen2.5-coder-0.5b", dtype: str = "bfloat16") -> dict:
    """``{(device, method, budget, length, room): StepCounts fields or {"error": ...}}``: each step compiled for its
    GPU on this CPU (batch 1)."""
    from kvjax.evals.gpu_schedule import compile_only_cuda

    compile_only_cuda()
    import jax.numpy as jnp

    from kvjax.cache import CacheSpec
    from kvjax.evals import plan
    from kvjax.evals.synthetic import synthetic_artifact
    from kvjax.methods import get_method
    from kvjax.models import model_architecture

    config, _ = model_architecture(model)
    out, meshes = {}, {}
    for key in sorted(set(keys), key=str):
        device, method, budget, length, room = key
        if device not in meshes:
            target = plan.TARGETS[device]
            mesh = plan.target_mesh(target, config)
            meshes[device] = (target, mesh, *plan.abstract_params(config, jnp.dtype(dtype), mesh))
        target, mesh, graphdef, params = meshes[device]
        try:
            m = get_method(method) if budget is None else get_method(method, budget=budget)
            artifact = synthetic_artifact(m, CacheSpec.for_model(config, 1, length, room, dtype))
            step = plan.compile_step(target, mesh, config, dtype, m, 1, length, room, artifact, graphdef=graphdef,
                                     params=params)
            counts = cost_model.count_step(step["compiled"].hlo_modules()[0].to_string())
            out[key] = {**vars(counts), "compile_s": step["compile_s"]}
        except Exception as e:  # noqa: BLE001 - a spec the code no longer has is a row saying so
            out[key] = {"error": f"{type(e).__name__}: {e}".replace("|", "/").replace("\n", " ")[:160]}
        print(f"{key}: {out[key]}", file=sys.stderr, flush=True)
    return out


def fit_kernel_s(rows: list[dict], bandwidth: float) -> float | None:
    """The per-kernel cost minimising the squared relative error of ``bytes / bandwidth + kernels × c`` over rows."""
    num = den = 0.0
    for r in rows:
        k, b = r["kernels"] / r["measured_s"], r["device_bytes"] / bandwidth / r["measured_s"]
        num, den = num + k * (1 - b), den + k * k
    return num / den if den else None


def backtest(rows: list[dict]) -> dict:
    """Fit each GPU's per-kernel cost, model every paired row with each fit, and summarise the errors."""
    paired = [r for r in rows if "kernels" in r]
    for r in paired:
        r["fit_row"] = not r["structure"] and r["host_to_device"] + r["device_to_host"] == 0
    fits = {}
    for device in RUNS:
        fit = fit_kernel_s([r for r in paired if r["device"] == device and r["fit_row"]],
                           cost_model.DEVICES[device].bandwidth)
        fits[device] = fit
    from kvjax.evals.plan import TARGETS

    for r in paired:
        counts = cost_model.StepCounts(r["device_bytes"], r["kernels"], r["host_to_device"], r["device_to_host"])
        r["bytes_only_s"] = r["device_bytes"] / TARGETS[r["device"]].bandwidth
        for label, fitted_on in (("own", r["device"]), ("other", "h200" if r["device"] == "h100" else "h100")):
            consts = dataclasses.replace(cost_model.DEVICES[r["device"]], kernel_s=fits[fitted_on])
            r[f"model_{label}"] = cost_model.step_time(counts, consts)
    summary = {}
    for device in RUNS:
        for label in ("own", "other"):
            for group, keep in (("all", lambda r: True), ("fit rows", lambda r: r["fit_row"]),
                                ("recall", lambda r: is_recall(r["method"])),
                                ("no host transfer", lambda r: r["host_to_device"] + r["device_to_host"] == 0)):
                errs = [abs(r[f"model_{label}"]["step_s"] / r["measured_s"] - 1) for r in paired
                        if r["device"] == device and keep(r)]
                if errs:
                    summary[f"{device} {label} {group}"] = {"rows": len(errs), "median": statistics.median(errs),
                                                            "max": max(errs)}
    return {"fits": fits, "summary": summary}


def render(report: dict) -> str:
    """The back-test's Markdown."""
    fits = report["fits"]
    lines = [
        "# Cost model back-test: committed GPU decode steps against the modelled step",
        "",
        f"- command: `{report['command']}`; {report['date']}; steps compiled by `{report['compiled']['command']}` "
        f"({report['compiled']['date']}, jax {report['compiled']['jax']}, CUDA plugin as compiler only)",
        f"- model (`kvjax.evals.cost_model`): {cost_model.ASSUMPTIONS}",
        "- measured: `decode ms/tok` of each committed `kvjax bench` run on an H100 / H200 (jax 0.11.2, the default "
        "model's shapes, random bf16 weights, batch 1, 30,720 prompt tokens, budget as the run's); modelled: the same "
        "method spec's one-token decode step compiled now for that GPU on this CPU (`kvjax.evals.plan.compile_step`, "
        "kvjax's GPU compiler options), counts read from its HLO",
        "- per-kernel cost fitted per GPU (least relative squares) on its `fit` rows: compiled step with no host-link "
        "bytes, measured program without a structure the current one lacks; "
        + ", ".join(f"{d.upper()} {number(None if c is None else c * 1e6, '{:.2f}')} µs" for d, c in fits.items())
        + "; `own` models a GPU's rows with its own fit, `other` with the other GPU's (the out-of-sample check); "
        "bandwidth and host link: `cost_model.DEVICES` (measured probes, their files there)",
        "- bytes-only: device bytes at the nominal HBM bandwidth (3.35 TB/s H100, 4.8 TB/s H200), what the plans "
        "projected before",
        "- every timing predates the code compiled now: `commits since` counts the commits to the decode path "
        f"({', '.join(CODE_PATHS)}) after the timing's file was committed; `measured program had` names structures "
        "later removed (a host synchronisation each), which the model has no term for",
        "- rows are per-row compiles, not recorded traces: no row uses a trace's kernel counts",
        "",
        "## Error summary (|modelled ÷ measured − 1|)",
        "",
    ]
    cells = [[k.split()[0].upper(), k.split()[1], " ".join(k.split()[2:]), v["rows"], f"{v['median'] * 100:.0f}%",
              f"{v['max'] * 100:.0f}%"] for k, v in report["summary"].items()]
    lines += table(["GPU", "kernel cost from", "rows", "n", "median error", "max error"], cells, "lllrrr") + [""]
    lines += ["## Rows", ""]
    cells = []
    for r in report["rows"]:
        name = f"[{os.path.basename(r['file']).replace('.json', '')}]({os.path.basename(r['file']).replace('.json', '.md')})"
        opts = "LHS" if r["options"].get("xla_gpu_enable_latency_hiding_scheduler") else "XLA default"
        common = [r["device"].upper(), name, r["date"], opts, r["method"], f"{r['measured_s'] * 1e3:.2f}"]
        tail = [r["commit"], r["code_commits_since"], "; ".join(r["structure"]) or "—"]
        if "kernels" not in r:
            cells.append(common + [f"no program: {r.get('error', '')}"] + [""] * 10 + tail)
            continue
        own, other = r["model_own"], r["model_other"]
        cells.append(common + [
            f"{own['step_s'] * 1e3:.2f}", f"{own['step_s'] / r['measured_s']:.2f}",
            f"{other['step_s'] * 1e3:.2f}", f"{other['step_s'] / r['measured_s']:.2f}",
            f"{r['bytes_only_s'] * 1e3:.2f}", f"{r['bytes_only_s'] / r['measured_s']:.2f}",
            f"{r['device_bytes'] / 2**30:.3f}", r["kernels"],
            f"{r['host_to_device'] / 2**20:.1f} / {r['device_to_host'] / 2**20:.2f}",
            f"{r['recalled_bytes_per_step'] / 2**20:.1f}", "yes" if r["fit_row"] else ""] + tail)
    lines += table(["GPU", "run", "date", "XLA options", "method", "measured ms", "modelled ms (own)", "÷ measured",
                    "modelled ms (other)", "÷ measured", "bytes-only ms", "÷ measured", "device GiB", "kernels",
                    "host→dev / dev→host MiB (program)", "recalled MiB/step (run)", "fit", "file's commit",
                    "commits since", "measured program had"], cells, "llllll" + "r" * 11 + "lrl") + [""]
    lines += ["`recalled MiB/step (run)`: the bytes the run's recall brought from the host per step "
              "(`cache.stats()`), beside the bytes the compiled step moves every step.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the CPU (--cpu)
# committed CPU decode timings on the project's 2-core Intel Xeon machine; the first two are the fit runs (one per model)
CPU_RUNS = ["docs/results/bench_methods_qwen2.5-coder-0.5b.json", "docs/results/bench_methods_smollm2-135m.json",
            "docs/results/bench_heterocache_synckv_qwen2.5-coder-0.5b.json", "docs/results/foundation_bench.json"]
CPU_FIT_RUNS = CPU_RUNS[:2]
CPU_SKIPPED_RUNS = {
    "docs/results/bench_hcattention_qwen2.5-coder-0.5b.json":
        "measured on another CPU (AMD EPYC, read probe 35.7 GB/s), not the machine whose constants are modelled",
}
# (run, method, prompt tokens): what its run says about contention
CPU_CONTENTION = {
    ("docs/results/bench_methods_qwen2.5-coder-0.5b.json", "h2o", 16384):
        "contention: its decode overlapped `.ci/run` on the same 2 cores (the run's note)",
}
# recorded method options of the prefill staging (since moved out of the methods' options): no part of the decode step
STAGING_OPTIONS = ("name", "window", "accumulate")
CPU_CODE_PATHS = ["kvjax/attention.py", "kvjax/decoding.py", "kvjax/methods", "pallas_kernels"]


def method_options(config: str) -> dict:
    """``{option: value text}`` of a method's recorded ``repr`` (``SnapKV(budget=0.1, page_size=16, ...)``)."""
    inner = config[config.index("(") + 1:config.rindex(")")]
    return dict(re.findall(r"(\w+)=('[^']*'|\([^)]*\)|[^,]+)", inner))


def rebuilt_method(name: str, budget, recorded: str | None):
    """``(method, None)``: the method ``name`` at ``budget`` as the code builds it now, if its options are the recorded
    ones (options of the prefill staging the method no longer holds aside); else ``(None, why not)``."""
    from kvjax.methods import get_method

    m = get_method(name) if budget is None else get_method(name, budget=budget)
    if recorded is None:
        return m, None
    was, now = method_options(recorded), method_options(repr(m))
    changed = [f"{k} {was[k]} -> {now[k]}" for k in was if k in now and was[k].strip() != now[k].strip()]
    dropped = [k for k in was if k not in now and k not in STAGING_OPTIONS]
    # an option added since the run, at its default, is the behaviour the run had (a default keeps the old program)
    defaults = {f.name: repr(f.default) for f in dataclasses.fields(m)}
    added = [f"{k}={now[k]}" for k in now if k not in was and now[k].strip() != defaults.get(k)]
    if changed or dropped or added:
        return None, "options changed since the run: " + "; ".join(
            ([f"changed {', '.join(changed)}"] if changed else []) + ([f"dropped {', '.join(dropped)}"] if dropped else [])
            + ([f"added {', '.join(added)}"] if added else []))
    return m, None


def cpu_measured_rows() -> tuple[list[dict], list[dict]]:
    """``(rows, skipped)``: every committed CPU decode timing of :data:`CPU_RUNS` that can be rebuilt, with its file's
    provenance, and the ones that cannot, each with the reason."""
    rows, skipped = [], []
    for path in CPU_RUNS:
        with open(path) as f:
            run = json.load(f)
        prov = provenance(path, CPU_CODE_PATHS)
        prov.pop("predates")  # the GPU's structure changes: the CPU kept its conditional (fbc39f7), recall rows skip
        common = {"file": path, "date": run["date"][:10], "probe": run["bandwidth"]["machine"], **prov}
        if "settings" in run:  # kvjax bench foundation: the full cache, kvjax's rows (best of its repeats)
            for r in run["rows"]:
                rows.append({**common, "model": run["settings"]["model"], "dtype": r["dtype"], "method": "full",
                             "budget": None, "length": r["prompt_tokens"], "room": r["new_tokens"],
                             "measured_s": r["kvjax"]["decode_ms_per_token_best"] / 1e3, "note": ""})
            continue
        for r in run["rows"]:
            budget = None if r["method"] == "full" else r["budget"]
            row = {**common, "model": run["args"]["model"], "dtype": run["args"]["dtype"], "method": r["method"],
                   "budget": budget, "length": r["prompt_tokens"], "room": run["args"]["new_tokens"],
                   "measured_s": r["decode_ms_per_token"] / 1e3,
                   "note": CPU_CONTENTION.get((path, r["method"], r["prompt_tokens"]), "")}
            _, why = rebuilt_method(r["method"], budget, run["method_configs"].get(r["method"]))
            (skipped if why else rows).append({**row, "skipped": why} if why else row)
    for path, why in CPU_SKIPPED_RUNS.items():
        with open(path) as f:
            run = json.load(f)
        skipped += [{"file": path, "date": run["date"][:10], "model": run["args"]["model"], "method": r["method"],
                     "length": r["prompt_tokens"], "measured_s": r["decode_ms_per_token"] / 1e3, "skipped": why}
                    for r in run["rows"]]
    return rows, skipped


def cpu_key(r: dict) -> tuple:
    return (r["model"], r["dtype"], r["method"], r["budget"], r["length"], r["room"])


def compile_cpu_counts(keys) -> dict:
    """``{(model, dtype, method, budget, length, room): StepCounts fields or {"error": ...}}``: each method's one-token
    decode step compiled for this CPU (batch 1, abstract weights, the synthetic compressed cache), as
    :func:`kvjax.evals.plan.compile_step` builds it for a TPU."""
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvjax.cache import CacheSpec
    from kvjax.decoding import decode_compiler_options, decode_step_jit
    from kvjax.evals import plan
    from kvjax.evals.synthetic import abstract_compressed_cache, cpu_mesh, synthetic_artifact
    from kvjax.models import model_architecture

    mesh = cpu_mesh()
    replicated = NamedSharding(mesh, P())
    out, weights = {}, {}
    for key in sorted(set(keys), key=str):
        model, dtype, method, budget, length, room = key
        if (model, dtype) not in weights:
            config, _ = model_architecture(model)
            weights[(model, dtype)] = (config, *plan.abstract_params(config, jnp.dtype(dtype), mesh))
        config, graphdef, params = weights[(model, dtype)]
        try:
            m, _ = rebuilt_method(method, budget, None)
            spec = CacheSpec.for_model(config, 1, length, room, dtype)
            t = time.perf_counter()
            cache = abstract_compressed_cache(m, spec, mesh, synthetic_artifact(m, spec))
            tokens = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=replicated)
            rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
            compiled = decode_step_jit.lower(graphdef, params, tokens, cache, rng).compile(
                compiler_options=decode_compiler_options("cpu"))
            counts = cost_model.count_step(compiled.as_text())
            out[key] = {**vars(counts), "compile_s": time.perf_counter() - t}
        except Exception as e:  # noqa: BLE001 - a spec the code no longer builds is a row saying so
            out[key] = {"error": f"{type(e).__name__}: {e}".replace("|", "/").replace("\n", " ")[:160]}
        print(f"{key}: {out[key]}", file=sys.stderr, flush=True)
    return out


def cpu_backtest(rows: list[dict], bandwidth: float | None = None) -> dict:
    """Fit the per-op cost on each model's fit rows (:data:`CPU_FIT_RUNS`, no contention) and on both, model every
    paired row with its own model's fit, the other model's and both's, and summarise the errors (bytes-only beside)."""
    bandwidth = cost_model.DEVICES["cpu"].bandwidth if bandwidth is None else bandwidth
    paired = [r for r in rows if "kernels" in r]
    for r in paired:
        r["fit_row"] = r["file"] in CPU_FIT_RUNS and not r["note"]
    models = sorted({r["model"] for r in paired if r["fit_row"]})
    fits = {m: fit_kernel_s([r for r in paired if r["fit_row"] and r["model"] == m], bandwidth) for m in models}
    fits["cpu"] = fit_kernel_s([r for r in paired if r["fit_row"]], bandwidth)
    for r in paired:
        counts = cost_model.StepCounts(r["device_bytes"], r["kernels"], r["host_to_device"], r["device_to_host"])
        r["bytes_only_s"] = r["device_bytes"] / bandwidth
        other = [m for m in models if m != r["model"]]
        for label, fitted_on in (("own", r["model"] if r["model"] in fits else None),
                                 ("other", other[0] if len(other) == 1 else None), ("both", "cpu")):
            if fitted_on is None:
                continue
            consts = dataclasses.replace(cost_model.DEVICES["cpu"], bandwidth=bandwidth, kernel_s=fits[fitted_on])
            r[f"model_{label}"] = {**cost_model.step_time(counts, consts), "fitted_on": fitted_on}
    groups = [("qwen bench_methods, fit rows", lambda r: r["fit_row"] and r["model"].startswith("qwen")),
              ("smollm2 bench_methods, fit rows", lambda r: r["fit_row"] and r["model"].startswith("smollm2")),
              ("both bench_methods, fit rows", lambda r: r["fit_row"]),
              ("qwen 25% run (heterocache_synckv)", lambda r: "heterocache" in r["file"]),
              ("qwen foundation, float32", lambda r: "foundation" in r["file"] and r["dtype"] == "float32"),
              ("qwen foundation, bfloat16", lambda r: "foundation" in r["file"] and r["dtype"] == "bfloat16"),
              ("contention", lambda r: bool(r["note"]))]
    summary = {}
    for group, keep in groups:
        chosen = [r for r in paired if keep(r)]
        if not chosen:
            continue
        entry = {"rows": len(chosen)}
        for label in ("own", "other", "both"):
            errs = [abs(r[f"model_{label}"]["step_s"] / r["measured_s"] - 1) for r in chosen if f"model_{label}" in r]
            if errs:
                entry[label] = {"median": statistics.median(errs), "max": max(errs)}
        # the constant with each row's own run's read probe instead of the table's bandwidth
        errs = [abs((r["device_bytes"] / r["probe"] + r["kernels"] * fits["cpu"]) / r["measured_s"] - 1)
                for r in chosen if r.get("probe")]
        if errs:
            entry["run_probe"] = {"median": statistics.median(errs), "max": max(errs)}
        errs = [abs(r["bytes_only_s"] / r["measured_s"] - 1) for r in chosen]
        entry["bytes_only"] = {"median": statistics.median(errs), "max": max(errs)}
        summary[group] = entry
    shares = [r["model_both"]["kernels_s"] / r["model_both"]["step_s"] for r in paired if r["fit_row"]]
    return {"fits": fits, "bandwidth": bandwidth, "summary": summary,
            "kernel_share": {"min": min(shares), "median": statistics.median(shares), "max": max(shares)} if shares else None}


def cpu_render(report: dict) -> str:
    """The CPU back-test's Markdown."""
    fits = report["fits"]

    def us(x):
        return number(None if x is None else x * 1e6, "{:.1f}")

    share = report["kernel_share"]
    lines = [
        "# Cost model back-test on the CPU: committed CPU decode steps against the modelled step",
        "",
        f"- command: `{report['command']}`; {report['date']}; jax {report['jax']}; steps compiled by "
        f"`{report['compiled']['command']}` for XLA:CPU on {report['compiled']['machine']} (jax "
        f"{report['compiled']['jax']}); the timings ran on the project's 2-core Intel Xeon machine (jax 0.10.2), "
        "whose read probes give the bandwidth",
        f"- model (`kvjax.evals.cost_model`): {cost_model.CPU_ASSUMPTIONS}",
        f"- bandwidth {report['bandwidth'] / 1e9:.1f} GB/s: the median of the back-tested runs' read probes "
        f"(`machine read bandwidth` of {', '.join('`' + os.path.basename(p) + '`' for p in cost_model.CPU_PROBES)}); "
        "each row's own run probe is in its `probe` column",
        "- measured: `decode ms/tok` of the committed CPU runs (`kvjax bench`: the best of the decode loop's timings "
        "÷ (new tokens − 1); `kvjax bench foundation`: kvjax's best), the model's architecture and real weights, "
        "batch 1; modelled: the same method spec's one-token decode step (`decode_step_jit`) compiled now for the CPU "
        "with abstract weights of the same shapes and the synthetic compressed cache (same budget, prompt length, "
        "room = the run's new tokens), memory bytes (`plan.hlo_bytes`) and kernels (`plan.kernel_launches`, XLA:CPU "
        "ops) read from its HLO",
        "- per-op cost fitted (least relative squares, as for the GPUs) on the `kvjax bench` runs of the default "
        "methods (`bench_methods_*`, the contention row left out): "
        + ", ".join(f"{m} {us(c)} µs" for m, c in fits.items() if m != "cpu")
        + f"; both together {us(fits['cpu'])} µs (the table's constant, `cost_model.DEVICES['cpu']`). `own` models "
        "a row with its model's fit, `other` with the other model's (the out-of-sample check), `both` with the "
        "constant; `the constant at the run's probe` replaces the bandwidth by each row's own run's read probe "
        "(23.0–30.3 GB/s: the machine's bandwidth varied between runs by as much as the model's error)",
        f"- bytes-only: memory bytes at the same bandwidth, no per-op term; per-op term's share of the modelled step "
        f"(fit rows, `both`): {share['min'] * 100:.0f}–{share['max'] * 100:.0f}% (median {share['median'] * 100:.0f}%)"
        if share else "- bytes-only: memory bytes at the same bandwidth, no per-op term",
        "- every timing predates the code compiled now: `commits since` counts the commits to "
        f"{', '.join(CPU_CODE_PATHS)} after the timing's file was committed (the CPU-relevant ones are listed below); "
        "`note` marks a row whose run reports contention",
        "",
        "## Error summary (|modelled ÷ measured − 1|)",
        "",
    ]
    cells = []
    for group, v in report["summary"].items():
        cell = [group, v["rows"]]
        for label in ("own", "other", "both", "run_probe", "bytes_only"):
            e = v.get(label)
            cell.append(f"{e['median'] * 100:.0f}% / {e['max'] * 100:.0f}%" if e else "—")
        cells.append(cell)
    lines += table(["rows", "n", "own fit (median / max)", "other model's fit", "both (the constant)",
                    "the constant at the run's probe", "bytes-only"], cells, "lrrrrrr") + [""]
    lines += ["## Rows", ""]
    cells = []
    for r in report["rows"]:
        name = f"[{os.path.basename(r['file']).replace('.json', '')}]({os.path.basename(r['file']).replace('.json', '.md')})"
        method = r["method"] + ("" if r["budget"] is None else f" {r['budget']:g}")
        common = [name, r["date"], r["model"], r["dtype"], method, r["length"], f"{r['measured_s'] * 1e3:.1f}"]
        tail = [f"{r['probe'] / 1e9:.1f}", r["commit"], r["code_commits_since"], r["note"] or "—"]
        if "kernels" not in r:
            cells.append(common + [f"no program: {r.get('error', '')}"] + [""] * 9 + tail)
            continue
        own, other, both = (r.get(f"model_{k}") for k in ("own", "other", "both"))
        cells.append(common + [
            f"{own['step_s'] * 1e3:.1f}", f"{own['step_s'] / r['measured_s']:.2f}",
            f"{other['step_s'] * 1e3:.1f}" if other else "—", f"{other['step_s'] / r['measured_s']:.2f}" if other else "—",
            f"{both['step_s'] * 1e3:.1f}", f"{both['step_s'] / r['measured_s']:.2f}",
            f"{r['bytes_only_s'] * 1e3:.1f}", f"{r['bytes_only_s'] / r['measured_s']:.2f}",
            f"{r['device_bytes'] / 2**30:.3f} / {r['kernels']}", ] + tail[:0] + ["yes" if r["fit_row"] else ""] + tail)
    lines += table(["run", "date", "model", "dtype", "method", "prompt", "measured ms", "modelled ms (own)",
                    "÷ measured", "(other)", "÷ measured", "(both)", "÷ measured", "bytes-only ms", "÷ measured",
                    "GiB / kernels", "fit", "probe GB/s", "file's commit", "commits since", "note"],
                   cells, "lllll" + "r" * 11 + "lrlrl") + [""]
    if report["skipped"]:
        lines += ["## Skipped rows", ""]
        lines += table(["run", "model", "method", "prompt", "measured ms", "why"],
                       [[os.path.basename(s["file"]), s["model"], s["method"], s["length"],
                         f"{s['measured_s'] * 1e3:.1f}", s["skipped"]] for s in report["skipped"]], "lllrrl") + [""]
    lines += ["## Decode-path commits since the earliest timing", "",
              f"`git log --since={report['earliest']} -- kvjax/attention.py kvjax/decoding.py` (the methods' and "
              "Pallas kernels' commits are counted per row above; the Pallas kernels are not the CPU's decode path):",
              ""]
    lines += [f"- `{c}`" for c in report["commits"]] + [""]
    return "\n".join(lines)


def cpu_main(args, argv) -> int:
    """The ``--cpu`` back-test: pair, compile (or reuse ``--counts``), fit and write."""
    import platform

    import jax

    rows, skipped = cpu_measured_rows()
    if args.counts:
        with open(args.counts) as f:
            earlier = json.load(f)
        fields = ("device_bytes", "kernels", "host_to_device", "device_to_host", "compile_s", "error")
        counts = {tuple(r[k] for k in ("model", "dtype", "method", "budget", "length", "room")):
                  {k: r[k] for k in fields if k in r} for r in earlier["rows"]}
        compiled = earlier["compiled"]
    else:
        counts = compile_cpu_counts([cpu_key(r) for r in rows])
        compiled = None
    for r in rows:
        r.update(counts[cpu_key(r)])
    earliest = min(r["date"] for r in rows)
    commits = _git("log", f"--since={earliest}", "--format=%h %ad %s", "--date=short", "--",
                   "kvjax/attention.py", "kvjax/decoding.py").splitlines()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    except OSError:
        cpu = platform.machine()
    command = "python -m kvjax.evals.cost_backtest " + shlex.join(argv)
    date = args.date or datetime.date.today().isoformat()
    machine = f"{cpu}, {os.cpu_count()} logical cores"
    report = {"command": command, "date": date, "jax": jax.__version__, "machine": machine,
              "compiled": compiled or {"command": command, "date": date, "jax": jax.__version__, "machine": machine},
              "device": vars(cost_model.DEVICES["cpu"]),
              **cpu_backtest(rows), "rows": rows, "skipped": skipped, "earliest": earliest,
              "commits": [c[:140] for c in commits]}
    write_report(args.out, cpu_render(report), report)
    print(cpu_render(report))
    return 0


def main(argv=None) -> int:
    """Pair, compile, fit and write the back-test (Markdown + JSON)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m kvjax.evals.cost_backtest", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="default docs/results/cost_model_backtest.md (--cpu: _cpu.md)")
    p.add_argument("--counts", default=None, metavar="BACKTEST.json",
                   help="reuse the compiled steps' counts an earlier back-test recorded (no compile)")
    p.add_argument("--cpu", action="store_true", help="the committed CPU timings against the steps compiled for the CPU")
    p.add_argument("--date", default=None, help="the report's date (--cpu; default today)")
    args = p.parse_args(argv)
    if args.cpu:
        args.out = args.out or "docs/results/cost_model_backtest_cpu.md"
        return cpu_main(args, argv)
    args.out = args.out or "docs/results/cost_model_backtest.md"
    rows = measured_rows()
    keys = [(r["device"], r["method"], r["budget"], r["length"], r["room"]) for r in rows]
    if args.counts:
        with open(args.counts) as f:
            earlier = json.load(f)
        fields = ("device_bytes", "kernels", "host_to_device", "device_to_host", "compile_s", "error")
        counts = {(r["device"], r["method"], r["budget"], r["length"], r["room"]): {k: r[k] for k in fields if k in r}
                  for r in earlier["rows"]}
        if "compiled" in earlier:
            compiled_by = earlier["compiled"]
    else:
        counts = compile_counts(keys)
        compiled_by = None
    for r in rows:
        r.update(counts[(r["device"], r["method"], r["budget"], r["length"], r["room"])])
    import jax

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = "PYTHONPATH=.aot-gpu:.aot-tpu:. python -m kvjax.evals.cost_backtest " + shlex.join(argv)
    report = {"command": command, "date": now, "jax": jax.__version__,
              "compiled": compiled_by or {"command": command, "date": now, "jax": jax.__version__}, "devices": {k: vars(v) for k, v in cost_model.DEVICES.items()},
              **backtest(rows), "rows": rows}
    write_report(args.out, render(report), report)
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
