#!/usr/bin/env bash
# Set up .venv (if needed) and run the demo: a pass key hidden in a ~4K-token haystack, answered by the default
# model (Qwen2.5-Coder-0.5B-Instruct) with the full cache and, at 10% of the KV, SnapKV and the five seed methods
# (HBW-KV, HeteroCache, SyncKV, HCAttention, Locret; presets where they have one), with the question in the prompt
# and asked after compression, side by side. Extra args go to `kvjax demo`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
. "$root/.venv/bin/activate"
exec kvjax demo "$@"
