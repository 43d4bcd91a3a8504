"""Kernel benchmark: paged decode attention and PQ scoring vs XLA, as achieved bandwidth.

For each number of attended ("selected") tokens per KV head it times

* the Pallas paged decode-attention kernel (the form of this accelerator),
* the XLA reference of the same op (gather pages through the block table, softmax),
* dense XLA attention over the same number of tokens in contiguous ``[B, H_kv, T, D]`` K/V,

and PQ scoring (``pq_scores`` with softmax statistics; Pallas and XLA) against a dense ``q . K``
over bf16 keys at ``D = 128``.  Achieved bandwidth = bytes of K/V (or PQ codes) that the op
must read / median time, reported as a fraction of the device's copy bandwidth measured in the
same run (``x + 1`` over a large array: read + write).

Usage::

    python -m research.bench_kernels                      # on a TPU/GPU: full run, 4K..128K tokens
    python -m research.bench_kernels --smoke              # tiny sizes, Pallas in interpret mode
    python -m research.bench_kernels --tokens 4096 65536 --out docs/results/kernels_gpu.md

On CPU without ``--smoke`` there is no compiled Pallas: only the XLA rows are timed (with a
message saying so).  Results: a Markdown table at ``--out`` and JSON next to it (``.json``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.pallas_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kvjax.pallas_kernels.pq_attention import pq_scores
from kvjax.reports import number, table, write_report

DEFAULT_TOKENS = (4096, 8192, 16384, 32768, 65536, 131072)
DEFAULT_PQ = ("16x256", "32x256", "32x1024", "64x4096")  # g x c at D=128


def _platform() -> str:
    p = jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def time_fn(fn, *args, warmup: int = 3, repeats: int = 20):
    """Median wall time (s) of ``fn(*args)`` with ``block_until_ready``; also compile+first time."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Device memory bandwidth (bytes/s) from ``x + 1`` over an ``nbytes`` f32 array."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    fn = jax.jit(lambda a: a + 1.0)
    t, _ = time_fn(fn, x, warmup=2, repeats=repeats)
    return 2 * x.size * 4 / t


def _dense_attention(q, k, v):
    """Dense decode attention over contiguous K/V [B, H_kv, T, D] (XLA)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgt,bhtd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d).astype(q.dtype)


def _dense_scores(q, k):
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    m = jnp.max(s, axis=-1)
    l = jnp.sum(jnp.exp(s - m[..., None]), axis=-1)
    return s.reshape(b, hq, -1), m, l


def bench_paged(args, forms, impl, dev_bw, log):
    """Time paged decode attention (Pallas forms, XLA reference, dense XLA) per dtype, batch and token count; a cell
    whose K/V exceed ``--max-gib`` is skipped, and the dense row is skipped where its contiguous copy would not fit."""
    rows = []
    for dtype_name in args.dtypes:
        for b in args.batch:
            rows += _bench_paged_cells(args, forms, impl, dev_bw, log, jnp.dtype(dtype_name), b)
    return rows


def _bench_paged_cells(args, forms, impl, dev_bw, log, dtype, b):
    rows = []
    key = jax.random.PRNGKey(0)
    hkv, g, d, ps = args.kv_heads, args.group, args.head_dim, args.page_size
    for tokens in args.tokens:
        kv_bytes = 2 * b * hkv * tokens * d * jnp.dtype(dtype).itemsize
        if kv_bytes > args.max_gib * 2**30:
            log(f"paged T={tokens} B={b} {dtype.name}: {kv_bytes / 2**30:.1f} GiB of K/V exceed --max-gib, skipped")
            continue
        pages_per_head = -(-tokens // ps)
        num_pages = b * hkv * pages_per_head
        k1, k2, k3, k4, key = jax.random.split(key, 5)
        k_pages = jax.random.normal(k1, (num_pages, ps, d), dtype)
        v_pages = jax.random.normal(k2, (num_pages, ps, d), dtype)
        q = jax.random.normal(k3, (b, hkv * g, d), dtype)
        table = jax.random.permutation(k4, num_pages).astype(jnp.int32)
        table = table.reshape(b, hkv, pages_per_head)  # scattered pages, as after eviction
        lengths = jnp.full((b, hkv), tokens, jnp.int32)
        cands = []
        for form in forms:
            fn = jax.jit(lambda *a, form=form: paged_decode_attention(
                *a, implementation=impl, backend=form, pages_per_block=args.pages_per_block))
            cands.append((f"pallas_{form}" + ("_interpret" if impl != "pallas" else ""), fn,
                          (q, k_pages, v_pages, table, lengths)))
        cands.append(("xla_reference", paged_decode_attention_reference,
                      (q, k_pages, v_pages, table, lengths)))
        kc = vc = None
        if 2 * kv_bytes <= args.max_gib * 2**30:
            kc = k_pages[table].reshape(b, hkv, pages_per_head * ps, d)[:, :, :tokens]
            vc = v_pages[table].reshape(b, hkv, pages_per_head * ps, d)[:, :, :tokens]
            cands.append(("dense_xla", jax.jit(_dense_attention), (q, kc, vc)))
        ref_out = None
        dense_t = None
        for name, fn, fargs in cands:
            try:
                t, first = time_fn(fn, *fargs, warmup=args.warmup, repeats=args.repeats)
                out = np.asarray(fn(*fargs), np.float32)
            except Exception as e:  # noqa: BLE001 - a form that fails to build or run is a row, the others go on
                rows.append(dict(op="paged_decode_attention", tokens=tokens, batch=b, dtype=jnp.dtype(dtype).name,
                                 impl=name, error=f"{type(e).__name__}: {e}"[:300]))
                log(f"paged T={tokens:>7} B={b:<3} {jnp.dtype(dtype).name:<8} {name:<24} FAILED: {type(e).__name__}")
                continue
            if ref_out is None:
                ref_out = out
            err = float(np.max(np.abs(out - ref_out)))
            if name == "dense_xla":
                dense_t = t
            rows.append(dict(op="paged_decode_attention", tokens=tokens, batch=b, dtype=jnp.dtype(dtype).name,
                             impl=name, time_us=t * 1e6, first_call_s=first, bytes=kv_bytes,
                             GBps=kv_bytes / t / 1e9,
                             frac_of_copy_bw=kv_bytes / t / dev_bw,
                             frac_of_nominal_bw=kv_bytes / t / args.nominal_bandwidth if args.nominal_bandwidth else None,
                             max_abs_diff=err))
            log(f"paged T={tokens:>7} B={b:<3} {jnp.dtype(dtype).name:<8} {name:<24} {t*1e6:10.1f} us  "
                f"{kv_bytes/t/1e9:8.1f} GB/s  ({kv_bytes/t/dev_bw:5.1%} of copy bw)")
        for r in rows:
            if r["tokens"] == tokens and r["op"] == "paged_decode_attention" and "error" not in r:
                r["time_vs_dense"] = r["time_us"] / (dense_t * 1e6) if dense_t else None
        del k_pages, v_pages, kc, vc
    return rows


def bench_pq(args, forms, impl, dev_bw, log):
    """Time PQ scoring with stats (Pallas forms, XLA reference) and dense q.K per token count."""
    rows = []
    key = jax.random.PRNGKey(1)
    b, hkv, g_q, d = args.batch[0], args.kv_heads, args.group, 128
    for tokens in args.pq_tokens or args.tokens:
        k1, k2, key = jax.random.split(key, 3)
        q = jax.random.normal(k1, (b, hkv * g_q, d), jnp.bfloat16)
        k_dense = jax.random.normal(k2, (b, hkv, tokens, d), jnp.bfloat16)
        dense_bytes = k_dense.size * 2
        t_dense, first = time_fn(jax.jit(_dense_scores), q, k_dense, warmup=args.warmup,
                                 repeats=args.repeats)
        rows.append(dict(op="scores", tokens=tokens, impl="dense_qK_xla", config="bf16 K",
                         time_us=t_dense * 1e6, first_call_s=first, bytes=dense_bytes,
                         GBps=dense_bytes / t_dense / 1e9,
                         frac_of_copy_bw=dense_bytes / t_dense / dev_bw, time_vs_dense=1.0))
        log(f"pq    T={tokens:>7} {'dense_qK_xla':<24} {t_dense*1e6:10.1f} us  "
            f"{dense_bytes/t_dense/1e9:8.1f} GB/s")
        del k_dense
        for spec in args.pq:
            groups, cents = (int(x) for x in spec.split("x"))
            k3, k4, key = jax.random.split(key, 3)
            cb = jax.random.normal(k3, (hkv, groups, cents, d // groups), jnp.float32)
            code_dtype = jnp.uint8 if cents <= 256 else jnp.uint16
            codes = jax.random.randint(k4, (b, hkv, tokens, groups), 0, cents).astype(code_dtype)
            lengths = jnp.full((b, hkv), tokens, jnp.int32)
            code_bytes = codes.size * codes.dtype.itemsize
            cands = [(f"pallas_{form}" + ("_interpret" if impl != "pallas" else ""), impl, form)
                     for form in forms] + [("xla_reference", "xla", None)]
            ref = None
            for name, implementation, form in cands:
                fn = jax.jit(lambda *a, i=implementation, f=form: pq_scores(
                    *a, return_stats=True, implementation=i, backend=f))
                t, first = time_fn(fn, q, cb, codes, lengths, warmup=args.warmup,
                                   repeats=args.repeats)
                z = np.asarray(fn(q, cb, codes, lengths)[0])
                ref = z if ref is None else ref
                rows.append(dict(op="pq_scores", tokens=tokens, impl=name,
                                 config=f"g={groups} c={cents}", time_us=t * 1e6,
                                 first_call_s=first, bytes=code_bytes,
                                 GBps=code_bytes / t / 1e9,
                                 frac_of_copy_bw=code_bytes / t / dev_bw,
                                 time_vs_dense=t / t_dense,
                                 max_abs_diff=float(np.max(np.abs(z - ref)))))
                log(f"pq    T={tokens:>7} {name:<16} g={groups:<3} c={cents:<5} "
                    f"{t*1e6:10.1f} us  {code_bytes/t/1e9:8.1f} GB/s  x{t/t_dense:.2f} of dense")
    return rows


def markdown(result) -> str:
    """The Markdown report: the paged-attention table, then the PQ-scoring one."""
    lines = [f"# Kernel benchmark ({result['backend']}: {result['device']})", "",
             f"Command: `{result['command']}`  ", f"jax {result['jax_version']}; "
             f"copy bandwidth {result['copy_bandwidth_GBps']:.1f} GB/s (x+1 over "
             f"{result['copy_bytes'] / 2**20:.0f} MiB); median of {result['repeats']} runs.", ""]
    if result.get("note"):
        lines += [f"> {result['note']}", ""]
    cfg = result["config"]
    nominal = result.get("nominal_bandwidth_GBps")
    lines += [f"## Paged decode attention (H_kv={cfg['kv_heads']}, G={cfg['group']}, D={cfg['head_dim']}, "
              f"page={cfg['page_size']})", "",
              "bytes = K+V of the attended tokens; time_vs_dense = time / dense XLA attention "
              f"over the same tokens; nominal bandwidth {nominal or '-'} GB/s.", ""]
    rows = []
    for r in result["paged"]:
        if "error" in r:
            rows.append([r["tokens"], r["batch"], r["dtype"], r["impl"], f"failed: {r['error']}"] + [""] * 4)
            continue
        rows.append([r["tokens"], r.get("batch", cfg["batch"]), r.get("dtype", "bfloat16"), r["impl"],
                     f"{r['time_us']:.1f}", f"{r['GBps']:.1f}", f"{r['frac_of_copy_bw']:.1%}",
                     number(r.get("frac_of_nominal_bw"), "{:.1%}", missing=""),
                     number(r.get("time_vs_dense"), missing="")])
    lines += table(["tokens", "batch", "dtype", "impl", "time (us)", "GB/s", "frac of copy bw", "frac of nominal bw",
                    "time vs dense"], rows, align="rrllrrrrr")
    lines += ["", f"## PQ scoring with softmax stats (D=128, B={cfg['pq_batch']}, "
              f"H_kv={cfg['kv_heads']}, G={cfg['group']})", "",
              "bytes = PQ codes read (dense row: bf16 K read); time_vs_dense = time / dense "
              "q.K (+ max/sum) over bf16 keys.", ""]
    lines += table(["tokens", "impl", "config", "time (us)", "GB/s", "frac of copy bw", "time vs dense"],
                   [[r["tokens"], r["impl"], r["config"], f"{r['time_us']:.1f}", f"{r['GBps']:.2f}",
                     f"{r['frac_of_copy_bw']:.1%}", f"{r['time_vs_dense']:.2f}"] for r in result["pq"]],
                   align="rllrrrr")
    return "\n".join(lines) + "\n"


def main(argv=None):
    """Run the kernel benchmark; returns the result dict (also written to --out and .json)."""
    ap = argparse.ArgumentParser(prog="python -m research.bench_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None,
                    help="Markdown output path (default docs/results/kernels_<backend>.md)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, Pallas in interpret mode (both kernel forms on CPU)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help=f"attended tokens per KV head (default {list(DEFAULT_TOKENS)})")
    ap.add_argument("--model", default=None,
                    help="take KV heads, query heads per KV head and head dim from a model (e.g. llama-3.1-8b)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="batches of the paged kernel (PQ: the first)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"],
                    help="K/V dtypes of the paged kernel")
    ap.add_argument("--pq-tokens", type=int, nargs="+", default=None, help="PQ scoring token counts (default --tokens)")
    ap.add_argument("--nominal-bandwidth", type=float, default=None,
                    help="the device's nominal HBM bandwidth in bytes/s (default: kvjax.evals.plan's figure for the device)")
    ap.add_argument("--max-gib", type=float, default=30.0, help="skip cells whose K/V exceed this many GiB")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--pages-per-block", type=int, default=None)
    ap.add_argument("--pq", nargs="*", default=None,
                    help=f"PQ configs gxc at D=128 (default {list(DEFAULT_PQ)})")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--copy-mib", type=int, default=1024,
                    help="size of the bandwidth-probe array (MiB)")
    args = ap.parse_args(argv)

    if args.model:
        from kvjax.models import model_architecture

        config, _ = model_architecture(args.model)
        args.kv_heads, args.group, args.head_dim = config.num_kv_heads, config.group_size, config.head_dim
    backend = _platform()
    note = ""
    if args.smoke:
        args.tokens = args.tokens or [200]
        args.pq = args.pq if args.pq is not None else ["16x256"]
        args.batch, args.kv_heads, args.group, args.head_dim = [1], 2, 2, 64
        args.page_size = 16
        args.warmup, args.repeats, args.copy_mib = 0, 1, 16
        impl = "pallas_interpret" if backend == "cpu" else "pallas"
        forms = ["tpu", "gpu"] if backend == "cpu" else [backend]
        note = "smoke run: tiny sizes" + (", Pallas in interpret mode (timings meaningless)"
                                          if backend == "cpu" else "")
    elif backend in ("tpu", "gpu"):
        impl, forms = "pallas", [backend]
    else:
        impl, forms = "xla", []
        note = (f"Pallas timings need an accelerator (jax.default_backend() = {backend!r}); "
                "only the XLA rows were timed.")
        print(note, file=sys.stderr)
        args.tokens = args.tokens or [4096, 16384]
    args.tokens = args.tokens or list(DEFAULT_TOKENS)
    args.pq = args.pq if args.pq is not None else list(DEFAULT_PQ)
    out = args.out or os.path.join(
        "docs", "results", f"kernels_{backend}{'_smoke' if args.smoke else ''}.md")

    def log(msg):
        print(msg, flush=True)

    if args.nominal_bandwidth is None:
        from kvjax.evals.plan import TARGETS

        kind = jax.devices()[0].device_kind.upper()
        args.nominal_bandwidth = next((t.bandwidth for t in TARGETS.values() if t.platform == "cuda"
                                       and t.name.upper() in kind), None)
    copy_bytes = args.copy_mib * 2**20
    dev_bw = copy_bandwidth(copy_bytes, args.repeats)
    log(f"device: {jax.devices()[0].device_kind}; copy bandwidth {dev_bw/1e9:.1f} GB/s")
    # the paged kernel's Mosaic GPU form beside the Triton one, wherever a GPU form runs (interpreted on CPU)
    paged_forms = forms + (["mosaic_gpu"] if "gpu" in forms else [])
    paged = bench_paged(args, paged_forms, impl, dev_bw, log)
    pq = bench_pq(args, forms, impl, dev_bw, log)
    result = dict(
        command="python -m research.bench_kernels " + " ".join(argv if argv is not None
                                                            else sys.argv[1:]),
        backend=backend, device=jax.devices()[0].device_kind, jax_version=jax.__version__,
        python=platform.python_version(), copy_bandwidth_GBps=dev_bw / 1e9,
        copy_bytes=copy_bytes, repeats=args.repeats, warmup=args.warmup, note=note,
        nominal_bandwidth_GBps=args.nominal_bandwidth / 1e9 if args.nominal_bandwidth else None,
        config=dict(batch=args.batch, pq_batch=args.batch[0], kv_heads=args.kv_heads, group=args.group,
                    head_dim=args.head_dim, page_size=args.page_size,
                    pages_per_block=args.pages_per_block, dtypes=args.dtypes),
        paged=paged, pq=pq)
    write_report(out, markdown(result), result)
    log(f"wrote {out} and {os.path.splitext(out)[0]}.json")
    return result


if __name__ == "__main__":
    main()
