// The CPU backend's loops that vector instructions carry: its matrix products, GELU's and
// the logit softcap's tanh, and the softmax and entropy of a row of logits.
//
// The products come in the two layouts the weights do:
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
// The sums of many values (softmax's, the entropy's, a norm's squares) are taken in
// dot_rows' order: sixteen running sums, then the fixed tree. e^x is Cephes' expf (within
// 1 ulp), 0 below -87.34.
//
// tanh is Cephes' single-precision method (an odd polynomial below 0.625, 1 - 2 / (e^2|x| + 1)
// above, e^x by Cephes' expf) written without branches so that it vectorizes: at most 1.33
// ulp from the true tanh over every float in [-12, 12], checked with and without FMA (glibc's
// tanhf, which it replaces, is within 1), +-1 from 10 on; NaN stays NaN.
//
// cpu_simd.cpp picks, once, the build of cpu_simd_build.cpp for the best vector extension
// the CPU has (AVX-512, AVX2, or the compiler's baseline); DIFFUSERVE_CPU_ISA names one.
#pragma once

#include <cstdint>

namespace diffuserve::cpu {

// y[i * ldy + r] = sum over j < k of x[i * ldx + j] * w[r * ldw + j], for i < m, r < n.
void dot_rows(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t n, int64_t k, float* y,
              int64_t ldy);

// y[i * ldy + c] += sum over j < k of x[i * ldx + j] * w[j * ldw + c], for i < m, c < n.
// Row j of w is not read where x[i][j] is zero for every row of a block (probabilities
// are often zero): exact where w is finite, as a product with zero then adds nothing.
void add_rows_times(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k, int64_t n,
                    float* y, int64_t ldy);

// out[j] = gelu(gate[j]) * up[j] for j < n, GELU by its tanh approximation:
// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as transformers' gelu_pytorch_tanh.
void gelu_tanh_times(const float* gate, const float* up, int64_t n, float* out);

// x[j] = cap * tanh(x[j] / cap) for j < n: the logits' softcap.
void softcap(float* x, int64_t n, float cap);

// x[j] = e^(x[j] - max) / (their sum), for j < n: a row's softmax. A NaN makes the row NaN.
void softmax(float* x, int64_t n);

// sum over j < n of x[j]^2 (an RMS norm's).
float sum_squares(const float* x, int64_t n);

// sum over j < n of e^(x[j] - shift).
float sum_exp(const float* x, int64_t n, float shift);

// -sum over j < n of log p * p, log p = x[j] - log_z (at least -FLT_MAX, so that a p of 0
// adds 0 rather than NaN, as torch.distributions.Categorical's entropy does).
float entropy(const float* x, int64_t n, float log_z);

// The vector extension the loops run on: "avx512", "avx2" or "baseline".
const char* simd_isa();

}  // namespace diffuserve::cpu
