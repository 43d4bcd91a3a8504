#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite in 2 worker processes (pytest-xdist).
#
# With no arguments it runs in two passes (CPU figures: README, Tests):
# 1. the tests that run the ready models (marker `real_model`; their time goes into running a 0.5B model), with
#    XLA's default CPU code generation, spread test by test over the workers (`--dist load`: the one big file
#    would otherwise keep one worker busy while the other idles);
# 2. all the others, one test file per worker at a time (module fixtures built once; the slowest files first, in
#    tests/conftest.py's order), with `--xla_backend_optimization_level=0`. They run tiny models, where compiling
#    dominates: without LLVM's optimisation XLA compiles ~25% faster, while the real-model tests would run slower.
#    The flag changes LLVM's code generation only, not XLA's HLO passes.
# Both passes share a persistent compilation cache in a fresh temporary directory, removed at the end: programs
# compiled again after a module's `jax.clear_caches()` (tests/conftest.py), in the other worker or in a subprocess
# load from it instead of compiling. Trace counts, which the compile-once tests compare, are unaffected.
# Extra args go to pytest in one pass (`-n 0`: one process).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
. "$root/.venv/bin/activate"
cd "$root"
cache="$(mktemp -d -t kvjax-test-cache.XXXXXX)"
trap 'rm -rf "$cache"' EXIT
export JAX_COMPILATION_CACHE_DIR="$cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export KVJAX_AOT_GPU="$root/.aot-gpu"  # jax's CUDA plugin (setup_env.sh): tests/test_gpu_schedule.py fails without it
export KVJAX_AOT_TPU="$root/.aot-tpu"  # libtpu (setup_env.sh): tests/test_accelerator_compile.py fails without it
run() { python -m pytest -q -n 2 --durations=15 "$@"; }
if [ "$#" -gt 0 ]; then
    run --dist loadfile --no-loadscope-reorder "$@"
    exit
fi
status=0  # both passes run; the script fails if either did
run --dist load -m real_model || status=$?
XLA_FLAGS="--xla_backend_optimization_level=0${XLA_FLAGS:+ $XLA_FLAGS}" \
    run --dist loadfile --no-loadscope-reorder -m "not real_model" || status=$?
exit "$status"
