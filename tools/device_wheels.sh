#!/usr/bin/env bash
# Wheels for the packages Rollplex needs that the lent H200 machine's image lacks
# (it has torch, transformers 5.17.0, safetensors, pyyaml, nvidia-ml-py, matplotlib
# and rich, and reaches no registry; math-verify is the math reward's). transformers travels only once the minimum that
# pyproject.toml declares rises above 5.17.0: then as a wheel of that minimum, which
# shadows the image's (the wheels go first on PYTHONPATH; installed without deps, so
# check its tokenizers/huggingface-hub bounds against the image's). Run here, in the
# repo root; then carry `.whl` in the device call, whose command
# `bash tools/device_run.sh` installs them (pip --no-index --target, on PYTHONPATH).
# CACHE_PYTHON=<python 3.12 with triton 3.6.0> also compiles the kernels into .triton-cache (below).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE_TRANSFORMERS=5.17.0
# math-verify and its parser: the math reward (pure Python; the image's sympy serves them).
# fla-core: Qwen3.5's gated delta rule kernels (pure Python and Triton, ~1 MB; the image's einops serves it).
# On that machine transformers' Qwen3.5 then runs fla's kernels too, on CUDA and on CPU tensors alike.
wheels=(tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
        fla-core==0.6.0)
minimum=$(sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$minimum" ] || { echo "no transformers>= bound in pyproject.toml" >&2; exit 1; }
if [ "$(printf '%s\n' "$DEVICE_TRANSFORMERS" "$minimum" | sort -V | tail -n 1)" != "$DEVICE_TRANSFORMERS" ]; then
    wheels+=("transformers==$minimum")
fi
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${wheels[@]}"
ls .whl
# The hand-written Triton kernels compiled for sm_90 into .triton-cache (binaries only), which the device
# call carries and tools/device_run.sh hands to Triton. Triton's cache key holds its own build, so the
# compiling Python must have the device's triton (3.6.0) built for its Python (3.12): CACHE_PYTHON names one
# (e.g. a venv of python3.12 with torch and `pip install --no-deps triton==3.6.0`); without it, no cache.
rm -rf .triton-cache
if [ -n "${CACHE_PYTHON:-}" ]; then
    TRITON_STORE_BINARY_ONLY=1 "$CACHE_PYTHON" tools/compile_kernels.py --cache-dir "$PWD/.triton-cache"
    du -sh .triton-cache
fi
