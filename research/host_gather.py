"""One layer's host-tier recall at the sizes of the H200 run (docs/RESULTS.md, "On a GPU"), on this machine.

HeteroCache and SyncKV at 25% of a 30,720-token prompt refresh about 2 follower heads per layer of Qwen2.5
(45 followers over 24 layers) with ~3,072 (SyncKV) or ~6,144 (HeteroCache) token rows each, bf16, D = 64. This
times :func:`kvjax.host_tier.recall` (scattered token rows, what the methods use) against
:func:`kvjax.host_tier.recall_pages` (the same number of rows as whole 16-token pages), jitted, best and median
of 20 calls. On a CPU host memory is the same RAM: this measures the host-side gather alone, not the link.

Run: ``python -m research.host_gather`` (a Markdown table on stdout).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.host_tier import offload, recall, recall_pages
from kvjax.reports import table

LENGTH, HEAD_DIM, HEADS, PAGE = 30720, 64, 2, 16


def best_and_median(fn, *args, repeats: int = 20):
    """(best, median) seconds of ``fn(*args)`` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times), float(np.median(times))


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m research.host_gather", description=__doc__.splitlines()[0]).parse_args(argv)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((1, HEADS, LENGTH, HEAD_DIM)), jnp.bfloat16)
    host = offload(k, k, [(0, h) for h in range(HEADS)], page_size=PAGE)
    print(f"jax {jax.__version__} ({jax.default_backend()}); {HEADS} heads, prompt {LENGTH}, D={HEAD_DIM}, bf16\n")
    cells = []
    for rows in (3072, 6144):
        mib = 2 * HEADS * rows * HEAD_DIM * 2 / 2**20
        idx = jnp.asarray(np.sort(rng.choice(LENGTH, (HEADS, rows)), axis=1), jnp.int32)
        pages = jnp.asarray(np.sort(np.stack([rng.choice(LENGTH // PAGE, rows // PAGE, replace=False)
                                              for _ in range(HEADS)]), axis=1), jnp.int32)
        for name, fn, ids, count in (
                ("token rows", jax.jit(recall), idx, rows),
                (f"{PAGE}-token pages", jax.jit(recall_pages), pages, rows // PAGE)):
            best, median = best_and_median(fn, host, ids, jnp.full((HEADS,), count, jnp.int32))
            cells.append([rows, name, f"{best * 1e3:.2f}", f"{median * 1e3:.2f}", f"{mib:.1f}", f"{mib / 1024 / best:.2f}"])
    print("\n".join(table(["rows per head", "granularity", "best ms", "median ms", "MiB (K+V)", "GiB/s (best)"], cells,
                          align="rlrrrr")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
