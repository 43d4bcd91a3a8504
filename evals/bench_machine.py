"""The conditions a benchmark runs in, shared by the benchmarks in ``evals/``.

* the prompt: random token ids (the content does not change the cost) and the prefill chunk;
* the machine: CPU, memory, OS and package versions, and its memory read bandwidth (the divisor of
  every bandwidth limit);
* the process: its resident set now, its peak, and resetting the peak between measured phases.

Only numpy and the standard library at import time (a benchmark's parent process stays
framework-free); the bandwidth measurement imports jax when it runs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import resource
import sys
import time

import numpy as np

GIB = 1024 ** 3
MIB = 1024 ** 2


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# prompt


def effective_chunk(length: int, chunk_size: int) -> int:
    """Prefill chunk for a prompt of ``length`` tokens (0 = no chunking); the prompt must be a multiple."""
    chunk = length if chunk_size <= 0 else min(chunk_size, length)
    if length % chunk:
        raise ValueError(f"prompt length {length} is not a multiple of --chunk-size {chunk_size}")
    return chunk


def prompt_tokens(vocab_size: int, length: int, seed: int) -> np.ndarray:
    """Random prompt ids int32 [1, length] (the same for every framework given the same vocabulary)."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=(1, length), dtype=np.int32)


# --------------------------------------------------------------------------------------------
# process memory


def proc_status_kib(field: str) -> int:
    """A memory field of this process (KiB) from /proc/self/status, e.g. ``VmRSS``, ``VmHWM`` (0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_now_kib() -> int:
    """Current resident set size (KiB) from /proc/self/status (0 where unavailable)."""
    return proc_status_kib("VmRSS")


def peak_rss_kib() -> int:
    """Peak RSS (KiB) of this process: ``getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def reset_peak_rss() -> bool:
    """Reset the peak-RSS high-water mark (Linux ``/proc/self/clear_refs``); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# machine


@contextlib.contextmanager
def real_compilations():
    """JAX's persistent compilation cache off inside the block (the compile times measured are real compilations),
    restored after it."""
    import jax

    old = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", old)


def machine_info() -> dict:
    """CPU model, core counts, memory, OS."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu, "logical_cores": os.cpu_count(), "usable_cores": usable, "memory_bytes": mem,
        "os": platform.platform(), "python": platform.python_version(),
    }


def versions() -> dict:
    """Installed versions of the packages that matter, without importing them."""
    from importlib import metadata

    out = {}
    for pkg in ("jax", "jaxlib", "flax", "numpy", "torch", "transformers", "gguf", "kvjax"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def worker_bandwidth(args) -> dict:
    """Memory read bandwidth (bytes/s): jitted ``jnp.sum``, numpy ``a.sum()``, numpy one thread per core."""
    from concurrent.futures import ThreadPoolExecutor

    n = args.bandwidth_mib * MIB // 4
    nbytes = n * 4
    reps = args.bandwidth_repeats
    a = np.ones((n,), np.float32)  # pages touched

    def best(fn):
        fn()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times)

    out = {"array_bytes": nbytes, "repeats": reps}
    _log(f"[bandwidth] numpy sum over {nbytes / MIB:.0f} MiB")
    out["numpy_sum"] = best(lambda: a.sum())
    workers = os.cpu_count() or 1
    parts = np.array_split(a, workers)
    with ThreadPoolExecutor(workers) as pool:
        out["numpy_threaded_sum"] = best(lambda: sum(pool.map(np.sum, parts)))
    out["threads"] = workers

    import jax
    import jax.numpy as jnp

    _log("[bandwidth] jitted jnp.sum")
    x = jnp.asarray(a)
    del a, parts
    gc.collect()
    fn = jax.jit(jnp.sum)
    out["jax_sum"] = best(lambda: fn(x).block_until_ready())
    out["machine"] = max(out["numpy_sum"], out["numpy_threaded_sum"], out["jax_sum"])
    out["machine_source"] = max(("numpy_sum", "numpy_threaded_sum", "jax_sum"), key=lambda k: out[k])
    return out
