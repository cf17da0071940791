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
#include "cublaslt_gemm.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace diffuserve::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // NVIDIA's advice for Hopper
constexpr int64_t kReferenceRows = 256;               // a canvas: the rows a denoise step multiplies

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

CublasLtGemm::Plan CublasLtGemm::choose(const Key& key) {
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
  Product reference = product_at(kReferenceRows), one = product_at(1), many = product_at(64 * kReferenceRows);
  if (fp8) {  // the choice looks at the scales' modes, not their addresses: a placeholder, never read
    const float* const placeholder = reinterpret_cast<const float*>(uintptr_t(256));
    for (Product* product : {&reference, &one, &many}) product->set_scales(placeholder, placeholder);
  }
  cublasLtMatmulHeuristicResult_t results[8];
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, reference.op, reference.w, reference.a,
                                                               reference.y, reference.y, preference, 8, results, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS) return plan;
  // The first (fastest by the heuristic) that also runs at one row and at many.
  for (int i = 0; i < found && !plan.usable; ++i) {
    cublasLtMatmulHeuristicResult_t check_one{}, check_many{};
    plan.usable = results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= kWorkspaceBytes &&
                  cublasLtMatmulAlgoCheck(handle_, one.op, one.w, one.a, one.y, one.y, &results[i].algo,
                                          &check_one) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulAlgoCheck(handle_, many.op, many.w, many.a, many.y, many.y, &results[i].algo,
                                          &check_many) == CUBLAS_STATUS_SUCCESS;
    if (plan.usable) plan.algo = results[i].algo;
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
                                                    int64_t rows, int64_t k, const float* y, int64_t ldy, int batches) {
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
  if (it == plans_.end()) it = plans_.emplace(key, choose(key)).first;
  return it->second.usable ? &it->second : nullptr;
}

std::vector<const CublasLtGemm::Plan*> CublasLtGemm::part_plans(GemmInput input, const GemmMatrix& w, int64_t n,
                                                                int64_t k, const float* y, int64_t ldy) {
  const int64_t rows = part_rows(input, w, n);
  std::vector<const Plan*> plans;
  if (w.tiled || !rows) return plans;
  for (int64_t first = 0; first < n; first += rows) {
    const Plan* plan = usable_plan(input, w, first, rows, k, y, ldy);
    if (!plan) return {};
    plans.push_back(plan);
  }
  return plans;
}

const CublasLtGemm::Plan* CublasLtGemm::batch_plan(GemmInput input, const std::vector<GemmMatrix>& ws, int64_t n,
                                                   int64_t k, const std::vector<float*>& ys, int64_t m, int64_t ldy) {
  if (ws.size() < 2 || input == GemmInput::Fp8Token) return nullptr;
  const int64_t bytes = n * k * 2;
  for (size_t i = 0; i < ws.size(); ++i)
    if (ws[i].row_scales || ws[i].tiled ||
        static_cast<const uint8_t*>(ws[i].values) != static_cast<const uint8_t*>(ws[0].values) + int64_t(i) * bytes ||
        ys[i] != ys[0] + int64_t(i) * m * ldy)
      return nullptr;
  return usable_plan(input, ws[0], 0, n, k, ys[0], ldy, int(ws.size()));
}

bool CublasLtGemm::supports(GemmInput input, const GemmMatrix& w, int64_t n, int64_t k, const float* y, int64_t ldy) {
  return !part_plans(input, w, n, k, y, ldy).empty();
}

void CublasLtGemm::multiply(const float* x, int64_t m, int64_t ldx, bool gated, GemmInput input,
                            const std::vector<GemmMatrix>& ws, int64_t n, int64_t k, const std::vector<float*>& ys,
                            int64_t ldy, const PreparedX& prepared, void* scratch, cudaStream_t stream) {
  if (ws.size() != ys.size()) throw std::invalid_argument("CublasLtGemm::multiply: one output a weight");
  if (reinterpret_cast<uintptr_t>(scratch) % 16) throw std::invalid_argument("CublasLtGemm::multiply: unaligned scratch");
  std::vector<std::vector<const Plan*>> chosen;
  for (size_t i = 0; i < ws.size(); ++i) {
    chosen.push_back(part_plans(input, ws[i], n, k, ys[i], ldy));
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
  auto x_plane = [&](int plane) { return x_rows.rows + plane * kp * (fp8 ? 1 : 2); };
  if (const Plan* batched = batch_plan(input, ws, n, k, ys, m, ldy)) {
    Product product(false, false, m, row_values(input, k), n, k, ldy, int(ws.size()), m * ldy);
    for (int plane = 0; plane < planes(input); ++plane)
      check(cublasLtMatmul(handle_, product.op, &host_constants[1], ws[0].values, product.w, x_plane(plane), product.a,
                           &host_constants[plane ? 1 : 0], ys[0], product.y, ys[0], product.y, &batched->algo,
                           workspace, kWorkspaceBytes, stream),
            "cublasLtMatmul");
    return;
  }
  for (size_t i = 0; i < ws.size(); ++i) {
    const GemmMatrix& w = ws[i];
    const bool device_scalars = !fp8 && w.row_scales;  // alpha: the part's row factor
    const float* constants = device_scalars ? device_constants_ : host_constants;
    const int64_t rows = part_rows(input, w, n);
    Product product(fp8, device_scalars, m, row_values(input, k), rows, k, ldy);
    if (fp8) product.set_scales(w.row_scales, x_rows.scales);
    for (size_t part = 0; part < chosen[i].size(); ++part) {
      const int64_t first = int64_t(part) * rows;
      const float* alpha = device_scalars ? w.row_scales + first : &constants[1];
      const uint8_t* values = static_cast<const uint8_t*>(w.values) + first * row_bytes;
      float* y = ys[i] + first;
      for (int plane = 0; plane < planes(input); ++plane) {
        check(cublasLtMatmul(handle_, product.op, alpha, values, product.w, x_plane(plane), product.a,
                             &constants[plane ? 1 : 0], y, product.y, y, product.y, &chosen[i][part]->algo, workspace,
                             kWorkspaceBytes, stream),
              "cublasLtMatmul");
      }
    }
  }
}

}  // namespace diffuserve::cuda
