// Every kernel of the CUDA backend is launched with launch() and starts with
// wait_for_earlier_kernels(): programmatic dependent launch (Hopper). A step is a
// thousand short kernels in a row on one stream; launched plainly, each one's blocks are
// scheduled only once the one before has drained, a few microseconds of an idle GPU per
// kernel. With the launch attribute a kernel's blocks may be scheduled as soon as every
// block of the one before has started (and called launch_dependents), and then wait in
// griddepcontrol.wait until it has finished and its writes are visible: the scheduling
// overlaps the tail of the kernel before, the order of memory accesses stays the
// stream's. The wait comes before any global store and any load of what a kernel may
// write, so no kernel reads or overwrites what an earlier one still uses; and as each
// kernel finishes only after its own wait, the wait covers every kernel before it, not
// just the last. (The attention's kernels read their launch's plan tables, which only
// copies write, before it: their look-ups then overlap the tail of the kernel before.)
// Kernels of other libraries (cuBLASLt) and copies keep the plain stream order.
// DIFFUSERVE_PDL=0 launches plainly, to compare.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace diffuserve::cuda {

__device__ __forceinline__ void wait_for_earlier_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // This kernel's blocks have all started once each has passed here: the next kernel's
  // may be scheduled into the room they leave.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the environment variable `name` is "0": the switches that turn a fast path off,
// to compare (DIFFUSERVE_WGMMA, DIFFUSERVE_CUBLASLT, DIFFUSERVE_CUDA_GRAPHS,
// DIFFUSERVE_CUDA_BRANCHES, DIFFUSERVE_PDL).
bool switched_off(const char* name);

// Whether Hopper's wgmma kernels run: the build has sm_90a code (DIFFUSERVE_SM90A), the GPU
// (the first one asked about) is an sm_90 one, and DIFFUSERVE_WGMMA is not 0.
bool wgmma_enabled();

// The current device's multiprocessors (at least 1).
int multiprocessors();

// Blocks of `kernel` (`threads` threads, `shared_bytes` of dynamic shared memory, which this
// allows it) that run at once on the current device: multiprocessors x blocks per one.
template <class... Params>
int resident_blocks(void (*kernel)(Params...), int threads, int shared_bytes) {
  int per_multiprocessor = 0;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, threads, shared_bytes);
  return (per_multiprocessor > 1 ? per_multiprocessor : 1) * multiprocessors();
}

// Clusters of `cluster_blocks` blocks of `kernel` along x that run at once on the current
// device (resident_blocks where cluster_blocks is 1).
template <class... Params>
int resident_clusters(int cluster_blocks, void (*kernel)(Params...), int threads, int shared_bytes) {
  if (cluster_blocks == 1) return resident_blocks(kernel, threads, shared_bytes);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim = {unsigned(cluster_blocks), 1, 1};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(cluster_blocks * multiprocessors()));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = size_t(shared_bytes);
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
  return clusters > 1 ? clusters : 1;
}

// Whether launch() uses programmatic dependent launch: an sm_90 or newer GPU (the first
// one asked about) and DIFFUSERVE_PDL not 0.
bool programmatic_launch();

// kernel<<<grid, block, shared_bytes, stream>>>(args...), with programmatic dependent
// launch where programmatic_launch() says so, and the blocks in clusters of
// `cluster_blocks` along x where that is more than 1 (sm_90 code; grid.x a multiple). A grid
// with no blocks launches nothing. A launch the device refuses (its shared memory, its
// grid) throws: <<<>>> leaves the error for a later check, which a pass outside a graph
// never made, and a kernel that never ran had left its output as the memory held it.
template <class... Params, class... Args>
void launch_clusters(int cluster_blocks, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                     cudaStream_t stream, Args&&... args) {
  if (!grid.x || !grid.y || !grid.z) return;
  cudaLaunchAttribute attributes[2] = {};
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attributes;
  if (programmatic_launch()) {
    attributes[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[config.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_blocks > 1) {
    attributes[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attributes[config.numAttrs++].val.clusterDim = {unsigned(cluster_blocks), 1, 1};
  }
  if (const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...); e != cudaSuccess) {
    cudaGetLastError();  // not left for an unrelated later check
    throw std::runtime_error(std::string("CUDA kernel launch failed (grid ") + std::to_string(grid.x) + "x" +
                             std::to_string(grid.y) + "x" + std::to_string(grid.z) + ", " +
                             std::to_string(block.x * block.y * block.z) + " threads, " +
                             std::to_string(shared_bytes) + " bytes of shared memory): " + cudaGetErrorString(e));
  }
}
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
            Args&&... args) {
  launch_clusters(1, kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
}

}  // namespace diffuserve::cuda
