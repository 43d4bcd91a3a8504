"""HCAttention's key encoding on this machine: a dot against the elementwise sum ``encode_keys`` uses, per block size.

:func:`kvjax.pq_codebooks.encode_keys` scores each key group against its ``c`` centroids as ``||C||^2 - 2 k.C``,
with ``k.C`` the ``d = D / g`` products summed elementwise (``_dots``), over blocks of tokens whose distance block
stays under ``block_bytes``. This benchmark times one layer's encoding of random keys ``[rows, H_kv, tokens, D]``
(``D / g`` dims per group, ``c`` centroids per group, both from a seed) in two forms:

* ``dot``: ``encode_keys(..., products="dot")``, ``k.C`` as ``einsum(..., precision=HIGHEST)`` (a dot of ``d``
  terms per output);
* ``sum``: ``encode_keys`` as it encodes by default;

for each ``--block-mib``, best of ``--repeats`` runs after a compiling one, and counts the codes that differ from
the dot form at the largest block (the two forms round ``k.C`` differently in the last bit, which moves near-ties).

Usage::

    python -m research.bench_pq_encode                                  # g = 32, c = 256, 4 rows of 4096 tokens
    python -m research.bench_pq_encode --groups 16 --centroids 8192 --tokens 512
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import jax
import numpy as np

from kvjax.reports import table, write_report

DEFAULT_OUT = "docs/results/hcattention_encode/encode_cpu.md"


def best_seconds(fn, repeats: int) -> tuple[float, np.ndarray]:
    """Best wall time of ``repeats`` calls of ``fn`` after a first (compiling) one, and its output."""
    out = np.asarray(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = np.asarray(fn())
        best = min(best, time.perf_counter() - t0)
    return best, out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m research.bench_pq_encode", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4, help="batch rows")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (the default model's 2)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (the default model's 64)")
    p.add_argument("--tokens", type=int, default=4096, help="keys per (row, KV head)")
    p.add_argument("--groups", type=int, default=32, help="groups g (D / g dims each)")
    p.add_argument("--centroids", type=int, default=256, help="centroids c per group")
    p.add_argument("--block-mib", default="512,8", help="comma-separated distance block sizes (MiB)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell (best is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help="Markdown report (JSON next to it)")
    return p


def main(argv=None) -> int:
    """Time both forms at every block size; write the Markdown + JSON report."""
    from kvjax.pq_codebooks import encode_keys

    args = build_parser().parse_args(argv)
    blocks = sorted({int(b) for b in args.block_mib.split(",")}, reverse=True)
    if not blocks or blocks[-1] < 1:
        raise SystemExit(f"--block-mib needs sizes >= 1, got {args.block_mib!r}")
    if args.groups < 1 or args.head_dim % args.groups:
        raise SystemExit(f"--groups must divide --head-dim {args.head_dim}, got {args.groups}")
    kk, kc = jax.random.split(jax.random.PRNGKey(args.seed))
    k = jax.random.normal(kk, (args.rows, args.kv_heads, args.tokens, args.head_dim))
    cb = jax.random.normal(kc, (args.kv_heads, args.groups, args.centroids, args.head_dim // args.groups))
    rows, reference = [], None
    for form in ("dot", "sum"):
        for mib in blocks:
            sec, codes = best_seconds(lambda: encode_keys(k, cb, block_bytes=mib * 2**20, products=form),
                                      args.repeats)
            if reference is None:
                reference = codes
            rows.append({"form": form, "block_mib": mib, "seconds": sec,
                         "codes_differing": int((codes != reference).sum()), "codes": int(codes.size)})
            print(f"{form} {mib} MiB: {sec:.3f} s, {rows[-1]['codes_differing']} codes differ", file=sys.stderr)
    base = rows[0]["seconds"]
    command = "python -m research.bench_pq_encode " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [f"# PQ key encoding: dot against elementwise sum ({jax.default_backend()})", "",
          f"- command: `{command.strip()}`",
          f"- jax {jax.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), "
          f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
          f"- keys `[{args.rows}, {args.kv_heads}, {args.tokens}, {args.head_dim}]`, g = {args.groups} "
          f"({args.head_dim // args.groups} dims per group), c = {args.centroids}; random (seed {args.seed}); one "
          f"layer's encoding, best of {args.repeats} runs after a compiling one",
          "- codes differing: against the dot form at the largest block", ""]
    md += table(["form", "block MiB", "s per layer", "speed-up vs dot at the largest block", "codes differing"],
                [[r["form"], r["block_mib"], f"{r['seconds']:.3f}", f"{base / r['seconds']:.1f}×",
                  f"{r['codes_differing']} of {r['codes']:,}"] for r in rows], align="lrrrr")
    write_report(args.out, "\n".join(md) + "\n", {"args": vars(args), "jax": jax.__version__, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
