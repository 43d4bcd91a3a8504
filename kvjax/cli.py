"""The ``kvjax`` command line: generate, models, demo, eval, bench, calibrate, train-locret."""

from __future__ import annotations

import argparse
import sys
import time

from kvjax.budgets import parse_budget
from kvjax.distributed import add_mesh_args, setup_devices
from kvjax.kv_quantization import KV_DTYPES, check_kv_dtype


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from kvjax.models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help=f"ready model name, HF directory or .gguf file (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and cache dtype")


def _add_method_args(p: argparse.ArgumentParser) -> None:
    from kvjax.methods import METHODS

    p.add_argument("--method", default="full",
                   help=f"KV-cache method: {', '.join(sorted(METHODS))}; hyper-parameters as name:key=value[:key=value], "
                        "e.g. synckv:stride=10")
    p.add_argument("--budget", type=parse_budget, default=None,
                   help="KV budget: an int = tokens per KV head per layer, a float in (0, 1] = fraction of the prompt's KV kept")
    p.add_argument("--implementation", default="auto", choices=["auto", "xla", "pallas", "pallas_interpret"],
                   help="attention implementation (auto: pallas on TPU/GPU, xla on CPU)")
    h = p.add_argument_group("hcattention", "options of --method hcattention (instead of --budget)")
    h.add_argument("--groups", type=int, default=None, help="key groups g (codes of g bytes per token); 0 = exact keys")
    h.add_argument("--centroids", type=int, default=None, help="codebook size c (default 256)")
    h.add_argument("--tau", type=float, default=None, help="cumulative attention mass kept (default 0.9)")
    h.add_argument("--value-path", default=None, choices=["host", "device"],
                   help="weighted sum where the values live (host) or selected rows moved to the device")
    h.add_argument("--local", type=int, default=None,
                   help="last prompt tokens kept exact on the device (default 0: every prompt key quantized, the paper; "
                        "64 keeps a question at the prompt's end exact)")


HCATTENTION_OPTIONS = ("groups", "centroids", "tau", "value_path", "local")


def methods_help() -> str:
    """Every method with its hyper-parameters and defaults, and its presets (``kvjax generate --help``)."""
    import dataclasses

    from kvjax.methods import METHODS, PRESETS

    lines = ["methods (--method name:key=value[:key=value], defaults as shown; presets as name:preset=P):"]
    for name, cls in sorted(METHODS.items()):
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
        lines.append(f"  {name}: {fields}")
        for preset, options in PRESETS.get(name, {}).items():
            lines.append(f"    preset {preset}: " + ":".join(f"{k}={v}" for k, v in options.items()))
    return "\n".join(lines)


def method_from_args(args):
    """The method a parsed command line names (``--method`` with ``--budget``, ``--implementation`` and HCAttention's flags); ValueError for flags that do not apply."""
    from kvjax.methods import get_method, parse_method_spec

    base = parse_method_spec(args.method)[0]
    if base == "full":
        if args.budget is not None:
            raise ValueError("--budget does not apply to --method full (it keeps every token)")
        return get_method(args.method, implementation=args.implementation)
    kwargs = {"implementation": args.implementation}
    if args.budget is not None:
        kwargs["budget"] = args.budget
    given = {k: getattr(args, k) for k in HCATTENTION_OPTIONS if getattr(args, k) is not None}
    if given and base != "hcattention":
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{flags} apply to --method hcattention only, not {args.method}")
    return get_method(args.method, **kwargs, **given)


def cmd_generate(args) -> int:
    """Stream the answer to a prompt (or a prompt file)."""
    import kvjax
    from kvjax.cache import format_bytes

    if (args.prompt is None) == (args.prompt_file is None):
        raise SystemExit("kvjax generate: give exactly one of --prompt or --prompt-file")
    prompt = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    method = method_from_args(args)  # a bad spec or budget fails here, before the model loads
    check_kv_dtype(args.kv_dtype, args.dtype)
    model = kvjax.load(args.model, args.dtype, progress=True, mesh=setup_devices(args))
    result = kvjax.generate(
        model, prompt, method=method, max_new_tokens=args.max_new_tokens, chat=args.chat,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, chunk_size=args.chunk_size,
        stream=lambda s: print(s, end="", flush=True), progress=True, kv_dtype=args.kv_dtype,
    )
    s, t = result.cache_stats, result.timings
    print(
        f"\n[{result.prompt_tokens[0]} prompt tokens, {len(result.tokens[0])} generated | prefill {t['prefill_s']:.2f} s, "
        f"decode {_decode_speed(t)} | cache {s['method']}: device {format_bytes(s['device_bytes'])}"
        + (f" ({format_bytes(s['device_bytes_per_device'])} per device)" if model.mesh is not None else "")
        + f", host {format_bytes(s['host_bytes'])}]",
        file=sys.stderr,
    )
    return 0


def cmd_models(args) -> int:
    """List the ready models and whether their packages are installed."""
    from kvjax.models import DEFAULT_MODEL, READY_MODELS, is_installed

    for name, m in READY_MODELS.items():
        state = "installed" if is_installed(name) else f"not installed ({m.install_command})"
        default = " [default]" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}: {m.description}\n    {state}")
    return 0


def _decode_speed(timings: dict) -> str:
    """Decode speed for the console: steady-state ms/token when known, else the average incl. compilation."""
    if "decode_steady_ms_per_token" in timings:
        return (f"{timings['decode_steady_ms_per_token']:.1f} ms/token "
                f"(first step incl. compilation {timings['first_step_s']:.1f} s)")
    return f"{timings['decode_ms_per_token']:.1f} ms/token (incl. compilation)"


# the five seed methods (the tuned presets where they have one) and SnapKV, the baseline their papers compare against
DEMO_METHODS = ("snapkv", "hbw", "heterocache:preset=tuned", "synckv:preset=tuned", "hcattention:preset=tuned", "locret")


def demo_kv_dtype(kv_dtype, dtype) -> str | None:
    """The demo's ``--kv-dtype``: its name, None when it is the model's ``dtype`` (or not given); ValueError naming
    the allowed values otherwise."""
    name = check_kv_dtype(kv_dtype, dtype)
    return None if name == dtype else name


def demo_methods(specs, kv_dtype: str | None = None) -> list[tuple[str, object]]:
    """``(label, method)`` for the full cache and each spec (``name[:budget=B][:key=value]``, default budget 0.1),
    built before any model loads so a typo costs nothing. With a ``kv_dtype`` (other than the model's) the full
    cache stored in it follows the reference, labelled ``full:kv_dtype=D`` as ``kvjax eval`` names it."""
    from kvjax.evals.records import split_budget, stored_full_name
    from kvjax.methods import FullCache, get_method

    out = [("full", FullCache())]
    if kv_dtype is not None:
        out.append((stored_full_name(kv_dtype), FullCache()))
    for spec in specs:
        name, budget = split_budget(spec)
        if name == "full":
            continue
        budget = 0.1 if budget is None else budget
        out.append((f"{name} @ {budget:g}", get_method(name, budget=budget)))
    return out


def demo_groups(runs, kv_dtype: str | None) -> list[tuple[str | None, list]]:
    """``(kv_dtype, runs)`` of each ``kvjax.compare`` call for the demo's ``(label, method)`` runs: all in one call
    without a ``kv_dtype``; with one, the reference full cache (label ``full``) in the model's dtype, then every
    other run stored in ``kv_dtype``."""
    if kv_dtype is None:
        return [(None, list(runs))]
    groups = ((None, [r for r in runs if r[0] == "full"]), (kv_dtype, [r for r in runs if r[0] != "full"]))
    return [(kv, group) for kv, group in groups if group]


def check_demo_kv_dtype(model: str, methods, length: int, dtype, kv_dtype: str) -> None:
    """ValueError naming every demo method that cannot store its cache in ``kv_dtype``, checked on the model's
    architecture (no weights read) before the model loads."""
    from kvjax.cache import unstorable
    from kvjax.models import model_architecture

    config, _ = model_architecture(model)
    problems = [f"{label}: {why}" for label, why in unstorable(dict(methods), config, length, 16, dtype,
                                                                kv_dtype=kv_dtype).items()]
    if problems:
        raise ValueError(f"--kv-dtype {kv_dtype}: not every method can store it (choose --methods among those that "
                         "can):\n  " + "\n  ".join(problems))


def demo_table(rows) -> str:
    """The demo's side-by-side table: one line per (protocol, method)."""
    return "\n".join(" ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, DEMO_COLUMNS))
                     for cells in demo_cells(rows))


# the demo table's columns: (title, console width, alignment)
DEMO_COLUMNS = (("question", 17, "<"), ("method", 34, "<"), ("answer", 14, "<"), ("ok", 3, "<"),
                ("device KV", 10, ">"), ("host KV", 10, ">"), ("prefill s", 9, ">"), ("1st step s", 10, ">"),
                ("decode ms/tok", 13, ">"))


def demo_cells(rows) -> list[list[str]]:
    """The demo table as text cells: the header, a rule, then one line per (protocol, method)."""
    from kvjax.cache import format_bytes

    out = [[title for title, _, _ in DEMO_COLUMNS], ["-" * width for _, width, _ in DEMO_COLUMNS]]
    for r in rows:
        out.append([r["protocol"], r["method"], r["answer"][:14], "yes" if r["ok"] else "NO",
                    format_bytes(r["device_bytes"]), format_bytes(r["host_bytes"]),
                    ("*" if r.get("prefill_shared") else "") + format(r["prefill_s"], ".2f"),
                    format(r["first_step_s"], ".2f"), format(r["decode_ms_per_token"], ".1f")])
    return out


def demo_png(rows, path, title: str) -> None:
    """The demo table as a PNG (for the README)."""
    from kvjax.reports import figure, save_figure

    cells = demo_cells(rows)
    head, body = cells[0], cells[2:]
    fig = figure((11, 0.22 * (len(body) + 2)))
    ax = fig.add_subplot(1, 1, 1)
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")
    table = ax.table(cellText=body, colLabels=head, loc="upper center", cellLoc="left", bbox=(0, 0, 1, 1))
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.auto_set_column_width(list(range(len(head))))
    for (i, j), cell in table.get_celld().items():
        if i > 0 and body[i - 1][3] == "NO":
            cell.set_facecolor("#fde0dc")
    save_figure(fig, path, dpi=130)


def cmd_demo(args) -> int:
    """A pass key in a long haystack, answered with the full cache and with compressed methods, side by side: the
    question inside the compressed prompt, then asked after the context alone was compressed."""
    import kvjax
    from kvjax.evals.passkey import QUESTION, make_passkey
    from kvjax.methods import FullCache

    kv_dtype = demo_kv_dtype(args.kv_dtype, args.dtype)
    specs = args.methods if args.methods is not None else DEMO_METHODS
    methods = demo_methods(specs, kv_dtype)
    if kv_dtype is not None:
        check_demo_kv_dtype(args.model, methods, args.length, args.dtype, kv_dtype)
    t0 = time.perf_counter()
    model = kvjax.load(args.model, args.dtype, progress=True, mesh=setup_devices(args))
    print(f"model {args.model} ({args.dtype}) loaded in {time.perf_counter() - t0:.1f} s")
    sample = make_passkey(model.tokenizer, args.length, depth=args.depth, seed=args.seed)
    print(f"prompt: {sample.num_tokens} tokens of filler with a pass key at depth {sample.depth:.0%}; expected {sample.answer}")
    context = sample.prompt[: sample.prompt.rindex(QUESTION)]
    rows = []
    for protocol, prompt, question in (("in the prompt", sample.prompt, None), ("after compression", context, QUESTION)):
        # the full cache's answer does not change when the question comes after the (uncompressed) context
        runs = [(label, m) for label, m in methods if question is None or not isinstance(m, FullCache)]
        print(f"  question {protocol}: {', '.join(label for label, _ in runs)} ...", flush=True)
        labels, results = [], []  # the reference full cache in the model's dtype, the others in --kv-dtype
        for kv, group in demo_groups(runs, kv_dtype):
            labels += [label for label, _ in group]
            results += kvjax.compare(model, prompt, [m for _, m in group], question=question, max_new_tokens=16,
                                     chat=True, chunk_size=args.chunk_size, steady_timings=True, kv_dtype=kv)
        for label, r in zip(labels, results):
            rows.append({"protocol": protocol, "method": label, "answer": r.text.strip().replace("\n", " "),
                         "ok": sample.answer in r.text,
                         "device_bytes": r.cache_stats["device_bytes"] - r.cache_stats["artifact_device_bytes"],
                         "host_bytes": r.cache_stats["host_bytes"], "prefill_s": r.timings["prefill_s"],
                         "prefill_shared": r.timings.get("prefill_shared_by", 1) > 1,
                         "first_step_s": r.timings["first_step_s"],
                         "decode_ms_per_token": r.timings["decode_steady_ms_per_token"]})
    print()
    if kv_dtype is not None:
        print(f"KV stored in {kv_dtype}: every method's compressed cache and {methods[1][0]}; the full cache in "
              f"{args.dtype}\n")
    print(demo_table(rows))
    print("\n" + DEMO_NOTE)
    if args.png:
        import jax

        device = jax.devices()[0]
        demo_png(rows, args.png, f"kvjax demo: {args.model}, {sample.num_tokens}-token pass-key prompt, "
                 f"needle at {sample.depth:.0%}, {args.dtype}" + (f", KV in {kv_dtype}" if kv_dtype else "")
                 + f", jax {jax.__version__}, "
                 f"{device.platform} ({device.device_kind})")
        print(f"table: {args.png}")
    return 0


DEMO_NOTE = ("device/host KV: the bytes the cache holds after compression, without a method's trained or calibrated "
             "arrays, which are weights held once per model (Locret's retaining heads, HCAttention's codebooks); prefill s "
             "includes compiling the prefill (once per method; * one prefill shared by the methods so marked, kvjax.compare); 1st step s: the first "
             "decode step with its compilation; decode ms/tok: the steps after it. With the question after compression "
             "a method keeps what it can without knowing the question.")


def run_bench(argv) -> int:
    """``kvjax bench [methods|foundation|matvec|locret-memory|mesh] ...``: the named benchmark (default ``methods``)."""
    argv = list(argv)
    if argv[:1] == ["foundation"]:
        from kvjax.evals.bench_foundation import main as bench_main
    elif argv[:1] == ["matvec"]:
        from kvjax.evals.bench_matvec import main as bench_main
    elif argv[:1] == ["locret-memory"]:
        from kvjax.evals.locret_memory import main as bench_main
    elif argv[:1] == ["mesh"]:
        from kvjax.evals.bench_mesh import main as bench_main
    else:
        from kvjax.evals.bench_methods import main as bench_main

        return bench_main(argv[1:] if argv[:1] == ["methods"] else argv)
    return bench_main(argv[1:])


def run_eval(argv) -> int:
    """``kvjax eval``: task accuracy and fidelity of methods x budgets (``evals/runner.py``)."""
    from kvjax.evals.runner import main as eval_main

    return eval_main(argv)


def run_calibrate(argv) -> int:
    """``kvjax calibrate``: HeteroCache / SyncKV head roles, HCAttention codebooks (``kvjax/make_artifacts.py``)."""
    from kvjax.make_artifacts import main as calibrate_main

    return calibrate_main(argv)


def run_train_locret(argv) -> int:
    """``kvjax train-locret``: train Locret's retaining heads (``train/cli.py``)."""
    from kvjax.train.cli import main as train_main

    return train_main(argv)


# Subcommands with a parser of their own: ``kvjax NAME ...`` hands everything after NAME to it. One table, read by
# the top-level parser (for ``kvjax --help``) and by :func:`main` (to dispatch).
FORWARDED = {
    "bench": (run_bench, "benchmarks: `kvjax bench [methods] ...` latency/memory per method vs context length "
              "(default), `kvjax bench foundation ...` kvjax vs transformers, `kvjax bench matvec ...` f32 vs bf16 "
              "weight products, `kvjax bench locret-memory ...` Locret's bounded prefill memory, `kvjax bench mesh ...` "
              "methods on device meshes; --help after the name for options"),
    "eval": (run_eval, "accuracy of methods x budgets on long-context task suites (kvjax's, RULER's), fidelity vs "
             "the full cache; `kvjax eval --help` for options"),
    "calibrate": (run_calibrate, "offline calibration: `kvjax calibrate heterocache|synckv|hcattention --model M`; "
                  "writes the artifact and plots; `kvjax calibrate --help` for options"),
    "train-locret": (run_train_locret, "train Locret's retaining heads (QA data, labels from the frozen model, Optax, "
                     "Orbax checkpoints); `kvjax train-locret --help` for options"),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kvjax`` command."""
    parser = argparse.ArgumentParser(prog="kvjax", description="Llama/Qwen in JAX with compressed KV caches")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streaming the answer", epilog=methods_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(g)
    _add_method_args(g)
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chunk-size", type=int, default=None, help="prefill in chunks of this many tokens")
    g.add_argument("--kv-dtype", default=None, help="storage dtype of the compressed page pools (and of --method full's "
                   "cache): the --dtype (default), "
                   f"{', '.join(KV_DTYPES)} (int8 and fp8 with per-token scales; docs/QUANTIZATION.md)")
    add_mesh_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list the ready models")
    m.set_defaults(func=cmd_models)

    d = sub.add_parser("demo", help="a pass key in a ~4K-token haystack: the full cache and compressed methods side by side")
    _add_model_args(d)
    d.add_argument("--methods", type=lambda t: tuple(x.strip() for x in t.split(",") if x.strip()), default=None,
                   help=f"comma list of method specs, name[:budget=B][:key=value] (default {','.join(DEMO_METHODS)}; "
                        "budget 0.1 when none is given); the full cache always runs")
    d.add_argument("--length", type=int, default=4096, help="prompt length in tokens")
    d.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1]")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--chunk-size", type=int, default=1024)
    d.add_argument("--png", default=None, help="also write the table as a PNG to this path")
    d.add_argument("--kv-dtype", default=None, metavar="D",
                   help=f"store every method's compressed cache in D: the --dtype (default), {', '.join(KV_DTYPES)} "
                        "(int8 and fp8 with per-token scales; docs/QUANTIZATION.md). The table then shows the full "
                        "cache twice, in the --dtype (full) and stored in D (full:kv_dtype=D, with the question in the "
                        "prompt only, as full); a method that cannot store D (HeteroCache, SyncKV, HCAttention) is "
                        "refused before the model loads")
    add_mesh_args(d)
    d.set_defaults(func=cmd_demo)

    for name, (_, help_text) in FORWARDED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``kvjax`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    try:
        if command in FORWARDED:
            run, _ = FORWARDED[command]
            return run(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as e:
        print(f"kvjax {command}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: a bad option value, --help
        return e.code if isinstance(e.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
