// Segmented GEMM on tensor cores (mma.sync m16n8k16, bf16 or fp16, fp32 accumulation).
//
// One launch computes a product per segment (one for a dense layer, one per expert for
// the MoE), each over its own rows of X and its own weight matrix.
//
// X is fp32 and enters the tensor cores as two bf16 parts, hi = bf16(x) and lo =
// bf16(x - hi), each multiplied by the bf16 weights: 16 bits of mantissa instead of 8, so
// the product matches the fp32 reference (whose weights are the same bf16 values) to
// fp32-like precision. A pre-pass writes X as rows of [hi | lo] bf16 (K zero-padded to a
// multiple of 64) into the caller's scratch, so the main loop is a plain bf16 GEMM of A =
// hi and lo against the same weight tile, with nothing to convert per tile. The pre-pass
// keeps X's row order and the main loop gathers A rows through row_map (the MoE's up
// projection), so a token is converted once however many experts it goes to. With
// RoundBf16 (activations "bfloat16", and linear_nt's round_bf16(x) @ w) only hi is written
// and multiplied: lo would be zero. (Packed weights with bf16 X: one MMA per decoded
// fragment instead of two.)
//
// FP8 per token (GemmInput::Fp8Token: a compressed-tensors FP8_DYNAMIC linear's input,
// with FP8 weights) is multiplied in E4M3 instead: the pre-pass quantizes each X row as
// activation_quant.h does, to E4M3 codes of x / s_row (s_row = amax / 448), one byte
// each, and the main loop multiplies them with the weights' E4M3 codes as stored, the
// scales s_row * w_scale applied to the finished sums. On sm_90a both operands go to
// Hopper's E4M3 tensor cores as they are (wgmma, below), whose sums carry fewer bits than
// fp32: within 2e-3 of sum |x w| of the exact product, far inside E4M3's own rounding of
// each input. Elsewhere (and with DIFFUSERVE_WGMMA=0) both are unpacked to fp16 in
// registers (exact) for mma.sync's fp16 MMAs, half the bf16 path's (no lo plane), and the
// weight tile needs no conversion pass through shared memory (gemm_tile.cuh says why not
// mma.sync's E4M3 MMA): every product is exact in fp32 and the sums are fp32, the
// fake-quantized fp32 product (quantize_input, then the hi/lo GEMM) up to fp32 summation
// order.
//
// Main loop: block tiles of BM x BN outputs, K in slices of 128 bytes per tile row (64
// bf16 or 128 E4M3 values), streamed global -> shared memory by cp.async into a ring of
// 3-6 stages, so the next slices are in flight while the tensor cores work on the current
// one. Each tile row keeps its eight 16-byte chunks XOR-swizzled by (row % 8), which makes
// both the cp.async stores and the ldmatrix reads (8 rows of one chunk column) free of
// bank conflicts (gemm_tile.cuh). Fragments come from ldmatrix.x4, without .trans: W is
// [N, K], K contiguous, which is already the MMA's "col" B layout; in bytes the E4M3
// fragments are laid out as the bf16 ones, so both MMAs share the addressing. The tile
// shapes:
//   128 x 256, 8 warps of 64 x 64: tall inputs (dense at large batch, the lm_head, the MoE
//       at large batch). Per 32-byte K step a warp loads 8 A and 4 B fragments for 64
//       MMAs (E4M3: 4 and 4 for 64), which keeps shared-memory traffic below the
//       tensor-core time.
//   64 x 128, 4 warps of 32 x 64: a few hundred rows, where 128 x 256 tiles would leave
//       most multiprocessors idle (batch 1's 256 rows); two blocks fit per multiprocessor.
//       A launch of one wave or less (batch 1's dense products: about one block a
//       multiprocessor) takes 8 warps of 32 x 32 instead, which hide latency better (4-6%
//       faster on the H200; where blocks are plenty, 4 warps' fewer fragment loads win).
//       With decoded packed weights, 4 warps of 64 x 32 side by side (MediumDecoded).
//   16 or 32 x 128, 4 warps of 16 or 32 x 32: the MoE at small batch (32 rows from 13 rows
//       an expert: at batch 1 an expert's 16 +- 4 rows spill past 16 about half the time,
//       and a second tile streams and decodes its weights again), where
//       the kernel's job is streaming weights at memory bandwidth: three stages and three
//       blocks per multiprocessor keep ~100 KB of bf16 weights in flight on each. (With
//       two blocks of four stages, 8 warps, ncu found no warp ready to issue 56% of the
//       time, mostly waiting on dependent instructions; three blocks were 3-5% faster.)
//   32, 64 or 128 x 128 on wgmma (wgmma.cuh), one warpgroup: in place of the 32-, 64- and
//       128-row tiles above where X and the weights are both bf16 or both E4M3 and the build
//       has sm_90a (the MoE of bf16 checkpoints; dense products where cuBLASLt is absent;
//       every product of FP8_DYNAMIC's linears and experts). The same ring, read by the
//       tensor cores through descriptors, the weight rows as the MMAs' M. (At 16 rows, bf16
//       wgmma measured no faster than mma.sync: the warps' issue was not what held that tile
//       back, the second tiles were; E4M3 takes 32 rows there as well.) A block a tile is
//       deliberate: persistent blocks whose ring runs on from tile to tile (tiles dealt
//       round-robin, taken from a global counter, or handed over by a scheduler warp)
//       measured 3-10% slower for the MoE at 256 tokens and up to 2x at 1024-4096 on the
//       H200, and a producer warp filling the ring through mbarriers streamed only about
//       1 TB/s per warp (a warp's cp.async copies in flight are few). Nor did the first
//       wave's blocks gain from prefetching their first K slices into L2 (bulk prefetch)
//       before the programmatic wait, the router and the plan letting the up product start
//       early (twenty-sixth session: the batch-1 step 17.3 ms with it and without). An
//       L2 evict_first policy on the tiled weights' copies (cp.async's L2::cache_hint, so
//       that the weights streamed once leave L2 before the down product's 23 MB of outputs
//       the combine reads next) could not be measured: with it the tiled kernels stopped
//       on an illegal instruction on the H200 (CUDA 13.0's ptxas; the disassembly shows
//       those copies alone with an odd descriptor register, desc[UR1], beside an address
//       in [R + UR0]; the policy made once a thread; made beside each copy, it compiled
//       to the same and was not run) (thirtieth session). Keeping those outputs in L2 as
//       persisting lines instead (an access-policy window on the down product's launch,
//       the L2 set aside for persisting lines at its most, 37.5 of the H200's 60 MB, the
//       lines made normal again by the norm that sums them) made the steps 28-34% slower
//       (16.9 -> 21.7 ms at batch 1, 1K; thirty-fifth session). Nor did tiles that carry their
//       segment by value (a block's copies one look-up from its start, not two): batch-1
//       up / down 240.7-240.8 / 133.1-134.0 -> 240.4-240.6 / 133.2-133.5 us, the steps
//       alike (thirty-fourth session). At batch 1 the tiles stream the bf16 experts at 4.22
//       / 3.78 TB/s, where stream_bench reads the same tiled bytes, three stages and three
//       blocks a multiprocessor as here, at 4.43 / 4.44 (229.3 / 114.3 us): 11 and 20 us a
//       layer that the ring's refills alone do not cost.
// Every shape accumulates each output in the same order (K steps of 32 bytes in order, hi
// then lo; E4M3 on wgmma, a stage's tensor-core sum added in order), so a row's result does
// not depend on the tile shape its batch size picked: batched and single-sequence runs agree
// bitwise.
//
// Packed weights (FP8, NVFP4: packed_weight.h) with bf16 X stream as they are stored, 1 or
// 1/2 byte per value (plus NVFP4's scale per 16; NVFP4 in the GEMM layout the backend writes
// at upload, packed_decode.cuh: a pair of values decodes in a rotation, a mask and a
// multiply by the scale), into the ring, and each lane decodes
// its B fragments from there in registers (packed_decode.cuh: exact): 16 consecutive values
// of a W row per lane and slice, read by one shared-memory load, so no pass through shared
// memory and no extra barrier per slice (at batch 1 the MoE streams weights, and a
// conversion pass had made FP8 and NVFP4 slower than bf16). The pre-pass stores X's K in
// the order those fragments take (gemm_tile.cuh, packed_k_source). The per-row fp32 scale
// (FP8's scale, NVFP4's global scale) is applied to the finished sums. From 64 rows (the
// MoE from batch 4) NVFP4 takes wgmma tiles instead, which decode each stage's slice once
// into a bf16 tile in shared memory, in the same K order, for the wgmmas to read (a barrier
// more a stage): the products and sums are those of the mma.sync tiles, bitwise (gemm_bench).
// H200, NVFP4 with bf16 X, up / down at 4,096 tokens 1124 / 719 -> 743 / 476 us, at 1,024
// 317 / 218 -> 316 / 184 (gemm_bench --moe).
//
// Weights stream by 16-byte cp.async (4-byte for NVFP4's scales) where their rows allow
// it (whole, aligned chunks); partial chunks are zero-filled past N and K. Otherwise (tiny
// test models) the same bytes are copied one by one.
//
// Expert stacks the wgmma tiles read (bf16, or E4M3 with FP8 X) are stored tiled by the
// backend (Backend::lay_out_experts; gemm_tile.cuh, tiled_offset): each stage's 128 weight
// rows are one contiguous 16 KB run, already swizzled, so a stage is a plain copy and the
// memory serves few long runs instead of 128 rows' 128-byte pieces (stream_bench: 4.36 ->
// 4.53 TB/s for gate_up's pattern). The tiled load is a kernel of its own (kTiled): one
// kernel with both loads kept both address sets live, 30-40 registers more. On the H200 at
// batch 1 (gemm_bench --moe): bf16 gate_up / down 247.5 / 134.6 -> 236.4 / 131.9 us, FP8
// 138.6 / 95.2 -> 135.7 / 90.8 us. A stage's run loaded by one bulk copy (cp.async.bulk: the
// copy engine, signalling the stage's mbarrier) in place of the 128 threads' cp.async was no
// faster and was not kept (fifty-sixth session, H200, checks passed: up / down 241.2-241.8 /
// 132.7-134.6 -> 241.0-241.8 / 133.3-135.1 us, the batch-1 step 16.93-16.96 -> 16.89-16.93 ms).
// Nor was the down product's ring starting on its first weight slices before its wait (its
// tile list is the plan's, written before the up product ran, so only its X rows wait for the
// up product), to stream through the up product's last blocks: gemm_bench --check and
// test_cuda.py passed, and the steps (ab_steps.sh, H100, twice each) went 22.20 / 22.22 ->
// 22.29 / 22.41 ms at 1x1K, 40.35 / 40.50 -> 40.39 / 40.39 at 4x1K, 23.72 / 23.77 -> 23.73 /
// 23.76 at 1x8K (fifty-seventh session).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "activation_quant.h"
#include "block_reduce.cuh"
#include "cp_async.cuh"
#include "gemm_tile.cuh"
#include "kernels.h"
#include "load8.cuh"
#include "mma.cuh"
#include "packed_decode.cuh"
#include "wgmma.cuh"

namespace diffuserve::cuda {
namespace {

// How X enters the tensor cores: bf16 parts (planes, kernels.h) or E4M3 codes, values per
// tile row.
__host__ __device__ constexpr int x_value_bytes(GemmInput input) { return input == GemmInput::Fp8Token ? 1 : 2; }
// K values per pipeline stage (a tile row's 128 bytes of X).
__host__ __device__ constexpr int stage_k(GemmInput input) { return kRowBytes / x_value_bytes(input); }
// Whether packed weights are decoded to bf16 fragments (bf16 X) or multiplied as they are.
__host__ __device__ constexpr bool decodes(GemmInput input, WeightFormat format) {
  return format != WeightFormat::Plain && input != GemmInput::Fp8Token;
}

int64_t padded_k(int64_t k, GemmInput input) { return (k + stage_k(input) - 1) / stage_k(input) * stage_k(input); }

// Of `most` bytes, those before an end `remaining` bytes away.
__device__ __forceinline__ int bytes_before(int64_t remaining, int most) {
  return remaining <= 0 ? 0 : remaining >= most ? most : int(remaining);
}

// kBytes bytes global -> shared, of which the first `valid` are read and the rest
// zero-filled, byte by byte: where the rows' bytes are not whole aligned chunks (tiny test
// models), which cp.async needs.
template <int kBytes>
__device__ __forceinline__ void copy_bytes(uint8_t* dst, const uint8_t* src, int valid) {
#pragma unroll
  for (int e = 0; e < kBytes; ++e) dst[e] = e < valid ? src[e] : 0;
}

// Four 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and each
// thread gets element (lane / 4, 2 * (lane % 4) + {0, 1}) of matrix i in register i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

struct Params {
  const uint8_t* a;         // the pre-pass's X: row r at a + r * a_row_bytes, hi then (Split) lo
  int64_t a_row_bytes;      // planes * kp values
  int64_t plane_bytes;      // kp values: lo after hi
  const float* a_scales;    // Fp8Token: s_row per X row
  int64_t kp;               // K padded to the stage's K
  const int64_t* row_map;
  const GemmSegment* segments;
  const GemmTile* tiles;
  GemmSegment single;  // the segment when tiles is null (dense)
  int64_t n, k;
  bool w_vector;   // weights by cp.async (whole aligned chunks per row, see gemm())
  bool w_tiled;    // the weights stored tiled (GemmMatrix::tiled), every segment's
  bool y_pairs;    // Y by pair stores, float2 or bf16x2 (ldy even, aligned)
  int64_t k_slice;  // split-K: K columns per blockIdx.z, a multiple of the stage's K
  float* y;
  __nv_bfloat16* y_bf16;  // not null: Y rounded to bf16 there instead of y (gemm()'s y_bf16)
  int64_t ldy, y_copy_stride;
  PreparedX act;  // rows not null: the MLP's activation instead of y (gemm()'s `act`)
};

// Output i of Y (y + i, or y_bf16 + i rounded to nearest even). Split-K's copies are fp32.
__device__ __forceinline__ void store_y(const Params& p, int64_t i, float v) {
  if (p.y_bf16) p.y_bf16[i] = __float2bfloat16_rn(v);
  else p.y[int64_t(blockIdx.z) * p.y_copy_stride + i] = v;
}

// Bytes of a stage's W row: the MMA tile's 128 (bf16, or E4M3 with E4M3 X), or the packed
// slice that is converted into it; NVFP4's E4M3 scales (one per 16 values) follow the rows.
__host__ __device__ constexpr int weight_row_stage_bytes(GemmInput input, WeightFormat format) {
  return int(weight_row_bytes(format, stage_k(input)));
}
__host__ __device__ constexpr int weight_stage_bytes(GemmInput input, WeightFormat format, int rows) {
  return rows * (weight_row_stage_bytes(input, format) + (format == WeightFormat::Nvfp4 ? stage_k(input) / 16 : 0));
}

// A block tile of kBM x kBN outputs, warps of (kBM / kWarpsM) x (kBN / kWarpsN), a ring of
// kStages K-slices (kPackedStages with packed weights, whose slices are smaller, and with
// E4M3 X, whose one plane is), kBlocks resident per multiprocessor (shared memory allows it).
// kWgmma: the MMAs are wgmma's (wgmma.cuh), one warpgroup's.
template <int kBM_, int kBN_, int kWarpsM_, int kWarpsN_, int kStages_, int kPackedStages_, int kBlocks_,
          bool kWgmma_ = false>
struct Shape {
  static constexpr int kBM = kBM_, kBN = kBN_, kWarpsM = kWarpsM_, kWarpsN = kWarpsN_;
  static constexpr bool kWgmma = kWgmma_;
  static constexpr int kBlocks = kBlocks_, kThreads = kWarpsM * kWarpsN * 32;
  __host__ __device__ static constexpr int stages(WeightFormat format) {
    return format == WeightFormat::Plain ? kStages_ : kPackedStages_;
  }
  // A stage's bytes; on wgmma whole swizzle atoms (1 KB), as the MMAs read each stage's tiles.
  __host__ __device__ static constexpr int stage_bytes(GemmInput input, WeightFormat format) {
    const int bytes = planes(input) * kBM * kRowBytes + weight_stage_bytes(input, format, kBN);
    return kWgmma ? (bytes + 1023) / 1024 * 1024 : bytes;
  }
  // The ring, and on wgmma with packed weights the bf16 W tile they are decoded into.
  __host__ __device__ static constexpr int decoded_offset(GemmInput input, WeightFormat format) {
    return stages(format) * stage_bytes(input, format);
  }
  static constexpr int smem_bytes(GemmInput input, WeightFormat format) {
    return decoded_offset(input, format) + (kWgmma && decodes(input, format) ? kBN * kRowBytes : 0);
  }
};
// Shared memory with hi and lo planes, bf16 / FP8 / NVFP4 weights; E4M3 X and weights:
using Small = Shape<16, 128, 1, 4, 3, 6, 3>;    // 60 / 72 / 52 KB; 108 KB
using Small32 = Shape<32, 128, 1, 4, 3, 4, 3>;  // 72 / 64 / 50 KB; 80 KB
using Medium = Shape<64, 128, 2, 2, 3, 3, 2>;   // 96 / 72 / 62 KB; 72 KB
using MediumOneWave = Shape<64, 128, 2, 4, 3, 3, 2>;
using Large = Shape<128, 256, 2, 4, 3, 3, 1>;   // 192 / 144 / 123 KB; 144 KB
// The wgmma tiles (bf16 X and weights, or E4M3 both; see the top): the 128 weight rows are
// the MMAs' M, as two m64 halves, and the 32, 64 or 128 X rows their N (Y^T = W X^T), one
// wgmma per half, plane and 32-byte K step. (Packed weights decoded into wgmma's register
// operand measured no faster than Small's mma.sync, NVFP4's down projection 18% slower:
// they stay there.) E4M3's stages are smaller (one X plane, a byte a weight); 6 stages at 64
// and 128 rows measured no faster for the dense products at batch 1 (about a block a
// multiprocessor) and up to 1.7x slower for the MoE at batch 4 and 16 (one block a
// multiprocessor where two had fit).
// (Wgmma32 at two stages, four or five blocks a multiprocessor, so that more blocks cover one
// block's refills and output: slower, bf16 experts at batch 1 up / down 254 / 139 -> 278 / 143
// us, rows not tiled; gemm_bench --moe 256, H200, forty-sixth session.)
// Nor did 256 weight rows a block at batch 1 (bf16 X, tiled weights; 36 KB stages, two blocks
// a multiprocessor, 179 registers), so that each staged X tile serves twice the weight rows
// and the L2 (93% busy at an 8-9% hit rate, twenty-third session's ncu) carries half the X
// reads: up / down 343.0-342.9 / 188.6-188.2 -> 344.6-344.4 / 188.5-189.4 us (gemm_bench --moe
// 256, H100, base and wide alternating twice; its 344 checks passed on it; seventieth session).
using Wgmma32 = Shape<32, 128, 1, 4, 3, 3, 3, true>;    // 72 KB; 60 KB
using Wgmma64 = Shape<64, 128, 1, 4, 3, 3, 2, true>;    // 96 KB; 72 KB
using Wgmma128 = Shape<128, 128, 1, 4, 3, 3, 1, true>;  // 144 KB; 96 KB
// At 4,096 tokens (batch 16) the 128-row tile's bf16 experts run at 466 / 358 TFLOP/s up /
// down (559 / 358 us), of the 794 the tensor cores give a dense product. Tried and not kept
// (thirty-second session, H200, gemm_bench --moe, bf16 X, tiled weights): two warpgroups side
// by side over 256 weight rows, so that each X tile staged serves twice the weight rows (one
// block a multiprocessor, four stages at 64 rows): up / down 560 / 360 -> 690 / 438 us at
// 4,096 tokens, 290 / 171 -> 307 / 186 at 1,024, the 16x1K step 116.5 -> 122.1 ms; and four
// stages whose wgmmas stay in flight through the next stage's barrier and copies
// (wgmma_wait<1>, the ring refilling the stage two behind): 559 / 358 -> 720 / 492 us, 290 /
// 171 -> 298 / 179, the 16x1K step 120.5 -> 125.0 ms. gemm_bench's checks and the GPU tests
// passed on both.
// The 64- and 128-row wgmma tiles for NVFP4 weights with bf16 X (the MoE from batch 4): each
// stage's packed slice is decoded once into a bf16 W tile in shared memory, which the wgmmas
// read as they read bf16 weights. Decoded in registers instead (the mma.sync tiles), each
// value is decoded by every warp row that multiplies it, at mma.sync's rate: at 4,096 tokens
// the 128 x 256 tile took twice Wgmma128's time on bf16 weights. More blocks a multiprocessor
// than the bf16 tiles (bf16 X: 55 / 79 KB), so that one block's decoding overlaps another's
// MMAs. (At 32 rows the decoding is the whole cost, and the pass through shared memory only
// adds to it: a 32-row tile of this kind took NVFP4's batch-1 up / down from 142 / 85 to 227
// / 103 us, the step from 14.6 to 17.9 ms.)
using Wgmma64Decoded = Shape<64, 128, 1, 4, 3, 3, 3, true>;
using Wgmma128Decoded = Shape<128, 128, 1, 4, 3, 3, 2, true>;
// Medium for decoded packed weights: warps side by side (64 x 32 each), as each warp decodes
// the W columns it multiplies and two warps over the same columns would decode them twice.
using MediumDecoded = Shape<64, 128, 1, 4, 3, 3, 2>;  // 72 / 62 KB
// Small32 for decoded packed weights: four blocks a multiprocessor (128 registers, none
// spilled) where three had fit at 142-159. The decoding keeps the issue slots busy (ncu,
// H200, NVFP4 up projection at batch 1: 57%), and the three blocks' 12 warps left none
// eligible 40% of the cycles. Five blocks (96 registers, NVFP4 with its GEMM layout spilling
// 4 bytes) measured slower (eighteenth session: NVFP4 up 159.1 -> 171.9 us at batch 1, FP8
// weights with hi/lo X 217.5 -> 250.4 us, the batch-1 step 15.4 -> 15.8 ms); with the
// nineteenth session's lean copies, NVFP4 with bf16 X up / down 144.0 / 86.3 -> 156.0 / 83.9 us.
using Small32Decoded = Shape<32, 128, 1, 4, 3, 4, 4>;

// kTiled: the weights are stored tiled (GemmMatrix::tiled), each stage's 128 rows one run.
template <class S, GemmInput kInput, WeightFormat kFormat, bool kTiled>
__global__ void __launch_bounds__(S::kThreads, S::kBlocks) gemm_kernel(const Params p) {
  wait_for_earlier_kernels();
  constexpr int kBM = S::kBM, kBN = S::kBN, kStages = S::stages(kFormat), kThreads = S::kThreads;
  constexpr int kPlanes = planes(kInput), kBK = stage_k(kInput);
  constexpr int kWM = kBM / S::kWarpsM, kWN = kBN / S::kWarpsN;
  constexpr int kTilesM = kWM / 16, kTilesN = kWN / 8;  // m16 / n8 MMA tiles per warp
  constexpr int kARows = kPlanes * kBM;                 // A tile rows per stage: hi rows, then lo rows
  constexpr int kABytes = kARows * kRowBytes, kStageBytes = S::stage_bytes(kInput, kFormat);
  constexpr int kRowStep = kThreads / 8;  // tile rows one pass of the block's 16-byte copies covers
  constexpr int kALoads = kBM / kRowStep;
  constexpr bool kDecode = decodes(kInput, kFormat);
  static_assert(!kTiled || (!kDecode && S::kWgmma), "tiled weights: not decoded, on the wgmma tiles");
  // A stage's W row: 16-byte chunks of the MMA tile (swizzled) or of the packed slice (in order).
  constexpr int kWRowBytes = weight_row_stage_bytes(kInput, kFormat);
  constexpr int kWChunks = kBN * kWRowBytes / 16, kWLoads = kWChunks / kThreads;
  static_assert(kBM % kRowStep == 0 && kWChunks % kThreads == 0 && kTilesN % 2 == 0 &&
                    kBN <= kThreads,  // a thread per W row for NVFP4's scales
                "tile shape");
  static_assert(!S::kWgmma || ((gemm_operands_alike(kInput, kFormat) || kFormat == WeightFormat::Nvfp4) && kBN == 128 &&
                               kThreads == 128 && kABytes % 1024 == 0 && kStageBytes % 1024 == 0),
                "wgmma: bf16 X and W, E4M3 X and W, or NVFP4 W decoded for bf16 X; one warpgroup, 128 W rows, "
                "operands on whole swizzle atoms");
  extern __shared__ __align__(1024) uint8_t smem[];

  GemmSegment seg = p.single;
  int m0 = blockIdx.y * kBM;  // dense: tiles follow blockIdx.y
  if (p.tiles) {
    const GemmTile tile = p.tiles[blockIdx.y];
    if (tile.segment < 0) return;  // an unused slot of a device-planned tile list
    seg = p.segments[tile.segment];
    m0 = tile.m0;
  }
  const int rows = min(kBM, seg.rows - m0);
  const int64_t n0 = int64_t(blockIdx.x) * kBN, n = p.n, k = p.k;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / S::kWarpsN, warp_n = warp % S::kWarpsN;

  // The X row of tile row r (< rows).
  auto x_row = [&](int r) {
    const int64_t i = seg.x_row + m0 + r;
    return p.row_map ? p.row_map[i] : i;
  };

  // This thread's copies: chunk tid % 8 of A's tile rows tid / 8 + j * kRowStep, W's chunks
  // below, and (NVFP4) row tid's group scales. Whether each row exists and where in a stage
  // each copy lands do not change from stage to stage, and the stages load the K slices in
  // order, so each source is a pointer that moves on by one slice's bytes a stage (in the
  // batch-1 MoE's decoding tile, which issues on 55% of its cycles, the 64-bit address and
  // bounds arithmetic of each stage's copies had been 115 of the loop's 286 instructions).
  // Split-K: the block's first slice is first_slice.
  const int64_t k_begin = int64_t(blockIdx.z) * p.k_slice, k_end = min(p.kp, k_begin + p.k_slice);
  const int k_tiles = int((k_end - k_begin) / kBK), first_slice = int(k_begin / kBK);
  const int copy_row = tid / 8, copy_chunk = tid % 8;
  const uint8_t* a_src[kALoads];
  bool a_copy[kALoads];
#pragma unroll
  for (int j = 0; j < kALoads; ++j) {
    const int r = copy_row + j * kRowStep;
    a_copy[j] = r < rows;  // rows past the tile's end are zero-filled from a valid address
    a_src[j] = p.a + (a_copy[j] ? x_row(r) : 0) * p.a_row_bytes + copy_chunk * 16 + first_slice * kRowBytes;
  }
  const uint8_t* const w_values = static_cast<const uint8_t*>(seg.w.values);
  const int64_t w_row_bytes = weight_row_bytes(kFormat, k);
  const int w_row_bytes32 = int(w_row_bytes);  // gemm(): K <= 2^29
  // W: as rows, this thread copies chunk w_chunk of slice rows w_row + j * kWRowStep (the
  // chunk is 16 bytes of the slice's kWRowBytes of a row; a missing row reads row 0, which
  // exists, zero-filled); stored tiled, bytes `at` of the stage's runs (each 128 rows of the
  // stage one contiguous 16 KB run, stored as the tile itself, swizzled: N % 128 == 0).
  constexpr int kPerRow = kWRowBytes / 16, kWRowStep = kThreads / kPerRow;
  static_assert(kThreads % kPerRow == 0, "W chunk mapping");
  const int w_row = tid / kPerRow, w_chunk = tid % kPerRow;
  constexpr int kWSliceStep = kTiled ? kTiledRunBytes : kWRowBytes;
  const uint8_t* w_src[kWLoads];
  uint32_t w_dst[kWLoads];  // offset in the stage's W tile
  bool w_copy[kWLoads];
#pragma unroll
  for (int j = 0; j < kWLoads; ++j) {
    const int r = w_row + j * kWRowStep, at = 16 * (tid + j * kThreads);
    if constexpr (kTiled) {
      const int64_t slices = w_row_bytes / kRowBytes;
      w_src[j] = w_values + (n0 / 128 + at / kTiledRunBytes) * slices * kTiledRunBytes + at % kTiledRunBytes;
      w_dst[j] = at;
      w_copy[j] = true;
    } else {
      w_copy[j] = n0 + r < n;
      w_src[j] = w_values + (w_copy[j] ? n0 + r : 0) * w_row_bytes + 16 * w_chunk;
      w_dst[j] = kDecode ? r * kWRowBytes + 16 * w_chunk : swizzle(r, w_chunk);
    }
    w_src[j] += int64_t(first_slice) * kWSliceStep;
  }
  constexpr int kScales = kBK / 16;  // NVFP4: a stage's group scales of a row
  constexpr int kScalesOffset = kBN * kWRowBytes;  // NVFP4: where in a stage's W part its scales lie
  const int64_t groups = k / 16;
  const bool s_copy = tid < kBN && n0 + tid < n;
  [[maybe_unused]] const uint8_t* s_src =
      kFormat == WeightFormat::Nvfp4 ? seg.w.group_scales + (s_copy ? (n0 + tid) * groups : 0) + first_slice * kScales
                                     : nullptr;

  // Stage `stage` <- K slice `slice` (columns [slice * kBK, +kBK)) of the A rows and the W
  // rows; called for the block's slices in order. Only a row's last slice can hold chunks
  // past its end, so the others copy without a check, in one branch with NVFP4's scales.
  const int whole_slices = w_row_bytes32 / kWRowBytes;  // W slices whose chunks all lie inside the rows
  auto load_tile = [&](int stage, int slice) {
    uint8_t* const base = smem + stage * kStageBytes;
#pragma unroll
    for (int j = 0; j < kALoads; ++j) {
#pragma unroll
      for (int plane = 0; plane < kPlanes; ++plane)
        cp_async16(shared_address(base + swizzle(plane * kBM + copy_row + j * kRowStep, copy_chunk)),
                   a_src[j] + plane * p.plane_bytes, a_copy[j]);
      a_src[j] += kRowBytes;  // kBK values of x_value_bytes
    }
    uint8_t* const w_stage = base + kABytes;
    // NVFP4: this slice's group scales of row tid.
    static_assert(kFormat != WeightFormat::Nvfp4 || kScales == 4, "a stage's scales of a row: one 4-byte copy");
    [[maybe_unused]] uint8_t* const s_dst = w_stage + kScalesOffset + tid * kScales;
    [[maybe_unused]] const bool s_thread = kBN == kThreads || tid < kBN;
    if (kTiled || (p.w_vector && slice < whole_slices)) {  // whole chunks and scales: one uniform branch
#pragma unroll
      for (int j = 0; j < kWLoads; ++j) cp_async16(shared_address(w_stage + w_dst[j]), w_src[j], w_copy[j]);
      if constexpr (kFormat == WeightFormat::Nvfp4)  // w_vector: K % 64 == 0
        if (s_thread) cp_async4(shared_address(s_dst), s_src, s_copy);
    } else if (p.w_vector) {  // the rows' last slice (not NVFP4's): each chunk inside its row or past it
      const bool k_ok = slice * kWRowBytes + 16 * w_chunk < w_row_bytes32;
#pragma unroll
      for (int j = 0; j < kWLoads; ++j)  // a chunk past its row, zero-filled, names the matrix's start
        cp_async16(shared_address(w_stage + w_dst[j]), k_ok ? w_src[j] : w_values, k_ok && w_copy[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kWLoads; ++j) {
        const int valid = w_copy[j] ? bytes_before(w_row_bytes32 - slice * kWRowBytes - 16 * w_chunk, 16) : 0;
        copy_bytes<16>(w_stage + w_dst[j], valid ? w_src[j] : w_values, valid);
      }
      if constexpr (kFormat == WeightFormat::Nvfp4) {
        const int valid = s_copy ? bytes_before(groups - slice * kScales, kScales) : 0;
        if (s_thread) copy_bytes<kScales>(s_dst, valid ? s_src : seg.w.group_scales, valid);
      }
    }
#pragma unroll
    for (int j = 0; j < kWLoads; ++j) w_src[j] += kWSliceStep;
    if constexpr (kFormat == WeightFormat::Nvfp4) s_src += kScales;
  };

  // The warp's MMAs over one stage: 4 K steps of 32 bytes, each one bf16 MMA per plane (hi
  // then lo) or two fp16 ones (E4M3 halves, gemm_tile.cuh) per output tile. The W
  // fragments of a step are loaded all at once, or with E4M3 (unpacked to twice the
  // registers) one n16 pair at a time, which leaves registers for the accumulators.
  constexpr int kHalves = kInput == GemmInput::Fp8Token ? 2 : 1;
  constexpr int kPairsPerLoad = kInput == GemmInput::Fp8Token ? 1 : kTilesN / 2;
  float acc[kTilesM][kTilesN][4] = {};
  auto compute = [&](int stage) {
    const uint8_t* const base = smem + stage * kStageBytes;
    const uint32_t a_base = shared_address(base), w_base = shared_address(base + kABytes);
#pragma unroll
    for (int ks = 0; ks < kRowBytes / 32; ++ks) {
      uint32_t a[kPlanes][kTilesM][kHalves][4];
#pragma unroll
      for (int plane = 0; plane < kPlanes; ++plane)
#pragma unroll
        for (int mt = 0; mt < kTilesM; ++mt) {
          uint32_t r[4];
          ldmatrix_x4(r, a_base + swizzle(a_fragment_row(plane * kBM + warp_m * kWM + mt * 16, lane),
                                          a_fragment_chunk(ks, lane)));
          if constexpr (kHalves == 2) e4m3_a_halves(r, a[plane][mt], e4m3x4_to_f16);
          else for (int i = 0; i < 4; ++i) a[plane][mt][0][i] = r[i];
        }
#pragma unroll
      for (int np0 = 0; np0 < kTilesN / 2; np0 += kPairsPerLoad) {
        uint32_t b[2 * kPairsPerLoad][kHalves][2];  // n8 tiles 2 np0..
#pragma unroll
        for (int np = 0; np < kPairsPerLoad; ++np) {
          uint32_t q[4];  // {0, 1}: the first n8 tile's, {2, 3}: the second's
          ldmatrix_x4(q, w_base + swizzle(b_fragment_row(warp_n * kWN + (np0 + np) * 16, lane),
                                          b_fragment_chunk(ks, lane)));
          if constexpr (kHalves == 2) {
            e4m3_b_halves(q, b[2 * np], e4m3x4_to_f16);
            e4m3_b_halves(q + 2, b[2 * np + 1], e4m3x4_to_f16);
          } else {
            b[2 * np][0][0] = q[0], b[2 * np][0][1] = q[1], b[2 * np + 1][0][0] = q[2], b[2 * np + 1][0][1] = q[3];
          }
        }
#pragma unroll
        for (int mt = 0; mt < kTilesM; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2 * kPairsPerLoad; ++nt)
#pragma unroll
            for (int half = 0; half < kHalves; ++half)
#pragma unroll
              for (int plane = 0; plane < kPlanes; ++plane) {
                float* const c = acc[mt][2 * np0 + nt];
                if constexpr (kHalves == 2) mma_f16(c, a[plane][mt][half], b[nt][half]);
                else mma_bf16(c, a[plane][mt][half], b[nt][half]);
              }
      }
    }
  };

  // Packed weights with bf16 X: lane (g, t) reads values 16t..16t+15 of W row g of each of
  // its n8 tiles (FP8: 16 bytes; NVFP4: 8 bytes and their group's scale), and K step ks
  // decodes values 16t + 4ks + {0..3} into that tile's B fragment (gemm_tile.cuh). Outputs
  // accumulate in the same order as compute(): K steps in order, hi then lo. The large tile
  // takes its n8 tiles in two passes (loading A's fragments twice), which keeps the packed
  // words beside its 128 accumulators in registers. Only the warp's first kLiveM m16 tiles
  // are multiplied (live_m below): the others' rows are all past the tile's end.
  constexpr int kPasses = kTilesM * kTilesN >= 32 ? 2 : 1, kPassTiles = kTilesN / kPasses;
  auto compute_decoded = [&](int stage, auto live_m) {
    constexpr int kLiveM = decltype(live_m)::value;
    const uint8_t* const base = smem + stage * kStageBytes;
    const uint8_t* const w_stage = base + kABytes;
    const uint32_t a_base = shared_address(base);
    const int g = lane >> 2, t = lane & 3;
    constexpr int kWords = kFormat == WeightFormat::Fp8 ? 4 : 2;  // a lane's 16 values of a row
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      uint32_t w[kPassTiles][kWords];
      [[maybe_unused]] uint32_t scale[kPassTiles];
#pragma unroll
      for (int i = 0; i < kPassTiles; ++i) {
        const int r = warp_n * kWN + (pass * kPassTiles + i) * 8 + g;
        if constexpr (kFormat == WeightFormat::Fp8) {
          const uint4 v = *reinterpret_cast<const uint4*>(w_stage + r * kWRowBytes + 16 * t);
          w[i][0] = v.x, w[i][1] = v.y, w[i][2] = v.z, w[i][3] = v.w;
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(w_stage + r * kWRowBytes + 8 * t);
          w[i][0] = v.x, w[i][1] = v.y;
          scale[i] = nvfp4_scale_pair(w_stage[kScalesOffset + r * kScales + t]);
        }
      }
#pragma unroll
      for (int ks = 0; ks < kRowBytes / 32; ++ks) {
        uint32_t a[kPlanes][kLiveM][4];
#pragma unroll
        for (int plane = 0; plane < kPlanes; ++plane)
#pragma unroll
          for (int mt = 0; mt < kLiveM; ++mt)
            ldmatrix_x4(a[plane][mt], a_base + swizzle(a_fragment_row(plane * kBM + warp_m * kWM + mt * 16, lane),
                                                       a_fragment_chunk(ks, lane)));
#pragma unroll
        for (int i = 0; i < kPassTiles; ++i) {
          uint32_t b[2];
          if constexpr (kFormat == WeightFormat::Fp8) fp8x4_to_bf16(w[i][ks], b[0], b[1]);
          else nvfp4x4_to_bf16(w[i][ks / 2], ks % 2, scale[i], b[0], b[1]);
#pragma unroll
          for (int mt = 0; mt < kLiveM; ++mt)
#pragma unroll
            for (int plane = 0; plane < kPlanes; ++plane) mma_bf16(acc[mt][pass * kPassTiles + i], a[plane][mt], b);
        }
      }
    }
  };

  // NVFP4 on wgmma: the stage's packed slice decoded into the bf16 W tile after the ring,
  // row tid's 64 values (four groups) by thread tid, in X's permuted K order: K step ks's
  // position 2t (+ 8) of a row holds the first (second) pair compute_decoded's lane t gives
  // the MMAs at that step (packed_k_source), so chunk 2 ks holds the first pairs of t = 0..3
  // and chunk 2 ks + 1 the second ones, and the wgmmas sum the products those MMAs would.
  constexpr int kDecodedOffset = S::decoded_offset(kInput, kFormat);
  [[maybe_unused]] auto decode_stage = [&](int stage) {
    if constexpr (S::kWgmma && kFormat == WeightFormat::Nvfp4) {
      static_assert(kWRowBytes == 32 && kScales == 4 && kBN == kThreads, "a thread per row of 64 values");
      const uint8_t* const w_stage = smem + stage * kStageBytes + kABytes;
      const uint4 v0 = *reinterpret_cast<const uint4*>(w_stage + tid * kWRowBytes);
      const uint4 v1 = *reinterpret_cast<const uint4*>(w_stage + tid * kWRowBytes + 16);
      const uint32_t scales = *reinterpret_cast<const uint32_t*>(w_stage + kScalesOffset + tid * kScales);
      const uint32_t words[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};  // lane t's: 2t, 2t + 1
      uint8_t* const tile = smem + kDecodedOffset;
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
        uint32_t first[4], second[4];
#pragma unroll
        for (int t = 0; t < 4; ++t)
          nvfp4x4_to_bf16(words[2 * t + ks / 2], ks % 2, nvfp4_scale_pair(uint8_t(scales >> 8 * t)), first[t],
                          second[t]);
        *reinterpret_cast<uint4*>(tile + swizzle(tid, 2 * ks)) = make_uint4(first[0], first[1], first[2], first[3]);
        *reinterpret_cast<uint4*>(tile + swizzle(tid, 2 * ks + 1)) =
            make_uint4(second[0], second[1], second[2], second[3]);
      }
    }
  };

  // On wgmma: weight rows [64 h, 64 h + 64) of the tile are half h's M, the X tile's plane
  // rows its N. bf16: per accumulator, K steps in order, hi then lo, as compute() sums them.
  // E4M3: the tensor cores add E4M3 products with fewer bits than fp32 (errors near 2^-12 of
  // the magnitude within one MMA), and carried on in their accumulators they would compound
  // over K. So each stage's 128 values go into registers of their own (the first K step
  // overwriting them), added to the fp32 sums after: an output is within 2e-3 of sum |x w|
  // of the exact product (gemm_bench), a hundredth of E4M3's own rounding of each input
  // (2^-4), and the order of the additions is the stage's alone. Both halves are in flight
  // at once where the registers allow (32 and 64 X rows).
  float wacc[2][kBM / 2] = {};
  constexpr int kPartHalves = kBM <= 64 ? 2 : 1;
  [[maybe_unused]] float wpart[kPartHalves][kBM / 2] = {};
  auto compute_wgmma = [&](int stage) {
    if constexpr (S::kWgmma) {
#ifdef DIFFUSERVE_WGMMA_DEVICE
      const uint32_t a_base = shared_address(smem + stage * kStageBytes);
      const uint32_t w_base = kDecode ? shared_address(smem + kDecodedOffset) : a_base + kABytes;
      auto w_operand = [&](int half, int ks) { return wgmma_descriptor(w_base + half * 64 * kRowBytes + 32 * ks); };
      auto x_operand = [&](int plane, int ks) { return wgmma_descriptor(a_base + plane * kBM * kRowBytes + 32 * ks); };
      if constexpr (kInput == GemmInput::Fp8Token) {
#pragma unroll
        for (int half0 = 0; half0 < 2; half0 += kPartHalves) {
          wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < kRowBytes / 32; ++ks)
#pragma unroll
            for (int h = 0; h < kPartHalves; ++h)
              wgmma_e4m3<kBM>(wpart[h], w_operand(half0 + h, ks), x_operand(0, ks), ks > 0);
          wgmma_commit();
          wgmma_wait<0>();
#pragma unroll
          for (int h = 0; h < kPartHalves; ++h) {
            wgmma_hold(wpart[h]);
#pragma unroll
            for (int i = 0; i < kBM / 2; ++i) wacc[half0 + h][i] += wpart[h][i];
          }
        }
      } else {
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kRowBytes / 32; ++ks)
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int plane = 0; plane < kPlanes; ++plane)
              wgmma_bf16<kBM>(wacc[half], w_operand(half, ks), x_operand(plane, ks));
        wgmma_commit();
        wgmma_wait<0>();  // the stage is refilled after the next barrier
        wgmma_hold(wacc[0]);
        wgmma_hold(wacc[1]);
      }
#else
      __trap();  // gemm() launches wgmma shapes only where the build has sm_90a code
#endif
    }
  };

  // Split-K: blockIdx.z takes K-slice z of k_slice columns (k_begin, above) and writes its
  // partial product into its own copy of Y (gemm() sums the copies in a fixed order).
  // The ring: slice t lives in stage t % kStages. Each iteration waits for its slice
  // (at most kStages - 2 younger groups pending), syncs (the slice is visible to all
  // warps, and all are done with the stage about to be refilled, read last iteration),
  // then queues slice t + kStages - 1 before multiplying slice t.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_tile(s, first_slice + s);
    cp_async_commit();
  }
  auto main_loop = [&](auto live_m) {
    for (int t = 0; t < k_tiles; ++t) {
      cp_async_wait<kStages - 2>();
#ifdef DIFFUSERVE_WGMMA_DEVICE
      if constexpr (S::kWgmma) fence_proxy_async();
#endif
      __syncthreads();
      const int next = t + kStages - 1;
      if (next < k_tiles) load_tile(next % kStages, first_slice + next);
      cp_async_commit();
      if constexpr (S::kWgmma) {
#ifdef DIFFUSERVE_WGMMA_DEVICE
        if constexpr (kDecode) {  // the W tile is free: every warp waited for its wgmmas before the barrier above
          decode_stage(t % kStages);
          fence_proxy_async();  // the decoded tile, seen by the wgmmas
          __syncthreads();
        }
#endif
        compute_wgmma(t % kStages);
      } else if constexpr (kDecode) {
        compute_decoded(t % kStages, live_m);
      } else {
        compute(t % kStages);
      }
    }
  };
  // Decoding tiles whose rows for this warp all lie in its first half of m16 tiles multiply
  // that half alone (the batch-1 MoE: an expert's 16 +- 4 rows fit the 32-row tile's first
  // m16 tile about half the time, and 14% of the warps' stalls had waited on a busy math
  // pipe; ncu, batch-1 NVFP4 up projection).
  using AllM = std::integral_constant<int, kTilesM>;
  if constexpr (kDecode && !S::kWgmma && kTilesM % 2 == 0) {
    if (rows - warp_m * kWM <= kWM / 2) main_loop(std::integral_constant<int, kTilesM / 2>{});
    else main_loop(AllM{});
  } else {
    main_loop(AllM{});
  }

  // Accumulator (m16 x n8): registers 0-1 at row lane / 4, 2-3 at row lane / 4 + 8,
  // columns 2 * (lane % 4) + {0, 1}. An output is its sum times its column's factor:
  // FP8's row scale, or kNvfp4Unscale over NVFP4's global scale (its decode's values are
  // 2^-8 of the products), as packed_weight.h dequantizes; plain weights' row factors where
  // they have them (GemmMatrix::row_scales). E4M3 X: first times its row's scale. Each
  // column's factor is read (NVFP4: divided) once and each row's scale once, not once an
  // output: the per-output IEEE division had kept the epilogue at 13% of the batch-1 NVFP4
  // up projection's instructions (ncu), and the wgmma tiles' per-output loads of both (322
  // global loads in the E4M3 128-row tile's code, 130 now) had cost the FP8 x FP8 experts
  // at 4,096 tokens 630 / 617 us up / down, 449 / 393 now (gemm_bench --moe, H200).
  auto column_factor = [&](int64_t c) {
    if constexpr (kFormat == WeightFormat::Nvfp4) return kNvfp4Unscale / seg.w.row_scales[c];
    if constexpr (kFormat == WeightFormat::Fp8) return seg.w.row_scales[c];
    return seg.w.row_scales ? seg.w.row_scales[c] : 1.0f;
  };
  auto rescale = [&](float v, float x_scale, float factor) {
    return kInput == GemmInput::Fp8Token ? v * x_scale * factor : v * factor;
  };
  auto x_scale = [&](int r) { return kInput == GemmInput::Fp8Token ? p.a_scales[x_row(r)] : 1.0f; };
  float* y = p.y + int64_t(blockIdx.z) * p.y_copy_stride;
  if constexpr (S::kWgmma) {
    // wacc[h][4 j + 2 i + e]: W row 64 h + 16 warp + lane / 4 + 8 i, X row 8 j + 2 (lane % 4) + e
    auto column = [&](int half, int i) { return n0 + 64 * half + 16 * warp + (lane >> 2) + 8 * i; };
    // f(j, e, r) for each of this thread's X rows r = 8 j + 2 (lane % 4) + e of the tile.
    auto for_each_row = [&](auto f) {
#pragma unroll
      for (int j = 0; j < kBM / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (8 * j + 2 * (lane & 3) + e < rows) f(j, e, 8 * j + 2 * (lane & 3) + e);
    };
    if (p.act.rows) {
      // Paired rows (paired_row): i = 0 a gate output, i = 1 its up output, of the
      // activation's column (64 h + 16 warp + n0) / 2 + lane / 4; plain bf16 weights, so the
      // outputs are the sums themselves, and the activation and its bf16 planes are the
      // down product's pre-pass's function and roundings of them.
      for_each_row([&](int j, int e, int r) {
        auto* const hi = reinterpret_cast<uint16_t*>(p.act.rows + (seg.y_row + m0 + r) * p.act.row_bytes());
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int64_t c = column(half, 0) / 16 * 8 + (lane >> 2);
          uint32_t h, l;
          split_bf16(gelu_glu_value(wacc[half][4 * j + e], wacc[half][4 * j + 2 + e]), 0.0f, h, l);
          hi[c] = uint16_t(h);
          if (p.act.input == GemmInput::Split) hi[p.act.kp + c] = uint16_t(l);
        }
      });
      return;
    }
    float factor[2][2];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int i = 0; i < 2; ++i) factor[half][i] = column(half, i) < n ? column_factor(column(half, i)) : 0.0f;
    auto value = [&](int half, int i, int j, int e, float s) {
      return rescale(wacc[half][4 * j + 2 * i + e], s, factor[half][i]);
    };
    if (p.y_bf16 && p.y_pairs) {
      // bf16 pairs of adjacent columns: a lane holds columns g and g + 8 of its rows (g = lane
      // / 4), so lanes g and g + 1 (g even) swap one each, and g stores columns (g, g + 1), g +
      // 1 columns (g + 8, g + 9). A warp's store then fills whole 32-byte sectors of a row, as
      // the fp32 stores do (with 2-byte stores each sector was written in halves, and the
      // batch-16 step was slower than with fp32 rows).
      const bool odd = (lane >> 2) & 1;
#pragma unroll
      for (int j = 0; j < kBM / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = 8 * j + 2 * (lane & 3) + e;  // the same in both lanes of a swap
          const float s = r < rows ? x_scale(r) : 0.0f;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float v0 = value(half, 0, j, e, s), v1 = value(half, 1, j, e, s);
            const float swapped = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
            if (r >= rows) continue;
            const int64_t c = odd ? column(half, 1) - 1 : column(half, 0), at = (seg.y_row + m0 + r) * p.ldy + c;
            const float first = odd ? swapped : v0, second = odd ? v1 : swapped;
            if (c + 1 < n) {
              *reinterpret_cast<__nv_bfloat162*>(p.y_bf16 + at) = __floats2bfloat162_rn(first, second);
            } else if (c < n) {
              store_y(p, at, first);
            }
          }
        }
      return;
    }
    for_each_row([&](int j, int e, int r) {
      const float s = x_scale(r);
      const int64_t at = (seg.y_row + m0 + r) * p.ldy;
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (column(half, i) < n) store_y(p, at + column(half, i), value(half, i, j, e, s));
    });
  } else {
    const int64_t c0 = n0 + warp_n * kWN + (lane & 3) * 2;  // the lane's first column
    float factor[kTilesN][2];
#pragma unroll
    for (int nt = 0; nt < kTilesN; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) factor[nt][e] = c0 + nt * 8 + e < n ? column_factor(c0 + nt * 8 + e) : 0.0f;
#pragma unroll
    for (int mt = 0; mt < kTilesM; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp_m * kWM + mt * 16 + (lane >> 2) + half * 8;
        if (r >= rows) continue;
        const float s = x_scale(r);
#pragma unroll
        for (int nt = 0; nt < kTilesN; ++nt) {
          const int64_t c = c0 + nt * 8;
          const int64_t at = (seg.y_row + m0 + r) * p.ldy + c;
          const float v0 = rescale(acc[mt][nt][half * 2], s, factor[nt][0]);
          const float v1 = rescale(acc[mt][nt][half * 2 + 1], s, factor[nt][1]);
          // (The wgmma epilogue's pair store is written out above as this one is here: one
          // helper for both cost this tile 6 registers and the 16x1K bf16 step 1.6%, 118.8 ->
          // 120.8 ms, H200, forty-eighth session.)
          if (p.y_pairs && c + 1 < n) {
            if (p.y_bf16) *reinterpret_cast<__nv_bfloat162*>(p.y_bf16 + at) = __floats2bfloat162_rn(v0, v1);
            else *reinterpret_cast<float2*>(y + at) = make_float2(v0, v1);
          } else {
            if (c < n) store_y(p, at, v0);
            if (c + 1 < n) store_y(p, at + 1, v1);
          }
        }
      }
  }
}

// Column c of an X row of k values, zero past k; kGated: the row holds [gate | up], 2K
// values, and the column's value is their gelu_glu_value (the MLP's activation).
template <bool kGated>
__device__ __forceinline__ float x_value(const float* row, int64_t k, int64_t c) {
  return c >= k ? 0.0f : kGated ? gelu_glu_value(row[c], row[k + c]) : row[c];
}
// Columns c..c+7 of it: two float4 loads (gated, four) where `vector` (rows 16-byte aligned)
// and all eight lie before k, else one by one.
template <bool kGated>
__device__ __forceinline__ void x_values8(const float* row, int64_t k, int64_t c, bool vector, float (&v)[8]) {
  if (vector && c + 8 <= k) {
    load8<true>(row, c, k, v);
    if constexpr (kGated) {
      float u[8];
      load8<true>(row + k, c, k, u);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = gelu_glu_value(v[j], u[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = x_value<kGated>(row, k, c + j);
  }
}

// A[r] = [hi | lo] of X row r (or hi alone with kPlanes 1), K zero-padded to kp; one
// thread per 8 columns. kPermuted: each 64-column slice in the order the decoded packed
// weights take (gemm_tile.cuh, packed_k_source), 4 pairs of adjacent columns per thread.
// kGated: X row r is [gate | up], 2K values, and the row taken is their gelu_glu_value
// (the MLP's activation, computed here rather than in a pass of its own).
template <int kPlanes, bool kPermuted, bool kGated>
__global__ void split_kernel(const float* __restrict__ x, int64_t ldx, int64_t rows, int64_t k, int64_t kp, bool vector,
                             __nv_bfloat16* __restrict__ a) {
  wait_for_earlier_kernels();
  const int64_t chunks = kp / 8, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * chunks) return;
  const int64_t r = i / chunks, c = (i % chunks) * 8;
  const float* row = x + r * ldx;
  float v[8];
  if constexpr (kPermuted) {
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const int64_t column = c - c % 64 + packed_k_source(int(c % 64) + j);  // even: a pair
      v[j] = x_value<kGated>(row, k, column);
      v[j + 1] = x_value<kGated>(row, k, column + 1);
    }
  } else {
    x_values8<kGated>(row, k, c, vector, v);
  }
  uint4 hi, lo;
  split_bf16(v[0], v[1], hi.x, lo.x);
  split_bf16(v[2], v[3], hi.y, lo.y);
  split_bf16(v[4], v[5], hi.z, lo.z);
  split_bf16(v[6], v[7], hi.w, lo.w);
  __nv_bfloat16* dst = a + r * kPlanes * kp + c;
  *reinterpret_cast<uint4*>(dst) = hi;
  if (kPlanes == 2) *reinterpret_cast<uint4*>(dst + kp) = lo;
}

// FP8 per token, a block per row, 8 consecutive values a thread (two float4 loads where the
// row allows): the row's absolute maximum over the block, its scale, then the E4M3 codes (one
// 8-byte store a thread), zero past k up to kp (a multiple of 128). Where the block covers
// the row (kp <= 8,192) each thread keeps its values in registers between the two; wider
// rows are read again. (A warp a row had each multiprocessor run two warps of dependent
// loads at batch 1: 19 us a launch on the H200.) kGated: a row holds [gate | up], 2K values,
// and its values are their gelu_glu_value, as split_kernel's.
constexpr int kCodesMaxThreads = 1024;
template <bool kGated>
__global__ void __launch_bounds__(kCodesMaxThreads) fp8_codes_kernel(const float* __restrict__ x, int64_t ldx,
                                                                     int64_t k, int64_t kp, bool vector,
                                                                     uint8_t* __restrict__ codes,
                                                                     float* __restrict__ scales) {
  wait_for_earlier_kernels();
  const int64_t row = blockIdx.x, stride = 8 * int64_t(blockDim.x), first = 8 * int64_t(threadIdx.x);
  const float* src = x + row * ldx;
  auto load = [&](int64_t c, float (&v)[8]) { x_values8<kGated>(src, k, c, vector, v); };
  float v[8], amax = 0.0f;
  load(first, v);
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
  for (int64_t c = first + stride; c < k; c += stride) {
    float w[8];
    load(c, w);
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(w[j]));
  }
  const float scale = fp8_token_scale(block_reduce(amax, [](float a, float b) { return fmaxf(a, b); }));
  if (threadIdx.x == 0) scales[row] = scale;
  uint8_t* const dst = codes + row * kp;
  auto pair = [&](float a, float b) { return e4m3x2_codes(a, b, scale); };
  auto store = [&](int64_t c, const float (&w)[8]) {
    *reinterpret_cast<uint2*>(dst + c) =
        make_uint2(pair(w[0], w[1]) | pair(w[2], w[3]) << 16, pair(w[4], w[5]) | pair(w[6], w[7]) << 16);
  };
  if (first < kp) store(first, v);
  for (int64_t c = first + stride; c < kp; c += stride) {
    float w[8];
    load(c, w);
    store(c, w);
  }
}

// y[i] = sum over copies c of partial[c][i], in copy order.
__global__ void sum_copies_kernel(const float* partial, int copies, int64_t n, float* y) {
  wait_for_earlier_kernels();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float acc = 0.0f;
  for (int c = 0; c < copies; ++c) acc += partial[c * n + i];
  y[i] = acc;
}

template <class S, GemmInput kInput, WeightFormat kFormat, bool kTiled = false>
void launch_gemm(const Params& p, dim3 grid, cudaStream_t stream) {
  constexpr int bytes = S::smem_bytes(kInput, kFormat);
  const auto kernel = gemm_kernel<S, kInput, kFormat, kTiled>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  launch(kernel, grid, S::kThreads, bytes, stream, p);
}

// The blocks of a launch: N's tiles, the segments' row tiles, the K splits. A grid's y
// stops at 65,535: past it (over 4 M rows of one product, or token-expert pairs of the
// experts') the pass is refused by name rather than by a failed launch.
template <class S>
dim3 block_grid(const Params& p, int64_t num_tiles, int splits) {
  if (num_tiles > 65535)
    throw std::invalid_argument("gemm: " + std::to_string(num_tiles) + " tiles of " + std::to_string(S::kBM) +
                                " rows in one product, past the 65,535 a launch takes: fewer tokens a pass");
  return {unsigned((p.n + S::kBN - 1) / S::kBN), unsigned(num_tiles), unsigned(splits)};
}

// A wgmma tile (bf16 weights with X split or rounded, or FP8 weights with FP8 X), its
// weights stored as rows or tiled (kernels of their own: both loads in one kernel kept the
// addresses of both live, 30-40 registers more).
template <class S, bool kTiled>
void launch_wgmma(const Params& p, GemmInput input, dim3 grid, cudaStream_t stream) {
  if (input == GemmInput::RoundBf16) launch_gemm<S, GemmInput::RoundBf16, WeightFormat::Plain, kTiled>(p, grid, stream);
  else if (input == GemmInput::Fp8Token)
    launch_gemm<S, GemmInput::Fp8Token, WeightFormat::Fp8, kTiled>(p, grid, stream);
  else launch_gemm<S, GemmInput::Split, WeightFormat::Plain, kTiled>(p, grid, stream);
}
template <class S>
void launch_wgmma(const Params& p, GemmInput input, int64_t num_tiles, int splits, cudaStream_t stream) {
  const dim3 grid = block_grid<S>(p, num_tiles, splits);
  if (p.w_tiled) launch_wgmma<S, true>(p, input, grid, stream);
  else launch_wgmma<S, false>(p, input, grid, stream);
}

// NVFP4 weights with X split or rounded on a wgmma tile that decodes them in shared memory.
template <class S>
void launch_decoding_wgmma(const Params& p, GemmInput input, int64_t num_tiles, int splits, cudaStream_t stream) {
  const dim3 grid = block_grid<S>(p, num_tiles, splits);
  if (input == GemmInput::RoundBf16) launch_gemm<S, GemmInput::RoundBf16, WeightFormat::Nvfp4>(p, grid, stream);
  else launch_gemm<S, GemmInput::Split, WeightFormat::Nvfp4>(p, grid, stream);
}

// Fp8Token only ever multiplies FP8 weights; X split or rounded multiplies any.
template <class S, class SDecoded, GemmInput kInput>
void launch_format(const Params& p, WeightFormat format, dim3 grid, cudaStream_t stream) {
  if (format == WeightFormat::Fp8) launch_gemm<SDecoded, kInput, WeightFormat::Fp8>(p, grid, stream);
  else if (format == WeightFormat::Nvfp4) launch_gemm<SDecoded, kInput, WeightFormat::Nvfp4>(p, grid, stream);
  else launch_gemm<S, kInput, WeightFormat::Plain>(p, grid, stream);
}
template <class S, class SDecoded = S>
void launch_shape(const Params& p, GemmInput input, WeightFormat format, int64_t num_tiles, int splits,
                  cudaStream_t stream) {
  static_assert(S::kBN == SDecoded::kBN && S::kBM == SDecoded::kBM, "one tile, two warp layouts");
  if (p.w_tiled) throw std::invalid_argument("gemm: weights stored tiled take the wgmma tiles (sm_90a)");
  const dim3 grid = block_grid<S>(p, num_tiles, splits);
  if (input == GemmInput::Fp8Token) launch_gemm<S, GemmInput::Fp8Token, WeightFormat::Fp8>(p, grid, stream);
  else if (input == GemmInput::RoundBf16) launch_format<S, SDecoded, GemmInput::RoundBf16>(p, format, grid, stream);
  else launch_format<S, SDecoded, GemmInput::Split>(p, format, grid, stream);
}

// Whether the pre-passes may read X's rows (and, gated, their up halves) as whole float4s.
bool whole_float4s(const float* x, int64_t ldx, bool gated, int64_t k) {
  return ldx % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && (!gated || k % 4 == 0);
}

// Fp8Token's scratch: the codes, then (16-byte aligned) the scales.
size_t codes_bytes(int64_t x_rows, int64_t k) {
  return (size_t(x_rows) * size_t(padded_k(k, GemmInput::Fp8Token)) + 15) / 16 * 16;
}

// Far too few blocks to fill the GPU: split K, each slice's product into its own copy of
// Y, the copies summed in order after. Whether and how many slices is a function of the
// weight's shape alone, never of the rows, so that a row's result does not depend on what
// it is batched with. It pays where a 256-row product (4 row tiles of 64) would fill a
// quarter of the multiprocessors or less (the KV projections, 16 blocks: 42 -> 30 us on the
// H200; at 88-128 blocks two slices measured 5-25% slower), and for a long K (the soft
// embedding, K = vocab) up to 4 blocks a multiprocessor; slices of >= 512. For a product
// of one segment (no tiles) whose Y rows are N wide.
struct SplitK {
  int splits = 1;
  int64_t k_slice = 0;
};
SplitK split_k(int64_t n, int64_t k, GemmInput input) {
  SplitK s;
  const int64_t kp = padded_k(k, input), bk = stage_k(input);
  s.k_slice = kp;
  const int64_t blocks_at_256 = 4 * ((n + Medium::kBN - 1) / Medium::kBN);
  const int64_t target = (k >= 8192 ? 4 : 1) * multiprocessors();
  if (4 * blocks_at_256 <= target) {
    s.splits = std::max(1, int(std::min<int64_t>({(target + blocks_at_256 - 1) / blocks_at_256, k / 512, 64})));
    s.k_slice = (kp / s.splits + bk - 1) / bk * bk;
    s.splits = int((kp + s.k_slice - 1) / s.k_slice);
  }
  return s;
}

}  // namespace

// The pre-pass's bytes of X (the split copies of Y follow, 256-byte aligned).
size_t prepared_x_bytes(int64_t x_rows, int64_t k, GemmInput input) {
  const size_t bytes = input == GemmInput::Fp8Token
                           ? codes_bytes(x_rows, k) + sizeof(float) * size_t(x_rows)
                           : sizeof(__nv_bfloat16) * size_t(x_rows) * planes(input) * size_t(padded_k(k, input));
  return (bytes + 255) / 256 * 256;
}

PreparedX prepared_x(void* data, int64_t rows, int64_t k, GemmInput input) {
  auto* bytes = static_cast<uint8_t*>(data);
  const bool fp8 = input == GemmInput::Fp8Token;
  return {bytes, fp8 ? reinterpret_cast<float*>(bytes + codes_bytes(rows, k)) : nullptr, padded_k(k, input), input};
}

bool gemm_has_wgmma_tile(GemmInput input, WeightFormat format) {
  return gemm_operands_alike(input, format) && wgmma_enabled();
}

int gemm_tile_rows(int64_t rows_per_segment, int64_t segments, int64_t n, GemmInput input, WeightFormat format,
                   bool routed) {
  const bool wgmma = gemm_has_wgmma_tile(input, format);
  // 16 or 32 rows for the MoE at small batch (32 from 13 rows an expert: see the top).
  // Decoding packed weights for bf16 X, 32 always: where a tile's rows fit 16 it multiplies
  // only its first m16 tile (gemm_kernel's main_loop), and an expert of 17-32 rows does not
  // decode its weights twice (H200, 128 tokens, 8 rows an expert: NVFP4 up / down 127.5 /
  // 77.7 us on 32 rows, 174.0 / 72.6 on 16). With hi/lo X, 16 stayed 4% faster there.
  const bool decoding_bf16 = decodes(input, format) && input == GemmInput::RoundBf16;
  if (rows_per_segment <= 24) return wgmma || decoding_bf16 || rows_per_segment > 12 ? 32 : 16;
  // Experts with bf16 X (one plane) from 80 rows an expert (batch 5 and up at 256-token
  // canvases): 128-row tiles. An expert's rows vary (binomially) about the mean, and where
  // they pass 64 a 64-row tile streams its weights again for the rest. H100, gemm_bench --moe,
  // tiled bf16 experts, up / down on 64 -> 128 rows: 416.0 / 246.0 -> 397.9 / 242.5 us at
  // 1,280 tokens, 482.8 / 297.8 -> 452.9 / 295.6 at 2,048; at 1,024 (64 rows an expert)
  // 394.7 / 227.6 -> 388.9 / 232.2, a wash, and at 768 slower (367.3 / 213.9 -> 378.4 /
  // 221.7). Not with hi/lo X (two planes: a 128-row block's stages take twice the shared
  // memory, 417 / 248 -> 496 / 334 us at 1,024) nor FP8 (221 / 151 -> 246 / 179). (Nor did
  // FP8 experts gain in the step from 64 rows where the rule below gives 128, though the bench
  // said so: up / down 389.7 / 352.7 -> 386.5 / 312.0 us at 3,072 tokens, but fp8-dynamic's
  // steps went 155.60 / 155.69 -> 157.07 / 157.11 ms at 16x1K, H100, A/B twice.)
  if (routed && wgmma && input == GemmInput::RoundBf16 && rows_per_segment >= 80) return 128;
  // 128 x 256 tiles where they are mostly full and still give two waves of blocks.
  const int64_t large_tiles = segments * ((rows_per_segment + 127) / 128) * ((n + 255) / 256);
  return rows_per_segment >= 192 && large_tiles >= 2 * multiprocessors() ? 128 : 64;
}

size_t gemm_scratch_bytes(int64_t x_rows, int64_t n, int64_t k, GemmInput input) {
  const SplitK split = split_k(n, k, input);
  return prepared_x_bytes(x_rows, k, input) +
         (split.splits > 1 ? sizeof(float) * size_t(split.splits * x_rows * n) : 0);
}

void fp8_token_codes(const float* x, int64_t rows, int64_t ldx, bool gated, int64_t k, int64_t ld_codes,
                     uint8_t* codes, float* scales, cudaStream_t stream) {
  if (rows <= 0) return;
  if (ld_codes % 128 || ld_codes < k) throw std::invalid_argument("fp8_token_codes: code rows of a multiple of 128 >= K");
  const int threads = int(std::min<int64_t>(kCodesMaxThreads, (ld_codes / 8 + 31) / 32 * 32));
  launch(gated ? fp8_codes_kernel<true> : fp8_codes_kernel<false>, unsigned(rows), threads, 0, stream, x, ldx, k,
         ld_codes, whole_float4s(x, ldx, gated, k), codes, scales);
}

int64_t gemm_padded_k(int64_t k, GemmInput input) { return padded_k(k, input); }

namespace {
// The bf16 pre-pass writing kPlanes planes, its K order permuted or not, X gated or not.
template <int kPlanes>
auto split_kernel_for(bool permuted, bool gated) {
  return permuted ? (gated ? split_kernel<kPlanes, true, true> : split_kernel<kPlanes, true, false>)
                  : (gated ? split_kernel<kPlanes, false, true> : split_kernel<kPlanes, false, false>);
}
}  // namespace

void write_gemm_input(const float* x, int64_t rows, int64_t ldx, bool gated, int64_t k, bool permuted,
                      const PreparedX& to, cudaStream_t stream) {
  if (permuted && to.input == GemmInput::Fp8Token)
    throw std::invalid_argument("write_gemm_input: FP8 codes are never permuted");
  if (to.input == GemmInput::Fp8Token)
    return fp8_token_codes(x, rows, ldx, gated, k, to.kp, to.rows, to.scales, stream);
  if (rows <= 0 || to.kp <= 0) return;
  const unsigned blocks = unsigned((rows * (to.kp / 8) + 255) / 256);
  const auto kernel =
      to.input == GemmInput::RoundBf16 ? split_kernel_for<1>(permuted, gated) : split_kernel_for<2>(permuted, gated);
  launch(kernel, blocks, 256, 0, stream, x, ldx, rows, k, to.kp, whole_float4s(x, ldx, gated, k),
         reinterpret_cast<__nv_bfloat16*>(to.rows));
}

PreparedX prepare_gemm_input(const float* x, int64_t rows, int64_t ldx, bool gated, int64_t k, GemmInput input,
                             bool permuted, void* scratch, cudaStream_t stream) {
  const PreparedX out = prepared_x(scratch, rows, k, input);
  write_gemm_input(x, rows, ldx, gated, k, permuted, out, stream);
  return out;
}

void gemm(const float* x, int64_t x_rows, int64_t ldx, bool gated, const int64_t* row_map, const GemmSegment* segments,
          const GemmTile* tiles, int num_tiles, int tile_rows, WeightFormat format, bool w_tiled, int64_t n, int64_t k,
          GemmInput input, float* y, __nv_bfloat16* y_bf16, int64_t ldy, const PreparedX& prepared,
          const PreparedX& act, void* scratch, cudaStream_t stream) {
  if (input == GemmInput::Fp8Token && format != WeightFormat::Fp8)
    throw std::invalid_argument("gemm: Fp8Token takes FP8 weights");
  if (act.rows && (format != WeightFormat::Plain || !w_tiled || !gemm_has_wgmma_tile(input, format) ||
                   tile_rows == 16 || n % 128 || act.kp != n / 2 || act.input == GemmInput::Fp8Token))
    throw std::invalid_argument("gemm: the activation output takes paired, tiled bf16 weights on the wgmma tiles");
  if (y_bf16 && (y || act.rows)) throw std::invalid_argument("gemm: y_bf16 is instead of y and of act");
  if (format == WeightFormat::Nvfp4 && k % 16) throw std::invalid_argument("gemm: NVFP4 weights need K % 16 == 0");
  if (num_tiles <= 0 || n <= 0) return;
  if (padded_k(k, input) > (int64_t(1) << 29))
    throw std::invalid_argument("gemm: K over 2^29 (the kernel's offsets are 32-bit)");
  if (prepared.rows && (gated || decodes(input, format) || prepared.input != input))
    throw std::invalid_argument("gemm: a prepared X is plain rows of the product's input kind");
  const PreparedX a =
      prepared.rows ? prepared
                    : prepare_gemm_input(x, x_rows, ldx, gated, k, input, decodes(input, format), scratch, stream);
  const int64_t kp = a.kp;

  // With `tiles` null, `segments` is a host pointer to the single segment, passed by value.
  const GemmSegment single = tiles ? GemmSegment{} : *segments;
  if (!tiles && single.w.tiled != w_tiled) throw std::invalid_argument("gemm: w_tiled is not the segment's layout");
  static_assert(Small::kBN == Medium::kBN, "one block width below 128 rows");
  const SplitK split = !tiles && ldy == n && !y_bf16 ? split_k(n, k, input) : SplitK{1, kp};
  const int splits = split.splits;
  float* out = y;
  const int64_t copy_stride = int64_t(single.rows) * ldy;
  if (splits > 1) {  // single segment, y_row 0: copy c of Y lives at partial + c * rows * ldy
    out = reinterpret_cast<float*>(static_cast<uint8_t*>(scratch) + prepared_x_bytes(x_rows, k, input));
    cudaMemsetAsync(out, 0, sizeof(float) * size_t(splits * copy_stride), stream);  // columns past n stay 0
  }

  Params p{};
  p.a = a.rows;
  p.a_row_bytes = a.row_bytes();
  p.plane_bytes = kp * x_value_bytes(input);
  p.a_scales = a.scales;
  p.kp = kp;
  p.row_map = row_map;
  p.segments = tiles ? segments : nullptr;
  p.tiles = tiles;
  p.single = single;
  p.n = n;
  p.k = k;
  // Weight rows of whole 16-byte chunks, and NVFP4 scale rows of whole 4-byte words (the
  // segments' matrices lie at multiples of a matrix's bytes from 256-byte-aligned
  // allocations, so that aligns them all).
  const bool whole_chunks = weight_row_bytes(format, k) % 16 == 0 && (format != WeightFormat::Nvfp4 || k % 64 == 0);
  p.w_vector = whole_chunks && (tiles || reinterpret_cast<uintptr_t>(single.w.values) % 16 == 0);
  p.w_tiled = w_tiled;
  p.y_pairs = ldy % 2 == 0 && (y_bf16 ? reinterpret_cast<uintptr_t>(y_bf16) % 4 : reinterpret_cast<uintptr_t>(out) % 8) == 0;
  p.k_slice = split.k_slice;
  p.y = out;
  p.y_bf16 = y_bf16;
  p.ldy = ldy;
  p.y_copy_stride = copy_stride;
  p.act = act;
  const bool wgmma = gemm_has_wgmma_tile(input, format);
  const bool decoding_wgmma = format == WeightFormat::Nvfp4 && wgmma_enabled();  // 64 and 128 rows
  static_assert(Wgmma32::kBM == Small32::kBM, "one 32-row tile height");
  if (tile_rows == 32) {
    if (wgmma) launch_wgmma<Wgmma32>(p, input, num_tiles, splits, stream);
    else launch_shape<Small32, Small32Decoded>(p, input, format, num_tiles, splits, stream);
  } else if (tile_rows == 16) {
    launch_shape<Small>(p, input, format, num_tiles, splits, stream);
  } else if (tile_rows == 128) {
    if (wgmma) launch_wgmma<Wgmma128>(p, input, num_tiles, splits, stream);
    else if (decoding_wgmma) launch_decoding_wgmma<Wgmma128Decoded>(p, input, num_tiles, splits, stream);
    else launch_shape<Large>(p, input, format, num_tiles, splits, stream);
  } else if (wgmma) {
    launch_wgmma<Wgmma64>(p, input, num_tiles, splits, stream);
  } else if (decoding_wgmma) {
    launch_decoding_wgmma<Wgmma64Decoded>(p, input, num_tiles, splits, stream);
  } else if (int64_t(num_tiles) * ((n + Medium::kBN - 1) / Medium::kBN) * splits <= multiprocessors()) {
    launch_shape<MediumOneWave, MediumDecoded>(p, input, format, num_tiles, splits, stream);
  } else {
    launch_shape<Medium, MediumDecoded>(p, input, format, num_tiles, splits, stream);
  }
  if (splits > 1)
    launch(sum_copies_kernel, unsigned((copy_stride + 255) / 256), 256, 0, stream, out, splits, copy_stride, y);
}

}  // namespace diffuserve::cuda
