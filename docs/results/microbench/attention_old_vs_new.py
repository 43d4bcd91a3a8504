"""Per-layer prefill attention and H2O column sums: the code before the rewrite (git 2c131b6) vs HEAD.

Qwen2.5-0.5B shapes (14 query heads, 2 KV heads, head dim 64), batch 1, f32, best of 3 after a warm-up.
Run from the repository root: python docs/results/microbench/attention_old_vs_new.py
"""
import importlib.util
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import blocked_causal_attention
from kvjax.methods.compressed import chunk_attention_sums

OLD = "2c131b6"


def old_module(path, name):
    src = subprocess.run(["git", "show", f"{OLD}:{path}"], capture_output=True, text=True, check=True).stdout
    f = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    f.write(src)
    f.close()
    spec = importlib.util.spec_from_file_location(name, f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def best_ms(fn, *args, n=3):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


old_attention = old_module("kvjax/attention.py", "old_attention")
old_compressed = old_module("kvjax/methods/compressed.py", "old_compressed")
rng = np.random.default_rng(0)
pad = jnp.zeros((1,), jnp.int32)
print(f"jax {jax.__version__} ({jax.default_backend()}); old = git {OLD}, new = HEAD; ms per layer call\n")
print("| computation | chunk T | chunk start | cache slots S | old ms | new ms | old ÷ new | max abs diff |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for T, start, S in [(1024, 0, 1280), (1024, 3072, 4352), (1024, 7168, 8448)]:
    q = jnp.asarray(rng.standard_normal((1, T, 14, 64), dtype=np.float32))
    k = jnp.asarray(rng.standard_normal((1, 2, S, 64), dtype=np.float32))
    v = jnp.asarray(rng.standard_normal((1, 2, S, 64), dtype=np.float32))
    f_old = jax.jit(lambda q, k, v, s: old_attention.blocked_causal_attention(q, k, v, q_start=s, pad=pad, scale=0.125, block=256))
    f_new = jax.jit(lambda q, k, v, s: blocked_causal_attention(q, k, v, q_start=s, pad=pad, scale=0.125, block=256))
    a, b = best_ms(f_old, q, k, v, start), best_ms(f_new, q, k, v, start)
    d = float(jnp.abs(f_old(q, k, v, start) - f_new(q, k, v, start)).max())
    print(f"| prefill attention | {T} | {start} | {S} | {a:.0f} | {b:.0f} | {a / b:.1f}× | {d:.1e} |", flush=True)
for T, start, S in [(1024, 0, 1024), (1024, 3072, 4096), (4096, 0, 4096)]:
    q = jnp.asarray(rng.standard_normal((1, T, 14, 64), dtype=np.float32))
    k = jnp.asarray(rng.standard_normal((1, 2, S, 64), dtype=np.float32))
    f_old = jax.jit(lambda q, k, s: old_compressed.chunk_attention_sums(q, k, s, pad, 256))
    f_new = jax.jit(lambda q, k, s: chunk_attention_sums(q, k, s, pad, 256))
    a, b = best_ms(f_old, q, k, start), best_ms(f_new, q, k, start)
    d = float(jnp.abs(f_old(q, k, start) - f_new(q, k, start)).max())
    print(f"| H2O column sums | {T} | {start} | {S} | {a:.0f} | {b:.0f} | {a / b:.1f}× | {d:.1e} |", flush=True)
sys.exit(0)
