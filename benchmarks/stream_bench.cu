// How fast the GPU's memory streams into the multiprocessors, read the ways the kernels read
// it: the ceiling for the MoE at small batch, whose job is streaming expert weights
// (cuda/gemm.cu). Prints one table of TB/s:
//   - a 4 GB buffer read into registers (16-byte loads, 8 in flight a thread), and through a
//     ring of shared-memory stages by cp.async (as gemm.cu copies), at a few occupancies;
//   - the experts' weights at DiffusionGemma-26B shapes (gate/up: 128 x 1408 rows of 5,632
//     bytes; down: 128 x 2816 rows of 1,408) read as gemm.cu's 32-row tiles read them: a
//     block a 128-row tile, each stage 128 bytes of each of its rows, three stages, three
//     blocks a multiprocessor; and, for comparison, the same bytes stored tiled, each
//     stage's 16 KB one contiguous run;
//   - a device-to-device copy, counting bytes read and written: the copy bandwidth that
//     benchmarks/step_latency.py's roofline divides by.
// Nothing is computed on the bytes beyond what keeps the compiler from dropping the reads.
// Build and run (any sm_80 or newer GPU; sm_90a for the H200):
//   nvcc -std=c++20 -arch=sm_90a -O3 -I cuda benchmarks/stream_bench.cu -o /tmp/stream_bench && /tmp/stream_bench
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "bench_common.cuh"
#include "cp_async.cuh"

using namespace kernel_bench;
using namespace diffuserve::cuda;

namespace {

// Keeps a read alive: never true for the buffers here (all bytes 1).
__device__ __forceinline__ void keep(uint32_t v, uint32_t* sink) {
  if (v == 0x12345678u) *sink = v;
}

// n 16-byte words into registers, grid-stride, 8 loads in flight a thread.
__global__ void read_registers_kernel(const uint4* p, int64_t n, uint32_t* sink) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  uint32_t acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  keep(acc, sink);
}

// The ring both kernels below stream through: `count` stages' bytes, stage t by
// load(slot, t) into slot t % kStages, kStages - 1 in flight while one is "used".
template <int kStages, int kStageBytes, class Load>
__device__ void stream_ring(uint8_t* smem, int64_t count, Load load, uint32_t* sink) {
  uint32_t acc = 0;
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count) load(smem + s * kStageBytes, s);
    cp_async_commit();
  }
  for (int64_t t = 0; t < count; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < count) load(smem + (t + kStages - 1) % kStages * kStageBytes, t + kStages - 1);
    cp_async_commit();
    acc ^= reinterpret_cast<const uint32_t*>(smem + t % kStages * kStageBytes)[threadIdx.x];
  }
  keep(acc, sink);
}

// Contiguous chunks of kChunk bytes, chunk c to block c % gridDim.x.
template <int kChunk, int kStages>
__global__ void read_ring_kernel(const uint8_t* p, int64_t chunks, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int64_t count = blockIdx.x < chunks ? (chunks - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  stream_ring<kStages, kChunk>(
      smem, count,
      [&](uint8_t* stage, int64_t t) {
        const uint8_t* src = p + (blockIdx.x + t * gridDim.x) * kChunk;
        for (int o = threadIdx.x * 16; o < kChunk; o += blockDim.x * 16) cp_async16(stage + o, src + o);
      },
      sink);
}

// Block b reads tile b: 128 rows of row_bytes, stage t the bytes [128 t, 128 t + 128) of every
// row (kTiled: the tile's stage t stored as one contiguous 16 KB run).
template <bool kTiled>
__global__ void read_tiles_kernel(const uint8_t* p, int row_bytes, uint32_t* sink) {
  constexpr int kStages = 3, kStageBytes = 128 * 128;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint8_t* tile = p + int64_t(blockIdx.x) * 128 * row_bytes;
  stream_ring<kStages, kStageBytes>(
      smem, row_bytes / 128,
      [&](uint8_t* stage, int64_t t) {
        for (int c = threadIdx.x; c < kStageBytes / 16; c += blockDim.x) {
          const int row = c / 8, chunk = c % 8;
          cp_async16(stage + 16 * c, kTiled ? tile + t * kStageBytes + 16 * c
                                            : tile + int64_t(row) * row_bytes + 128 * t + 16 * chunk);
        }
      },
      sink);
}

void print_row(const char* what, double bytes, float ms) {
  std::printf("| %-58s | %8.1f | %5.2f |\n", what, ms * 1e3, bytes / (ms * 1e-3) / 1e12);
}

}  // namespace

int main() {
  const int64_t bytes = int64_t(4) << 30;
  uint8_t* buf = nullptr;
  uint32_t* sink = nullptr;
  check(cudaMalloc(&buf, bytes), "malloc");
  check(cudaMalloc(&sink, sizeof(uint32_t)), "malloc");
  check(cudaMemset(buf, 1, bytes), "memset");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "multiprocessors");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device");
  std::printf("%s, %d multiprocessors\n\n| read | us | TB/s |\n|:--|--:|--:|\n", prop.name, sms);

  for (int blocks : {2, 4, 8}) {
    char what[96];
    std::snprintf(what, sizeof what, "4 GB into registers, %d blocks of 512 a multiprocessor", blocks);
    print_row(what, double(bytes),
              time_ms([&] { read_registers_kernel<<<sms * blocks, 512>>>((const uint4*)buf, bytes / 16, sink); }));
  }
  auto ring = [&](auto kernel, int chunk, int stages, int blocks) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, chunk * stages), "smem");
    char what[96];
    std::snprintf(what, sizeof what, "4 GB by cp.async, %d KB x %d stages, %d blocks a multiprocessor", chunk / 1024,
                  stages, blocks);
    print_row(what, double(bytes),
              time_ms([&] { kernel<<<sms * blocks, 128, chunk * stages>>>(buf, bytes / chunk, sink); }));
  };
  ring(read_ring_kernel<16384, 3>, 16384, 3, 3);
  ring(read_ring_kernel<16384, 6>, 16384, 6, 2);
  ring(read_ring_kernel<32768, 3>, 32768, 3, 2);

  auto tiles = [&](const char* what, auto kernel, int row_bytes, int64_t total) {
    constexpr int kSmem = 3 * 128 * 128;
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem), "smem");
    const int blocks = int(total / (128 * int64_t(row_bytes)));
    print_row(what, double(total), time_ms([&] { kernel<<<blocks, 128, kSmem>>>(buf, row_bytes, sink); }));
  };
  const int64_t up = int64_t(128) * 1408 * 5632, down = int64_t(128) * 2816 * 1408;
  tiles("experts' gate/up, as gemm.cu's 32-row tiles read it", read_tiles_kernel<false>, 5632, up);
  tiles("experts' gate/up, stored tiled", read_tiles_kernel<true>, 5632, up);
  tiles("experts' down, as gemm.cu's 32-row tiles read it", read_tiles_kernel<false>, 1408, down);
  tiles("experts' down, stored tiled", read_tiles_kernel<true>, 1408, down);

  print_row("device-to-device copy of 2 GB (bytes read and written)", double(bytes),
            time_ms([&] { cudaMemcpyAsync(buf + bytes / 2, buf, bytes / 2, cudaMemcpyDeviceToDevice); }));
  check(cudaGetLastError(), "kernels");
  cudaFree(buf), cudaFree(sink);
  return 0;
}
