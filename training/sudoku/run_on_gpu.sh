#!/usr/bin/env bash
# One call on the GPU machine: build diffuserve (CPU backend: evaluation through its sampler
# runs on the CPU cores while the GPU trains) unless it is installed, and train; $OUT gets
# the best checkpoint (best/) and the training log.
# Usage: bash training/sudoku/run_on_gpu.sh [train.py options]; results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p "${OUT:-gpu-logs}"
out="$(cd "${OUT:-gpu-logs}" && pwd)"
if ls .device/transformers-*.whl >/dev/null 2>&1; then  # transformers >= 5.23, as the tests pin
  python3 -m pip install -q --no-deps --target /tmp/newer-transformers .device/transformers-*.whl
  export PYTHONPATH="/tmp/newer-transformers${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd /tmp && python3 -c "import diffuserve") 2>/dev/null; then
  CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps \
    --config-settings=cmake.define.DIFFUSERVE_CUDA=OFF . > /tmp/build.log 2>&1 \
    || { tail -30 /tmp/build.log; exit 1; }
fi
cd /tmp
PYTHONUNBUFFERED=1 python3 "$OLDPWD/training/sudoku/train.py" --out "$out" "$@"
