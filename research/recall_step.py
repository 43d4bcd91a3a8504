"""Where a decode step's host recall time goes: the structure of HeteroCache's / SyncKV's recall, isolated.

On an H200 a decode step with recall cost 5.5-8.5 ms more than one without (docs/RESULTS.md, "On a GPU"), and
no device time was left to profile why. This script times, in one jitted loop of ``--steps`` decode
steps over ``--layers`` synthetic layers (two bf16 products of Qwen2.5-0.5B's MLP shapes each, as a stand-in
for a layer's compute), the ways a layer can recall ``--rows`` token rows for each of ``--heads`` follower heads
from a ``pinned_host`` copy of a ``--length``-token prompt and write them into a device page pool:

* ``none``: compute only (the baseline);
* ``cond``: every ``--every`` steps, inside a per-layer ``lax.cond`` (what kvjax's recall did before its one-token step lost
  its conditionals): the gather, the copy and the scatter all in the branch;
* ``always``: the same recall and scatter unconditionally, every step (no ``cond``);
* ``prefetch``: issued unconditionally at layer ``l`` of step ``t`` and scattered at layer ``l`` of step ``t+1``
  (the prefetch pattern of :mod:`kvjax.host_tier`: a whole step of compute between issue and use);
* ``cond-pages``: as ``cond`` with the same number of rows as whole 16-token pages;
* ``cond-empty``: a per-layer ``lax.cond`` every step whose taken branch (every ``--every`` steps) only copies one
  device row: the cost of the conditional itself, without a transfer;
* ``spread``: no ``cond``; every step each layer recalls a ``1 / --every`` slice of its rows (slice
  ``step % every``) and scatters it: the bytes of ``cond``, spread evenly over the steps;
* ``gather-alone``: one layer's recall by itself, outside any loop (the raw gather + copy);
* ``scatter-alone``: writing one layer's recalled rows into its page pool, by itself;
* ``dep-cond``, ``dep-spread``, ``dep-always``, ``dep-prefetch``: the same four schedules with indices that
  depend on the layer's compute in the same step (as a leader's choice does in the real decode: the values
  stay those of the fixed indices, but XLA cannot know them before the layer's products). ``dep-prefetch``
  is the one-step-ahead plan: indices from step ``t``'s compute, gathered during step ``t``, scattered at step
  ``t+1``. If ``spread`` is cheap and ``dep-spread`` is not, the dependency (a device -> host -> device round
  trip per layer) is the cost; if ``dep-prefetch`` then costs about what ``prefetch`` does, issuing recalls a
  step ahead removes it.
* ``dep-spread-ahead``, ``dep-pipelined``: ``spread``'s bytes with indices from the step's compute.
  ``dep-spread-ahead`` gathers them in the step that computes them and writes them at the layer in the next
  step (kvjax's ``recall_schedule="ahead"``); ``dep-pipelined`` carries the indices to the next step, gathers
  there at the layer's start and writes the rows the step after (a two-step pipeline: the gather's inputs are
  ready when the step begins). On an H100 the real decode's ``ahead`` did not overlap its recall (docs/RESULTS.md,
  "On a GPU: recall schedules and profiles"): if ``dep-pipelined`` costs clearly less than ``dep-spread-ahead``, the pipeline is
  the fix to build.

Every variant is timed twice (``--schedulers``): compiled with kvjax's decode options (``kvjax``:
:data:`kvjax.decoding.GPU_DECODE_COMPILER_OPTIONS` on a GPU, XLA:GPU's latency-hiding scheduler) and with XLA's
defaults (``xla-default``), under which XLA:GPU schedules a host computation's start and done back to back (found by
compiling for an H100 without one: ``python -m kvjax.evals.gpu_schedule``). The GPU timings before then used XLA's defaults.

Each row reports ms per step, the extra over ``none``, rows and MiB moved per step and the rate of the extra.
If ``always`` costs about ``every`` times ``cond``'s extra and ``prefetch`` costs as much as ``always``, the
transfer is not overlapping anything and its own speed is the limit; if ``prefetch`` is much cheaper than
``always``, the ``cond`` (no overlap across it) is. On a CPU host memory is the same RAM, so the figures here
show the structure and the host-side gather's cost, not a link.

Run: ``python -m research.recall_step [--out FILE]`` (the ``recall-micro`` stage of ``scripts/gpu_checks.sh`` on a
GPU).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.decoding import decode_compiler_options
from kvjax.host_tier import offload, recall, recall_pages, write_recalled
from kvjax.reports import table as markdown_table
from kvjax.reports import write_report
from research.host_gather import best_and_median

PAGE = 16


def build(args):
    """Weights, one host copy per layer, page pools and the recall indices (fixed, random, sorted)."""
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16
    L, H, S, D, R = args.layers, args.heads, args.length, args.head_dim, args.rows
    w1 = jnp.asarray(rng.standard_normal((L, args.hidden, args.ffn)) * args.hidden**-0.5, dt)
    w2 = jnp.asarray(rng.standard_normal((L, args.ffn, args.hidden)) * args.ffn**-0.5, dt)
    kv = jnp.asarray(rng.standard_normal((1, H, S, D)), dt)
    heads = [(0, h) for h in range(H)]
    hosts = [offload(kv, kv, heads, page_size=PAGE) for _ in range(L)]
    pages_per_head = -(-R // PAGE)
    pool = jnp.zeros((H * pages_per_head, PAGE, D), dt)
    table = jnp.arange(H * pages_per_head, dtype=jnp.int32).reshape(1, H, pages_per_head)
    idx = jnp.asarray(np.sort(np.stack([rng.choice(S, R, replace=False) for _ in range(H)]), axis=1), jnp.int32)
    pages = jnp.asarray(np.sort(np.stack([rng.choice(S // PAGE, R // PAGE, replace=False) for _ in range(H)]), axis=1),
                        jnp.int32)
    return w1, w2, hosts, pool, table, idx, pages, heads


def make_loop(variant: str, args, hosts, table, heads, options: dict):
    """A jitted ``(w1, w2, pools, idx, pages) -> (x, pools)`` running ``args.steps`` decode steps, compiled with the
    XLA ``options``."""
    H, R, L = args.heads, args.rows, args.layers
    count = jnp.full((H,), R, jnp.int32)
    part = -(-R // args.every)  # rows per step of ``spread``
    part_count = jnp.full((H,), part, jnp.int32)
    page_count = jnp.full((H,), R // PAGE, jnp.int32)
    schedule = variant.removeprefix("dep-")  # dep-X: schedule X, indices from the step's compute

    def fetch(layer, ids, pages):
        if schedule == "cond-pages":
            rows = recall_pages(hosts[layer], pages, page_count)
        else:
            rows = recall(hosts[layer], ids, count)
        return rows.k, rows.v

    def scatter(pool_k, pool_v, rk, rv):
        return write_recalled(pool_k, pool_v, table, rk, rv, heads, 0, count)

    def spread_slice(ids, step):  # the ``part`` indices ``spread`` moves in ``step``; their region offset
        start = jnp.minimum((step % args.every) * part, R - part)
        return lax.dynamic_slice_in_dim(ids, start, part, axis=1), start

    def layer_fn(layer, x, pk, pv, carry_kv, step, ids, pages, w1, w2):
        if schedule in ("spread-ahead", "pipelined"):  # the rows gathered in the previous step land first
            pk, pv = write_recalled(pk, pv, table, carry_kv[0], carry_kv[1], heads, carry_kv[2], part_count)
        if schedule == "pipelined":  # then the indices the previous step chose are gathered, to land next step
            rows = recall(hosts[layer], carry_kv[3], part_count)
            carry_kv = (rows.k, rows.v, carry_kv[4], carry_kv[3], carry_kv[4])
        x = jnp.tanh(x @ w1[layer]) @ w2[layer]
        x = x + (pk.astype(jnp.float32).sum() + pv.astype(jnp.float32).sum()).astype(x.dtype) * 1e-6  # use the pool
        if variant.startswith("dep-"):  # indices known only after this layer's compute; their values do not change
            shift = (x[0, 0] > 1e30).astype(jnp.int32)
            ids, pages = ids + shift, pages + shift
        if schedule in ("cond", "cond-pages"):
            pk, pv = lax.cond(step % args.every == 0, lambda p: scatter(*p, *fetch(layer, ids, pages)), lambda p: p,
                              (pk, pv))
        elif schedule == "cond-empty":
            pk, pv = lax.cond(step % args.every == 0, lambda p: (p[0].at[0].set(p[0][1]), p[1]), lambda p: p, (pk, pv))
        elif schedule == "spread":
            start = (step % args.every) * part
            rows = recall(hosts[layer], lax.dynamic_slice_in_dim(ids, jnp.minimum(start, R - part), part, axis=1),
                          part_count)
            pk, pv = write_recalled(pk, pv, table, rows.k, rows.v, heads, jnp.minimum(start, R - part), part_count)
        elif schedule == "always":
            pk, pv = scatter(pk, pv, *fetch(layer, ids, pages))
        elif schedule == "prefetch":
            pk, pv = scatter(pk, pv, *carry_kv)  # issued in the previous step
            carry_kv = fetch(layer, ids, pages)
        elif schedule == "spread-ahead":  # gathered now, written by the next step's call (above)
            chosen, start = spread_slice(ids, step)
            rows = recall(hosts[layer], chosen, part_count)
            carry_kv = (rows.k, rows.v, start)
        elif schedule == "pipelined":  # chosen now, gathered by the next step's call, written the step after
            chosen, start = spread_slice(ids, step)
            carry_kv = (carry_kv[0], carry_kv[1], carry_kv[2], chosen, start)
        return x, pk, pv, carry_kv

    def run(w1, w2, pools_k, pools_v, ids, pages):
        x0 = jnp.ones((1, args.hidden), jnp.bfloat16)
        if schedule in ("spread-ahead", "pipelined"):  # rows (and indices) of one spread step, region offset 0
            rows = tuple(jnp.zeros((H, part, args.head_dim), jnp.bfloat16) for _ in range(2))
            zero = jnp.zeros((), jnp.int32)
            empty = (*rows, zero) if schedule == "spread-ahead" else (*rows, zero, ids[:, :part], zero)
        else:
            empty = tuple(jnp.zeros((H, R, args.head_dim), jnp.bfloat16) for _ in range(2))
        carry0 = (x0, pools_k, pools_v, tuple(empty for _ in range(L)))

        def body(step, carry):
            x, pks, pvs, pending = carry
            pks, pvs, pending = list(pks), list(pvs), list(pending)
            for layer in range(L):
                x, pks[layer], pvs[layer], pending[layer] = layer_fn(layer, x, pks[layer], pvs[layer], pending[layer],
                                                                     step, ids, pages, w1, w2)
            return x, tuple(pks), tuple(pvs), tuple(pending)

        x, pks, pvs, _ = lax.fori_loop(0, args.steps, body, carry0)
        return x, pks, pvs

    return jax.jit(run, compiler_options=options or None)


HEAD = ["variant", "XLA options", "ms/step", "extra ms/step", "rows moved/step", "MiB moved/step", "GB/s of the extra"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.recall_step", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=2, help="follower heads per layer")
    p.add_argument("--length", type=int, default=30720, help="prompt tokens in each host copy")
    p.add_argument("--rows", type=int, default=3840, help="rows recalled per head (SyncKV at 25%% of 30,720: 3,840)")
    p.add_argument("--every", type=int, default=5, help="steps between recalls in the cond variants (SyncKV's m)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--ffn", type=int, default=4864)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="none,cond,cond-empty,spread,always,prefetch,cond-pages,"
                                         "dep-cond,dep-spread,dep-always,dep-prefetch,dep-spread-ahead,dep-pipelined")
    p.add_argument("--schedulers", default="kvjax,xla-default",
                   help="compile every variant with kvjax's decode options (kvjax) and/or XLA's defaults (xla-default)")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = p.parse_args(argv)
    schedulers = {"kvjax": decode_compiler_options(), "xla-default": {}}
    unknown = set(args.schedulers.split(",")) - set(schedulers)
    if unknown:
        p.error(f"--schedulers: unknown {sorted(unknown)}; choose from {sorted(schedulers)}")
    if args.rows % PAGE or args.length % PAGE:
        p.error(f"--rows and --length must be multiples of {PAGE}")

    w1, w2, hosts, pool, table, idx, pages, heads = build(args)
    pools = tuple(pool for _ in range(args.layers))
    rows_per_recall = args.heads * args.rows  # one layer
    mib_per_recall = 2 * rows_per_recall * args.head_dim * 2 / 2**20  # K+V, bf16
    lines = [f"# Recall structure on {jax.devices()[0].device_kind} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ})",
             "",
             f"Command: `python -m research.recall_step --layers {args.layers} --heads {args.heads} "
             f"--length {args.length} --rows {args.rows} --every {args.every} --steps {args.steps} --schedulers "
             f"{args.schedulers}`; jax {jax.__version__}, {platform.machine()}; best of {args.repeats}. XLA options: "
             + "; ".join(f"{name} = {schedulers[name] or 'none'}" for name in args.schedulers.split(",")) + ".",
             ""]
    rows = []

    def add(cells):
        rows.append(cells)
        print(markdown_table(HEAD, [cells])[-1], flush=True)

    for scheduler in args.schedulers.split(","):
        base = None
        for variant in args.variants.split(","):
            loop = make_loop(variant, args, hosts, table, heads, schedulers[scheduler])
            ms = best_and_median(loop, w1, w2, pools, pools, idx, pages, repeats=args.repeats)[0] * 1e3 / args.steps
            base = ms if variant == "none" else base
            per_step = {"none": 0.0, "cond-empty": 0.0, "always": 1.0, "prefetch": 1.0}.get(
                variant.removeprefix("dep-"), 1.0 / args.every) * args.layers
            mib = per_step * mib_per_recall
            extra = ms - base if base is not None else float("nan")
            rate = mib * 2**20 / (extra * 1e-3) / 1e9 if extra > 0 and mib else float("nan")
            add([variant, scheduler, f"{ms:.3f}", f"{extra:.3f}", f"{per_step * rows_per_recall:.0f}", f"{mib:.2f}",
                 f"{rate:.2f}"])
    count = jnp.full((args.heads,), args.rows, jnp.int32)
    alone = jax.jit(lambda ids: recall(hosts[0], ids, count))
    ms = best_and_median(alone, idx, repeats=max(args.repeats, 10))[0] * 1e3
    add(["gather-alone (one layer, outside the loop)", "", f"{ms:.3f}", "", rows_per_recall, f"{mib_per_recall:.2f}",
         f"{mib_per_recall * 2**20 / (ms * 1e-3) / 1e9:.2f}"])
    recalled = jnp.ones((args.heads, args.rows, args.head_dim), jnp.bfloat16)
    scatter = jax.jit(lambda pk, pv, rk, rv: write_recalled(pk, pv, table, rk, rv, heads, 0, count))
    ms = best_and_median(scatter, pool, pool, recalled, recalled, repeats=max(args.repeats, 10))[0] * 1e3
    add(["scatter-alone (one layer's rows into its page pool, on the device)", "", f"{ms:.3f}", "", rows_per_recall,
         f"{mib_per_recall:.2f}", ""])
    if args.out:
        write_report(args.out, "\n".join(lines + markdown_table(HEAD, rows, align="llrrrrr")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
