"""Decode-step matrix-vector products of one model's layers, f32 vs bf16, as achieved read bandwidth.

A decode step of a small model at short context is bound by reading every weight once, so bf16
weights should halve the step time. This benchmark isolates that part of the step to show
whether the backend's matrix-vector product reaches the memory bandwidth at each dtype: for the
layer shapes of ``--model`` (the fused ``qkv_proj``, ``o_proj``, fused ``gate_up_proj`` and
``down_proj`` of every layer, HF's ``weight[out, in]`` layout as in :mod:`kvjax.models.llama`; embeddings,
norms and attention left out) it runs ``--steps`` chained products (batch 1, each layer's output
feeding the next, like a decode step) inside one jitted ``lax.fori_loop``, for

* ``f32 dot``: f32 weights, ``lax.dot_general`` (kvjax's float32 path),
* ``bf16 dot``: bf16 weights and activations, ``lax.dot_general`` (kvjax's bfloat16 path),
* ``bf16 dot → f32``: bf16 operands, ``preferred_element_type=float32``,
* ``bf16 → f32, f32 dot``: the weights converted to f32 inside the step, then an f32 product,
* ``f32 multiply-reduce`` / ``bf16 multiply-reduce (f32)``: no dot at all: ``(w * x).sum(-1)`` as one
  elementwise-and-reduce fusion (bf16 weights converted to f32 inside it),

and reports ms per step, the weight bytes read per step, the achieved GB/s and the ratio of the
step time to its bandwidth limit (bytes / the machine's read bandwidth, measured in the same run
by ``bench_machine.worker_bandwidth``, as in the other benchmarks). Random weights; the numbers do not depend on
their values. ``XLA_FLAGS`` from the environment apply (e.g. ``--xla_cpu_use_onednn=true``).

Usage::

    kvjax bench matvec                       # shapes of qwen2.5-coder-0.5b
    kvjax bench matvec --model smollm2-135m --steps 20
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

from kvjax.reports import table, write_report

DEFAULT_OUT = os.path.join("docs", "results", "matvec_bf16.md")
MIB = 1024 ** 2


def layer_shapes(config) -> list[tuple[str, int, int]]:
    """(name, out, in) of the projections of one decoder layer, in forward order."""
    c = config
    return [
        ("qkv_proj", (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        ("o_proj", c.hidden_size, c.num_heads * c.head_dim),
        ("gate_up_proj", 2 * c.intermediate_size, c.hidden_size),
        ("down_proj", c.hidden_size, c.intermediate_size),
    ]


def _config(model: str):
    from kvjax.models import resolve_model_path
    from kvjax.models.config import load_hf_config
    from kvjax.models.weights import open_gguf, gguf_config

    path = resolve_model_path(model)
    return gguf_config(open_gguf(path), model) if path.endswith(".gguf") else load_hf_config(path)


def _variants():
    import jax
    import jax.numpy as jnp

    contract = (((0,), (1,)), ((), ()))  # x[in] . weight[out, in] -> [out]
    return {
        "f32 dot": (jnp.float32, lambda x, w: jax.lax.dot_general(x, w, contract)),
        "bf16 dot": (jnp.bfloat16, lambda x, w: jax.lax.dot_general(x, w, contract)),
        "bf16 dot → f32": (jnp.bfloat16, lambda x, w: jax.lax.dot_general(
            x, w, contract, preferred_element_type=jnp.float32).astype(x.dtype)),
        "bf16 → f32, f32 dot": (jnp.bfloat16, lambda x, w: jax.lax.dot_general(
            x.astype(jnp.float32), w.astype(jnp.float32), contract).astype(x.dtype)),
        "f32 multiply-reduce": (jnp.float32, lambda x, w: (w * x[None, :]).sum(axis=1)),
        "bf16 multiply-reduce (f32)": (jnp.bfloat16, lambda x, w: (
            w.astype(jnp.float32) * x.astype(jnp.float32)[None, :]).sum(axis=1).astype(x.dtype)),
    }


def time_variant(product, dtype, shapes, num_layers: int, steps: int, repeats: int, seed: int) -> dict:
    """Best-of-``repeats`` ms per step of ``steps`` chained layer products in one jitted loop."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    weights = tuple(
        jnp.asarray((rng.standard_normal((o, i), dtype=np.float32) * 0.02)).astype(dtype)
        for _ in range(num_layers) for _, o, i in shapes
    )
    hidden = shapes[0][2]
    x0 = jnp.asarray(rng.standard_normal(hidden, dtype=np.float32)).astype(dtype)

    def run(x, ws):
        def step(_, x):
            for li in range(num_layers):
                wqkv, wo, wgu, wd = ws[4 * li: 4 * li + 4]
                a = product(x, wqkv)[: wo.shape[1]]  # the attention output has the width of the q part
                x = x + product(a, wo)
                gu = product(x, wgu)
                half = gu.shape[0] // 2
                x = x + product(jax.nn.silu(gu[:half]) * gu[half:], wd) * 0.01
            return x / (1 + jnp.abs(x).max())  # keeps values bounded over the steps

        return jax.lax.fori_loop(0, steps, step, x)

    fn = jax.jit(run)
    fn(x0, weights).block_until_ready()  # compile + warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x0, weights).block_until_ready()
        best = min(best, time.perf_counter() - t)
    nbytes = sum(w.nbytes for w in weights)
    return {"ms_per_step": 1000 * best / steps, "weight_bytes": nbytes}


def build_parser() -> argparse.ArgumentParser:
    """Options of ``kvjax bench matvec``."""
    p = argparse.ArgumentParser(prog="kvjax bench matvec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="ready model or path whose layer shapes are used")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the model's)")
    p.add_argument("--steps", type=int, default=10, help="chained steps per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (best is kept)")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="array size of the bandwidth measurement (MiB)")
    p.add_argument("--bandwidth-repeats", type=int, default=5, help="bandwidth measurement runs (best reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help="Markdown report (JSON next to it)")
    return p


def main(argv=None) -> int:
    """``kvjax bench matvec``: time each variant, write the Markdown + JSON report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if (args.steps < 1 or args.repeats < 1 or args.bandwidth_mib < 1 or args.bandwidth_repeats < 1
            or (args.layers is not None and args.layers < 1)):
        raise ValueError("--steps, --repeats, --bandwidth-mib, --bandwidth-repeats and --layers must be >= 1")
    import jax

    from kvjax.evals.bench_machine import worker_bandwidth

    config = _config(args.model)
    layers = args.layers or config.num_layers
    shapes = layer_shapes(config)
    start = time.perf_counter()
    measured = worker_bandwidth(args)
    bandwidth = measured["machine"]
    print(f"[matvec] read bandwidth {bandwidth / 1e9:.1f} GB/s ({measured['machine_source']})", file=sys.stderr, flush=True)
    rows = []
    for name, (dtype, product) in _variants().items():
        r = time_variant(product, dtype, shapes, layers, args.steps, args.repeats, args.seed)
        limit_ms = 1000 * r["weight_bytes"] / bandwidth
        r |= {"variant": name, "gb_s": r["weight_bytes"] / (r["ms_per_step"] / 1000) / 1e9,
              "limit_ms": limit_ms, "over_limit": r["ms_per_step"] / limit_ms}
        rows.append(r)
        print(f"[matvec] {name}: {r['ms_per_step']:.2f} ms/step, {r['gb_s']:.1f} GB/s, "
              f"{r['over_limit']:.2f}x limit", file=sys.stderr, flush=True)
    report = {
        "command": " ".join(["kvjax bench matvec", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "jax": jax.__version__, "backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "model": args.model, "layers": layers, "shapes": shapes, "steps": args.steps,
        "bandwidth": measured, "rows": rows, "total_s": time.perf_counter() - start,
    }
    f32 = next(r for r in rows if r["variant"] == "f32 dot")
    lines = [
        "# Decode matrix-vector products, f32 vs bf16",
        "",
        f"Layer shapes of `{args.model}` ({', '.join(f'{n} {o}×{i}' for n, o, i in shapes)}) × {layers} layers, "
        f"batch 1, {args.steps} chained steps in one jitted `lax.fori_loop`, best of {args.repeats}.",
        f"jax {report['jax']} ({report['backend']}), XLA_FLAGS `{report['xla_flags'] or '(none)'}`, {report['date']}.",
        f"Command: `{report['command']}`. Machine read bandwidth {bandwidth / 1e9:.1f} GB/s (best of jitted `jnp.sum` "
        f"{measured['jax_sum'] / 1e9:.1f}, numpy `a.sum()` {measured['numpy_sum'] / 1e9:.1f}, numpy in "
        f"{measured['threads']} threads {measured['numpy_threaded_sum'] / 1e9:.1f} GB/s over a {args.bandwidth_mib} MiB "
        f"f32 array, best of {args.bandwidth_repeats}).",
        "",
    ]
    lines += table(["variant", "weight MiB read per step", "ms/step", "GB/s achieved", "limit ms/step", "÷ limit",
                    "time ÷ f32 dot"],
                   [[r["variant"], f"{r['weight_bytes'] / MIB:.0f}", f"{r['ms_per_step']:.2f}", f"{r['gb_s']:.1f}",
                     f"{r['limit_ms']:.2f}", f"{r['over_limit']:.2f}", f"{r['ms_per_step'] / f32['ms_per_step']:.2f}"]
                    for r in rows], align="l" + "r" * 6)
    md = "\n".join(lines) + "\n"
    write_report(args.out, md, report)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
