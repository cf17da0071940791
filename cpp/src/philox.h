// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): a
// counter-based generator. A draw is a pure function of (key, counter), so every random
// number of a request is addressed by (seed, block, step, position, index) and comes out
// the same whatever else is batched with it and on whichever backend computes it.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

namespace diffuserve {

inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u, kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kMul0) * ctr[0], p1 = uint64_t(kMul1) * ctr[2];
    ctr = {uint32_t(p1 >> 32) ^ ctr[1] ^ key[0], uint32_t(p1), uint32_t(p0 >> 32) ^ ctr[3] ^ key[1], uint32_t(p0)};
    key = {key[0] + kWeyl0, key[1] + kWeyl1};
  }
  return ctr;
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
  std::array<uint32_t, 4> draw(uint32_t position, uint32_t index) const {
    return philox4x32({index / 4, position, step, (block & 0x3fffffffu) | (uint32_t(stream) << 30)},
                      {uint32_t(seed), uint32_t(seed >> 32)});
  }
};

// A uniform in the open interval (0, 1) from 24 random bits.
inline float uniform_open(uint32_t bits) { return (float(bits >> 8) + 0.5f) * (1.0f / 16777216.0f); }

// Standard Gumbel noise: argmax(logits + gumbel) samples from softmax(logits).
inline float gumbel(uint32_t bits) { return -std::log(-std::log(uniform_open(bits))); }

// A uniform integer in [0, n) (multiply-shift; bias below 2^-32 * n).
inline uint32_t uniform_below(uint32_t bits, uint32_t n) { return uint32_t((uint64_t(bits) * n) >> 32); }

}  // namespace diffuserve
