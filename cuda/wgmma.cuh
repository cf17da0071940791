// Hopper's warpgroup MMA (wgmma.mma_async, sm_90a): one instruction per 128 threads
// multiplies a 64 x N x 16 product, both operands read from shared memory by the tensor
// cores themselves (or the first from registers), so the warps issue no fragment loads and
// wait on nothing until wgmma_wait. The GEMM (gemm.cu) uses it for bf16 and E4M3 products:
// 128 weight rows as M, 32, 64 or 128 rows of X as N; the attention (attention_wgmma.cu) for
// its scores (64 queries x a chunk of keys) and, with the probabilities in registers, P V.
//
// Shared-memory operands are described by a 64-bit descriptor. gemm.cu's tiles (gemm_tile.cuh)
// are exactly the layout the descriptor's 128-byte swizzle names, K-major: rows of 128
// bytes, 16-byte chunk c of row r at chunk c ^ (r % 8), in atoms of 8 rows (1,024 bytes,
// which must start 1,024-byte aligned). An operand of 8k rows is k atoms one after the
// other (the stride between atoms, 1,024 bytes), and its K step s of 32 bytes (16 bf16
// or 32 E4M3 values) starts 32 s bytes into its first row: the hardware applies the swizzle to the
// address it forms, as ldmatrix's addresses had it applied by hand.
#pragma once

#include <cstdint>

namespace diffuserve::cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DIFFUSERVE_WGMMA_DEVICE 1  // this device pass has wgmma
#endif

// The descriptor of a 128-byte-swizzled operand whose first row starts at shared address
// `address`. K-major (gemm.cu's tiles, the attention's Q and K): plus the K offset within
// the row, a multiple of 32 bytes; `leading_bytes` is unused. N-major (the attention's V as
// P V's B operand): rows of 128 bytes, each 64 consecutive N values of one k, in the same
// swizzled rows and 8-row atoms, the atoms one after the other along K (a K step of 16
// starts two atoms, 2,048 bytes, further), and the next 64 N values `leading_bytes` on.
__device__ __forceinline__ uint64_t wgmma_descriptor(uint32_t address, uint32_t leading_bytes = 16) {
  constexpr uint64_t kAtomStride = 1024 >> 4;             // bytes between 8-row atoms, in 16-byte units
  constexpr uint64_t kSwizzle128 = 1;                     // layout type: 128-byte swizzle
  return uint64_t((address & 0x3ffff) >> 4)               // start address, 16-byte units
         | uint64_t((leading_bytes >> 4) & 0x3fff) << 16  // leading byte offset
         | kAtomStride << 32 | kSwizzle128 << 62;
}

// The descriptor of the operand `bytes` (a multiple of 16) past the one `d` describes: its
// start address field plus bytes / 16. Shared memory's addresses (under 256 KB) fit the
// field's 14 bits of 16-byte units, so the sum never carries into the next field: the loops
// step descriptors worked out once by additions, not by each address's masks and shifts.
__device__ __forceinline__ uint64_t wgmma_advance(uint64_t d, uint32_t bytes) {
  return (d >> 32 << 32) | uint32_t(uint32_t(d) + (bytes >> 4));  // the upper word as it is
}

#ifdef DIFFUSERVE_WGMMA_DEVICE
// d[64 x kN] (+)= a[64 x k] * b[kN x k]^T, fp32 accumulators (kN = 32, 64 or 128), a and b
// K-major in shared memory, 32 bytes of K each: wgmma_bf16's 16 bf16 values, wgmma_e4m3's 32
// E4M3 ones. `accumulate` false: d = a b^T, the registers' old values ignored. Thread i of
// the warpgroup holds d's rows 16 (i / 32) + g + {0, 8} and columns 8 j + 2 t + {0, 1},
// with g = (i % 32) / 4 and t = i % 4: d[4 j + 2 h + e] = row g + 8 h, column 8 j + 2 t + e.
// (E4M3 takes no transpose operands: its only layout is K-major.)
#define DS_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define DS_D16(i) DS_D4(i), DS_D4(i + 4), DS_D4(i + 8), DS_D4(i + 12)
#define DS_WGMMA(KIND, TAIL)                                                                               \
  if constexpr (kN == 32)                                                                                  \
    asm volatile(                                                                                          \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                       \
        "wgmma.mma_async.sync.aligned.m64n32" KIND                                                         \
        " {"                                                                                               \
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"                                            \
        "}, %16, %17, p, 1, 1" TAIL ";\n}\n"                                                               \
        : DS_D16(0)                                                                                        \
        : "l"(a), "l"(b), "r"(int(accumulate)));                                                           \
  else if constexpr (kN == 64)                                                                             \
    asm volatile(                                                                                          \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                       \
        "wgmma.mma_async.sync.aligned.m64n64" KIND                                                         \
        " {"                                                                                               \
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,"   \
        "%26,%27,%28,%29,%30,%31"                                                                          \
        "}, %32, %33, p, 1, 1" TAIL ";\n}\n"                                                               \
        : DS_D16(0), DS_D16(16)                                                                            \
        : "l"(a), "l"(b), "r"(int(accumulate)));                                                           \
  else                                                                                                     \
    asm volatile(                                                                                          \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                       \
        "wgmma.mma_async.sync.aligned.m64n128" KIND                                                        \
        " {"                                                                                               \
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,"   \
        "%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49," \
        "%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"                                          \
        "}, %64, %65, p, 1, 1" TAIL ";\n}\n"                                                               \
        : DS_D16(0), DS_D16(16), DS_D16(32), DS_D16(48)                                                    \
        : "l"(a), "l"(b), "r"(int(accumulate)))
template <int kN>
__device__ __forceinline__ void wgmma_bf16(float (&d)[kN / 2], uint64_t a, uint64_t b, bool accumulate = true) {
  static_assert(kN == 32 || kN == 64 || kN == 128, "wgmma: N of 32, 64 or 128");
  DS_WGMMA("k16.f32.bf16.bf16", ", 0, 0");
}
template <int kN>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[kN / 2], uint64_t a, uint64_t b, bool accumulate = true) {
  static_assert(kN == 32 || kN == 64 || kN == 128, "wgmma: N of 32, 64 or 128");
  DS_WGMMA("k32.f32.e4m3.e4m3", "");
}
// d[64 x 256] += a[64 x 16] * b[16 x 256] with a in registers (bf16, thread i of the
// warpgroup holding an mma.sync m16n8k16 A fragment of rows 16 (i / 32)..+15: register r
// at row g + 8 (r % 2), columns 2 t + 8 (r / 2) + {0, 1}, the lower column in the low half)
// and b N-major in shared memory (wgmma_descriptor with its leading bytes); fp32 accumulators laid out as above
// (d[4 j + 2 h + e] = row g + 8 h, column 8 j + 2 t + e). The registers of a are read while
// the MMA runs: they must keep their values until wgmma_wait.
__device__ __forceinline__ void wgmma_bf16_rs256(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,"
      "%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,"
      "%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,"
      "%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,"
      "%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,"
      "%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
      "}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
      : DS_D16(0), DS_D16(16), DS_D16(32), DS_D16(48), DS_D16(64), DS_D16(80), DS_D16(96), DS_D16(112)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
#undef DS_WGMMA
#undef DS_D16
#undef DS_D4

// Before the first wgmma of a group: the accumulator registers as the warps last wrote them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses to d across a wgmma fence or wait (the asm
// statements above do not name the registers an in-flight wgmma writes).
template <int kN>
__device__ __forceinline__ void wgmma_hold(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A fragments held in registers (wgmma_bf16_rs256's).
template <int kSteps>
__device__ __forceinline__ void wgmma_hold(uint32_t (&a)[kSteps][4]) {
#pragma unroll
  for (int i = 0; i < kSteps; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[i][r])::"memory");
}
// Shared memory written by this thread's cp.async (the generic proxy), made visible to the
// tensor cores' reads (the async proxy); a barrier then makes everyone's visible.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif

}  // namespace diffuserve::cuda
