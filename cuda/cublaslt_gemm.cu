// cuBLASLt for the dense linears (cublaslt_gemm.h). cuBLASLt is column-major, so the
// row-major product y[m, n] = a[m, k] @ w[n, k]^T is computed as its transpose:
// y^T[n, m] = w^T (w stored [n, k] row-major is [k, n] column-major, transposed) @ a^T
// (a [m, k] row-major is [k, m] column-major, as it is): the "TN" layout, the only one
// its E4M3 products take. Their scales are outer vectors: y^T[i, j] times w's scale i
// (a weight row's) and a's scale j (a token's), applied to the finished sums; with
// fast accumulation off, the tensor cores' partial sums are added in fp32 as they go.
// A bf16 weight with row factors (decoded NVFP4) is one product per run of rows sharing a
// factor (GemmMatrix::factor_rows), the factor its alpha, read from device memory (as beta
// then is): cuBLASLt has no bf16 kernel taking alpha as a vector, one per row.
#include <algorithm>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "cublaslt_gemm.h"

namespace diffuserve::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // NVIDIA's advice for Hopper
constexpr int64_t kReferenceRows = 256;               // a canvas: the rows a denoise step multiplies
constexpr int64_t kManyRows = 64 * kReferenceRows;    // the most rows one call takes (Plan::max_rows)
constexpr int kCandidates = 8;                        // the heuristic's algorithms a product chooses among

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt error in ") + what + ": " + std::to_string(int(status)));
}

// The largest power of two (at most 16, the most any kernel asks for) dividing every byte
// address and stride given: a plan serves every operand as aligned as its key says.
int alignment(std::initializer_list<uint64_t> values) {
  int a = 16;
  for (uint64_t v : values)
    while (a > 1 && v % a) a /= 2;
  return a;
}

// Values in a row of X's planes: planes * kp (hi, then lo), as gemm.cu's pre-pass writes them.
int64_t row_values(GemmInput input, int64_t k) { return planes(input) * gemm_padded_k(k, input); }

// The operation and matrix layouts of one product at m rows (destroyed with it); `fp8`:
// E4M3 operands with outer-vector scales (set_scales gives their addresses); `device_scalars`:
// alpha and beta in device memory. `batches` > 1: that many weights stored back to back,
// each multiplying the same X into its own output, y_stride values after the one before.
struct Product {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, a = nullptr, y = nullptr;

  Product(bool fp8, bool device_scalars, int64_t m, int64_t lda, int64_t n, int64_t k, int64_t ldy, int batches = 1,
          int64_t y_stride = 0) {
    check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
    const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)), "transa");
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)), "transb");
    if (device_scalars) {
      const cublasLtPointerMode_t mode = CUBLASLT_POINTER_MODE_DEVICE;
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof(mode)), "pointer mode");
    }
    if (fp8) {
      const cublasLtMatmulMatrixScale_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      const int8_t fast_accumulation = 0;
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof(outer)), "a scales");
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof(outer)), "b scales");
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accumulation,
                                           sizeof(fast_accumulation)),
            "fast accumulation");
    }
    const cudaDataType_t type = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    check(cublasLtMatrixLayoutCreate(&w, type, uint64_t(k), uint64_t(n), k), "w layout");
    check(cublasLtMatrixLayoutCreate(&a, type, uint64_t(k), uint64_t(m), lda), "a layout");
    check(cublasLtMatrixLayoutCreate(&y, CUDA_R_32F, uint64_t(n), uint64_t(m), ldy), "y layout");
    if (batches > 1)
      for (const auto& [layout, stride] : {std::pair{w, n * k}, std::pair{a, int64_t(0)}, std::pair{y, y_stride}}) {
        check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batches, sizeof(batches)),
              "batch count");
        check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                               sizeof(stride)),
              "batch stride");
      }
  }
  void set_scales(const float* w_scales, const float* a_scales) {
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales, sizeof(w_scales)),
          "w scales");
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scales, sizeof(a_scales)),
          "a scales");
  }
  ~Product() {
    if (y) cublasLtMatrixLayoutDestroy(y);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (w) cublasLtMatrixLayoutDestroy(w);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  Product(const Product&) = delete;
  Product& operator=(const Product&) = delete;
};

// Adds to `hash` a hash of n 32-bit words, each times an odd number of its place (mod 2^64):
// a change to any one word changes it, so two outputs compare without keeping both.
__global__ void hash_words_kernel(const uint32_t* words, int64_t n, unsigned long long* hash) {
  unsigned long long h = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    h += (unsigned long long)words[i] * (2 * (unsigned long long)i + 1);
  atomicAdd(hash, h);
}

// Device memory held for one scope; null where it is not there to be had.
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) cudaGetLastError(), p = nullptr;
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// A CUDA event pair timing work queued on a stream between them.
struct Timer {
  cudaEvent_t start = nullptr, stop = nullptr;
  Timer() {
    if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) cudaGetLastError();
  }
  ~Timer() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
};

// The heuristic ranks candidates by a model of the machine: at the 26B shapes its first for
// the lm_head (n 262144, k 2816) took 581 us on the H200 where another with the same bits
// took 533. Of `candidates` for `product` (bf16 operands, alpha and beta on the host, at
// kReferenceRows rows: X x_values values, its output y_values), the index of the fastest
// whose output is candidate 0's bit for bit; 0 where the timing's operands do not fit in
// memory. Each runs on random X and the product's own weights; only those whose output
// hashes as candidate 0's are timed, so that the choice changes no result, whatever the
// timings say (tiles of other shapes summing over K in the same order give the same bits;
// another K split does not, and drops out).
size_t fastest_alike(cublasLtHandle_t handle, const Product& product, int64_t x_values, int64_t y_values,
                     std::span<const cublasLtMatmulAlgo_t> candidates, const void* weights, cudaStream_t stream) {
  if (cudaStreamSynchronize(stream) != cudaSuccess) {  // the work queued before would share the machine
    cudaGetLastError();
    return 0;
  }
  DeviceBuffer x(size_t(x_values) * 2), y(size_t(y_values) * sizeof(float)), hash(sizeof(unsigned long long)),
      workspace(kWorkspaceBytes);
  Timer timer;
  if (!x.p || !y.p || !hash.p || !workspace.p || !timer.stop) return 0;
  random_bf16(static_cast<__nv_bfloat16*>(x.p), x_values, 1, 1.0f, stream);
  const float constants[2] = {0.0f, 1.0f};
  auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(handle, product.op, &constants[1], weights, product.w, x.p, product.a, &constants[0], y.p,
                          product.y, y.p, product.y, &algo, workspace.p, kWorkspaceBytes,
                          stream) == CUBLAS_STATUS_SUCCESS;
  };
  auto output_hash = [&] {
    unsigned long long h = 0;
    if (cudaMemsetAsync(hash.p, 0, sizeof(h), stream) != cudaSuccess) return std::pair{false, h};
    hash_words_kernel<<<1024, 256, 0, stream>>>(static_cast<const uint32_t*>(y.p), y_values,
                                                static_cast<unsigned long long*>(hash.p));
    const bool ok = cudaMemcpyAsync(&h, hash.p, sizeof(h), cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
                    cudaStreamSynchronize(stream) == cudaSuccess;
    return std::pair{ok, h};
  };
  constexpr int kRuns = 4;
  size_t best = 0;
  float best_ms = 0.0f;
  unsigned long long reference = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!run(candidates[i])) {  // the warm-up, whose output is hashed
      if (i == 0) break;
      continue;
    }
    const auto [ok, h] = output_hash();
    if (!ok) break;
    if (i == 0) reference = h;
    if (h != reference) continue;
    float ms = 0.0f;
    bool ran = cudaEventRecord(timer.start, stream) == cudaSuccess;
    for (int r = 0; r < kRuns && ran; ++r) ran = run(candidates[i]);
    if (!ran || cudaEventRecord(timer.stop, stream) != cudaSuccess || cudaEventSynchronize(timer.stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, timer.start, timer.stop) != cudaSuccess)
      break;
    if (i == 0 || ms < best_ms) best = i, best_ms = ms;
  }
  cudaGetLastError();
  cudaStreamSynchronize(stream);
  return best;
}

}  // namespace

CublasLtGemm::CublasLtGemm() {
  check(cublasLtCreate(&handle_), "cublasLtCreate");
  const float constants[2] = {0.0f, 1.0f};
  if (cudaMalloc(&device_constants_, sizeof(constants)) != cudaSuccess ||
      cudaMemcpy(device_constants_, constants, sizeof(constants), cudaMemcpyHostToDevice) != cudaSuccess) {
    cudaGetLastError();
    cudaFree(device_constants_);
    cublasLtDestroy(handle_);
    throw std::runtime_error("CublasLtGemm: cannot place its constants in GPU memory");
  }
}

CublasLtGemm::~CublasLtGemm() {
  for (const auto& [stream, workspace] : workspaces_) cudaFree(workspace);
  cudaFree(device_constants_);
  cublasLtDestroy(handle_);
}

CublasLtGemm::Plan CublasLtGemm::choose(const Key& key, const void* weights, cudaStream_t stream) {
  const auto [fp8, device_scalars, n, k, lda, ldy, align_w, align_y, batches] = key;
  Plan plan;
  cublasLtMatmulPreference_t preference = nullptr;
  check(cublasLtMatmulPreferenceCreate(&preference), "preference");
  const uint64_t workspace = kWorkspaceBytes;
  check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                             sizeof(workspace)), "workspace preference");
  // Sums over K in one sequence, or over fixed slices reduced from a workspace: both give a
  // row the same result at every m once the algorithm is fixed. In-place reductions don't.
  // cuBLASLt's A is the weight, B X's planes (always 16-byte aligned), C and D the output.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> preferences[] = {
      {CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, CUBLASLT_REDUCTION_SCHEME_NONE |
                                                       CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                                                       CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, uint32_t(align_w)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, 16},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, uint32_t(align_y)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, uint32_t(align_y)}};
  for (const auto& [attribute, value] : preferences)
    check(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)), "preference");
  // Batched outputs lie one above the other, as Backend::linears keeps them.
  auto product_at = [&](int64_t m) { return Product(fp8, device_scalars, m, lda, n, k, ldy, batches, m * ldy); };
  // (The choice looks at FP8's scale modes, not their addresses: a placeholder, never read.)
  const float* const placeholder = reinterpret_cast<const float*>(uintptr_t(256));
  Product reference = product_at(kReferenceRows), one = product_at(1), many = product_at(kManyRows);
  if (fp8)
    for (Product* product : {&reference, &one, &many}) product->set_scales(placeholder, placeholder);
  cublasLtMatmulHeuristicResult_t results[kCandidates];
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle_, reference.op, reference.w, reference.a, reference.y, reference.y,
                                     preference, kCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS) return plan;
  // The candidates (the heuristic's fastest first) that also run at one row and at many.
  // (An array: nvcc 13.0's front end fails on a std::vector of cuBLASLt's anonymous struct.)
  cublasLtMatmulAlgo_t candidates[kCandidates];
  size_t count = 0;
  for (int i = 0; i < found; ++i) {
    cublasLtMatmulHeuristicResult_t check_one{}, check_many{};
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= kWorkspaceBytes &&
        cublasLtMatmulAlgoCheck(handle_, one.op, one.w, one.a, one.y, one.y, &results[i].algo, &check_one) ==
            CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulAlgoCheck(handle_, many.op, many.w, many.a, many.y, many.y, &results[i].algo, &check_many) ==
            CUBLAS_STATUS_SUCCESS)
      candidates[count++] = results[i].algo;
  }
  if (!count) return plan;
  plan.usable = true;
  plan.algo = candidates[0];
  // Rows a call may take (Plan::max_rows): kManyRows, halved while the algorithm's workspace
  // at that height would pass kWorkspaceBytes (down to kReferenceRows, whose workspace the
  // heuristic's candidates fit). Found by fuzzing on the GPU (fiftieth session): where K is
  // odd the heuristic splits K at 256 rows, and prompts of 500-700 tokens had failed.
  const auto fits = [&](const cublasLtMatmulAlgo_t& algo, int64_t m) {
    Product product = product_at(m);
    if (fp8) product.set_scales(placeholder, placeholder);
    cublasLtMatmulHeuristicResult_t result{};
    return cublasLtMatmulAlgoCheck(handle_, product.op, product.w, product.a, product.y, product.y, &algo, &result) ==
               CUBLAS_STATUS_SUCCESS &&
           result.workspaceSize <= kWorkspaceBytes;
  };
  const auto rows_taken = [&](const cublasLtMatmulAlgo_t& algo) {
    int64_t rows = kManyRows;
    while (rows > kReferenceRows && !fits(algo, rows)) rows /= 2;
    return rows;
  };
  plan.max_rows = rows_taken(plan.algo);
  // Timed where the weights are too large for the L2 to hold (so that each run reads them
  // from memory, as a forward does), the scalars are the host's (FP8's scales and bf16's row
  // factors are the product's own), and the stream is free to run the timing (not recording
  // a graph). Products of smaller weights keep the heuristic's first: timed alone (in copies
  // filling the L2 twice, to keep it cold) they chose other kernels, whose busy share of a
  // batch-1 step on the H200 rose from 1.70 to 1.96 ms (the step's other kernels run beside
  // them), the step no faster.
  int device = 0, l2_bytes = 0;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device) != cudaSuccess ||
      cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    cudaGetLastError();  // not to be had: the heuristic's first
    return plan;
  }
  if (!fp8 && !device_scalars && count > 1 && int64_t(batches) * n * k * 2 >= 2 * int64_t(l2_bytes) &&
      capture == cudaStreamCaptureStatusNone) {
    plan.algo = candidates[fastest_alike(handle_, reference, kReferenceRows * lda, batches * kReferenceRows * ldy,
                                         {candidates, count}, weights, stream)];
    plan.max_rows = rows_taken(plan.algo);
  }
  return plan;
}

int64_t CublasLtGemm::part_rows(GemmInput input, const GemmMatrix& w, int64_t n) {
  constexpr int64_t kMostParts = 4;  // a few linears stacked (gate and up: two); more stay on gemm.cu
  if (input == GemmInput::Fp8Token || !w.row_scales) return n;
  const int64_t rows = w.factor_rows;
  return rows > 0 && n % rows == 0 && n / rows <= kMostParts ? rows : 0;
}

const CublasLtGemm::Plan* CublasLtGemm::usable_plan(GemmInput input, const GemmMatrix& w, int64_t first_row,
                                                    int64_t rows, int64_t k, const float* y, int64_t ldy,
                                                    cudaStream_t stream, int batches) {
  const bool fp8 = input == GemmInput::Fp8Token;
  if (fp8 && !w.row_scales) return nullptr;
  const uint64_t row_bytes = uint64_t(k) * (fp8 ? 1 : 2);
  const Key key{fp8,
                !fp8 && w.row_scales,
                rows,
                k,
                row_values(input, k),
                ldy,
                alignment({reinterpret_cast<uintptr_t>(w.values) + first_row * row_bytes, row_bytes}),
                alignment({reinterpret_cast<uintptr_t>(y) + first_row * 4, uint64_t(ldy) * 4}),
                batches};
  auto it = plans_.find(key);
  if (it == plans_.end())
    it = plans_.emplace(key, choose(key, static_cast<const uint8_t*>(w.values) + first_row * row_bytes, stream)).first;
  return it->second.usable ? &it->second : nullptr;
}

std::vector<const CublasLtGemm::Plan*> CublasLtGemm::part_plans(GemmInput input, const GemmMatrix& w, int64_t n,
                                                                int64_t k, const float* y, int64_t ldy,
                                                                cudaStream_t stream) {
  const int64_t rows = part_rows(input, w, n);
  std::vector<const Plan*> plans;
  if (w.tiled || !rows) return plans;
  for (int64_t first = 0; first < n; first += rows) {
    const Plan* plan = usable_plan(input, w, first, rows, k, y, ldy, stream);
    if (!plan) return {};
    plans.push_back(plan);
  }
  return plans;
}

const CublasLtGemm::Plan* CublasLtGemm::batch_plan(GemmInput input, const std::vector<GemmMatrix>& ws, int64_t n,
                                                   int64_t k, const std::vector<float*>& ys, int64_t m, int64_t ldy,
                                                   cudaStream_t stream) {
  if (ws.size() < 2 || input == GemmInput::Fp8Token) return nullptr;
  const int64_t bytes = n * k * 2;
  for (size_t i = 0; i < ws.size(); ++i)
    if (ws[i].row_scales || ws[i].tiled ||
        static_cast<const uint8_t*>(ws[i].values) != static_cast<const uint8_t*>(ws[0].values) + int64_t(i) * bytes ||
        ys[i] != ys[0] + int64_t(i) * m * ldy)
      return nullptr;
  return usable_plan(input, ws[0], 0, n, k, ys[0], ldy, stream, int(ws.size()));
}

bool CublasLtGemm::supports(GemmInput input, const GemmMatrix& w, int64_t n, int64_t k, const float* y, int64_t ldy,
                            cudaStream_t stream) {
  return !part_plans(input, w, n, k, y, ldy, stream).empty();
}

void CublasLtGemm::multiply(const float* x, int64_t m, int64_t ldx, bool gated, GemmInput input,
                            const std::vector<GemmMatrix>& ws, int64_t n, int64_t k, const std::vector<float*>& ys,
                            int64_t ldy, const PreparedX& prepared, void* scratch, cudaStream_t stream) {
  if (ws.size() != ys.size()) throw std::invalid_argument("CublasLtGemm::multiply: one output a weight");
  if (reinterpret_cast<uintptr_t>(scratch) % 16) throw std::invalid_argument("CublasLtGemm::multiply: unaligned scratch");
  std::vector<std::vector<const Plan*>> chosen;
  for (size_t i = 0; i < ws.size(); ++i) {
    chosen.push_back(part_plans(input, ws[i], n, k, ys[i], ldy, stream));
    if (chosen.back().empty())
      throw std::invalid_argument("CublasLtGemm::multiply: cuBLASLt has no algorithm for this product");
  }
  if (m <= 0 || n <= 0) return;
  void*& workspace = workspaces_[stream];
  if (!workspace && cudaMalloc(&workspace, kWorkspaceBytes) != cudaSuccess) {
    cudaGetLastError();
    workspace = nullptr;
    throw std::runtime_error("out of GPU memory allocating cuBLASLt's workspace");
  }
  const bool fp8 = input == GemmInput::Fp8Token;
  if (prepared.rows && (gated || prepared.input != input))
    throw std::invalid_argument("CublasLtGemm::multiply: a prepared X is plain rows of the product's input kind");
  const PreparedX x_rows =
      prepared.rows ? prepared : prepare_gemm_input(x, m, ldx, gated, k, input, /*permuted=*/false, scratch, stream);
  const int64_t kp = x_rows.kp, row_bytes = k * (fp8 ? 1 : 2);
  const float host_constants[2] = {0.0f, 1.0f};
  // Plane `plane` of X's rows from `first` on.
  auto x_plane = [&](int plane, int64_t first) {
    return x_rows.rows + first * x_rows.row_bytes() + plane * kp * (fp8 ? 1 : 2);
  };
  // f(first, rows) for X's rows in slices of at most max_rows (Plan::max_rows): one slice of
  // all m rows unless the algorithms' workspace bounds them.
  auto in_slices = [&](int64_t max_rows, auto f) {
    for (int64_t first = 0; first < m; first += max_rows) f(first, std::min(max_rows, m - first));
  };
  if (const Plan* batched = batch_plan(input, ws, n, k, ys, m, ldy, stream)) {
    in_slices(batched->max_rows, [&](int64_t first, int64_t rows) {
      Product product(false, false, rows, row_values(input, k), n, k, ldy, int(ws.size()), m * ldy);
      float* y = ys[0] + first * ldy;
      for (int plane = 0; plane < planes(input); ++plane)
        check(cublasLtMatmul(handle_, product.op, &host_constants[1], ws[0].values, product.w, x_plane(plane, first),
                             product.a, &host_constants[plane ? 1 : 0], y, product.y, y, product.y, &batched->algo,
                             workspace, kWorkspaceBytes, stream),
              "cublasLtMatmul");
    });
    return;
  }
  for (size_t i = 0; i < ws.size(); ++i) {
    const GemmMatrix& w = ws[i];
    const bool device_scalars = !fp8 && w.row_scales;  // alpha: the part's row factor
    const float* constants = device_scalars ? device_constants_ : host_constants;
    const int64_t rows = part_rows(input, w, n);
    int64_t max_rows = kManyRows;
    for (const Plan* plan : chosen[i]) max_rows = std::min(max_rows, plan->max_rows);
    in_slices(max_rows, [&](int64_t first_x, int64_t x_count) {
      Product product(fp8, device_scalars, x_count, row_values(input, k), rows, k, ldy);
      if (fp8) product.set_scales(w.row_scales, x_rows.scales + first_x);
      for (size_t part = 0; part < chosen[i].size(); ++part) {
        const int64_t first = int64_t(part) * rows;
        const float* alpha = device_scalars ? w.row_scales + first : &constants[1];
        const uint8_t* values = static_cast<const uint8_t*>(w.values) + first * row_bytes;
        float* y = ys[i] + first_x * ldy + first;
        for (int plane = 0; plane < planes(input); ++plane) {
          check(cublasLtMatmul(handle_, product.op, alpha, values, product.w, x_plane(plane, first_x), product.a,
                               &constants[plane ? 1 : 0], y, product.y, y, product.y, &chosen[i][part]->algo,
                               workspace, kWorkspaceBytes, stream),
                "cublasLtMatmul");
        }
      }
    });
  }
}

}  // namespace diffuserve::cuda
