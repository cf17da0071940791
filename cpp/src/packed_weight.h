// A quantized linear's weight on the host, packed as a compressed-tensors checkpoint
// stores it (what LLM Compressor writes), and its dequantization: the one definition of
// what the packed bytes mean. model.cpp reads these from a checkpoint (or draws random ones
// for load_format "dummy"), then hands them to a backend that keeps them packed
// (Backend::keeps_packed), or dequantizes them here and uploads the values.
//
//   Fp8:   value[r, c] = e4m3(values[r, c]) * scales[r, c / group_size]
//   Nvfp4: value[r, c] = e2m1(nibble c of row r) * (e4m3(group_scales[r, c / group_size]) / global_scales[r])
//
// with NVFP4's two values a byte, the even column in the low nibble. Rows run over every
// matrix of a stack ([experts, rows, cols] is rows * experts rows of cols).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace diffuserve {

// How a weight's values are stored in backend memory: plainly (Weight::dtype), or packed
// as below, for a backend that multiplies packed weights itself.
enum class WeightFormat { Plain, Fp8, Nvfp4 };

struct PackedWeight {
  WeightFormat format;
  std::vector<int64_t> shape;          // the values' logical shape: [rows, cols] or [experts, rows, cols]
  int64_t group_size = 0;              // inputs per scale (cols: one scale per row)
  std::vector<uint8_t> values;         // Fp8: E4M3 [rows, cols]; Nvfp4: [rows, cols / 2]
  std::vector<float> scales;           // Fp8: [rows, cols / group_size]
  std::vector<uint8_t> group_scales;   // Nvfp4: E4M3 [rows, cols / group_size]
  std::vector<float> global_scales;    // Nvfp4: [rows] (a checkpoint's one per linear, repeated per row)

  int64_t rows() const;  // over every matrix of a stack
  int64_t cols() const { return shape.back(); }
  // `part`'s rows after these (stacking gate and up, or experts); same format, cols and
  // group size, else InvalidArgument naming `what`.
  void append(const PackedWeight& part, const std::string& what);
};

// Rows [first, first + count) of the weight's values in fp32 into out ([count, cols]), by
// the formulas above (as fp32 operations, in that order); dequantize: all of them.
void dequantize_rows(const PackedWeight& w, int64_t first, int64_t count, float* out);
std::vector<float> dequantize(const PackedWeight& w);

// Random packed bytes and scales of `shape` for load_format "dummy", the same for a seed
// on every backend: values from every code (FP8's two NaN codes excepted), group scales
// around 1, and the row scales that give the values a variance of about 1 / cols, as the
// plain dummy weights have (FP8: a scale per row; NVFP4: a global scale per matrix, as a
// checkpoint's). Nvfp4 needs cols % 16 == 0.
PackedWeight random_packed_weight(WeightFormat format, const std::vector<int64_t>& shape, uint64_t seed);

}  // namespace diffuserve
