#!/usr/bin/env bash
# Microbenchmarks behind the prefill-attention rewrite and the XLA_FLAGS claims in README/notes.
# Run from the repository root inside .venv, on a quiet machine:  bash docs/results/microbench/run.sh
set -euo pipefail
here=docs/results/microbench
{
  echo "# Microbenchmarks (this CPU)"; echo
  echo "Command: \`bash $here/run.sh\`; $(date -u +%Y-%m-%dT%H:%M:%SZ); $(nproc) cores."; echo
  echo "## Prefill attention and H2O column sums, before/after"; echo
  python $here/attention_old_vs_new.py
  echo; echo "## f32 products at prefill shapes, jax vs torch, per XLA_FLAGS"; echo; echo '```'
  for flags in "" "--xla_cpu_use_onednn=true" \
      "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT" \
      "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT" \
      "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT" \
      "--xla_cpu_prefer_vector_width=512"; do
    XLA_FLAGS="$flags" python $here/gemm_jax_vs_torch.py
  done
  echo '```'
} > $here/README.md
echo "wrote $here/README.md"
