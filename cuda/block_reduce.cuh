// A reduction over a thread block, every thread getting the result: warp shuffles, then one
// value a warp through shared memory, combined in warp order. Every thread of the block
// calls it (it has barriers).
#pragma once

namespace diffuserve::cuda {

template <class Op>
__device__ __forceinline__ float block_reduce(float v, Op op) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();  // an earlier call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = partial[0];
  for (int w = 1; w < warps; ++w) total = op(total, partial[w]);
  return total;
}

}  // namespace diffuserve::cuda
