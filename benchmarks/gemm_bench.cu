// The CUDA GEMM (cuda/gemm.cu) on its own: correctness against a double-precision host
// reference over edge cases (tails in M, N and K, K not a multiple of 8, row_map gathers,
// many segments with unused tile slots, ldx / ldy wider than K / N, split-K, RoundBf16),
// for bf16 weights and packed FP8 / NVFP4 ones (the reference multiplies the values
// packed_weight.h's dequantize gives, as model.cpp loads them; K not a multiple of 16 / 32
// / 64 takes the byte-by-byte loads), and for FP8 weights with FP8 per-token X
// (Fp8Token: the reference is sum(code_x * code_w) * s_x * s_w from the host's
// activation_quant.h codes, and the product must also match the fake-quantized fp32 path,
// quantize_input then Split); bitwise agreement of the tile shapes (batch invariance; the
// wgmma tiles' too, where the build and GPU have them); then timings at DiffusionGemma-26B
// shapes. Before any of that, host checks that need no GPU: E4M3 code bytes, an emulation
// of ldmatrix and the MMA fragment layouts (PTX ISA) with gemm_tile.cuh's addressing and
// E4M3 unpacking, and the K order of decoded packed weights. Build and run:
//   nvcc -std=c++20 -arch=sm_90a -DDIFFUSERVE_SM90A -O3 -I cpp/src -I cpp/include -I cuda benchmarks/gemm_bench.cu \
//       cuda/gemm.cu cuda/kernels.cu cuda/launch.cu cpp/src/packed_weight.cpp cpp/src/sampler.cpp cpp/src/dtype.cpp \
//       -o /tmp/gemm_bench
//       && /tmp/gemm_bench
// (--check: the checks alone; --host: the host checks alone, on a machine without a GPU;
// --moe [TOKENS], --dense: the MoE timings (at TOKENS tokens), the dense ones at 256 rows,
// alone).
// Built with cuBLASLt as well (add -DDIFFUSERVE_WITH_CUBLASLT cuda/cublaslt_gemm.cu -lcublasLt
// and its include and library paths), it checks the dense bf16 products the CUDA backend
// sends there the same way ("cuBLASLt" in place of a tile height), that a row's result is
// the same whatever rows it is computed with, and times them beside gemm.cu's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "activation_quant.h"
#include "bench_common.cuh"
#include "gemm_tile.cuh"
#include "kernels.h"
#include "packed_decode.cuh"
#ifdef DIFFUSERVE_WITH_CUBLASLT
#include "cublaslt_gemm.h"
#endif
#include "packed_weight.h"

using namespace kernel_bench;
using namespace diffuserve;
using namespace diffuserve::cuda;

namespace {

float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// run()'s and bench()'s "tile height" for the product on cuBLASLt.
constexpr int kCublasLt = 0;
std::string engine_name(int tile_rows) {
  return tile_rows == kCublasLt ? "cuBLASLt" : "tile " + std::to_string(tile_rows);
}
#ifdef DIFFUSERVE_WITH_CUBLASLT
CublasLtGemm& cublaslt() {
  static CublasLtGemm gemm;
  return gemm;
}
#endif

// The weights' format, "fp8x8" for FP8 weights with FP8 per-token X, and with an "x" after
// it ("bf16x", "fp8x", "nvfp4x") for X rounded to bf16.
const char* format_name(WeightFormat f, GemmInput input = GemmInput::Split) {
  if (input == GemmInput::Fp8Token) return "fp8x8";
  const bool rounded = input == GemmInput::RoundBf16;
  if (f == WeightFormat::Plain) return rounded ? "bf16x" : "bf16";
  if (f == WeightFormat::Fp8) return rounded ? "fp8x" : "fp8";
  return rounded ? "nvfp4x" : "nvfp4";
}

// E4M3 codes (activation_quant.h): every finite code's value encodes back to the code, and
// quantized values encode to the code whose value they are, over scales and magnitudes.
void check_e4m3_codes() {
  int64_t wrong = 0;
  for (int c = 0; c < 256; ++c)
    if (fp8_is_number(uint8_t(c)) && e4m3_code(fp8_e4m3_to_f32(uint8_t(c))) != c) ++wrong;
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int i = 0; i < 200000; ++i) {
    const float scale = std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, int(rng() % 40) - 20);
    const float x = d(rng) * scale * std::ldexp(1.0f, int(rng() % 20) - 4);
    const float value = quantize_e4m3(x, scale);
    if (fp8_e4m3_to_f32(e4m3_code(value)) != value) ++wrong;
  }
  report(!wrong, "e4m3 codes of quantized values (host)", std::to_string(wrong) + " wrong");
}

// The emulation's stand-in for e4m3x4_to_f16: each code in its fp16 value's 16-bit slot.
struct CodeSlots {
  DS_HOST_DEVICE void operator()(uint32_t codes, uint32_t& lo, uint32_t& hi) const {
    lo = (codes & 0xff) | (codes >> 8 & 0xff) << 16;
    hi = (codes >> 16 & 0xff) | (codes >> 24) << 16;
  }
};

// ldmatrix.x4 and the MMA fragments emulated on the host over a random tile of E4M3 codes
// stored as the kernel stores it (gemm_tile.cuh's swizzle): per 32-byte K step, each lane
// loads A and B registers with the kernel's addressing and unpacks them (e4m3_a_halves /
// e4m3_b_halves, the "fp16" pairs here holding code bytes in their value slots); the two
// fp16 m16n8k16 MMAs, as the PTX ISA defines their fragments, must then give the exact
// product of the 16 x K A rows and 8 x K W rows.
void check_fragments() {
  constexpr int kRows = 64, kK = kRowBytes;  // one stage: 4 steps of 32 bytes
  std::mt19937 rng(4);
  std::vector<uint8_t> tile(kRows * kRowBytes);
  std::vector<uint8_t> value(kRows * kK);  // [row][k], as stored before swizzling
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kK; ++c) {
      uint8_t code = uint8_t(rng());
      while (!fp8_is_number(code)) code = uint8_t(rng());  // no NaN
      value[r * kK + c] = code;
      tile[swizzle(r, c / 16) + c % 16] = code;
    }
  // Register j of lane l after ldmatrix.x4: the 4 bytes at byte 4 (l % 4) of row l / 4 of
  // the matrix whose rows lanes 8j..8j+7 give (their (row, chunk) by `address`).
  auto ldmatrix = [&](auto address, int lane, uint32_t* r) {
    for (int j = 0; j < 4; ++j) {
      const auto [row, chunk] = address(8 * j + lane / 4);
      std::memcpy(&r[j], &tile[swizzle(row, chunk) + 4 * (lane % 4)], 4);
    }
  };
  auto slot_value = [](uint32_t pair, int e) { return double(fp8_e4m3_to_f32(uint8_t(pair >> (16 * e)))); };
  int64_t wrong = 0;
  for (int a_row0 : {0, 16, 48})
    for (int b_row0 : {0, 16, 40}) {
      double d[16][16] = {};  // rows x columns of two n8 tiles
      for (int ks = 0; ks < kK / 32; ++ks) {
        uint32_t a[32][2][4], b[32][2][2][2];  // [lane][half][register]; b: [lane][n8 tile][half][register]
        for (int lane = 0; lane < 32; ++lane) {
          uint32_t r[4];
          ldmatrix([&](int l) { return std::pair{a_fragment_row(a_row0, l), a_fragment_chunk(ks, l)}; }, lane, r);
          e4m3_a_halves(r, a[lane], CodeSlots{});
          ldmatrix([&](int l) { return std::pair{b_fragment_row(b_row0, l), b_fragment_chunk(ks, l)}; }, lane, r);
          e4m3_b_halves(r, b[lane][0], CodeSlots{});
          e4m3_b_halves(r + 2, b[lane][1], CodeSlots{});
        }
        // m16n8k16, PTX ISA: A register j of lane l holds row g + 8 (j % 2), columns
        // 2t + 8 (j / 2) + e; B register j holds column g, rows 2t + 8 j + e (g = l / 4,
        // t = l % 4, e = 0, 1 the low and high half). D[m][n] = sum over k of A[m][k] B[k][n].
        for (int nt = 0; nt < 2; ++nt)
          for (int half = 0; half < 2; ++half) {
            double am[16][16], bm[16][8];
            for (int l = 0; l < 32; ++l)
              for (int e = 0; e < 2; ++e) {
                for (int j = 0; j < 4; ++j) am[l / 4 + 8 * (j % 2)][2 * (l % 4) + 8 * (j / 2) + e] = slot_value(a[l][half][j], e);
                for (int j = 0; j < 2; ++j) bm[2 * (l % 4) + 8 * j + e][l / 4] = slot_value(b[l][nt][half][j], e);
              }
            for (int m = 0; m < 16; ++m)
              for (int n = 0; n < 8; ++n)
                for (int k = 0; k < 16; ++k) d[m][8 * nt + n] += am[m][k] * bm[k][n];
          }
      }
      for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
          double want = 0;
          for (int k = 0; k < kK; ++k)
            want += double(fp8_e4m3_to_f32(value[(a_row0 + m) * kK + k])) *
                    double(fp8_e4m3_to_f32(value[(b_row0 + n) * kK + k]));
          if (d[m][n] != want) ++wrong;
        }
    }
  report(!wrong, "ldmatrix + E4M3 halves + m16n8k16 emulation (host)", std::to_string(wrong) + " of 2304 outputs wrong");
}

// Weights stored tiled (gemm_tile.cuh): every 16-byte chunk of a matrix has one place, and
// a (row block, slice)'s 128 rows are one contiguous 16 KB run, laid out as the swizzled
// shared-memory tile, so that copying it in order fills the tile.
void check_tiled_layout() {
  const int64_t n = 384, slices = 5;
  std::vector<int> seen(size_t(n * slices * kRowBytes / 16), 0);
  int64_t misplaced = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t s = 0; s < slices; ++s)
      for (int c = 0; c < kRowBytes / 16; ++c) {
        const int64_t at = tiled_offset(r, s, c, slices), run = (r / 128 * slices + s) * 128 * kRowBytes;
        ++seen[size_t(at / 16)];
        if (at % 16 || at - run != swizzle(int(r % 128), c)) ++misplaced;
      }
  const int64_t twice = std::count_if(seen.begin(), seen.end(), [](int v) { return v != 1; });
  report(!misplaced && !twice, "tiled weights: chunk places (host)",
         std::to_string(misplaced) + " misplaced, " + std::to_string(twice) + " not once");
}

// The K order of decoded packed weights (gemm_tile.cuh): packed_k_source permutes each
// 64-column slice, and the X column at each of lane l's A fragment positions (bf16
// m16n8k16: columns 2t + 8j + e of K step ks, t = l % 4) is the W column its B fragment
// decodes there: value 4ks + 2j + e of the lane's 16, i.e. column 16t + 4ks + 2j + e.
void check_packed_order() {
  int64_t wrong = 0;
  std::vector<int> seen(64, 0);
  for (int position = 0; position < 64; ++position) ++seen[packed_k_source(position)];
  for (int column = 0; column < 64; ++column) wrong += seen[column] != 1;
  for (int t = 0; t < 4; ++t)
    for (int ks = 0; ks < 4; ++ks)
      for (int j = 0; j < 2; ++j)
        for (int e = 0; e < 2; ++e) wrong += packed_k_source(16 * ks + 2 * t + 8 * j + e) != 16 * t + 4 * ks + 2 * j + e;
  report(!wrong, "packed weights' K order, X against W (host)", std::to_string(wrong) + " wrong");
}

// The value the GEMM's NVFP4 decode gives for E2M1 `nibble` under E4M3 scale `code`
// (dtype.h), before the main loop's kNvfp4Unscale: value x scale x 2^-8.
float nvfp4_gemm_value(uint8_t nibble, uint8_t code) {
  return fp4_e2m1_to_f32(nibble) * fp8_e4m3_to_f32(code) / kNvfp4Unscale;
}

// Host checks of the exactness the packed GEMM relies on (packed_decode.cuh): every product
// of an E2M1 value and an E4M3 scale is a bf16 value; the NVFP4 GEMM layout is a permutation
// of a word's bits; and its decode (the rotations, the scale byte, the bf16 product, here in
// fp32, exact as the bf16 one) gives every value under every scale that is a number, in
// every position, with its sign (the products that are zero: any sign).
void check_decode() {
  int64_t wrong = 0, inexact = 0;
  for (int scale = 0; scale < 256; ++scale)
    for (int nibble = 0; nibble < 16; ++nibble) {
      const float product = fp4_e2m1_to_f32(uint8_t(nibble)) * fp8_e4m3_to_f32(uint8_t(scale));
      if (!std::isnan(product) && round_bf16(product) != product) ++inexact;
    }
  uint32_t bits = 0;
  for (int i = 0; i < 8; ++i)
    for (int b = 0; b < 4; ++b) bits |= 1u << nvfp4_layout_bit(i, b);
  wrong += bits != 0xffffffffu;
  std::mt19937 rng(12);
  for (int code = 0; code < 256; ++code) {
    if (!fp8_is_number(uint8_t(code))) continue;  // NaN: refused at load
    for (int trial = 0; trial < 64; ++trial) {
      // every nibble in every position: trial t puts (t + i) % 16 at value i, then random words
      uint32_t stored[2];
      for (uint32_t& word : stored) {
        word = 0;
        for (int i = 0; i < 8; ++i) word |= uint32_t((trial + i + 8 * (&word - stored)) % 16) << (4 * i);
        if (trial >= 16) word = uint32_t(rng());
      }
      uint32_t words[2] = {stored[0], stored[1]};
      uint8_t gemm_scale = uint8_t(code);
      nvfp4_gemm_group(words, gemm_scale);
      const float scale = bf16_to_f32(uint16_t(nvfp4_scale_pair(gemm_scale)));
      wrong += nvfp4_scale_pair(gemm_scale) >> 16 != (nvfp4_scale_pair(gemm_scale) & 0xffff);
      for (int half = 0; half < 4; ++half) {
        uint32_t pairs[2];
        e2m1_pairs(words[half / 2], half % 2, pairs[0], pairs[1]);
        for (int v = 0; v < 4; ++v) {
          const int value = 4 * half + v;
          const float got = bf16_to_f32(uint16_t(pairs[v / 2] >> (16 * (v % 2)))) * scale;
          const float want = nvfp4_gemm_value(uint8_t(stored[value / 8] >> (4 * (value % 8)) & 0xf), uint8_t(code));
          wrong += got != want || (want != 0 && std::signbit(got) != std::signbit(want)) || round_bf16(got) != got;
        }
      }
    }
  }
  std::printf("%-6s %-44s: %ld wrong decodes, %ld inexact products\n", wrong || inexact ? "FAIL" : "ok",
              "NVFP4 GEMM layout decode, e2m1 x e4m3 (host)", long(wrong), long(inexact));
  if (wrong || inexact) ++failures;
}

// NVFP4 weights' group scales cycling through every E4M3 code that is a number (256 groups
// or more: all of them), in place of the dummy weights' few positive normal ones.
void every_group_scale(PackedWeight& w) {
  for (size_t g = 0; g < w.group_scales.size(); ++g) {
    const uint8_t code = uint8_t(g * 7 % 256);
    w.group_scales[g] = fp8_is_number(code) ? code : code ^ 1;  // NaN -> 448
  }
}

// decode_nvfp4 (the CUDA backend's load-time decode of dense NVFP4 linears) on the GPU:
// every value bitwise e2m1 x its group's E4M3 scale (exact in bf16, above), under every
// scale that is a number (zero, subnormal and negative ones too: the layout's special cases).
void check_decode_nvfp4() {
  const int64_t rows = 37, cols = 208;
  PackedWeight w = random_packed_weight(WeightFormat::Nvfp4, {rows, cols}, 3);
  every_group_scale(w);
  uint8_t* packed = upload(w.values);
  uint8_t* group_scales = upload(w.group_scales);
  __nv_bfloat16* out = nullptr;
  check(cudaMalloc(&out, size_t(rows * cols) * 2), "malloc decoded");
  decode_nvfp4(packed, group_scales, rows, cols, out, nullptr);
  std::vector<uint16_t> got(size_t(rows * cols));
  check(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost), "download decoded");
  cudaFree(packed), cudaFree(group_scales), cudaFree(out);
  int64_t wrong = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t byte = w.values[size_t(r * cols / 2 + c / 2)];
      const float want = fp4_e2m1_to_f32(c % 2 ? byte >> 4 : byte & 0xf) *
                         fp8_e4m3_to_f32(w.group_scales[size_t(r * cols / 16 + c / 16)]);
      const float value = bf16_to_f32(got[size_t(r * cols + c)]);
      wrong += value != want || (want != 0 && std::signbit(value) != std::signbit(want));
    }
  report(!wrong, "decode_nvfp4 37x208, every scale (GPU)", std::to_string(wrong) + " values differ from e2m1 x scale");
}

__global__ void random_fill_kernel(float* x, __nv_bfloat16* w, int64_t nx, int64_t nw) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nx + nw; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ uint32_t(i >> 32);
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    const float u = float(h >> 8) / float(1 << 24) - 0.5f;
    if (i < nx) x[i] = 4.0f * u;
    else w[i - nx] = __float2bfloat16(0.1f * u);
  }
}

void random_fill(float* x, __nv_bfloat16* w, int64_t nx, int64_t nw) {
  random_fill_kernel<<<4096, 256>>>(x, w, nx, nw);
  check(cudaDeviceSynchronize(), "random fill");
}

struct Problem {
  int64_t x_rows, ldx, n, k, ldy, y_rows;
  std::vector<float> x;
  WeightFormat format = WeightFormat::Plain;
  PackedWeight packed;           // FP8 / NVFP4: the matrices [S][N][K] as stored
  std::vector<uint8_t> w;        // the matrices' bytes as the GEMM reads them
  std::vector<float> w_values;   // the values the product multiplies, [S][N][K]
  std::vector<int64_t> row_map;  // empty: none
  std::vector<GemmSegment> segs;  // w.values as the index of the segment's matrix until uploaded
  GemmInput input = GemmInput::Split;
  bool gated = false;  // X's rows [gate | up], 2K values: the product takes gelu_glu of them
  bool tiled = false;  // the matrices uploaded tiled (GemmMatrix::tiled)
  std::vector<float> row_factors;  // plain weights: a factor per matrix row (GemmMatrix::row_scales), or none
  int64_t factor_rows = 0;         // ... in runs of this many rows (GemmMatrix::factor_rows)
};

// `matrices` [n, row_bytes] byte matrices one after the other, each stored tiled
// (gemm_tile.cuh: n a multiple of 128, row_bytes of kRowBytes).
std::vector<uint8_t> tiled_bytes(const std::vector<uint8_t>& rows, int64_t matrices, int64_t n, int64_t row_bytes) {
  std::vector<uint8_t> out(rows.size());
  const int64_t slices = row_bytes / kRowBytes, matrix_bytes = n * row_bytes;
  for (int64_t m = 0; m < matrices; ++m)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t s = 0; s < slices; ++s)
        for (int c = 0; c < kRowBytes / 16; ++c)
          std::memcpy(&out[size_t(m * matrix_bytes + tiled_offset(r, s, c, slices))],
                      &rows[size_t(m * matrix_bytes + r * row_bytes + s * kRowBytes + 16 * c)], 16);
  return out;
}

int matrix_of(const GemmSegment& s) { return int(reinterpret_cast<intptr_t>(s.w.values)); }

// `matrices` random [n, k] weight matrices in `format` into p (bf16: values around 0.05).
void random_weights(Problem& p, WeightFormat format, int matrices, std::mt19937& rng) {
  p.format = format;
  if (format == WeightFormat::Plain) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    p.w.resize(size_t(2 * matrices * p.n * p.k));
    for (size_t i = 0; i < p.w.size() / 2; ++i) {
      const __nv_bfloat16 v = __float2bfloat16(d(rng) * 0.05f);
      std::memcpy(&p.w[2 * i], &v, 2);
      p.w_values.push_back(__bfloat162float(v));
    }
    return;
  }
  p.packed = random_packed_weight(format, {matrices, p.n, p.k}, rng());
  p.w = p.packed.values;
  p.w_values = dequantize(p.packed);
}

// The tile heights gemm() has, whose results must agree bitwise (on sm_90a, for bf16, those
// of 32 rows and more are wgmma's, 16 is mma.sync's; for NVFP4, 64 and 128 are wgmma's).
const int kTileHeights[] = {16, 32, 64, 128};

// Runs `p` with the given tile height; returns Y (y_rows x ldy).
std::vector<float> run(const Problem& p, int tile_rows) {
  float* x = upload(p.x);
  const int64_t row_bytes = weight_row_bytes(p.format, p.k), matrices = int64_t(p.w.size()) / (p.n * row_bytes);
  uint8_t* w = upload(p.tiled ? tiled_bytes(p.w, matrices, p.n, row_bytes) : p.w);
  const bool fp8 = p.format == WeightFormat::Fp8;
  float* row_scales = p.format != WeightFormat::Plain ? upload(fp8 ? p.packed.scales : p.packed.global_scales)
                      : p.row_factors.empty()         ? nullptr
                                                      : upload(p.row_factors);
  uint8_t* group_scales = p.format == WeightFormat::Nvfp4 ? upload(p.packed.group_scales) : nullptr;
  if (group_scales) lay_out_nvfp4(w, group_scales, int64_t(p.packed.group_scales.size()), nullptr);
  const ExpertStack stack{{w, row_scales, group_scales, p.tiled, p.factor_rows}, p.format, p.n, p.k};
  int64_t* row_map = p.row_map.empty() ? nullptr : upload(p.row_map);
  std::vector<GemmSegment> segs = p.segs;
  for (auto& s : segs) s.w = stack.expert(matrix_of(s));
  float* y = nullptr;
  const size_t y_bytes = sizeof(float) * size_t(p.y_rows * p.ldy);
  check(cudaMalloc(&y, y_bytes), "malloc y");
  check(cudaMemset(y, 0xff, y_bytes), "memset y");  // NaN: anything the GEMM should write and does not shows
  void* scratch = nullptr;
  check(cudaMalloc(&scratch, std::max<size_t>(gemm_scratch_bytes(p.x_rows, p.n, p.k, p.input), 1)), "malloc scratch");
  if (tile_rows == kCublasLt) {  // one segment: bf16 weights, or FP8 weights and X
#ifdef DIFFUSERVE_WITH_CUBLASLT
    cublaslt().multiply(x, p.x_rows, p.ldx, p.gated, p.input, {segs[0].w}, p.n, p.k, {y}, p.ldy, {}, scratch, nullptr);
#endif
  } else if (segs.size() == 1 && p.row_map.empty() && segs[0].x_row == 0 && segs[0].y_row == 0) {
    gemm(x, p.x_rows, p.ldx, p.gated, nullptr, &segs[0], nullptr, int((segs[0].rows + tile_rows - 1) / tile_rows),
         tile_rows, p.format, p.tiled, p.n, p.k, p.input, y, nullptr, p.ldy, {}, {}, scratch, nullptr);
  } else {  // device-planned style: tiles per segment, then unused slots
    std::vector<GemmTile> tiles;
    for (size_t s = 0; s < segs.size(); ++s)
      for (int m0 = 0; m0 < segs[s].rows; m0 += tile_rows) tiles.push_back({int(s), m0});
    for (int i = 0; i < 5; ++i) tiles.insert(tiles.begin() + (tiles.size() * i) / 5, GemmTile{-1, 0});
    GemmSegment* d_segs = upload(segs);
    GemmTile* d_tiles = upload(tiles);
    gemm(x, p.x_rows, p.ldx, p.gated, row_map, d_segs, d_tiles, int(tiles.size()), tile_rows, p.format, p.tiled, p.n,
         p.k, p.input, y, nullptr, p.ldy, {}, {}, scratch, nullptr);
    check(cudaDeviceSynchronize(), "gemm");
    cudaFree(d_segs);
    cudaFree(d_tiles);
  }
  check(cudaDeviceSynchronize(), "gemm");
  std::vector<float> out(size_t(p.y_rows * p.ldy));
  check(cudaMemcpy(out.data(), y, y_bytes, cudaMemcpyDeviceToHost), "download");
  cudaFree(x), cudaFree(w), cudaFree(row_scales), cudaFree(group_scales), cudaFree(row_map), cudaFree(y),
      cudaFree(scratch);
  return out;
}

// X's rows as the product takes them, k values each: p.x's, or with `gated` the MLP's
// activation of each [gate | up] row as the device computes it (gelu_glu; the host's tanhf
// may differ by an ulp, which FP8 per token could round to another code).
std::vector<float> x_values(const Problem& p) {
  std::vector<float> rows(size_t(p.x_rows * p.k)), gate_up(size_t(p.x_rows * 2 * p.k));
  if (!p.gated) {
    for (int64_t r = 0; r < p.x_rows; ++r) std::copy_n(&p.x[size_t(r * p.ldx)], p.k, &rows[size_t(r * p.k)]);
    return rows;
  }
  for (int64_t r = 0; r < p.x_rows; ++r) std::copy_n(&p.x[size_t(r * p.ldx)], 2 * p.k, &gate_up[size_t(r * 2 * p.k)]);
  float* d_in = upload(gate_up);
  float* d_out = upload(rows);
  gelu_glu(d_in, p.x_rows, p.k, d_out, nullptr);
  check(cudaMemcpy(rows.data(), d_out, rows.size() * sizeof(float), cudaMemcpyDeviceToHost), "download");
  cudaFree(d_in), cudaFree(d_out);
  return rows;
}

// What the product multiplies: X and W ([x_rows][k], [matrices][n][k]) as values the
// reference sums the products of, times x_scale[row] * w_scale[matrix row]. Split: X and
// the dequantized W, scales 1; RoundBf16: bf16(X); Fp8Token: the E4M3 values X's rows
// quantize to (activation_quant.h, on the host) and W's E4M3 values, with their scales.
struct Operands {
  std::vector<float> x, x_scale, w, w_scale;
};
Operands operands(const Problem& p) {
  Operands o;
  o.x.resize(size_t(p.x_rows * p.k));
  o.x_scale.assign(size_t(p.x_rows), 1.0f);
  const std::vector<float> x = x_values(p);
  for (int64_t r = 0; r < p.x_rows; ++r) {
    const float* row = &x[size_t(r * p.k)];
    float amax = 0.0f;
    for (int64_t c = 0; c < p.k; ++c) amax = std::fmax(amax, std::fabs(row[c]));
    if (p.input == GemmInput::Fp8Token) o.x_scale[r] = fp8_token_scale(amax);
    for (int64_t c = 0; c < p.k; ++c)
      o.x[size_t(r * p.k + c)] = p.input == GemmInput::Fp8Token    ? quantize_e4m3(row[c], o.x_scale[r])
                                 : p.input == GemmInput::RoundBf16 ? round_bf16(row[c])
                                                                   : row[c];
  }
  if (p.input == GemmInput::Fp8Token) {
    for (uint8_t code : p.packed.values) o.w.push_back(fp8_e4m3_to_f32(code));
    o.w_scale = p.packed.scales;
  } else {
    o.w = p.w_values;
    o.w_scale = p.row_factors;
    o.w_scale.resize(o.w.size() / size_t(p.k), 1.0f);
  }
  return o;
}

// Whether `tile_rows` multiplies p on wgmma (32 rows and more, where the build and GPU have it).
bool on_wgmma(const Problem& p, int tile_rows) { return tile_rows >= 32 && gemm_has_wgmma_tile(p.input, p.format); }

// How far from the exact product an output may be, relative to sum |x w|: fp32-like (the
// hi/lo planes; E4M3 on mma.sync, whose fp16 products are exact), or E4M3 on the tensor
// cores (wgmma, cuBLASLt), which add products with fewer bits (gemm.cu).
double tolerance(const Problem& p, int tile_rows) {
  return p.input == GemmInput::Fp8Token && (tile_rows == kCublasLt || on_wgmma(p, tile_rows)) ? 2e-3 : 2e-5;
}

// Checks Y against the double reference on every written element (or `samples` random
// ones), and that elements no segment writes were left alone.
void verify(const Problem& p, const std::vector<float>& y, const char* name, int tile_rows, int samples = 0) {
  const Operands o = operands(p);
  std::vector<char> written(size_t(p.y_rows * p.ldy), 0);
  double worst = 0;
  int64_t bad = 0, checked = 0;
  std::mt19937_64 rng(1);
  for (const GemmSegment& s : p.segs) {
    const int64_t w_off = matrix_of(s) * p.n * p.k;
    for (int i = 0; i < s.rows; ++i)
      for (int64_t j = 0; j < p.n; ++j) written[size_t((s.y_row + i) * p.ldy + j)] = 1;
    auto one = [&](int i, int64_t j) {
      const int64_t xr = p.row_map.empty() ? s.x_row + i : p.row_map[s.x_row + i];
      double ref = 0, mag = 0;
      for (int64_t kk = 0; kk < p.k; ++kk) {
        const double xv = o.x[xr * p.k + kk], wv = o.w[w_off + j * p.k + kk];
        ref += xv * wv, mag += std::fabs(xv * wv);
      }
      const double scale = double(o.x_scale[xr]) * o.w_scale[matrix_of(s) * p.n + j];
      ref *= scale, mag *= scale;
      const double got = y[size_t((s.y_row + i) * p.ldy + j)];
      const double err = std::fabs(got - ref) / (mag + 1e-30);
      worst = std::max(worst, err);
      ++checked;
      if (!(err <= tolerance(p, tile_rows))) {
        if (bad++ < 5)
          std::printf("    %s: row %d col %ld: got %.8g want %.8g\n", name, int(s.y_row + i), long(j), got, ref);
      }
    };
    if (samples) {
      for (int t = 0; t < samples && s.rows; ++t) one(int(rng() % s.rows), int64_t(rng() % p.n));
    } else {
      for (int i = 0; i < s.rows; ++i)
        for (int64_t j = 0; j < p.n; ++j) one(i, j);
    }
  }
  if (!samples)
    for (size_t e = 0; e < written.size(); ++e)
      if (!written[e] && !std::isnan(y[e])) {
        if (bad++ < 5) std::printf("    %s: element %zu written outside the segments\n", name, e);
      }
  std::printf("%-6s %-44s %-6s %-8s: %s (%ld checked, worst rel err %.2e)\n", bad ? "FAIL" : "ok", name,
              format_name(p.format, p.input), engine_name(tile_rows).c_str(), bad ? "MISMATCH" : "match", long(checked),
              worst);
  if (bad) ++failures;
}

Problem dense(int64_t m, int64_t n, int64_t k, int64_t ldx_extra = 0, int64_t ldy_extra = 0,
              GemmInput input = GemmInput::Split, WeightFormat format = WeightFormat::Plain) {
  std::mt19937 rng(unsigned(m * 7919 + n * 31 + k));
  std::normal_distribution<float> d(0.0f, 1.0f);
  Problem p;
  p.x_rows = m, p.ldx = k + ldx_extra, p.n = n, p.k = k, p.ldy = n + ldy_extra, p.y_rows = m;
  p.input = input;
  p.x.resize(size_t(m * p.ldx));
  for (auto& v : p.x) v = d(rng);
  random_weights(p, format, 1, rng);
  p.segs = {{0, 0, int(m), {}}};
  return p;
}
Problem dense(WeightFormat format, int64_t m, int64_t n, int64_t k, int64_t ldx_extra = 0, int64_t ldy_extra = 0) {
  return dense(m, n, k, ldx_extra, ldy_extra, GemmInput::Split, format);
}
// p (NVFP4) under every group scale (every_group_scale): the GEMM layout's special cases.
Problem every_scale(Problem p) {
  every_group_scale(p.packed);
  p.w_values = dequantize(p.packed);
  return p;
}
// p with gated X: rows of [gate | up], 2K random values (ldx K more).
Problem gated(Problem p) {
  std::mt19937 rng(unsigned(p.x_rows * 131 + p.k));
  std::normal_distribution<float> d(0.0f, 1.0f);
  p.gated = true;
  p.ldx += p.k;
  p.x.resize(size_t(p.x_rows * p.ldx));
  for (auto& v : p.x) v = d(rng);
  return p;
}
// p (FP8 weights) with FP8 per-token X; with `zero_rows` every 7th X row all zero (the
// eps scale).
Problem fp8_token(Problem p, bool zero_rows = false) {
  p.input = GemmInput::Fp8Token;
  for (int64_t r = 0; zero_rows && r < p.x_rows; r += 7) std::fill_n(&p.x[size_t(r * p.ldx)], p.ldx, 0.0f);
  return p;
}
// p (plain weights) with a random factor per weight row, as decoded NVFP4 linears have: one
// factor per run of n / runs rows (a linear's global scale, gate and up stacked: two runs),
// or (runs 0) each row its own.
Problem row_factors(Problem p, int64_t runs) {
  std::mt19937 rng(unsigned(p.n * 17 + p.k));
  std::uniform_real_distribution<float> d(0.25f, 4.0f);
  p.factor_rows = runs ? p.n / runs : 0;
  p.row_factors.resize(p.w_values.size() / size_t(p.k));
  for (size_t r = 0; r < p.row_factors.size(); ++r)
    p.row_factors[r] = runs && r % size_t(p.factor_rows) ? p.row_factors[r - 1] : d(rng);
  return p;
}
// p with its weights stored tiled.
Problem tiled(Problem p) {
  p.tiled = true;
  return p;
}

// X's rows (x_values) fake-quantized by the CUDA backend's quantize_input.
std::vector<float> fake_quantized(const Problem& p) {
  std::vector<float> rows = x_values(p);
  float* d = upload(rows);
  quantize_input(d, p.x_rows, p.k, ActivationScheme::Fp8Token, 0, 0.0f, 0.0f, nullptr);
  check(cudaMemcpy(rows.data(), d, rows.size() * sizeof(float), cudaMemcpyDeviceToHost), "download");
  cudaFree(d);
  return rows;
}

// The pre-pass of an Fp8Token problem: scales and codes bitwise as the host computes them
// (activation_quant.h), zero past K, and code * scale bitwise quantize_input's value.
void check_codes(const Problem& p, const char* name) {
  const int64_t ld = (p.k + 127) / 128 * 128;
  float* x = upload(p.x);
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  check(cudaMalloc(&codes, size_t(p.x_rows * ld)), "malloc codes");
  check(cudaMalloc(&scales, sizeof(float) * size_t(p.x_rows)), "malloc scales");
  check(cudaMemset(codes, 0xff, size_t(p.x_rows * ld)), "memset codes");
  fp8_token_codes(x, p.x_rows, p.ldx, p.gated, p.k, ld, codes, scales, nullptr);
  std::vector<uint8_t> got(size_t(p.x_rows * ld));
  std::vector<float> got_scales(size_t(p.x_rows));
  check(cudaMemcpy(got.data(), codes, got.size(), cudaMemcpyDeviceToHost), "download codes");
  check(cudaMemcpy(got_scales.data(), scales, got_scales.size() * sizeof(float), cudaMemcpyDeviceToHost), "download");
  cudaFree(x), cudaFree(codes), cudaFree(scales);
  const Operands o = operands(p);
  const std::vector<float> fake = fake_quantized(p);
  int64_t wrong_scales = 0, wrong_codes = 0, wrong_fake = 0;
  for (int64_t r = 0; r < p.x_rows; ++r) {
    if (std::memcmp(&got_scales[r], &o.x_scale[r], 4) != 0) ++wrong_scales;
    for (int64_t c = 0; c < ld; ++c) {
      const uint8_t code = got[size_t(r * ld + c)];
      if (code != (c < p.k ? e4m3_code(o.x[size_t(r * p.k + c)]) : 0)) ++wrong_codes;
      const float value = fp8_e4m3_to_f32(code) * got_scales[r];
      if (c < p.k && std::memcmp(&value, &fake[size_t(r * p.k + c)], 4) != 0) ++wrong_fake;
    }
  }
  report(!(wrong_scales || wrong_codes || wrong_fake), (std::string("fp8 codes ") + name).c_str(),
         std::to_string(wrong_scales) + " scales, " + std::to_string(wrong_codes) + " codes, " +
             std::to_string(wrong_fake) + " code * scale != quantize_input");
}

// An Fp8Token product against today's path for the same linear: quantize_input's fake-
// quantized X through the hi/lo GEMM (Split) with the same FP8 weights. Equal up to the
// two products' tolerances of the exact one (fp32 summation order alone on mma.sync).
void check_against_fake_quant(const Problem& p, const char* name, int tile_rows) {
  Problem split = p;
  split.input = GemmInput::Split;
  split.gated = false;  // its rows: the fake-quantized activations
  split.tiled = false;  // Split decodes FP8 weights, which it reads as rows
  const std::vector<float> fake = fake_quantized(p);
  for (int64_t r = 0; r < p.x_rows; ++r) std::copy_n(&fake[size_t(r * p.k)], p.k, &split.x[size_t(r * p.ldx)]);
  const std::vector<float> y8 = run(p, tile_rows), y_fake = run(split, tile_rows);
  const Operands o = operands(p);
  double worst = 0;
  for (const GemmSegment& s : p.segs)
    for (int i = 0; i < s.rows; ++i) {
      const int64_t xr = p.row_map.empty() ? s.x_row + i : p.row_map[s.x_row + i];
      for (int64_t j = 0; j < p.n; ++j) {
        double mag = 0;
        for (int64_t kk = 0; kk < p.k; ++kk)
          mag += std::fabs(double(o.x[xr * p.k + kk]) * o.w[(matrix_of(s) * p.n + j) * p.k + kk]);
        mag *= double(o.x_scale[xr]) * o.w_scale[matrix_of(s) * p.n + j];
        const size_t e = size_t((s.y_row + i) * p.ldy + j);
        worst = std::max(worst, std::fabs(double(y8[e]) - y_fake[e]) / (mag + 1e-30));
      }
    }
  char detail[96];
  std::snprintf(detail, sizeof detail, "worst |fp8x8 - fake-quant hi/lo| / sum|xw| %.2e (tile %d)", worst, tile_rows);
  report(worst <= tolerance(p, tile_rows) + tolerance(split, tile_rows), (std::string("vs fake quant ") + name).c_str(),
         detail);
}

// Random routing: the tokens each expert gets, each token to top_k distinct experts.
std::vector<std::vector<int64_t>> route_randomly(int64_t tokens, int experts, int top_k, std::mt19937& rng) {
  std::vector<std::vector<int64_t>> by_expert(experts);
  std::vector<int> ids(experts);
  for (int e = 0; e < experts; ++e) ids[e] = e;
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int j = 0; j < top_k; ++j) by_expert[ids[j]].push_back(t);
  }
  return by_expert;
}

// The MoE layout: tokens routed to top_k of `experts`, rows ordered by expert, row_map
// gathering the token rows (up) or none (down: X already in expert order).
Problem moe(int64_t tokens, int experts, int top_k, int64_t n, int64_t k, bool gather, unsigned seed,
            WeightFormat format = WeightFormat::Plain) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  const std::vector<std::vector<int64_t>> by_expert = route_randomly(tokens, experts, top_k, rng);
  Problem p;
  const int64_t pairs = tokens * top_k;
  p.n = n, p.k = k, p.ldy = n, p.y_rows = pairs;
  p.x_rows = gather ? tokens : pairs, p.ldx = k;
  p.x.resize(size_t(p.x_rows * k));
  for (auto& v : p.x) v = d(rng);
  random_weights(p, format, experts, rng);
  int64_t row = 0;
  for (int e = 0; e < experts; ++e) {
    p.segs.push_back({row, row, int(by_expert[e].size()), {reinterpret_cast<const void*>(intptr_t(e)), nullptr, nullptr}});
    for (int64_t t : by_expert[e]) p.row_map.push_back(t);
    row += int64_t(by_expert[e].size());
  }
  if (!gather) p.row_map.clear();
  return p;
}

struct Case {
  const char* name;
  Problem p;
};

// The dense products with bf16 weights: tails in M, N and K, K < 16, ldx / ldy wider than
// K / N, RoundBf16. correctness() runs them with every tile shape, check_cublaslt() on
// cuBLASLt.
std::vector<Case> bf16_dense_cases() {
  std::vector<Case> cases;
  cases.push_back({"dense 1x8x16", dense(1, 8, 16)});
  cases.push_back({"dense 7x100x72", dense(7, 100, 72)});
  cases.push_back({"dense 33x333x72 (N tail)", dense(33, 333, 72)});
  cases.push_back({"dense 130x257x200 (M, N, K tails)", dense(130, 257, 200)});
  cases.push_back({"dense 65x40x333 (K % 8 != 0)", dense(65, 40, 333)});
  cases.push_back({"dense 20x24x13 (K < 16)", dense(20, 24, 13)});
  cases.push_back({"dense 300x512x704", dense(300, 512, 704)});
  cases.push_back({"dense 129x300x136 ldx+5 ldy+3", dense(129, 300, 136, 5, 3)});
  cases.push_back({"dense 96x130x2816", dense(96, 130, 2816)});
  cases.push_back({"dense 50x70x333 round", dense(50, 70, 333, 0, 0, GemmInput::RoundBf16)});
  cases.push_back({"dense 200x264x512 round", dense(200, 264, 512, 0, 0, GemmInput::RoundBf16)});
  // Gated X (the MLP's activation in the pre-pass): float4 loads, and K % 4 != 0's scalar ones.
  cases.push_back({"dense 300x512x704 gated", gated(dense(300, 512, 704))});
  cases.push_back({"dense 65x40x333 gated ldx+5", gated(dense(65, 40, 333, 5))});
  cases.push_back({"dense 200x264x512 round gated", gated(dense(200, 264, 512, 0, 0, GemmInput::RoundBf16))});
  // Row factors (decoded NVFP4 linears): hi/lo X (the lo plane's sum added after the
  // factors) and rounded X.
  cases.push_back({"dense 130x256x200 row factors, 2 runs", row_factors(dense(130, 256, 200), 2)});
  cases.push_back({"dense 129x296x2816 round row factors ldx+5 ldy+4",
                   row_factors(dense(129, 296, 2816, 5, 4, GemmInput::RoundBf16), 1)});
  return cases;
}

// Weights stored tiled (N % 128 == 0, K % 64 == 0 bf16, 128 E4M3): bf16 with hi/lo and
// rounded X, a tile of 256 rows over two tiles, gathered X rows, FP8 x FP8.
std::vector<Case> tiled_cases() {
  std::vector<Case> cases;
  cases.push_back({"dense 130x256x192 tiled", tiled(dense(130, 256, 192))});
  cases.push_back({"dense 200x384x512 round tiled", tiled(dense(200, 384, 512, 0, 0, GemmInput::RoundBf16))});
  cases.push_back({"moe up 300 tok, 16 exp top 4, 256x128 tiled", tiled(moe(300, 16, 4, 256, 128, true, 21))});
  Problem round = tiled(moe(500, 8, 2, 384, 704, false, 22));
  round.input = GemmInput::RoundBf16;
  cases.push_back({"moe down 500 tok, 8 exp top 2, 384x704 round tiled", round});
  cases.push_back({"moe up 300 tok, 16 exp top 4, 256x256 fp8x8 tiled",
                   tiled(fp8_token(moe(300, 16, 4, 256, 256, true, 23, WeightFormat::Fp8)))});
  return cases;
}

void correctness() {
  check_decode_nvfp4();
  std::vector<Case> cases = bf16_dense_cases();
  for (Case& c : tiled_cases()) cases.push_back(std::move(c));
  cases.push_back({"dense 65x40x333 row factors, each its own", row_factors(dense(65, 40, 333), 0)});
  cases.push_back({"moe up 40 tok, 6 exp top 3, 48x72", moe(40, 6, 3, 48, 72, true, 1)});
  cases.push_back({"moe down 40 tok, 6 exp top 3, 72x24", moe(40, 6, 3, 72, 24, false, 2)});
  cases.push_back({"moe up 300 tok, 16 exp top 4, 264x136", moe(300, 16, 4, 264, 136, true, 3)});
  cases.push_back({"moe up 100 tok, 8 exp top 2, 130x333", moe(100, 8, 2, 130, 333, true, 4)});
  cases.push_back({"moe down 500 tok, 8 exp top 2, 264x200", moe(500, 8, 2, 264, 200, false, 5)});
  // Inputs rounded to bf16 (activations "bfloat16"): one plane.
  for (Problem p : {moe(300, 16, 4, 264, 136, true, 16), moe(500, 8, 2, 264, 704, false, 17)}) {
    p.input = GemmInput::RoundBf16;
    cases.push_back({p.row_map.empty() ? "moe down 500 tok, 8 exp top 2, 264x704 round"
                                       : "moe up 300 tok, 16 exp top 4, 264x136 round", p});
  }
  // Packed weights. FP8 streams by cp.async where K % 16 == 0; NVFP4 (K % 16 == 0 always)
  // where K % 64 == 0; other K take the byte-by-byte loads.
  const WeightFormat fp8 = WeightFormat::Fp8, nvfp4 = WeightFormat::Nvfp4;
  cases.push_back({"dense 7x100x64", dense(fp8, 7, 100, 64)});
  cases.push_back({"dense 33x333x72 (N tail, K % 16 != 0)", dense(fp8, 33, 333, 72)});
  cases.push_back({"dense 130x257x200 (M, N, K tails)", dense(fp8, 130, 257, 200)});
  cases.push_back({"dense 65x40x333 (K odd)", dense(fp8, 65, 40, 333)});
  cases.push_back({"dense 20x24x13 (K < 16)", dense(fp8, 20, 24, 13)});
  cases.push_back({"dense 129x300x2816 ldx+5 ldy+3", dense(fp8, 129, 300, 2816, 5, 3)});
  cases.push_back({"moe up 40 tok, 6 exp top 3, 48x64", moe(40, 6, 3, 48, 64, true, 6, fp8)});
  cases.push_back({"moe up 300 tok, 16 exp top 4, 264x136", moe(300, 16, 4, 264, 136, true, 7, fp8)});
  cases.push_back({"moe down 500 tok, 8 exp top 2, 264x704", moe(500, 8, 2, 264, 704, false, 8, fp8)});
  cases.push_back({"dense 7x100x64", dense(nvfp4, 7, 100, 64)});
  cases.push_back({"dense 20x24x16 (K = 16)", dense(nvfp4, 20, 24, 16)});
  cases.push_back({"dense 33x333x96 (K % 64 != 0)", dense(nvfp4, 33, 333, 96)});
  cases.push_back({"dense 130x257x208 (M, N, K tails)", dense(nvfp4, 130, 257, 208)});
  cases.push_back({"dense 129x300x2816 ldx+5 ldy+3", dense(nvfp4, 129, 300, 2816, 5, 3)});
  cases.push_back({"moe up 40 tok, 6 exp top 3, 48x80", moe(40, 6, 3, 48, 80, true, 9, nvfp4)});
  cases.push_back({"moe up 300 tok, 16 exp top 4, 264x704", moe(300, 16, 4, 264, 704, true, 10, nvfp4)});
  cases.push_back({"moe down 500 tok, 8 exp top 2, 264x32", moe(500, 8, 2, 264, 32, false, 11, nvfp4)});
  cases.push_back(
      {"moe up 40 tok, 6 exp top 3, 48x80 every scale", every_scale(moe(40, 6, 3, 48, 80, true, 9, nvfp4))});
  // Gated X with packed weights: the pre-pass's permuted K order.
  cases.push_back({"dense 129x300x2816 gated ldx+5 ldy+3", gated(dense(fp8, 129, 300, 2816, 5, 3))});
  cases.push_back({"moe down 500 tok, 8 exp top 2, 264x704 gated", gated(moe(500, 8, 2, 264, 704, false, 18, nvfp4))});
  cases.push_back({"moe down 500 tok, 8 exp top 2, 264x704 gated", gated(moe(500, 8, 2, 264, 704, false, 19))});
  // Packed weights with X rounded to bf16 (activations "bfloat16", weight-only FP8 or
  // NVFP4): one plane in the permuted K order, gated too.
  const GemmInput round = GemmInput::RoundBf16;
  cases.push_back({"dense 130x257x200 round", dense(130, 257, 200, 0, 0, round, fp8)});
  cases.push_back({"dense 129x300x2816 round ldx+5 ldy+3", dense(129, 300, 2816, 5, 3, round, nvfp4)});
  cases.push_back({"dense 33x333x96 round (K % 64 != 0)", dense(33, 333, 96, 0, 0, round, nvfp4)});
  cases.push_back({"dense 300x512x704 round gated", gated(dense(300, 512, 704, 0, 0, round, fp8))});
  for (Problem p : {moe(300, 16, 4, 264, 704, true, 24, nvfp4), gated(moe(500, 8, 2, 264, 704, false, 25, nvfp4))}) {
    p.input = round;
    cases.push_back({p.row_map.empty() ? "moe down 500 tok, 8 exp top 2, 264x704 round gated"
                                       : "moe up 300 tok, 16 exp top 4, 264x704 round",
                     p});
  }
  // FP8 weights with FP8 per-token X: 128 K a stage, 32 per step; W byte by byte where
  // K % 16 != 0, the pre-pass's scalar loads where ldx % 4 != 0; zero rows.
  cases.push_back({"dense 7x100x64 (K < 128)", fp8_token(dense(fp8, 7, 100, 64))});
  cases.push_back({"dense 33x333x72 (N tail, K % 32 != 0)", fp8_token(dense(fp8, 33, 333, 72))});
  cases.push_back({"dense 130x257x208 (M, N, K tails, zero rows)", fp8_token(dense(fp8, 130, 257, 208), true)});
  cases.push_back({"dense 65x40x333 (K odd)", fp8_token(dense(fp8, 65, 40, 333))});
  cases.push_back({"dense 20x24x13 (K < 16)", fp8_token(dense(fp8, 20, 24, 13))});
  cases.push_back({"dense 300x512x704 (K % 128 = 64)", fp8_token(dense(fp8, 300, 512, 704))});
  cases.push_back({"dense 129x300x2816 ldx+5 ldy+3", fp8_token(dense(fp8, 129, 300, 2816, 5, 3))});
  cases.push_back({"moe up 40 tok, 6 exp top 3, 48x64", fp8_token(moe(40, 6, 3, 48, 64, true, 12, fp8))});
  cases.push_back({"moe up 100 tok, 8 exp top 2, 130x333", fp8_token(moe(100, 8, 2, 130, 333, true, 13, fp8))});
  cases.push_back(
      {"moe up 300 tok, 16 exp top 4, 264x136 zero rows", fp8_token(moe(300, 16, 4, 264, 136, true, 14, fp8), true)});
  cases.push_back({"moe down 500 tok, 8 exp top 2, 264x704", fp8_token(moe(500, 8, 2, 264, 704, false, 15, fp8))});
  // Gated FP8 X: the activation in the codes pass (float4 loads, and K % 4 != 0's scalar ones).
  cases.push_back({"dense 300x512x704 gated", fp8_token(gated(dense(fp8, 300, 512, 704)))});
  cases.push_back({"dense 65x40x333 gated ldx+5", fp8_token(gated(dense(fp8, 65, 40, 333, 5)))});
  cases.push_back(
      {"moe down 500 tok, 8 exp top 2, 264x704 gated", fp8_token(gated(moe(500, 8, 2, 264, 704, false, 20, fp8)))});
  // A row wider than the codes kernel's block (8,192 values): read twice.
  cases.push_back({"dense 9x40x9000 (wide rows)", fp8_token(dense(fp8, 9, 40, 9000))});
  for (const Case& c : cases) {
    if (c.p.input == GemmInput::Fp8Token) {
      check_codes(c.p, c.name);
      check_against_fake_quant(c.p, c.name, 64);
    }
    // Bitwise across the heights, except E4M3 on wgmma against mma.sync (other sums).
    std::vector<float> first_on[2];
    for (int t : kTileHeights) {
      if (c.p.tiled && !on_wgmma(c.p, t)) continue;  // tiled weights take the wgmma tiles alone
      const std::vector<float> y = run(c.p, t);
      verify(c.p, y, c.name, t);
      std::vector<float>& first = first_on[c.p.input == GemmInput::Fp8Token && on_wgmma(c.p, t)];
      if (first.empty()) {
        first = y;
      } else {
        size_t differ = 0;
        for (size_t e = 0; e < y.size(); ++e)
          if (std::memcmp(&y[e], &first[e], 4) != 0) ++differ;
        if (differ) {
          std::printf("FAIL   %-44s %-6s tile %3d: %zu elements differ bitwise from the first tile on the same MMAs\n",
                      c.name, format_name(c.p.format, c.p.input), t, differ);
          ++failures;
        }
      }
    }
  }
  // Split-K (few tiles, K >= 8192, ldy == n): the soft embedding.
  Problem split = dense(40, 96, 12288 + 40);
  verify(split, run(split, 64), "dense 40x96x12328 split-K", 64);
  Problem split_round = dense(40, 96, 9000, 0, 0, GemmInput::RoundBf16);
  verify(split_round, run(split_round, 16), "dense 40x96x9000 split-K round", 16);
  Problem split_fp8 = fp8_token(dense(WeightFormat::Fp8, 40, 96, 9000));
  verify(split_fp8, run(split_fp8, 64), "dense 40x96x9000 split-K", 64);
}

#ifdef DIFFUSERVE_WITH_CUBLASLT
// The dense products on cuBLASLt (bf16; FP8 weights with FP8 per-token X): against the
// reference (correctness()'s bf16 cases, long K, FP8 ones), and every row the same computed
// with all the rows or only the first few.
void check_cublaslt() {
  const GemmInput round = GemmInput::RoundBf16;
  const WeightFormat fp8 = WeightFormat::Fp8;
  std::vector<Case> cases = bf16_dense_cases();
  cases.push_back({"dense 40x96x12328 (long K)", dense(40, 96, 12288 + 40)});
  cases.push_back({"dense 40x96x9000 round (long K)", dense(40, 96, 9000, 0, 0, round)});
  cases.push_back({"dense 7x100x64", fp8_token(dense(fp8, 7, 100, 64))});
  cases.push_back({"dense 130x256x208 (M, K tails, zero rows)", fp8_token(dense(fp8, 130, 256, 208), true)});
  cases.push_back({"dense 129x300x2816 ldx+5 ldy+4", fp8_token(dense(fp8, 129, 300, 2816, 5, 4))});
  cases.push_back({"dense 300x512x704 gated", fp8_token(gated(dense(fp8, 300, 512, 704)))});
  for (const Case& c : cases) {
    const bool fp8_input = c.p.input == GemmInput::Fp8Token;
    const float* scales = fp8_input                 ? c.p.packed.scales.data()
                          : c.p.row_factors.empty() ? nullptr
                                                    : c.p.row_factors.data();
    const GemmMatrix w{c.p.w.data(), scales, nullptr, false, c.p.factor_rows};  // host addresses: alignment
    if ((fp8_input || scales) && !cublaslt().supports(c.p.input, w, c.p.n, c.p.k, nullptr, c.p.ldy, nullptr))
      report(false, std::string("cuBLASLt ") + c.name, "no algorithm");
    else verify(c.p, run(c.p, kCublasLt), c.name, kCublasLt);
  }
  Problem big = dense(512, 4096, 2816);
  verify(big, run(big, kCublasLt), "dense 512x4096x2816 (sampled)", kCublasLt, 4000);
  for (const Problem& full :
       {dense(300, 512, 704), dense(300, 2048, 2816, 0, 3), dense(256, 96, 30000, 0, 0, round),
        fp8_token(dense(fp8, 300, 2048, 2816)), row_factors(dense(300, 2048, 2816, 0, 0, round), 2)}) {
    const std::vector<float> all = run(full, kCublasLt);
    for (int64_t rows : {1, 7, 33, 200}) {
      Problem part = full;
      part.x_rows = part.y_rows = rows;
      part.x.resize(size_t(rows * part.ldx));
      part.segs[0].rows = int(rows);
      const std::vector<float> y = run(part, kCublasLt);
      const bool same = std::memcmp(y.data(), all.data(), y.size() * sizeof(float)) == 0;
      report(same,
             "cuBLASLt " + std::to_string(full.n) + "x" + std::to_string(full.k) + ": " + std::to_string(rows) +
                 " rows alone",
             same ? "bitwise equal to those rows among " + std::to_string(full.x_rows) : "DIFFER");
    }
  }
}
#endif

// Times gemm() (pre-pass included) on one problem; X, W random on the device (packed
// weights: random bytes, as the timing does not depend on the values). The tile height is
// the backend's (gemm_tile_rows) unless `tile` names one.
void bench(const char* name, int64_t tokens, int64_t n, int64_t k, int experts, int top_k, bool gather,
           WeightFormat format = WeightFormat::Plain, GemmInput input = GemmInput::Split, bool on_cublaslt = false,
           int tile = 0, bool tiled = false, int factor_runs = 0) {
  // The backend picks one tile height for both expert GEMMs, from the narrower (gate_up's 1408).
  const bool moe_layer = experts > 0;
  const int64_t rows = moe_layer ? tokens * top_k : tokens;  // output rows
  const int64_t x_rows = moe_layer && gather ? tokens : rows;
  const int64_t segments = moe_layer ? std::min<int64_t>(experts, rows) : 1;
  const int tile_rows = on_cublaslt ? kCublasLt
                        : tile      ? tile
                                    : gemm_tile_rows(rows / segments, segments, moe_layer ? 1408 : n, input, format,
                                                     moe_layer);
  float *x, *y, *row_scales;
  uint8_t *w, *group_scales;
  void* scratch;
  const int64_t matrices = moe_layer ? experts : 1;
  const int64_t value_bytes = matrices * n * weight_row_bytes(format, k);
  const int64_t group_bytes = format == WeightFormat::Nvfp4 ? matrices * n * (k / 16) : 0;
  const int64_t row_scale_bytes = format == WeightFormat::Plain && !factor_runs ? 0 : matrices * n * 4;
  check(cudaMalloc(&x, sizeof(float) * size_t(x_rows * k)), "x");
  check(cudaMalloc(&y, sizeof(float) * size_t(rows * n)), "y");
  check(cudaMalloc(&w, size_t(value_bytes)), "w");
  check(cudaMalloc(&row_scales, std::max<size_t>(row_scale_bytes, 1)), "row scales");
  check(cudaMalloc(&group_scales, std::max<size_t>(group_bytes, 1)), "group scales");
  check(cudaMemset(row_scales, 0, std::max<size_t>(row_scale_bytes, 1)), "row scales");
  check(cudaMemset(group_scales, 0x38, std::max<size_t>(group_bytes, 1)), "group scales");  // E4M3 1.0
  check(cudaMalloc(&scratch, gemm_scratch_bytes(x_rows, n, k, input)), "scratch");
  random_fill(x, reinterpret_cast<__nv_bfloat16*>(w), x_rows * k, value_bytes / 2);
  const ExpertStack stack{
      {w, row_scale_bytes ? row_scales : nullptr, group_scales, tiled, factor_runs ? n / factor_runs : 0},
      format,
      n,
      k};  // random bytes: any layout
  std::vector<GemmSegment> segs;
  std::vector<GemmTile> tiles;
  std::vector<int64_t> row_map;
  if (moe_layer) {  // random routing, laid out as moe_plan does
    std::mt19937 rng(5);
    const std::vector<std::vector<int64_t>> by_expert = route_randomly(tokens, experts, top_k, rng);
    int64_t row = 0;
    for (int e = 0; e < experts; ++e) {
      segs.push_back({row, row, int(by_expert[e].size()), stack.expert(e)});
      for (int64_t m0 = 0; m0 < int64_t(by_expert[e].size()); m0 += tile_rows) tiles.push_back({e, int(m0)});
      for (int64_t t : by_expert[e]) row_map.push_back(t);
      row += int64_t(by_expert[e].size());
    }
    const int max_tiles = int((rows + tile_rows - 1) / tile_rows + experts);
    while (int(tiles.size()) < max_tiles) tiles.push_back({-1, 0});
  } else {
    segs.push_back({0, 0, int(rows), stack.expert(0)});
  }
  GemmSegment* d_segs = moe_layer ? upload(segs) : nullptr;
  GemmTile* d_tiles = moe_layer ? upload(tiles) : nullptr;
  int64_t* d_map = moe_layer && gather ? upload(row_map) : nullptr;
  const int num_tiles = moe_layer ? int(tiles.size()) : on_cublaslt ? 0 : int((rows + tile_rows - 1) / tile_rows);
  auto call = [&] {
#ifdef DIFFUSERVE_WITH_CUBLASLT
    if (on_cublaslt)
      return cublaslt().multiply(x, x_rows, k, false, input, {stack.expert(0)}, n, k, {y}, n, {}, scratch, nullptr);
#endif
    gemm(x, x_rows, k, false, d_map, moe_layer ? d_segs : segs.data(), d_tiles, num_tiles, tile_rows, format, tiled, n,
         k, input, y, nullptr, n, {}, {}, scratch, nullptr);
  };
  const float ms = time_ms(call);
  const double flops = 2.0 * double(rows) * double(n) * double(k);
  const double w_bytes = double(value_bytes + group_bytes + row_scale_bytes);
  std::printf("%-38s %-6s %-8s%s%s: %9.1f us  %6.1f TFLOP/s (useful)  %5.2f TB/s of weights\n", name,
              format_name(format, input), engine_name(tile_rows).c_str(), tiled ? " tiled" : "",
              factor_runs ? (" row factors, " + std::to_string(factor_runs) + " run(s)").c_str() : "", ms * 1e3,
              flops / (ms * 1e-3) / 1e12, w_bytes / (ms * 1e-3) / 1e12);
  cudaFree(x), cudaFree(y), cudaFree(w), cudaFree(row_scales), cudaFree(group_scales), cudaFree(scratch);
  cudaFree(d_segs), cudaFree(d_tiles), cudaFree(d_map);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  // The MoE's canvases: batch 1, 4 and 16's, or (--moe TOKENS) one.
  const std::vector<int64_t> moe_tokens =
      mode == "--moe" && argc > 2 ? std::vector<int64_t>{std::atoll(argv[2])} : std::vector<int64_t>{256, 1024, 4096};
  if (moe_tokens[0] <= 0) {
    std::fprintf(stderr, "gemm_bench: --moe takes a positive token count, not '%s'\n", argv[2]);
    return 2;
  }
  check_decode();
  check_e4m3_codes();
  check_fragments();
  check_packed_order();
  check_tiled_layout();
  if (mode == "--host") {
    std::printf("%s\n", failures ? "HOST CHECK FAILURES" : "all host checks passed");
    return failures ? 1 : 0;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device");
  std::printf("%s, %d SMs, wgmma tile %s\n", prop.name, prop.multiProcessorCount,
              gemm_has_wgmma_tile(GemmInput::Split, WeightFormat::Plain) ? "on" : "off");
  // Weights and X: bf16 and NVFP4 weights with bf16 X (bf16 activations), bf16, FP8 and
  // NVFP4 weights with hi/lo X (FP8_DYNAMIC today: plus a copy and quantize_input of X), FP8
  // weights with FP8 per-token X (fp8x8: the pre-pass quantizes X).
  const std::pair<WeightFormat, GemmInput> kinds[] = {
      {WeightFormat::Plain, GemmInput::RoundBf16}, {WeightFormat::Plain, GemmInput::Split},
      {WeightFormat::Fp8, GemmInput::Split},       {WeightFormat::Fp8, GemmInput::Fp8Token},
      {WeightFormat::Nvfp4, GemmInput::Split},     {WeightFormat::Nvfp4, GemmInput::RoundBf16}};
  // The dense layers' products (name, N, K): q of sliding and of global layers, o, K and V
  // as one product (gemm.cu's linears), the MLP's.
  const std::tuple<const char*, int64_t, int64_t> layer_products[] = {
      {"q_proj 2816->4096", 4096, 2816},      {"q_proj 2816->8192", 8192, 2816},
      {"o_proj 4096->2816", 2816, 4096},      {"kv_proj 2816->2048", 2048, 2816},
      {"mlp gate_up 2816->4224", 4224, 2816}, {"mlp down 2112->2816", 2816, 2112}};
  // Those products at m rows, each kind of weights and X, then the tied embedding's.
  auto time_dense = [&](int64_t m) {
    std::printf("-- dense, %ld rows\n", long(m));
    for (const auto& [f, input] : kinds)
      for (const auto& [name, n, k] : layer_products) bench(name, m, n, k, 0, 0, false, f, input);
    for (int tile : {32, 128})  // FP8 x FP8 at the other tile heights
      for (const auto& [name, n, k] : layer_products)
        bench(name, m, n, k, 0, 0, false, WeightFormat::Fp8, GemmInput::Fp8Token, false, tile);
    // The tied embedding (never packed): the lm_head, and the soft embedding (K = vocab).
    auto time_embedding = [&](bool on_cublaslt) {
      bench("lm_head 2816->262144", m, 262144, 2816, 0, 0, false, WeightFormat::Plain, GemmInput::Split, on_cublaslt);
      bench("soft embedding 262144->2816 (round)", m, 2816, 262144, 0, 0, false, WeightFormat::Plain,
            GemmInput::RoundBf16, on_cublaslt);
    };
    time_embedding(false);
#ifdef DIFFUSERVE_WITH_CUBLASLT  // the bf16 products on cuBLASLt, with K (and V) apart as the backend runs them
    for (const auto& [name, n, k] : layer_products) {
      bench(name, m, n, k, 0, 0, false, WeightFormat::Plain, GemmInput::Split, true);
      bench(name, m, n, k, 0, 0, false, WeightFormat::Fp8, GemmInput::Fp8Token, true);
      // decoded NVFP4 linears (bf16 with row factors, rounded X; gate and up stacked: two
      // runs), against the rounded plain product
      bench(name, m, n, k, 0, 0, false, WeightFormat::Plain, GemmInput::RoundBf16, true);
      for (int runs : {1, 2})
        bench(name, m, n, k, 0, 0, false, WeightFormat::Plain, GemmInput::RoundBf16, true, 0, false, runs);
    }
    bench("k_proj 2816->1024", m, 1024, 2816, 0, 0, false, WeightFormat::Plain, GemmInput::Split, true);
    bench("router 2816->128", m, 128, 2816, 0, 0, false, WeightFormat::Plain, GemmInput::Split, true);
    time_embedding(true);
#endif
  };
  if (mode == "--dense") {  // the dense timings at batch 1's 256 rows alone
    time_dense(256);
    return failures ? 1 : 0;
  }
  if (mode != "--moe") {  // --moe: the MoE timings alone
    correctness();
    // Spot checks of the big shapes (sampled elements) with each tile shape.
    Problem big = dense(512, 4096, 2816);
    for (int t : kTileHeights) verify(big, run(big, t), "dense 512x4096x2816 (sampled)", t, 4000);
    Problem big_fp8 = fp8_token(dense(WeightFormat::Fp8, 512, 4096, 2816));
    for (int t : kTileHeights) verify(big_fp8, run(big_fp8, t), "dense 512x4096x2816 (sampled)", t, 4000);
    for (WeightFormat f : {WeightFormat::Plain, WeightFormat::Fp8, WeightFormat::Nvfp4}) {
      Problem moe_big = moe(512, 128, 8, 264, 704, true, 9, f);
      for (int t : kTileHeights) verify(moe_big, run(moe_big, t), "moe up 512 tok 128 exp 264x704", t);
    }
    Problem moe_fp8 = fp8_token(moe(512, 128, 8, 264, 704, true, 9, WeightFormat::Fp8));
    for (int t : kTileHeights) verify(moe_fp8, run(moe_fp8, t), "moe up 512 tok 128 exp 264x704", t);
#ifdef DIFFUSERVE_WITH_CUBLASLT
    check_cublaslt();
#endif
    std::printf("%s\n", failures ? "CORRECTNESS FAILURES" : "all correctness checks passed");
    if (mode == "--check") return failures ? 1 : 0;

    for (int64_t m : {256, 4096}) time_dense(m);
  }
  for (int64_t tokens : moe_tokens) {
    std::printf("-- MoE, %ld tokens, 128 experts top 8 (~%ld rows per expert)\n", long(tokens), long(tokens / 16));
    for (const auto& [f, input] : kinds) {
      bench("experts up 2816->1408", tokens, 1408, 2816, 128, 8, true, f, input);
      bench("experts down 704->2816", tokens, 2816, 704, 128, 8, false, f, input);
      if (f == WeightFormat::Plain || input == GemmInput::Fp8Token) {  // and with the weights stored tiled
        bench("experts up 2816->1408", tokens, 1408, 2816, 128, 8, true, f, input, false, 0, true);
        bench("experts down 704->2816", tokens, 2816, 704, 128, 8, false, f, input, false, 0, true);
        // Every wgmma tile height, where an expert's rows come near a tile's (gemm_tile_rows
        // chooses among them): a tile too short streams an expert's weights again for its rest.
        if (gemm_has_wgmma_tile(input, f) && tokens >= 384)
          for (int tile : {32, 64, 128}) {
            bench("experts up 2816->1408", tokens, 1408, 2816, 128, 8, true, f, input, false, tile, true);
            bench("experts down 704->2816", tokens, 2816, 704, 128, 8, false, f, input, false, tile, true);
          }
      }
      if (tokens <= 384 && !gemm_operands_alike(input, f)) {  // decoding tiles of 16 rows (two for a 17th row)
        bench("experts up 2816->1408", tokens, 1408, 2816, 128, 8, true, f, input, false, 16);
        bench("experts down 704->2816", tokens, 2816, 704, 128, 8, false, f, input, false, 16);
      }
    }
  }
  return failures ? 1 : 0;
}
