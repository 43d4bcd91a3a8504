"""f32 prefill-shaped products (1024 tokens x Qwen2.5-0.5B layer shapes): jax (XLA:CPU) against torch (oneDNN), GF/s.

NT = HF's weight[out, in] layout (kvjax's), NN = weight[in, out]. Best of 5 after a warm-up. ``XLA_FLAGS`` from the
environment apply: ``XLA_FLAGS=... python -m research.gemm_jax_vs_torch`` prints one line per shape.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TOKENS = 1024
SHAPES = ((896, 9728), (4864, 896), (896, 1152))  # (in, out) of the MLP's up / down projection and the fused QKV


def best_seconds(fn, *args, repeats: int = 5, block=lambda out: out) -> float:
    """The best of ``repeats`` timed calls of ``fn(*args)`` after a warm-up one (``block`` waits for the result)."""
    block(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m research.gemm_jax_vs_torch", description=__doc__.splitlines()[0]).parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    torch.set_num_threads(os.cpu_count())
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    nt = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    nn = jax.jit(lambda x, w: x @ w)
    ready = lambda out: out.block_until_ready()  # noqa: E731
    for din, dout in SHAPES:
        x = np.random.randn(TOKENS, din).astype(np.float32)
        w = np.random.randn(dout, din).astype(np.float32)
        flops = 2 * TOKENS * din * dout
        a = best_seconds(nt, jnp.asarray(x), jnp.asarray(w), block=ready)
        b = best_seconds(nn, jnp.asarray(x), jnp.asarray(w.T.copy()), block=ready)
        with torch.inference_mode():
            c = best_seconds(torch.nn.functional.linear, torch.from_numpy(x), torch.from_numpy(w))
        print(f"{din}->{dout}: jax NT {flops / a / 1e9:.0f} GF/s, jax NN {flops / b / 1e9:.0f} GF/s, "
              f"torch {flops / c / 1e9:.0f} GF/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
