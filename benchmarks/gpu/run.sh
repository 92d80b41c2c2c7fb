#!/usr/bin/env bash
# The GPU machine's one command: bash benchmarks/gpu/run.sh [--dry-run] [OUT_DIR] (default $OUT).
# Steps, their time budgets and outputs: benchmarks/gpu/run.py (standard library only, so it runs before the
# carried wheels are installed).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=$(command -v python3 || command -v python)
exec "$PYTHON" benchmarks/gpu/run.py "$@"
