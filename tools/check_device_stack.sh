#!/usr/bin/env bash
# The test suite on the lent GPU machine's software stack, run on CPU: torch 2.11.0
# (its registry wheel is the CUDA build, ~4 GB with its libraries, and runs on CPU),
# triton 3.6.0 and transformers at the minimum pyproject.toml declares.
#
#   bash tools/check_device_stack.sh [pytest args]   e.g. tests/test_processing.py -x
#
# Builds the virtual environment .venv-device in the repo root on the first run and
# reuses it after (pip leaves satisfied pins alone). PYTHON picks the interpreter
# that creates it (default python3; the GPU machine has 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.11.0
TRITON_VERSION=3.6.0
TRANSFORMERS_VERSION=5.17.0
VENV=.venv-device

[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
# The pins ride on the same command as the project, so the resolver keeps them
# while it satisfies the dev extra (whose triton is unpinned).
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" \
    "transformers==$TRANSFORMERS_VERSION" -e ".[dev]"
"$VENV/bin/python" - "$TORCH_VERSION" "$TRITON_VERSION" "$TRANSFORMERS_VERSION" <<'EOF'
import sys
import torch, transformers, triton
found = (torch.__version__.split("+")[0], triton.__version__, transformers.__version__)
assert found == tuple(sys.argv[1:]), f"stack is {found}, wanted {tuple(sys.argv[1:])}"
print("stack: torch %s, triton %s, transformers %s" % found)
EOF
exec "$VENV/bin/python" -m pytest -q "$@"
