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
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
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


def provenance(path: str) -> dict:
    """The commit that added a measurement file, the decode-path commits since, and the later structure changes."""
    added = _git("log", "--diff-filter=A", "--format=%h", "--", path).splitlines()
    commit = added[-1] if added else None
    since = int(_git("rev-list", "--count", f"{commit}..HEAD", "--", *CODE_PATHS) or 0) if commit else None
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


def main(argv=None) -> int:
    """Pair, compile, fit and write the back-test (Markdown + JSON)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m kvjax.evals.cost_backtest", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/results/cost_model_backtest.md")
    p.add_argument("--counts", default=None, metavar="BACKTEST.json",
                   help="reuse the compiled steps' counts an earlier back-test recorded (no compile)")
    args = p.parse_args(argv)
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
