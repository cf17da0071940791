// The GEMM's shared-memory tiles (gemm.cu) and where its ldmatrix loads find the MMA
// fragments, written for the host too: the bench (benchmarks/gemm_bench.cu) emulates
// ldmatrix and the MMA fragment layouts with these functions to check the mapping.
//
// A tile row holds one K slice of 128 bytes (64 bf16 or 128 E4M3 values) as eight 16-byte
// chunks, chunk c at position c ^ (row % 8): both the cp.async stores (a row's chunks) and
// the ldmatrix reads (one chunk column of 8 rows) then touch every bank once.
//
// MMA fragments, as the PTX ISA lays them out, with "g" = lane / 4 and "t" = lane % 4:
//   bf16 m16n8k16: A register i holds row g + 8 (i % 2), columns 2t + 8 (i / 2) + {0, 1};
//       B register i holds column (n) g, rows (k) 2t + 8 i + {0, 1}.
//   E4M3 m16n8k32: A register i holds row g + 8 (i % 2), columns 4t + 16 (i / 2) + {0..3};
//       B register i holds column g, rows 4t + 16 i + {0..3}.
// In bytes of K-contiguous rows the two are the same: register i of A is the 4 bytes at
// byte 4t + 16 (i / 2) of row g + 8 (i % 2) of a 16-row x 32-byte tile, and of B the 4
// bytes at byte 4t + 16 i of row g of an 8-row x 32-byte tile ([N, K], the "col" layout).
// So one ldmatrix addressing serves both: ldmatrix.x4 gives lane l, in register j, the 4
// bytes at byte 4 (l % 4) of row l / 4 of the 8 x 16-byte matrix whose rows lanes 8j..8j+7
// point at.
#pragma once

#include <cstdint>

#include "philox.h"  // DS_HOST_DEVICE

namespace diffuserve::cuda {

constexpr int kRowBytes = 128;  // bytes of a tile row: one K slice

// Byte offset of (row, 16-byte chunk) in a tile.
DS_HOST_DEVICE constexpr int swizzle(int row, int chunk) { return row * kRowBytes + ((chunk ^ (row & 7)) << 4); }

// Weights stored tiled (GemmMatrix::tiled): a matrix of N rows (a multiple of 128) of
// `slices` K slices of kRowBytes bytes each, as tiles of 128 rows x one slice (16 KB), in the
// order (block of 128 rows, slice), each laid out as the shared-memory tile it is copied
// into: a stage's copies of those 128 rows read one contiguous run. The byte of (row, slice,
// 16-byte chunk):
constexpr int kTiledRunBytes = 128 * kRowBytes;
DS_HOST_DEVICE constexpr int64_t tiled_offset(int64_t row, int64_t slice, int chunk, int64_t slices) {
  return (row / 128 * slices + slice) * kTiledRunBytes + swizzle(int(row % 128), chunk);
}

// A [gate; up] stack's rows paired for the MLP's activation in the wgmma tiles' epilogue
// (gemm()'s `act`): of n rows, gate row i and up row i (row n / 2 + i) go to 16 (i / 8) +
// i % 8 and 8 rows after, so that a warp's accumulators, rows lane / 4 and lane / 4 + 8 of
// its 16, hold each gate output beside its up output. n a multiple of 16.
DS_HOST_DEVICE constexpr int64_t paired_row(int64_t row, int64_t n) {
  const int64_t half = n / 2, i = row % half;
  return i / 8 * 16 + row / half * 8 + i % 8;
}

// The tile row and chunk whose address lane `lane` gives to ldmatrix.x4 for the A
// fragment of the 16 rows from `row0` at 32-byte K step `ks`: lanes 0-15 rows 0-15 at
// bytes 0-15 of the step, lanes 16-31 the same rows at bytes 16-31, which makes
// registers 0-3 = (rows 0-7, bytes 0-15), (8-15, 0-15), (0-7, 16-31), (8-15, 16-31).
DS_HOST_DEVICE constexpr int a_fragment_row(int row0, int lane) { return row0 + (lane & 15); }
DS_HOST_DEVICE constexpr int a_fragment_chunk(int ks, int lane) { return 2 * ks + (lane >> 4); }

// The same for the B fragments of two n8 tiles, the 16 W rows from `row0`: lanes 0-7
// give rows 0-7 at bytes 0-15, lanes 8-15 rows 0-7 at bytes 16-31, lanes 16-31 the same
// for rows 8-15, so that registers {0, 1} are the first n8 tile's, {2, 3} the second's.
DS_HOST_DEVICE constexpr int b_fragment_row(int row0, int lane) { return row0 + (lane & 7) + ((lane >> 4) << 3); }
DS_HOST_DEVICE constexpr int b_fragment_chunk(int ks, int lane) { return 2 * ks + ((lane >> 3) & 1); }

// Packed weights (FP8, NVFP4) with bf16 X are decoded in registers (gemm.cu): in a 64-value
// K slice, lane t of a B fragment reads the 16 consecutive values 16t..16t+15 of its W row
// (FP8: 16 bytes; NVFP4: 8 bytes, exactly one scale group), and 16-value K step ks takes
// values 16t + 4ks + {0..3} as its fragment's k 2t, 2t + 1, 2t + 8, 2t + 9. X's fragment k
// must name the same W column, so the pre-pass stores each 64-value slice of X permuted:
// position 16ks + j holds column packed_k_source(16ks + j). No value moves between lanes.
DS_HOST_DEVICE constexpr int packed_k_source(int position) {
  const int ks = position / 16, j = position % 16, t = (j % 8) / 2;
  return 16 * t + 4 * ks + (j >= 8 ? 2 : 0) + j % 2;
}

// E4M3 X and weights multiply as fp16 (exact for E4M3 values), two m16n8k16 MMAs per
// 32-byte step ("halves"): on sm_90 mma.sync has no E4M3 hardware, and ptxas's lowering of
// the m16n8k32 E4M3 MMA (the same unpacking, MMAs from zero, fp32 adds) costs more
// registers and instructions. Each register of 4 E4M3 values unpacks to two fp16 pairs, lo
// (values 0, 1) and hi (values 2, 3), and the halves reorder K so that no value moves
// between lanes: half h covers bytes 16h..16h+15 of the step, and its fp16 K position
// 2t + e holds byte 16h + 4t + e, position 8 + 2t + e byte 16h + 4t + 2 + e (e = 0, 1).
// With the fragments above that gives, from ldmatrix registers r (A: 4, B: 2):
//   A half h = {lo r[2h], lo r[2h+1], hi r[2h], hi r[2h+1]},  B half h = {lo r[h], hi r[h]}.
// A and B take the same K order, so the MMA sums the products of the same K, and each
// output's sum order is fixed by the step and half alone. `unpack(r, lo, hi)` does the
// unpacking (the kernel: to fp16; the bench's emulation: bytes into value slots).
template <class Unpack>
DS_HOST_DEVICE void e4m3_a_halves(const uint32_t* r, uint32_t (&half)[2][4], Unpack unpack) {
  for (int h = 0; h < 2; ++h) {
    unpack(r[2 * h], half[h][0], half[h][2]);
    unpack(r[2 * h + 1], half[h][1], half[h][3]);
  }
}
template <class Unpack>
DS_HOST_DEVICE void e4m3_b_halves(const uint32_t* r, uint32_t (&half)[2][2], Unpack unpack) {
  for (int h = 0; h < 2; ++h) unpack(r[h], half[h][0], half[h][1]);
}

}  // namespace diffuserve::cuda
