#!/usr/bin/env bash
# The packed FP8 / NVFP4 GEMMs on a GPU, in one call: gemm_bench (bf16, FP8 and NVFP4
# against a double-precision reference, then the timings side by side), a build with the
# CUDA backend and the quantized CUDA tests (checkpoints and dummy models against the CPU
# backend), then one quick step_latency row per format. Logs go to $OUT (or ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${OUT:-gpu-logs}")"
mkdir -p "$out"
nvcc -std=c++20 -arch=sm_90a -O3 -I cpp/src -I cpp/include -I cuda benchmarks/gemm_bench.cu cuda/gemm.cu \
  cpp/src/packed_weight.cpp cpp/src/dtype.cpp -o /tmp/gemm_bench > "$out/gemm_bench.txt" 2>&1 && /tmp/gemm_bench >> "$out/gemm_bench.txt" 2>&1
echo "gemm_bench: exit $? ($(grep -c '^ok' "$out/gemm_bench.txt") checks passed)"; grep -v "^ok" "$out/gemm_bench.txt"
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps . > "$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log"; exit 1; }
(cd /tmp && python3 -m pytest -q -s -p no:cacheprovider "$OLDPWD/tests/test_cuda.py" -k quantized > "$out/tests.log" 2>&1)
echo "quantized CUDA tests: exit $? ($(tail -1 "$out/tests.log"))"
grep -E "argmax agreement|Error|assert" "$out/tests.log" | head -40
for q in bf16 fp8 nvfp4; do
  python3 benchmarks/step_latency.py --quick --quantization $q 2>"$out/step_$q.err" | tee "$out/step_$q.txt" | tail -3
done
