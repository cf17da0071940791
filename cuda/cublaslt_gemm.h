// Dense products on cuBLASLt, NVIDIA's tuned GEMM library (on Hopper its kernels use wgmma
// and TMA): the CUDA backend's linears with plain bf16 weights, and those with FP8 weights
// and FP8 per-token inputs (FP8_DYNAMIC: E4M3 x E4M3 with the weight rows' and the tokens'
// scales as cuBLASLt's outer-vector scales), go here when the build found cuBLASLt
// (DIFFUSERVE_WITH_CUBLASLT). The MoE's grouped products and other packed weights stay on
// gemm.cu.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace diffuserve::cuda {

class CublasLtGemm {
 public:
  CublasLtGemm();
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // Whether cuBLASLt has an algorithm for products of X (entering as `input`) with the
  // weight w ([n, k], K contiguous; bf16, with row factors in runs (GemmMatrix::factor_rows)
  // or none, or with Fp8Token E4M3 with a scale per row) into y (rows ldy apart): the same
  // answer for every number of rows.
  //
  // A row's result must not depend on what it is batched with (DESIGN.md), while cuBLASLt
  // picks its kernel, tile and K split by the rows. So the algorithm is chosen once per
  // shape, at a reference row count, among those that sum over K in one sequence or reduce
  // fixed K slices from a workspace (never in place, whose order is not fixed), and kept:
  // the heuristic's first, or for weights too large for the L2 the fastest of its candidates
  // whose output is its first's bit for bit (fastest_alike), timed on `stream` once the work
  // queued there is done (unless it is recording a graph).
  bool supports(GemmInput input, const GemmMatrix& w, int64_t n, int64_t k, const float* y, int64_t ldy,
                cudaStream_t stream);
  // ys[i][m, n] (fp32, rows ldy apart) = X @ ws[i]^T for each weight (all [n, k] and
  // supported), X fp32 [m, k] (rows ldx apart; `gated`: gemm()'s gated rows) entering as
  // `input` says: gemm.cu's pre-pass writes its bf16 planes or E4M3 codes once into
  // `scratch` (gemm_scratch_bytes, 16-byte aligned), unless `prepared` holds them already
  // (rows not null, as gemm()'s), then one product a plane and weight, Split's lo plane's
  // added to its hi's. Plain bf16 weights stored back to back (Backend::place_together)
  // whose outputs lie one above the other (ys[i] = ys[0] + i m ldy) are one batched product
  // a plane, where cuBLASLt has an algorithm for it.
  void multiply(const float* x, int64_t m, int64_t ldx, bool gated, GemmInput input, const std::vector<GemmMatrix>& ws,
                int64_t n, int64_t k, const std::vector<float*>& ys, int64_t ldy, const PreparedX& prepared,
                void* scratch, cudaStream_t stream);

 private:
  struct Plan {
    bool usable = false;
    cublasLtMatmulAlgo_t algo{};
    // The most rows one call of the algorithm takes: a K split keeps each slice's partial
    // sums in the workspace, which grows with the rows, and cuBLASLt refuses a call whose
    // workspace would pass its size (CUBLAS_STATUS_INVALID_VALUE). Taller products go in
    // slices of rows, each row's result what it is in one call.
    int64_t max_rows = 0;
  };
  // (E4M3 or bf16 operands, alpha and beta in device memory (bf16 with row factors), n, k,
  // lda, ldy, alignment of w and y in bytes, weights batched); X's planes are always 16-byte
  // aligned
  using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int, int, int>;
  // The rows of w each product takes: all n, or a run sharing one row factor; 0 where the
  // factors have no such runs.
  static int64_t part_rows(GemmInput input, const GemmMatrix& w, int64_t n);
  // The plan for the product of w's rows [first_row, first_row + rows) into y's columns
  // there (`batches` weights of those rows back to back from w, into outputs as many rows
  // apart as X has), chosen on first use; null where none is usable.
  const Plan* usable_plan(GemmInput input, const GemmMatrix& w, int64_t first_row, int64_t rows, int64_t k,
                          const float* y, int64_t ldy, cudaStream_t stream, int batches = 1);
  // The plan for ws as one batched product at m rows (multiply); null where they are not
  // stored and written as it takes them, or cuBLASLt has no algorithm for it.
  const Plan* batch_plan(GemmInput input, const std::vector<GemmMatrix>& ws, int64_t n, int64_t k,
                         const std::vector<float*>& ys, int64_t m, int64_t ldy, cudaStream_t stream);
  // The plans of w's products, one a part (part_rows) in row order; empty where cuBLASLt
  // cannot take one of them.
  std::vector<const Plan*> part_plans(GemmInput input, const GemmMatrix& w, int64_t n, int64_t k, const float* y,
                                      int64_t ldy, cudaStream_t stream);
  // The plan for key's product of `weights` (the first product met of that key's).
  Plan choose(const Key& key, const void* weights, cudaStream_t stream);

  cublasLtHandle_t handle_ = nullptr;
  std::map<cudaStream_t, void*> workspaces_;  // one per stream: products on two streams may run at once
  std::map<Key, Plan> plans_;
  float* device_constants_ = nullptr;  // 0 and 1, alpha and beta for products whose alpha is in device memory
};

}  // namespace diffuserve::cuda
