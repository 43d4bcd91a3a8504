#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite. Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
. "$root/.venv/bin/activate"
cd "$root"
exec python -m pytest -q --durations=15 "$@"
