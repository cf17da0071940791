// cp.async (sm_80 and newer): 16 bytes at a time from global to shared memory without
// passing through registers, in commit groups a thread waits for, so that the next tiles'
// copies run while the current ones are used. The GEMM (gemm.cu) and the attention kernels
// (attention_keys.cuh) stage their tiles with these.
#pragma once

#include <cstdint>

namespace diffuserve::cuda {

// A shared-memory pointer as the 32-bit address the shared-memory instructions take.
__device__ __forceinline__ uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared at address `dst`, bypassing L1; zeros instead when !copy (src
// is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool copy = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(copy ? 16 : 0));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool copy = true) {
  cp_async16(shared_address(dst), src, copy);
}
// 4 bytes the same way (src 4-byte aligned), through L1.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool copy = true) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(copy ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace diffuserve::cuda
