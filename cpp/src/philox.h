// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): a
// counter-based generator. A draw is a pure function of (key, counter), so every random
// number of a request is addressed by (seed, block, step, position, index) and comes out
// the same whatever else is batched with it and on whichever backend computes it. The
// same code compiles for the host and for CUDA kernels.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DS_HOST_DEVICE __host__ __device__
#else
#define DS_HOST_DEVICE
#endif

namespace diffuserve {

struct Philox4 {
  uint32_t word[4];
  DS_HOST_DEVICE uint32_t operator[](int i) const { return word[i]; }
};

DS_HOST_DEVICE inline Philox4 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                         uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u, kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kMul0) * c0, p1 = uint64_t(kMul1) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c0 = n0, c1 = uint32_t(p1), c2 = n2, c3 = uint32_t(p0);
    k0 += kWeyl0, k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// What a request's random numbers are for; part of the counter so the streams never overlap.
enum class RandomStream : uint32_t { Candidate = 0, Renoise = 1, InitialCanvas = 2 };

// Addresses one request's draws: counter = (index / 4, position, step, block | stream << 30).
struct RandomKey {
  uint64_t seed = 0;
  uint32_t block = 0;
  uint32_t step = 0;
  RandomStream stream = RandomStream::Candidate;

  // Four 32-bit draws for (position, index / 4); use word index % 4.
  DS_HOST_DEVICE Philox4 draw(uint32_t position, uint32_t index) const {
    return philox4x32(index / 4, position, step, (block & 0x3fffffffu) | (uint32_t(stream) << 30), uint32_t(seed),
                      uint32_t(seed >> 32));
  }
};

// A uniform in the open interval (0, 1) from 23 random bits: (i + 0.5) / 2^23, every value
// exact in fp32, the largest 1 - 2^-24. (From 24 bits, (2^24 - 0.5) / 2^24 rounded to 1.0,
// whose Gumbel noise below is +inf: about four of a batch-1 step's 67 million draws made
// an unlikely token their row's candidate.)
DS_HOST_DEVICE inline float uniform_open(uint32_t bits) { return (float(bits >> 9) + 0.5f) * (1.0f / 8388608.0f); }

// Standard Gumbel noise: argmax(logits + gumbel) samples from softmax(logits). Finite:
// within [-2.82, 16.64], uniform_open's extremes.
DS_HOST_DEVICE inline float gumbel(uint32_t bits) { return -logf(-logf(uniform_open(bits))); }
// Bounds on gumbel's values with a margin for logf's rounding: p + noise can beat q + noise'
// only where p + kGumbelMax >= q + kGumbelMin.
constexpr float kGumbelMin = -2.9f, kGumbelMax = 16.7f;

// A uniform integer in [0, n) (multiply-shift; bias below 2^-32 * n).
DS_HOST_DEVICE inline uint32_t uniform_below(uint32_t bits, uint32_t n) { return uint32_t((uint64_t(bits) * n) >> 32); }

}  // namespace diffuserve
