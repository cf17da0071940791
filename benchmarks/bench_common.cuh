// What the kernel benches (gemm_bench.cu, attention_bench.cu) share: the failure count,
// CUDA error checks, one line per check, uploads, and event timing.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace kernel_bench {

inline int failures = 0;  // checks that failed; main() returns nonzero if any did

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error %s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

// One "ok" or "FAIL" line (run_on_gpu.sh counts the "ok" ones).
inline void report(bool ok, const std::string& what, const std::string& detail) {
  std::printf("%-6s %-58s: %s\n", ok ? "ok" : "FAIL", what.c_str(), detail.c_str());
  if (!ok) ++failures;
}

template <typename T>
T* upload(const std::vector<T>& v) {
  T* p = nullptr;
  check(cudaMalloc(&p, std::max<size_t>(v.size(), 1) * sizeof(T)), "malloc");
  check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return p;
}

// Milliseconds per call of `call` (which queues work on the default stream): 3 warm-up
// calls, then the mean of 20 between two events.
template <typename Call>
float time_ms(Call call) {
  for (int i = 0; i < 3; ++i) call();
  check(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  const int reps = 20;
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) call();
  cudaEventRecord(b);
  check(cudaEventSynchronize(b), "bench");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a), cudaEventDestroy(b);
  return ms / reps;
}

}  // namespace kernel_bench
