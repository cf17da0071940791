// The sampler's row pass (cuda/kernels.cu, sample_kernel) on its own: microseconds a call at
// DiffusionGemma's vocabulary (262,144) for a batch-1, -4 and -16 canvas (256 rows each), in
// the step's form (softcap 30, temperature 0.6, the softmax feedback rounded to bf16 into the
// soft embedding's input rows). Two kinds of rows:
//   - near-uniform (a random-weight model's, the step benchmark's): every id within the
//     Gumbel noise's reach of the row's max, so every id draws its noise;
//   - peaked (a trained model's): one id far ahead, the draws skipped.
// Each call gets the same logits (the kernel writes over them), copied in before it; only
// the kernel is timed, between two events (the copy leaves some of its bytes in L2). Nothing
// here checks the sampler's outputs: tests/test_cuda.py does, against the CPU's.
// First (unless --time) Divisor (cuda/fast_math.cuh) against __fdiv_rn for every float
// dividend (all 2^32 bit patterns) and a set of divisors: the sampler's divisions by the cap
// and the temperature must be IEEE's, as the CPU's are; --check stops after it.
// Build and run (sm_90a):
//   nvcc -std=c++20 -arch=sm_90a -O3 -I cpp/src -I cpp/include -I cuda benchmarks/sampler_bench.cu \
//     cuda/kernels.cu cuda/gemm.cu cuda/launch.cu cpp/src/packed_weight.cpp cpp/src/sampler.cpp cpp/src/dtype.cpp \
//     -o /tmp/sampler_bench && /tmp/sampler_bench
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "fast_math.cuh"
#include "kernels.h"

using namespace kernel_bench;
using namespace diffuserve;
using namespace diffuserve::cuda;

namespace {

constexpr int64_t kVocab = 262144, kCanvas = 256;

// Dividends hi << 16 | lo, a thread per lo (65,536) and `his` values of hi (blockIdx.y's
// share); counts those whose Divisor quotient differs from __fdiv_rn's in any bit.
__global__ void divisor_check_kernel(float d, uint32_t his, unsigned long long* mismatches) {
  const Divisor by(d);
  const uint32_t lo = threadIdx.x + blockIdx.x * blockDim.x, hi0 = blockIdx.y * his;
  unsigned long long bad = 0;
  for (uint32_t hi = hi0; hi < hi0 + his; hi += 4) {
    float x[4];
    for (int j = 0; j < 4; ++j) x[j] = __uint_as_float((hi + j) << 16 | lo);
    float q[4] = {x[0], x[1], x[2], x[3]};
    by.divide(q);
    for (int j = 0; j < 4; ++j) {
      const float want = __fdiv_rn(x[j], d);
      bad += __float_as_uint(q[j]) != __float_as_uint(want) && !(want != want && q[j] != q[j]);
    }
  }
  atomicAdd(mismatches, bad);
}

// Every float dividend against each divisor; the count of mismatches (0 expected).
void check_divisor() {
  std::vector<float> divisors = {30.0f, 0.8f, 0.6f, 0.4f, 0.7f, 1.0f, 2.0f, 3.0f, 7.0f, 1e-5f, 1.0f / 3.0f, 1e6f,
                                 0x1p-40f, 0x1p40f, 0x1.fffffep-1f, 1.5f};
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> log_scale(-20.0f, 20.0f);
  for (int i = 0; i < 8; ++i) divisors.push_back(std::exp2(log_scale(rng)));
  unsigned long long* mismatches = nullptr;
  check(cudaMalloc(&mismatches, sizeof(*mismatches)), "malloc");
  for (float d : divisors) {
    check(cudaMemset(mismatches, 0, sizeof(*mismatches)), "memset");
    divisor_check_kernel<<<dim3(256, 64), 256>>>(d, 1024, mismatches);
    unsigned long long bad = 0;
    check(cudaMemcpy(&bad, mismatches, sizeof(bad), cudaMemcpyDeviceToHost), "check");
    char what[96];
    std::snprintf(what, sizeof(what), "Divisor(%.9g) against __fdiv_rn, all 2^32 dividends", d);
    report(bad == 0, what, std::to_string(bad) + " quotients differ");
  }
  cudaFree(mismatches);
}

// rows x kVocab logits, made on the device: standard normal (Box-Muller on Philox draws), and
// for peaked rows one id (the row's index) 40 ahead.
__global__ void random_logits_kernel(float* logits, int64_t rows, bool peaked) {
  const int64_t n = rows * kVocab;
  const int64_t stride = 2 * int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = 2 * (int64_t(blockIdx.x) * blockDim.x + threadIdx.x); i < n; i += stride) {
    const Philox4 bits = philox4x32(uint32_t(i), uint32_t(i >> 32), 0, 0, 7, 0);
    const float r = sqrtf(-2.0f * logf(uniform_open(bits[0]))), a = 6.2831853f * uniform_open(bits[1]);
    logits[i] = r * cosf(a), logits[i + 1] = r * sinf(a);
    for (int64_t j = i; j < i + 2; ++j)
      if (peaked && j % kVocab == j / kVocab) logits[j] += 40.0f;
  }
}

// Microseconds a call of sample_rows on `rows` rows, the logits restored before each call.
float time_sampler(int64_t rows, bool peaked) {
  const size_t n = size_t(rows * kVocab);
  float *pristine = nullptr, *work = nullptr;
  __nv_bfloat16* feedback = nullptr;
  DeviceRowSample* out = nullptr;
  check(cudaMalloc(&pristine, n * sizeof(float)), "malloc");
  check(cudaMalloc(&work, n * sizeof(float)), "malloc");
  check(cudaMalloc(&feedback, n * sizeof(__nv_bfloat16)), "malloc");
  check(cudaMalloc(&out, rows * sizeof(DeviceRowSample)), "malloc");
  random_logits_kernel<<<1024, 256>>>(pristine, rows, peaked);
  cudaEvent_t start, stop;
  cudaEventCreate(&start), cudaEventCreate(&stop);
  const RandomKey key{1234, 0, 3, RandomStream::Candidate};
  float total = 0.0f;
  const int warmups = 2, reps = 10;
  for (int i = 0; i < warmups + reps; ++i) {
    check(cudaMemcpy(work, pristine, n * sizeof(float), cudaMemcpyDeviceToDevice), "restore");
    cudaEventRecord(start);
    sample_rows(work, rows, kVocab, 30.0f, 0.6f, nullptr, key, {}, true, true, feedback, out, nullptr);
    cudaEventRecord(stop);
    check(cudaEventSynchronize(stop), "sample_rows");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= warmups) total += ms;
  }
  cudaEventDestroy(start), cudaEventDestroy(stop);
  cudaFree(pristine), cudaFree(work), cudaFree(feedback), cudaFree(out);
  return 1000.0f * total / reps;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "" && mode != "--check" && mode != "--time") {
    std::fprintf(stderr, "usage: sampler_bench [--check | --time]\n");
    return 2;
  }
  if (mode != "--time") check_divisor();
  if (mode == "--check") return failures ? 1 : 0;
  std::printf("| rows | kind         | us a call | ns a row | ps an id |\n");
  std::printf("|-----:|:-------------|----------:|---------:|---------:|\n");
  for (int64_t batch : {1, 4, 16}) {
    const int64_t rows = batch * kCanvas;
    for (bool peaked : {false, true}) {
      const float us = time_sampler(rows, peaked);
      std::printf("| %4lld | %-12s | %9.1f | %8.1f | %8.1f |\n", static_cast<long long>(rows),
                  peaked ? "peaked" : "near-uniform", us, 1000.0f * us / rows, 1e6f * us / (rows * kVocab));
    }
  }
  return failures ? 1 : 0;
}
