#!/usr/bin/env bash
# The project's GPU check in one call, on a fresh GPU machine with no network (under 8 minutes
# on one H200): installs the wheels carried in .gpu-wheels/ (scripts/gpu_wheels.sh fills it),
# then runs scripts/gpu_check.py, which makes its random-weight checkpoints there, runs the
# CUDA tests, checks float32 greedy against transformers over HTTP, runs the speed levels beside
# transformers' static batches, and writes gpu_check.json, gpu_check.md and logs.tar.gz.
#
#   scripts/gpu_check.sh [--out DIR] [--cpu-smoke] [--skip-tests]
#
# --cpu-smoke runs every step on this CPU with tiny shapes, from this checkout's environment
# (no wheels installed): the plumbing, not the figures. Exit status: 1 if a correctness check
# failed (the speed bars are reported, not enforced).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
smoke=0
for arg in "$@"; do [ "$arg" = "--cpu-smoke" ] && smoke=1; done
site=${NANOSERVE_GPU_SITE:-/tmp/nanoserve-gpu-site}
if [ "$smoke" = 0 ] && compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    # --no-deps: the wheels are exactly what the machine lacks (scripts/gpu_wheels.sh).
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .gpu-wheels/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/gpu_check.py "$@"
