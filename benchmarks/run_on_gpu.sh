#!/usr/bin/env bash
# One call on the GPU machine: the GEMM and the attention on their own against double-
# precision references (benchmarks/gemm_bench.cu, benchmarks/attention_bench.cu), the
# sampler's divisions against IEEE's (benchmarks/sampler_bench.cu), a build
# with the CUDA backend, the GPU test files (transformers' parity, bad inputs, quantized
# checkpoints and KV cache dtypes on CUDA, and CUDA against the CPU backend), then the step
# benchmark.
# Logs go to $OUT (or ./gpu-logs). Usage: bash benchmarks/run_on_gpu.sh [step_latency.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-logs}"
mkdir -p "$out"
# transformers >= 5.23 (the oracle), carried as wheels when the machine's is older: the device
# machine reaches no index, so .device/whl (git-ignored; name it in the call's carry) holds
# transformers and what it needs beyond the machine's packages, fetched where pip works:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .device/whl "transformers==5.25.*" "huggingface-hub>=2.4,<3" "kernels>=0.19.1,<0.20" \
#     "httpx2>=2,<3" "httpcore2==2.17.0" truststore tomlkit "click>=8.4.2,<9"
if ls .device/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/device-wheels .device/whl/*.whl
  export PYTHONPATH="/tmp/device-wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# The three benches compile side by side, then each runs (checks first, then timings) within 150 s.
flags="-std=c++20 -arch=sm_90a -DDIFFUSERVE_SM90A -O3 -I cpp/src -I cpp/include -I cuda"
# cuBLASLt from the nvidia-cublas wheel beside PyTorch, as the build finds it: gemm_bench
# then checks and times the dense products the backend sends there too.
lt=$(python3 -c "import glob, site; print(next((p[:-len('/include/cublasLt.h')] for d in site.getsitepackages()
                                                for p in glob.glob(d + '/nvidia/*/include/cublasLt.h')), ''))")
lt_flags=${lt:+-DDIFFUSERVE_WITH_CUBLASLT -I $lt/include cuda/cublaslt_gemm.cu -L $lt/lib -l:libcublasLt.so.13 -Xlinker -rpath=$lt/lib}
# shellcheck disable=SC2086  # the flags split into words
nvcc $flags benchmarks/gemm_bench.cu cuda/gemm.cu cuda/kernels.cu cuda/launch.cu cpp/src/packed_weight.cpp cpp/src/sampler.cpp cpp/src/dtype.cpp \
  $lt_flags -o /tmp/gemm_bench > "$out/gemm_bench.txt" 2>&1 &
nvcc $flags benchmarks/attention_bench.cu cuda/attention.cu cuda/attention_mma.cu cuda/attention_wgmma.cu cuda/launch.cu -o /tmp/attention_bench \
  > "$out/attention_bench.txt" 2>&1 &
nvcc $flags benchmarks/sampler_bench.cu cuda/kernels.cu cuda/gemm.cu cuda/launch.cu cpp/src/packed_weight.cpp cpp/src/sampler.cpp \
  cpp/src/dtype.cpp -o /tmp/sampler_bench > "$out/sampler_bench.txt" 2>&1 &
wait
for bench in gemm_bench attention_bench sampler_bench; do
  [ -x /tmp/$bench ] && timeout 150 /tmp/$bench >> "$out/$bench.txt" 2>&1
  echo "$bench: exit $? ($(grep -c '^ok' "$out/$bench.txt") checks passed)"; grep -v "^ok" "$out/$bench.txt"
done
start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps . > "$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
cd /tmp
DIFFUSERVE_TEST_DEVICE=cuda python3 -m pytest -q -s -p no:cacheprovider "$OLDPWD/tests/test_cuda.py" \
  "$OLDPWD/tests/test_hf_parity.py" "$OLDPWD/tests/test_errors.py" "$OLDPWD/tests/test_quantized.py" \
  "$OLDPWD/tests/test_kv_cache_dtype.py" > "$out/tests.log" 2>&1
echo "tests: exit $? ($(tail -1 "$out/tests.log"))"
grep -E "argmax agreement|tokens equal|max \|logit diff\||denoise steps:|graph recording" "$out/tests.log" | sort | uniq | head -40
cd "$OLDPWD"
python3 benchmarks/step_latency.py "$@" 2>&1 | tee "$out/step_latency.txt"
