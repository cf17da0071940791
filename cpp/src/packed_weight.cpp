#include "packed_weight.h"

#include <array>
#include <cmath>

#include "backend.h"
#include "diffuserve/dtype.h"
#include "diffuserve/errors.h"

namespace diffuserve {

int64_t PackedWeight::rows() const {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) n *= shape[i];
  return n;
}

void PackedWeight::append(const PackedWeight& part, const std::string& what) {
  if (part.format != format || part.cols() != cols() || part.group_size != group_size)
    throw InvalidArgument(what + ": the linears stacked into one weight are quantized differently (format, input "
                          "count or group size)");
  shape[0] += part.rows();  // stacks are built from [rows, cols] parts; the caller sets the final shape
  values.insert(values.end(), part.values.begin(), part.values.end());
  scales.insert(scales.end(), part.scales.begin(), part.scales.end());
  group_scales.insert(group_scales.end(), part.group_scales.begin(), part.group_scales.end());
  global_scales.insert(global_scales.end(), part.global_scales.begin(), part.global_scales.end());
}

void dequantize_rows(const PackedWeight& w, int64_t first, int64_t count, float* out) {
  // The CPU backend dequantizes as it multiplies, every pass: every code's value is looked
  // up (fp8_e4m3_to_f32 of each byte, fp4_e2m1_to_f32 of each nibble), and each group's
  // scale is worked out once.
  static const std::array<float, 256> e4m3 = [] {
    std::array<float, 256> t;
    for (int code = 0; code < 256; ++code) t[code] = fp8_e4m3_to_f32(uint8_t(code));
    return t;
  }();
  static const std::array<float, 16> e2m1 = [] {
    std::array<float, 16> t;
    for (int nibble = 0; nibble < 16; ++nibble) t[nibble] = fp4_e2m1_to_f32(uint8_t(nibble));
    return t;
  }();
  const int64_t cols = w.cols(), group = w.group_size, groups = cols / group;
  for (int64_t r = first; r < first + count; ++r, out += cols) {
    for (int64_t g = 0; g < groups; ++g) {
      if (w.format == WeightFormat::Fp8) {
        const uint8_t* codes = w.values.data() + r * cols;
        const float scale = w.scales[r * groups + g];
        for (int64_t c = g * group; c < (g + 1) * group; ++c) out[c] = e4m3[codes[c]] * scale;
      } else {  // two values a byte, the low nibble first (cols is even; a group need not be)
        const uint8_t* bytes = w.values.data() + r * cols / 2;
        const float scale = e4m3[w.group_scales[r * groups + g]] / w.global_scales[r];
        for (int64_t c = g * group; c < (g + 1) * group; ++c)
          out[c] = e2m1[c % 2 ? bytes[c / 2] >> 4 : bytes[c / 2] & 0xf] * scale;
      }
    }
  }
}

std::vector<float> dequantize(const PackedWeight& w) {
  std::vector<float> out(size_t(w.rows() * w.cols()));
  dequantize_rows(w, 0, w.rows(), out.data());
  return out;
}

namespace {

// 64 random bits for (seed, i): a counter-based hash (splitmix64's finaliser), cheap
// enough to fill the 26B model's packed experts on the host in seconds.
uint64_t random_bits(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0xD1B54A32D192ED03ull + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Bytes i of `out` = byte i of the stream drawn from `seed` (eight bytes a draw).
void fill_random(std::vector<uint8_t>& out, uint64_t seed) {
  for (size_t word = 0; word * 8 < out.size(); ++word) {
    const uint64_t bits = random_bits(seed, word);
    for (size_t b = 0; b < 8 && word * 8 + b < out.size(); ++b) out[word * 8 + b] = uint8_t(bits >> (8 * b));
  }
}

// A factor in [0.75, 1.25) for row r: the scales differ from row to row.
float row_factor(uint64_t seed, int64_t r) {
  return 0.75f + 0.5f * float(random_bits(~seed, uint64_t(r)) >> 40) / float(1 << 24);
}

// Root mean square of `decode` over the codes [first, first + count) that `keep` admits.
template <typename Decode, typename Keep>
float rms_of_codes(int first, int count, Decode decode, Keep keep) {
  double sum = 0;
  int n = 0;
  for (int code = first; code < first + count; ++code)
    if (keep(uint8_t(code))) sum += double(decode(uint8_t(code))) * decode(uint8_t(code)), ++n;
  return float(std::sqrt(sum / n));
}

constexpr uint8_t kFirstGroupScale = 0x30;  // E4M3 0.5; the 16 codes from there run to 1.875

}  // namespace

PackedWeight random_packed_weight(WeightFormat format, const std::vector<int64_t>& shape, uint64_t seed) {
  PackedWeight w;
  w.format = format;
  w.shape = shape;
  const int64_t rows = w.rows(), cols = w.cols();
  const float unit = 1.0f / std::sqrt(float(cols));  // the plain dummy weights' standard deviation
  auto all = [](uint8_t) { return true; };
  if (format == WeightFormat::Fp8) {
    w.group_size = cols;
    w.values.resize(size_t(rows * cols));
    fill_random(w.values, seed);
    for (uint8_t& code : w.values) code = fp8_is_number(code) ? code : code ^ 1;
    const float rms = rms_of_codes(0, 256, fp8_e4m3_to_f32, fp8_is_number);
    for (int64_t r = 0; r < rows; ++r) w.scales.push_back(unit / rms * row_factor(seed, r));
    return w;
  }
  if (cols % 16) throw InvalidArgument("random NVFP4 weights need a multiple of 16 inputs, not " + std::to_string(cols));
  w.group_size = 16;
  w.values.resize(size_t(rows * cols / 2));
  fill_random(w.values, seed);
  w.group_scales.resize(size_t(rows * cols / 16));
  fill_random(w.group_scales, ~seed);
  for (uint8_t& code : w.group_scales) code = uint8_t(kFirstGroupScale + (code & 0xf));
  const float rms = rms_of_codes(0, 16, fp4_e2m1_to_f32, all) *
                    rms_of_codes(kFirstGroupScale, 16, fp8_e4m3_to_f32, all);
  // One global scale a matrix, as LLM Compressor writes one a linear (an expert's each).
  const int64_t matrix_rows = shape.size() > 1 ? shape[shape.size() - 2] : 1;
  for (int64_t r = 0; r < rows; ++r) w.global_scales.push_back(rms / unit * row_factor(seed, r / matrix_rows));
  return w;
}

Weight Backend::upload_packed(const PackedWeight&) {
  throw InvalidArgument("this backend does not keep quantized weights packed");
}

}  // namespace diffuserve
