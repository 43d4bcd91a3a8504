"""The methods benchmark's report (:mod:`kvjax.evals.bench_methods` measures): the figures derived from the
measured rows (bytes per step, bandwidth limit, ratios vs the full cache), the Markdown report, the
plot (decode ms/token and device KV bytes vs context length; with several batches tokens/s and device KV bytes vs
length per batch) and the files they are written to. A batch-1 run's report keeps the batch-1 form (no batch or
tokens/s columns)."""

from __future__ import annotations

import os

from kvjax.evals.bench_machine import GIB, MIB
from kvjax.kv_quantization import is_quantized
from kvjax.reports import MISSING, figure, number, save_figure, table
from kvjax.reports import write_report as write_files

REFERENCE = "full"  # the method every ratio is against
KIB_PER_GIB = 1024 ** 2


def full_cache_row(name: str) -> bool:
    """Whether a row measures the full cache: the reference ``full`` or the full cache stored in another dtype
    (``full:kv_dtype=int8``, :func:`kvjax.evals.records.stored_full_name`)."""
    return name.split(":", 1)[0] == REFERENCE


# --------------------------------------------------------------------------------------------
# derived figures


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def row_batch(r: dict) -> int:
    """Rows decoded together in a measured row (1 in reports written before ``--batch``)."""
    return r.get("batch", 1)


def batched(report: dict) -> bool:
    """Whether a report has a batch other than 1 (its tables then show the batch and tokens/s)."""
    return report["args"].get("batch", [1]) != [1]


def add_derived(rows: list[dict], weights: dict, bandwidth: float | None) -> None:
    """Bytes per step, bandwidth limit and the ratios vs the full cache of the same length and batch (in place)."""
    full_by_cell = {(r["prompt_tokens"], row_batch(r)): r for r in rows if r["method"] == REFERENCE and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        kv = r.get("kv_read_bytes_per_step")
        r["weights_read_bytes"] = weights["weights_read_bytes"]
        r["step_bytes"] = None if kv is None else weights["weights_read_bytes"] + kv
        r["limit_ms_per_token"] = 1000 * r["step_bytes"] / bandwidth if r["step_bytes"] and bandwidth else None
        r["over_limit"] = _ratio(r["decode_ms_per_token"], r["limit_ms_per_token"])
        full = full_by_cell.get((r["prompt_tokens"], row_batch(r)))
        r["decode_speedup"] = _ratio(full and full["decode_ms_per_token"], r["decode_ms_per_token"])
        r["tokens_per_s_ratio"] = _ratio(r.get("tokens_per_s"), full and full.get("tokens_per_s"))
        r["device_bytes_ratio"] = _ratio(r["device_bytes"], full and full["device_bytes"])
        r["prefill_ratio"] = _ratio(r["prefill_s"], full and full["prefill_s"])
        peaks = [m["peak_kib"] for m in (r["prefill_memory"], r["decode_memory"])]
        r["peak_rss_kib"] = max(peaks)


# --------------------------------------------------------------------------------------------
# Markdown, plot and files


def _method_cells(r: dict, with_batch: bool = False) -> list:
    """The main table's cells of one measured row (an error: its message, the rest marked missing); ``with_batch``:
    the batch after L and tokens/s and its ratio to the full cache in place of the decode speed-up."""
    head = [r["prompt_tokens"], row_batch(r), r["method"]] if with_batch else [r["prompt_tokens"], r["method"]]
    if "error" in r:
        return head + ["error"] + [MISSING] * (12 if with_batch else 11)
    c = r["compile_s"]
    decode = ([number(r["decode_ms_per_token"]), number(r["tokens_per_s"], "{:.1f}"),
               number(r["tokens_per_s_ratio"], "{:.2f}×")] if with_batch
              else [number(r["decode_ms_per_token"]), number(r["decode_speedup"], "{:.2f}×")])
    return head + [
        number(r["prefill_s"]), number(r["prefill_ratio"]), number(r["compress_s"], "{:.3f}"),
        *decode,
        number(r["limit_ms_per_token"]), number(r["over_limit"]),
        number(r["device_bytes"] / MIB, "{:.1f}"), number(r["device_bytes_ratio"], "{:.3f}"),
        number(r["host_bytes"] / MIB, "{:.1f}"),
        f"{r['prefill_memory']['peak_kib'] / KIB_PER_GIB:.2f} / {r['decode_memory']['peak_kib'] / KIB_PER_GIB:.2f}",
        f"{c['prefill'] + c['compress']:.1f} / {c['decode']:.1f}",
    ]


def kv_storage_line(args: dict) -> str:
    """The report's line on the dtype the caches are stored in (``--kv-dtype``; reports written before it: the
    model's dtype)."""
    kv = args.get("kv_dtype")
    if kv is None:
        return f"- KV stored in the model's dtype ({args['dtype']}, no `--kv-dtype`)"
    scales = ", a float32 scale per token and KV head, counted in the device bytes" if is_quantized(kv) else ""
    stored = [n for n in args["methods"] if n != REFERENCE]
    return (f"- KV stored in **{kv}** (`--kv-dtype {kv}`{scales}; docs/QUANTIZATION.md): "
            f"{', '.join(f'`{n}`' for n in stored) or 'no method'}; the reference `full` in the model's dtype "
            f"({args['dtype']}), every ratio against it")


def render_markdown(report: dict) -> str:
    """The Markdown report: set-up, one table per model/dtype, the limit's inputs and notes on every column."""
    m, v, bw, a = report["machine"], report["versions"], report["bandwidth"], report["args"]
    w = report["weights"]
    budget = a["budget"]
    budget_text = f"{budget} tokens per KV head" if isinstance(budget, int) else f"{budget:g} of the prompt's KV"
    if any("budget=" in n for n in a["methods"]):
        budget_text += " (a method spec's own `budget=` wins)"
    many = batched(report)
    batch_text = (f"batches {', '.join(map(str, a['batch']))} (B rows of different random prompts prefilled and "
                  "decoded together)" if many else "batch 1")
    lines = [
        "# KV-cache methods: " + ("throughput, latency and memory vs context length and batch" if many
                                  else "latency and memory vs context length"),
        "",
        f"Model `{a['model']}` ({a['dtype']}), {batch_text}, random prompt ids (seed {a['seed']}), budget {budget_text}, "
        f"{a['new_tokens']} greedy new tokens ({a['new_tokens'] - 1} timed decode steps, no EOS), prefill chunk "
        f"{a['chunk_size'] or 'none (whole prompt)'}, best of {a['repeats']} decode run(s), after AOT compilation "
        "and a warm-up run.",
        "",
        f"- command: `{report['command']}`",
        f"- machine: {m['cpu']}, {m['usable_cores']} usable cores ({m['logical_cores']} logical), "
        f"{number(m['memory_bytes'] and m['memory_bytes'] / GIB, '{:.1f}')} GiB RAM, {m['os']}; "
        f"JAX backend {report['backend']} ({', '.join(report['devices'])})",
        f"- versions: python {m['python']}, " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- date: {report['date']}, total time {report['total_s'] / 60:.1f} min",
    ]
    if report.get("cells_done", 0) < report.get("cells", 0):
        lines.append(f"- **partial**: {report['cells_done']} of {report['cells']} (length, batch) cells measured; the "
                     "run rewrites this file after each cell")
    options = report.get("decode_compiler_options")
    lines.append("- decode loop compiled with XLA options " + (", ".join(f"`{k}={v}`" for k, v in options.items())
                                                            if options else "none (XLA's defaults)"))
    lines.append(kv_storage_line(a))
    if a.get("random_weights"):
        lines.append("- **random weights** (`--random-weights`): the model's shapes, not its trained weights. Times and "
                     "bytes are the model's; data-dependent figures (recall trigger rates, selections) are not")
    synthetic = [n for n, source in report.get("artifacts", {}).items() if source == "synthetic"]
    if synthetic:
        lines.append(f"- **synthetic artifacts** for {', '.join(f'`{n}`' for n in synthetic)}: none ships for this "
                     "model, so each has the real shapes and the papers' head classes, calibrated on nothing "
                     "(`kvjax.evals.synthetic.synthetic_artifact`)")
    if "error" in bw:
        lines.append(f"- bandwidth measurement failed: {bw['error']} (no limits)")
    else:
        lines.append(
            f"- machine read bandwidth {bw['machine'] / 1e9:.1f} GB/s (best of jitted `jnp.sum` {bw['jax_sum'] / 1e9:.1f}, "
            f"numpy `a.sum()` {bw['numpy_sum'] / 1e9:.1f}, numpy in {bw['threads']} threads "
            f"{bw['numpy_threaded_sum'] / 1e9:.1f} GB/s over a {bw['array_bytes'] / MIB:.0f} MiB f32 array, "
            f"best of {bw['repeats']})"
        )
    what = ("all parameters (tied embeddings: the LM head reads the whole table)" if w["tied_embeddings"]
            else f"all parameters except the untied input-embedding table ({w['embedding_bytes'] / MIB:.0f} MiB)")
    lines += [
        f"- weights read per decode step: {w['weights_read_bytes'] / MIB:.1f} MiB = {what}",
        "",
        f"## {a['model']} {a['dtype']}",
        "",
    ]
    if many:
        head = ["L", "B", "method", "prefill s", "prefill ÷ full", "compress s", "decode ms/step", "tokens/s",
                "tokens/s ÷ full", "limit ms/step", "÷ limit", "device KV MiB", "÷ full bytes", "host KV MiB",
                "peak RSS GiB (prefill / decode)", "compile s (prefill / decode)"]
        lines += table(head, [_method_cells(r, True) for r in report["rows"]], align="rrl" + "r" * 13)
    else:
        head = ["L", "method", "prefill s", "prefill ÷ full", "compress s", "decode ms/tok", "decode speed-up vs full",
                "limit ms/tok", "÷ limit", "device KV MiB", "÷ full bytes", "host KV MiB",
                "peak RSS GiB (prefill / decode)", "compile s (prefill / decode)"]
        lines += table(head, [_method_cells(r) for r in report["rows"]], align="rl" + "r" * 12)

    recall_rows = [r for r in report["rows"] if "recall_events" in (r.get("cache_stats_after_decode") or {})]
    if recall_rows:
        lines += ["", "## Host recall (methods with a pinned-host tier)", "",
                  "From `cache.stats()` after the timed decode loop (N - 1 steps): refreshes of follower heads "
                  "(summed over layers), their rate per (follower head, step), token rows and K+V bytes brought "
                  "from host memory (written into follower slots), those bytes per decode step, and the bytes one "
                  "decode step transfers from the host (the schedule's fixed size, used or not).", ""]
        cells = []
        for r in recall_rows:
            a = r["cache_stats_after_decode"]
            steps = max(a["decode_steps"], 1)
            cells.append([r["prompt_tokens"], r["method"], a["recall_events"], f"{a['recall_trigger_rate']:.3f}",
                          a["rows_recalled"], f"{a['bytes_recalled'] / 1024:.1f}", f"{a['bytes_recalled'] / 1024 / steps:.1f}",
                          f"{a['bytes_fetched_per_step'] / 1024:.1f}"])
        lines += table(["L", "method", "recall events", "trigger rate", "rows recalled", "KiB recalled", "KiB / step",
                        "KiB fetched / step"], cells, align="rl" + "r" * 6)
    value_rows = [r for r in report["rows"] if "selection_ratio" in (r.get("cache_stats_after_decode") or {})]
    if value_rows:
        lines += ["", "## Values in host memory (HCAttention)", "",
                  "From `cache.stats()` after the timed decode loop: key representation on the device, the mean fraction "
                  "of the prompt selected per query (Eq. 4), value rows per (row, KV head) and decode call: "
                  "selected (the union of the call's selections) and fetched (the rows that cross, device path, or "
                  "are weighted on the host, host path: the call's transfer size), and the bytes crossing between "
                  "host and device per decode step over all layers: with `value_path=host` the row ids and weights "
                  "go to the host and the weighted sums come back; with `device` the value rows come to the "
                  "device.", ""]
        cells = []
        for r in value_rows:
            a = r["cache_stats_after_decode"]
            cells.append([r["prompt_tokens"], r["method"], a["key_representation"], a["tau"], a["value_path"],
                          f"{a['selection_ratio']:.3f}", f"{a['value_rows_per_head_per_call']:.1f}",
                          f"{a['value_rows_fetched_per_head_per_call']:.1f}", f"{a['bytes_moved_per_call'] / 1024:.1f}"])
        lines += table(["L", "method", "keys", "tau", "value path", "selected", "value rows selected / head / call",
                        "value rows fetched / head / call", "KiB moved / step"], cells, align="rllrlrrrr")
    own = sorted({r["method"] for r in report["rows"] if r.get("staging") == "own prefill"
                  and not full_cache_row(r["method"])})
    fulls = sorted({r["method"] for r in report["rows"] if full_cache_row(r["method"])}, key=len)
    lines += ["", "## Prefill sharing", "", f"- {', '.join(fulls) or REFERENCE}: "
              f"{'each ' if len(fulls) > 1 else ''}its own `FullCache().init_cache` prefill."]
    if own:
        lines.append(f"- its own prefill (evicting while prefilling): {', '.join(own)}")
    for kind in report["staging_kinds"]:
        lines.append(f"- one staging prefill (observation window {kind['window']}, accumulated attention "
                     f"{'yes' if kind['accumulate'] else 'no'}) per length{' and batch' if many else ''}, shared by "
                     f"{', '.join(kind['shared_by'])}")

    lines += ["", "## Columns", ""]
    if many:
        lines += [
            "- **B**: rows prefilled and decoded together (row b's prompt: random ids of seed + b). Every figure of a "
            "row is the whole batch's: prefill of B rows, cache bytes of B rows, K/V read per step by B rows; ratios "
            "are against the full cache at the same L and B.",
            "- **decode ms/step**: `decode_loop` time ÷ (N − 1) steps (each step gives every row one token: each "
            "row's ms per token). **tokens/s**: B × (N − 1) ÷ the best decode run's seconds. **tokens/s ÷ full**: "
            "that ÷ the full cache's tokens/s at the same L and B (= its decode speed-up).",
        ]
    lines += [
        "- **prefill s**: the full cache: its chunked jitted `prefill` of the prompt (incl. the argmax of the first "
        "token). A static method: the shared staging prefill of its kind (same window / accumulation; "
        "`kvjax.shared_prefill`, timed once and reported for every method of the kind) + its own `compress`. "
        "**prefill ÷ full**: that time ÷ the full cache's prefill s at the same L.",
        "- **compress s**: the method's jitted `compress` (selection + gathering into page pools) alone; "
        "the full cache's is the identity.",
        "- **decode ms/tok**: `decode_loop` (one jitted `lax.while_loop`, no EOS) time ÷ (N − 1) steps, best of the "
        "repeats, each run on a freshly derived cache. **decode speed-up vs full**: full ms/tok ÷ method ms/tok.",
        "- **limit ms/tok**: bytes one decode step must read ÷ the machine read bandwidth above. Bytes = weights "
        "read per step + K/V read at the mean decode context: full: every layer and KV head's `L + N/2` tokens; "
        "eviction methods: `kept_tokens_per_head` + N/2 per head; Quest: its `kv_bytes_read_per_step` (selected "
        "pages + page bounds; dense layers whole), averaged before/after decoding; each K or V vector in the row's "
        "stored dtype (`kv_dtype` in the JSON) with its scale when quantized. The dense full cache's XLA "
        "attention reads its whole buffer (L + N rounded up to 256 slots), i.e. somewhat more than counted. "
        "**÷ limit**: measured ms/tok ÷ limit (1.00 = at the memory-bandwidth limit).",
        "- **device KV MiB / host KV MiB**: `cache.stats()` of the compressed cache before decoding: every array "
        "the cache holds (pools, block tables, lengths, Quest's page bounds; the full cache: its dense buffer of "
        "L + N slots rounded up to 256). **÷ full bytes**: device bytes ÷ the full cache's at the same L "
        "(Quest keeps every token: it saves bandwidth, not memory).",
        "- **peak RSS GiB (prefill / decode)**: process resident-set high-water mark (`ru_maxrss`), reset right before "
        "the timed prefill of the method's staging (prefill) and right before its timed compress + decode "
        "(decode). It includes the weights, everything still alive (the staging kept for the other methods of its "
        "kind), compiled code and memory the allocator kept (JAX's caches are cleared after every method); the RSS at "
        "each reset is `rss_base_kib` in the JSON. On an "
        "accelerator the caches are in device memory, not in RSS (`device_memory` in the JSON).",
        "- **compile s (prefill / decode)**: ahead-of-time `lower` + `compile` (persistent compilation cache off) of "
        "the prefill executables of the method's staging kind (one per chunk shape, shared by the kind) "
        "+ its `compress`, and of its decode loop.",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"- L={r['prompt_tokens']} {r['method']} failed: {r['error']}")
    return "\n".join(lines) + "\n"


def length_axes(ax, lengths) -> None:
    """Log-2 context-length x axis labelled 1K, 2K, ..., a grid and the legend."""
    ax.set_xscale("log", base=2)
    if lengths:
        ax.set_xticks(lengths, [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths])
        ax.minorticks_off()
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def plot_batches(report: dict, path: str, bytes_key: str = "device_bytes", title: str | None = None) -> None:
    """PNG, one column per batch: tokens/s (top) and device KV bytes (bottom, each row's ``bytes_key``) vs context
    length, one line per method; ``title`` over the figure (default: model, dtype and budget)."""
    rows = [r for r in report["rows"] if "error" not in r]
    a = report["args"]
    batches = a["batch"]
    fig = figure((4.4 * len(batches), 8))
    axes = fig.subplots(2, len(batches), squeeze=False)
    lengths = sorted({r["prompt_tokens"] for r in rows})
    for j, B in enumerate(batches):
        top, bottom = axes[0][j], axes[1][j]
        for name in a["methods"]:
            rs = sorted((r for r in rows if r["method"] == name and row_batch(r) == B), key=lambda r: r["prompt_tokens"])
            if rs:
                x = [r["prompt_tokens"] for r in rs]
                top.plot(x, [r["tokens_per_s"] for r in rs], marker="o", label=name)
                bottom.plot(x, [r[bytes_key] / MIB for r in rs], marker="o", label=name)
        top.set(xlabel="context length (tokens)", ylabel="decode tokens / s", title=f"batch {B}: throughput")
        bottom.set(xlabel="context length (tokens)", ylabel="device KV cache (MiB)", title=f"batch {B}: KV cache bytes")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            length_axes(ax, lengths)
    fig.suptitle(title or f"{a['model']} {a['dtype']}, budget {a['budget']}")
    fig.tight_layout()
    save_figure(fig, path, dpi=110, tight=False)


def plot(report: dict, path: str) -> None:
    """PNG: decode ms/token vs context length per method (+ the full cache's limit, dashed), device KV bytes vs length;
    a report with several batches: :func:`plot_batches`."""
    if batched(report):
        plot_batches(report, path)
        return
    rows = [r for r in report["rows"] if "error" not in r]
    a = report["args"]
    fig = figure((12, 4.8))
    ax1, ax2 = fig.subplots(1, 2)
    for name in a["methods"]:
        rs = sorted((r for r in rows if r["method"] == name), key=lambda r: r["prompt_tokens"])
        if not rs:
            continue
        x = [r["prompt_tokens"] for r in rs]
        ax1.plot(x, [r["decode_ms_per_token"] for r in rs], marker="o", label=name)
        ax2.plot(x, [r["device_bytes"] / MIB for r in rs], marker="o", label=name)
    limit = sorted((r["prompt_tokens"], r["limit_ms_per_token"]) for r in rows
                   if r["method"] == REFERENCE and r.get("limit_ms_per_token"))
    if limit:
        ax1.plot(*zip(*limit), linestyle="--", color="black", label="full: bandwidth limit")
    ax1.set(xlabel="context length (tokens)", ylabel="decode ms / token", title=f"decode latency, {a['model']} {a['dtype']}")
    ax2.set(xlabel="context length (tokens)", ylabel="device KV cache (MiB)", title=f"KV cache bytes, budget {a['budget']}")
    lengths = sorted({r["prompt_tokens"] for r in rows})
    for ax in (ax1, ax2):
        length_axes(ax, lengths)
    ax2.set_yscale("log")
    fig.tight_layout()
    save_figure(fig, path, dpi=120, tight=False)


def write_report(report: dict, out: str, with_plot: bool = True) -> tuple[str, list[str]]:
    """Write the Markdown at ``out``, the JSON (and the PNG plot) next to it with the same stem: (Markdown, paths)."""
    md = render_markdown(report)
    stem = os.path.splitext(out)[0]
    written = write_files(out, md, report)
    if with_plot:
        plot(report, stem + ".png")
        written.append(stem + ".png")
    return md, written
