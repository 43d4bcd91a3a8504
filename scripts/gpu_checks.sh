#!/usr/bin/env bash
# kvjax's accelerator checks, in stages that each fit one 10-minute call of a lent GPU
# machine (docs/GPU.md). Run from the repository root. Every stage but `pack` runs on the accelerator
# machine without installing kvjax (its image has jax, flax, optax, orbax, torch, transformers) and writes
# to $OUT (default ./gpu-out).
#
#   scripts/gpu_checks.sh env             # versions and devices
#   scripts/gpu_checks.sh scale           # the papers' scale in one call (<= 9 min, 4 files): the paged and PQ kernels at
#                                         # 8K-128K (PQ to 1M) tokens, batch 1/8/32, bf16 and f32, vs XLA, dense and the
#                                         # nominal bandwidth; then every method on Llama-3.1-8B shapes at 128K and 32K,
#                                         # 10% and 25%, batch 1 and the plan's largest batch, caches built directly,
#                                         # vs the full cache and the plan (docs/results/plan/)
#   scripts/gpu_checks.sh kernels         # the Pallas kernel and host-tier tests, compiled for the GPU (the Mosaic GPU
#                                         # form over int8 / fp8 pages included)
#   scripts/gpu_checks.sh bench           # HeteroCache / SyncKV decode with and without recall (whole, spread,
#                                         # pipelined) vs the full cache, 30K (decode compiled with kvjax's GPU options;
#                                         # BENCH_METHODS overrides the methods)
#   scripts/gpu_checks.sh bench-xla-default  # the same for full, SyncKV pipelined / without recall, compiled with XLA's
#                                         # default schedule (no latency-hiding scheduler)
#   scripts/gpu_checks.sh recall-micro    # where a step's recall time goes: cond / unconditional / prefetch / pages,
#                                         # fixed indices and indices from the step's compute (dep-*)
#   scripts/gpu_checks.sh profile         # a jax.profiler trace of a few decode steps: full, SyncKV (spread, pipelined), 30K
#   scripts/gpu_checks.sh locret-memory   # Locret vs the full cache: measured peak memory during prefill, 8K and 32K
#   scripts/gpu_checks.sh locret-bench    # Locret vs the full cache: chunked prefill and decode time, 30K
#   scripts/gpu_checks.sh pack NAME       # HERE, not there: split a ready model's GGUF into .gpu/ for carrying
#   scripts/gpu_checks.sh train NAME      # THERE, after the parts arrived: train NAME's Locret heads, timed
#
# The timing stages use the model's architecture with random weights (`--random-weights`): the weight files
# (94 MiB SmolLM2, 469 MiB Qwen) do not fit one call's 64 MiB of carried files. LENGTHS overrides the lengths,
# REPEATS the bench's timed runs, DTYPE the benches' dtype (bfloat16 by default, as a GPU user runs it). A bench
# length must be a multiple of its chunk and leave room for the new tokens in the model's 32768 (hence 30720).
set -euo pipefail
stage=${1:?usage: scripts/gpu_checks.sh env|scale|kernels|bench|bench-xla-default|recall-micro|profile|locret-memory|locret-bench|pack NAME|train NAME}
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
model=qwen2.5-coder-0.5b

case "$stage" in
env)
    { nvidia-smi || true; "$py" -c "import jax, flax, optax, orbax.checkpoint as oc, numpy
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'numpy', numpy.__version__)
print(jax.devices())"; } 2>&1 | tee "$out/env.txt"
    ;;
scale)
    timeout 210 "$py" -m research.bench_kernels --model llama-3.1-8b --tokens 8192 32768 131072 --batch 1 8 32 --dtypes bfloat16 float32 \
        --pq-tokens 8192 131072 1048576 --warmup 2 --repeats 10 --out "$out/kernels_scale.md" || true
    "$py" -m research.bench_scale --model llama-3.1-8b --lengths 131008,32768 --budgets 0.1,0.25 --batches 1,max \
        --plan "${PLAN:-docs/results/plan/llama-3.1-8b_h100_128k_jax0.10.2.json,docs/results/plan/llama-3.1-8b_h100_32k_jax0.10.2.json}" --steps 16 --repeats 2 \
        --time-budget-s "${SCALE_SECONDS:-270}" --out "$out/scale_llama-3.1-8b.md"
    ;;
kernels)
    "$py" -m pytest -q -p no:cacheprovider tests/test_pallas_paged_attention.py tests/test_pallas_pq_attention.py \
        tests/test_pallas_row_write.py tests/test_host_tier.py tests/test_quantized_kernels.py -k "not v5e" 2>&1 \
        | tee "$out/kernels.txt"
    ;;
bench)
    "$py" -m kvjax.cli bench --model "$model" --random-weights --budget 0.25 --lengths "${LENGTHS:-30720}" \
        --methods "${BENCH_METHODS:-full,heterocache,heterocache:recall_schedule=spread,heterocache:recall_schedule=pipelined,heterocache:retrieval=false,synckv,synckv:recall_schedule=spread,synckv:recall_schedule=pipelined,synckv:anticipation=false,heterocache:preset=tuned:recall_schedule=pipelined,heterocache:preset=tuned:retrieval=false,synckv:preset=tuned:recall_schedule=pipelined,synckv:preset=tuned:anticipation=false}" \
        --chunk-size 2048 --new-tokens 64 --repeats "${REPEATS:-3}" --dtype "${DTYPE:-bfloat16}" --out "$out/bench_recall_gpu.md"
    ;;
bench-xla-default)
    "$py" -m kvjax.cli bench --model "$model" --random-weights --budget 0.25 --lengths "${LENGTHS:-30720}" \
        --methods full,synckv:recall_schedule=pipelined,synckv:anticipation=false \
        --compiler-option xla_gpu_enable_latency_hiding_scheduler=false \
        --chunk-size 2048 --new-tokens 64 --repeats "${REPEATS:-3}" --dtype "${DTYPE:-bfloat16}" --no-plot \
        --out "$out/bench_recall_xla_default_gpu.md"
    ;;
recall-micro)
    "$py" -m research.recall_step --steps "${STEPS:-20}" --repeats "${REPEATS:-3}" \
        --out "$out/recall_step_gpu.md"
    ;;
profile)
    # NEW_TOKENS - 1 decode steps per trace; only the Perfetto / Chrome traces come back (a returned file must stay
    # under 16 MiB): open them in ui.perfetto.dev; profile_summary.md is `python -m research.trace_summary` of them
    rm -rf /tmp/kvjax-profile
    "$py" -m kvjax.cli bench --model "$model" --random-weights --budget 0.25 --lengths "${LENGTHS:-30720}" \
        --methods full,synckv:recall_schedule=spread,synckv:recall_schedule=pipelined --chunk-size 2048 --new-tokens "${NEW_TOKENS:-8}" \
        --repeats 1 --dtype "${DTYPE:-bfloat16}" --no-plot --profile /tmp/kvjax-profile --out "$out/bench_profile_gpu.md"
    (cd /tmp/kvjax-profile && find . -name '*.trace.json.gz' | tar czf "$out/profile_traces.tgz" -T -)
    "$py" -m research.trace_summary /tmp/kvjax-profile --out "$out/profile_summary.md" > /dev/null
    ls -l "$out"
    ;;
locret-memory)
    "$py" -m kvjax.cli bench locret-memory --model "$model" --random-weights --measure \
        --lengths "${LENGTHS:-8192,32768}" --out "$out/locret_memory_gpu"
    ;;
locret-bench)
    "$py" -m kvjax.cli bench --model "$model" --random-weights --methods full,locret --budget 0.1 \
        --lengths "${LENGTHS:-30720}" --chunk-size 1024 --new-tokens 32 --dtype "${DTYPE:-bfloat16}" --out "$out/bench_locret_gpu.md"
    ;;
pack)
    name=${2:?usage: scripts/gpu_checks.sh pack NAME}
    gguf=$("$py" -c "from kvjax.models.registry import ready_model_path; print(ready_model_path('$name'))")
    rm -rf .gpu && mkdir -p .gpu
    # one part per call: a call carries at most 64 MiB with the working tree (~28 MiB) included
    split -b "${PART_MIB:-32}M" -d "$gguf" ".gpu/$name.gguf.part"
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .gpu "gguf==$("$py" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    ls -l .gpu
    ;;
train)
    name=${2:?usage: scripts/gpu_checks.sh train NAME}
    cat .gpu/"$name".gguf.part* > "/tmp/$name.gguf"  # the file's name is the model's identity
    "$py" -m pip install -q --no-index --no-deps --target /tmp/site .gpu/gguf-*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    start=$(date +%s)
    "$py" -m kvjax.cli train-locret --model "/tmp/$name.gguf" --samples 72 --heldout 8 --tokens 1024 --hidden 128 \
        --steps 1000 --out "/tmp/locret-train-$name" 2>&1 | tee "$out/train.txt"
    echo "wall time $(( $(date +%s) - start )) s" | tee -a "$out/train.txt"
    # what comes back (no checkpoints: too many files)
    cp /tmp/locret-train-"$name"/{metrics.json,loss.png,heads.npz,report.md} "$out/" 2>/dev/null || true
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
