#!/usr/bin/env bash
# Creates .venv with litsft and its test extras on a machine with or without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first: later resolves then keep this build instead of pulling a newer CUDA one.
.venv/bin/python -m pip install -q "torch==2.13.0"
echo "torch==2.13.0" > .venv/constraints.txt
.venv/bin/python -m pip install -q -c .venv/constraints.txt -e ".[test]"
# litdata pulls torchvision, whose only matching build here is a CUDA one that breaks `import lightning`
# on CPU torch (torchmetrics imports it when present). litsft does not need it.
if ! .venv/bin/python -c "import torchvision" >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y torchvision || true
fi
