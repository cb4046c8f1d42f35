#!/usr/bin/env bash
# Wheels for the packages Rollplex needs that the lent H200 machine's image lacks
# (it has torch, transformers, safetensors, pyyaml, nvidia-ml-py, matplotlib and
# rich, and reaches no registry). Run here, in the repo root; then carry `.whl`
# in the device call and begin its command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
ls .whl
