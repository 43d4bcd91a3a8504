#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite in 2 worker processes (pytest-xdist; one test file per
# worker at a time, so module fixtures are built once; the slowest files first, in tests/conftest.py's order). Extra
# args go to pytest (`-n 0`: one process).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
. "$root/.venv/bin/activate"
cd "$root"
exec python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 "$@"
