// The CPU backend's matrix products, in the two layouts its weights come in:
// - dot_rows: y[i][r] = sum over j of x[i][j] * w[r][j], w's rows the outputs (a linear
//   layer's [out_features, in_features]);
// - add_rows_times: y[i][c] += sum over j of x[i][j] * w[j][c], w's rows the inputs (the
//   embedding table, [vocab, hidden], as the soft embedding multiplies it).
//
// Every result is summed the same way, whichever block of the product it falls in and
// whichever vector instructions the machine has, so that a row's result does not depend
// on the rows batched with it and two machines with FMA agree to the bit (an x86 CPU
// without FMA rounds each product first):
// - dot_rows keeps sixteen running sums, sum l taking the products j = l, l + 16, l + 32, ...
//   as fused multiply-adds (j from 0 up), then adds them as a fixed tree (each with the
//   one eight lanes over, then four, two, one);
// - add_rows_times adds the products to y[i][c] one j after another, from j = 0 up, each a
//   fused multiply-add.
//
// cpu_products.cpp picks, once, the build of cpu_products_kernel.cpp for the best vector
// extension the CPU has (AVX-512, AVX2, or the compiler's baseline).
#pragma once

#include <cstdint>

namespace diffuserve::cpu {

// y[i * ldy + r] = dot(x + i * ldx, w + r * ldw, k) for i < m, r < n.
void dot_rows(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t n, int64_t k, float* y,
              int64_t ldy);

// One dot product of k values, summed as dot_rows sums.
float dot(const float* a, const float* b, int64_t k);

// y[i * ldy + c] += sum over j < k of x[i * ldx + j] * w[j * ldw + c], for i < m, c < n.
// Row j of w is not read where x[i][j] is zero for every row of a block (probabilities
// are often zero): exact where w is finite, as a product with zero then adds nothing.
void add_rows_times(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k, int64_t n,
                    float* y, int64_t ldy);

// The vector extension the products run on: "avx512", "avx2" or "baseline".
const char* products_isa();

}  // namespace diffuserve::cpu
