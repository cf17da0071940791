// Picks, once, the build of cpu_simd_build.cpp that the CPU runs best (or DIFFUSERVE_CPU_ISA names).
#include "cpu_simd.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "diffuserve/errors.h"

namespace diffuserve::cpu {

#define DIFFUSERVE_DECLARE_BUILD(isa)                                                                         \
  namespace isa {                                                                                             \
  void dot_rows(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t n, int64_t k,    \
                float* y, int64_t ldy);                                                                       \
  void add_rows_times(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k,         \
                      int64_t n, float* y, int64_t ldy);                                                      \
  void gelu_tanh_times(const float* gate, const float* up, int64_t n, float* out);                            \
  void softcap(float* x, int64_t n, float cap);                                                               \
  void softmax(float* x, int64_t n);                                                                          \
  float sum_squares(const float* x, int64_t n);                                                               \
  float sum_exp(const float* x, int64_t n, float shift);                                                      \
  float entropy(const float* x, int64_t n, float log_z);                                                      \
  }
DIFFUSERVE_DECLARE_BUILD(baseline)
#if DIFFUSERVE_CPU_SIMD_X86
DIFFUSERVE_DECLARE_BUILD(avx2)
DIFFUSERVE_DECLARE_BUILD(avx512)
#endif
#undef DIFFUSERVE_DECLARE_BUILD

namespace {

struct Build {
  const char* isa;
  decltype(&baseline::dot_rows) dot_rows;
  decltype(&baseline::add_rows_times) add_rows_times;
  decltype(&baseline::gelu_tanh_times) gelu_tanh_times;
  decltype(&baseline::softcap) softcap;
  decltype(&baseline::softmax) softmax;
  decltype(&baseline::sum_squares) sum_squares;
  decltype(&baseline::sum_exp) sum_exp;
  decltype(&baseline::entropy) entropy;
};

bool cpu_runs(const char* isa) {
#if DIFFUSERVE_CPU_SIMD_X86
  if (!std::strcmp(isa, "avx512")) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  if (!std::strcmp(isa, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return !std::strcmp(isa, "baseline");
}

// The best build this CPU runs, or the one DIFFUSERVE_CPU_ISA names (the tests compare the
// builds): a name the CPU cannot run, or that no build has, is an error, not a fallback.
Build choose() {
#define DIFFUSERVE_BUILD(isa)                                                                                 \
  Build {                                                                                                     \
    #isa, isa::dot_rows, isa::add_rows_times, isa::gelu_tanh_times, isa::softcap, isa::softmax,               \
        isa::sum_squares, isa::sum_exp, isa::entropy                                                          \
  }
  const Build builds[] = {
#if DIFFUSERVE_CPU_SIMD_X86
      DIFFUSERVE_BUILD(avx512),
      DIFFUSERVE_BUILD(avx2),
#endif
      DIFFUSERVE_BUILD(baseline),
  };
#undef DIFFUSERVE_BUILD
  const char* asked = std::getenv("DIFFUSERVE_CPU_ISA");
  for (const Build& build : builds) {
    if (!asked || !*asked) {
      if (cpu_runs(build.isa)) return build;
    } else if (!std::strcmp(build.isa, asked)) {
      if (!cpu_runs(build.isa)) throw InvalidArgument(std::string("DIFFUSERVE_CPU_ISA=") + asked + ": this CPU lacks it");
      return build;
    }
  }
  std::string names;
  for (const Build& build : builds) names += std::string(names.empty() ? "" : ", ") + build.isa;
  throw InvalidArgument(std::string("DIFFUSERVE_CPU_ISA=") + asked + ": no such build (this library has " + names + ")");
}

const Build& build() {
  static const Build chosen = choose();
  return chosen;
}

}  // namespace

void dot_rows(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t n, int64_t k, float* y,
              int64_t ldy) {
  build().dot_rows(x, ldx, m, w, ldw, n, k, y, ldy);
}

void add_rows_times(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k, int64_t n,
                    float* y, int64_t ldy) {
  build().add_rows_times(x, ldx, m, w, ldw, k, n, y, ldy);
}

void gelu_tanh_times(const float* gate, const float* up, int64_t n, float* out) {
  build().gelu_tanh_times(gate, up, n, out);
}

void softcap(float* x, int64_t n, float cap) { build().softcap(x, n, cap); }

void softmax(float* x, int64_t n) { build().softmax(x, n); }

float sum_squares(const float* x, int64_t n) { return build().sum_squares(x, n); }

float sum_exp(const float* x, int64_t n, float shift) { return build().sum_exp(x, n, shift); }

float entropy(const float* x, int64_t n, float log_z) { return build().entropy(x, n, log_z); }

const char* simd_isa() { return build().isa; }

}  // namespace diffuserve::cpu
