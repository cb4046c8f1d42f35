#!/usr/bin/env bash
# The one device command: every GPU check and the schedule benchmark, on the lent
# GPU machine, from the repo root, inside one 10-minute call.
#
#   here, once:   bash tools/device_wheels.sh          # the wheels that machine lacks, into .whl/
#   device call:  carry [".whl", ".triton-cache"], timeout_s 600, command:
#                 ROLLPLEX_COMMIT=<sha of HEAD> bash tools/device_run.sh
#
# Writes under $OUT (default runs/device): gpu_check.json (rewritten after every
# check), gpu_check.log, bench_schedules/report.json (rewritten after every
# schedule) and bench_schedules/timeline.png, bench_small_prefix_budget/report.json
# and, when the budget leaves time for it, bench_serial_naive/report.json: at most
# six files, within the eight that come back. Options go to tools/gpu_check.py:
# `--only NAME ...`, `--budget-s S` (default 540), `--device cpu` (the same run end
# to end on a CPU at the smallest sizes: tests/test_gpu_check.py). PYTHON picks the
# interpreter (default python3, the GPU machine's).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/device}
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/rollplex-wheels .whl/*.whl
    export PYTHONPATH=/tmp/rollplex-wheels${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The hand-written kernels compiled offline (tools/device_wheels.sh): a writable copy as Triton's cache,
# so the checks spend no time compiling what was compiled here; gpu_check reports hits and misses.
if [ -d .triton-cache ]; then
    rm -rf /tmp/rollplex-triton-cache && cp -r .triton-cache /tmp/rollplex-triton-cache
    export TRITON_CACHE_DIR=/tmp/rollplex-triton-cache
fi
mkdir -p "$OUT"
"$PYTHON" tools/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
