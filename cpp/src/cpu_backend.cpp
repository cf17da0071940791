// The CPU backend: the readable reference for every op in backend.h. fp32 arithmetic
// throughout, weights widened from their storage dtype (quantized ones dequantized from
// their packed bytes) as they are read, loops split over a thread pool.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <unistd.h>
#include <numeric>

#include "activation_quant.h"
#include "backend.h"
#include "cgroup.h"
#include "cpu_simd.h"
#include "diffuserve/errors.h"
#include "thread_pool.h"

namespace diffuserve {

int64_t Weight::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// Widens n elements of a row (a weight's, the KV cache's) to fp32.
void widen(const void* src, DType dtype, int64_t n, float* dst) {
  switch (dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    default:
      throw InvalidArgument(std::string("weights of dtype ") + dtype_name(dtype) + " are not supported");
  }
}

inline float gelu_erf(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.7071067811865476f)); }

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads)
      : pool_(ThreadPool::make(num_threads)) {
    cpu::simd_isa();  // picks the products' build now: a DIFFUSERVE_CPU_ISA the CPU lacks fails the load
  }

  Activation alloc(int64_t rows, int64_t cols) override {
    Activation a;
    a.rows = rows;
    a.cols = cols;
    // calloc: zeroed pages that the OS maps only when first touched (the KV pool is large).
    float* buf = static_cast<float*>(std::calloc(size_t(std::max<int64_t>(rows * cols, 1)), sizeof(float)));
    if (!buf) throw InvalidArgument("out of memory allocating " + std::to_string(rows) + " x " + std::to_string(cols) +
                                    " floats");
    a.data = buf;
    a.storage = std::shared_ptr<float>(buf, std::free);
    return a;
  }

  int64_t default_kv_cache_bytes() override {  // a quarter of the memory, at most 4 GiB
    return std::min<int64_t>(memory_bytes() / 4, int64_t(4) << 30);
  }
  // Physical memory, or the container's limit where lower (in a 1 GiB container the cache had
  // been sized for the host, and the process killed as it filled).
  int64_t memory_bytes() override {
    const int64_t physical = int64_t(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
    const int64_t limit = cgroup_limits().memory_bytes;
    return limit ? std::min(physical, limit) : physical;
  }

  Weight upload(const void* host, DType dtype, const std::vector<int64_t>& shape, DType as,
                std::shared_ptr<const void> keep_alive) override {
    Weight w;
    w.dtype = as;
    w.shape = shape;
    // Zero copy (point into the mapped checkpoint) when the bytes are aligned for their
    // type: a safetensors header need not be padded to a multiple of 8.
    if (dtype == as && reinterpret_cast<uintptr_t>(host) % dtype_size(as) == 0) {
      w.data = host;
      w.storage = std::move(keep_alive);
      return w;
    }
    return stored_in_chunks(shape, as, [&](int64_t b, int64_t e, uint8_t* out) {
      convert_floats(static_cast<const uint8_t*>(host) + b * dtype_size(dtype), dtype, e - b, out, as);
    });
  }

  // Every quantized weight stays packed (data points at the PackedWeight) and linear
  // dequantizes it a tile of rows at a time: the exact values packed_weight.h defines,
  // whatever the plain weights' dtype, as the CUDA backend's GEMM multiplies them.
  bool keeps_packed(const PackedWeight&) const override { return true; }

  Weight upload_packed(const PackedWeight& host) override {
    auto packed = std::make_shared<const PackedWeight>(host);
    Weight w;
    w.format = host.format;
    w.dtype = host.format == WeightFormat::Fp8 ? DType::F8_E4M3 : DType::U8;
    w.shape = host.shape;
    w.data = packed.get();
    w.storage = packed;
    return w;
  }

  Weight random_weight(const std::vector<int64_t>& shape, DType as, uint64_t seed, float scale) override {
    return stored_in_chunks(shape, as, [&](int64_t b, int64_t e, uint8_t* out) {
      std::vector<float> values(size_t(e - b));
      random_weight_values(seed, uint64_t(b), uint64_t(e), scale, values.data());
      convert_floats(values.data(), DType::F32, e - b, out, as);
    });
  }

  void to_host(const Activation& a, float* out) override { copy_bytes(out, a.data, a.size() * sizeof(float)); }
  void from_host(const float* in, Activation& a) override { copy_bytes(a.data, in, a.size() * sizeof(float)); }
  std::shared_ptr<void> alloc_bytes(size_t bytes) override {
    void* p = std::malloc(std::max<size_t>(bytes, 1));
    if (!p) throw InvalidArgument("out of memory allocating " + std::to_string(bytes) + " bytes");
    return std::shared_ptr<void>(p, std::free);
  }
  void write_bytes(void* dst, const void* src, size_t bytes) override { copy_bytes(dst, src, bytes); }
  void read_bytes(void* dst, const void* src, size_t bytes) override { copy_bytes(dst, src, bytes); }
  void copy_rows(const Activation& src, int64_t src_row, Activation& dst, int64_t dst_row, int64_t n) override {
    std::memmove(dst.row(dst_row), src.row(src_row), n * src.cols * sizeof(float));
  }

  void scatter_rows(const Activation& src, const std::vector<int64_t>& dst_rows, KvRows& dst) override {
    for (size_t i = 0; i < dst_rows.size(); ++i) {
      void* row = dst.row(dst_rows[i]);
      if (dst.dtype == DType::F32) {
        std::memcpy(row, src.row(int64_t(i)), src.cols * sizeof(float));
      } else {
        auto* bf16 = static_cast<uint16_t*>(row);
        for (int64_t j = 0; j < src.cols; ++j) bf16[j] = f32_to_bf16(src.row(int64_t(i))[j]);
      }
    }
  }

  void embed(const Weight& table, const int32_t* ids, float scale, Activation& out) override {
    const int64_t h = table.shape[1];
    const size_t esz = dtype_size(table.dtype);
    pool_->parallel_for(out.rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        float* dst = out.row(i);
        widen(static_cast<const uint8_t*>(table.data) + int64_t(ids[i]) * h * esz, table.dtype, h, dst);
        for (int64_t j = 0; j < h; ++j) dst[j] *= scale;
      }
    });
  }

  void linear(const Activation& x, const Weight& w, Activation& y, int expert) override {
    const int64_t n = w.shape[w.shape.size() - 2], k = w.shape.back();
    const int64_t first = expert >= 0 ? int64_t(expert) * n : 0;  // the matrix's first row in a stack
    const size_t esz = dtype_size(w.dtype);
    const uint8_t* base = static_cast<const uint8_t*>(w.data) + (w.format == WeightFormat::Plain ? first * k * esz : 0);
    const int64_t m = x.rows;
    // Each task widens a tile of weight rows once and reuses it for every input row.
    constexpr int64_t kTile = 16;
    pool_->parallel_for((n + kTile - 1) / kTile, 1, [&](int64_t tb, int64_t te) {
      std::vector<float> tile(kTile * k);
      for (int64_t t = tb; t < te; ++t) {
        const int64_t n0 = t * kTile, rows = std::min(kTile, n - n0);
        const float* wrows;
        if (w.format != WeightFormat::Plain) {
          dequantize_rows(*static_cast<const PackedWeight*>(w.data), first + n0, rows, tile.data());
          wrows = tile.data();
        } else if (w.dtype == DType::F32) {
          wrows = reinterpret_cast<const float*>(base) + n0 * k;
        } else {
          widen(base + n0 * k * esz, w.dtype, rows * k, tile.data());
          wrows = tile.data();
        }
        cpu::dot_rows(x.data, x.cols, m, wrows, k, rows, k, y.data + n0, y.cols);
      }
    });
  }

  void linear_nt(const Activation& x, const Weight& w, Activation& y) override {
    const int64_t k = w.shape[0], n = w.shape[1], m = x.rows;
    const size_t esz = dtype_size(w.dtype);
    // x rounded to w's dtype first, as the reference casts the probabilities.
    Activation rounded = x;
    if (w.dtype != DType::F32) {
      rounded = alloc(m, k);
      pool_->parallel_for(m, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b * k; i < e * k; ++i) rounded.data[i] = round_to_dtype(x.data[i], w.dtype);
      });
    }
    std::fill(y.data, y.data + y.size(), 0.0f);
    // A task is a group of rows by a band of columns; w's rows go in chunks (widened when
    // not fp32) that stay in cache while the group's rows take them.
    constexpr int64_t kRowGroup = 64, kBand = 64, kChunk = 256;
    const int64_t bands = (n + kBand - 1) / kBand, groups = (m + kRowGroup - 1) / kRowGroup;
    pool_->parallel_for(groups * bands, 1, [&](int64_t tb, int64_t te) {
      std::vector<float> chunk(w.dtype == DType::F32 ? 0 : kChunk * kBand);
      for (int64_t t = tb; t < te; ++t) {
        const int64_t r0 = t / bands * kRowGroup, rows = std::min(kRowGroup, m - r0);
        const int64_t c0 = t % bands * kBand, cols = std::min(kBand, n - c0);
        for (int64_t j0 = 0; j0 < k; j0 += kChunk) {
          const int64_t count = std::min(kChunk, k - j0);
          const uint8_t* first = static_cast<const uint8_t*>(w.data) + (j0 * n + c0) * esz;
          const float* w_chunk = reinterpret_cast<const float*>(first);
          int64_t ldw = n;
          if (w.dtype != DType::F32) {
            for (int64_t j = 0; j < count; ++j) widen(first + j * n * esz, w.dtype, cols, chunk.data() + j * cols);
            w_chunk = chunk.data();
            ldw = cols;
          }
          cpu::add_rows_times(rounded.row(r0) + j0, k, rows, w_chunk, ldw, count, cols, y.row(r0) + c0, y.cols);
        }
      }
    });
  }

  void rms_norm(const Activation& x, const Weight* weight, int64_t group, float eps, Activation& y) override {
    norm_groups(x, weight, group, eps, /*accumulate=*/false, y);
  }
  void add_rms_norm(const Activation& x, const Weight* weight, float eps, Activation& y, float scale) override {
    norm_groups(x, weight, x.cols, eps, /*accumulate=*/true, y, scale);
  }

  void rms_norm_rope(Activation& x, const Weight& weight, int64_t head_dim, float eps, const Weight& inv_freq_weight,
                     const std::vector<int64_t>& positions) override {
    norm_groups(x, &weight, head_dim, eps, /*accumulate=*/false, x);
    const float* inv_freq = static_cast<const float*>(inv_freq_weight.data);
    const int64_t heads = x.cols / head_dim, half = head_dim / 2;
    pool_->parallel_for(x.rows, 4, [&](int64_t b, int64_t e) {
      std::vector<float> c(half), s(half);
      for (int64_t i = b; i < e; ++i) {
        for (int64_t f = 0; f < half; ++f) {
          const float angle = float(positions[i]) * inv_freq[f];
          c[f] = std::cos(angle);
          s[f] = std::sin(angle);
        }
        for (int64_t h = 0; h < heads; ++h) {
          float* v = x.row(i) + h * head_dim;
          for (int64_t f = 0; f < half; ++f) {
            const float x1 = v[f], x2 = v[f + half];
            v[f] = x1 * c[f] - x2 * s[f];
            v[f + half] = x2 * c[f] + x1 * s[f];
          }
        }
      }
    });
  }

  void split_qkv_norms(const Activation& qkv, int64_t q_first, const Weight& q_weight, const Weight& k_weight,
                       int64_t head_dim, float eps, const Weight& inv_freq, const std::vector<int64_t>& positions,
                       Activation& q, Activation& kv) override {
    const int64_t n = qkv.rows, v_col = qkv_value_column(qkv, q_first, q, kv), kv_cols = kv.cols;
    for (int64_t r = 0; r < n; ++r) {
      const float* row = qkv.row(r);
      if (r >= q_first) std::copy(row, row + q.cols, q.row(r - q_first));
      std::copy(row + q.cols, row + q.cols + kv_cols, kv.row(r));
      std::copy(row + v_col, row + v_col + kv_cols, kv.row(n + r));
    }
    rms_norm_rope(q, q_weight, head_dim, eps, inv_freq, {positions.begin() + q_first, positions.begin() + n});
    key_value_norms(kv, k_weight, head_dim, eps, inv_freq, positions);
  }

  // Each task takes a block of a segment's query rows with the heads of one KV head's group,
  // and walks their keys and values in tiles that stay in cache while every query of the
  // task reads them (a task a row and head had read the whole context again for each: from
  // memory, past the cache, 4-5x slower at 32K). A query's sums are those of one pass over
  // its keys: a score is one dot_rows element whatever rows come with it, and add_rows_times
  // adds the weighted values one key after another, so the tiles change no bit.
  void attention(const Activation& q, const std::vector<AttentionSegment>& segments, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, Activation& out, bool round_bf16) override {
    auto input = [round_bf16](float x) { return round_bf16 ? round_to_dtype(x, DType::BF16) : x; };
    const int64_t group = num_heads / num_kv_heads, kv_stride = num_kv_heads * head_dim;
    const int64_t tile_keys = std::max<int64_t>(16, (int64_t(32) << 10) / head_dim);  // 128 KiB of fp32
    // Up to 32 queries a task, fewer rows where that would leave threads idle.
    int64_t all_rows = 0;
    for (const auto& seg : segments) all_rows += seg.rows;
    const int64_t block_rows =
        std::clamp<int64_t>(all_rows * num_kv_heads / (4 * int64_t(pool_->size())), 1, std::max<int64_t>(1, 32 / group));
    struct Block {
      const AttentionSegment* seg;
      int64_t first, end;  // its rows of seg
    };
    std::vector<Block> blocks;
    for (const auto& seg : segments)
      for (int64_t r = 0; r < seg.rows; r += block_rows) blocks.push_back({&seg, r, std::min(seg.rows, r + block_rows)});
    pool_->parallel_for(int64_t(blocks.size()) * num_kv_heads, 1, [&](int64_t b, int64_t e) {
      // A query's visible keys of one span, rows [first, end) (a causal row at position p sees
      // (p - window, p]), and where their scores start among the query's.
      struct Run {
        int64_t first = 0, end = 0;
        size_t scores_at = 0;
      };
      struct Query {
        float* q;    // its vector, rounded with round_bf16
        float* out;  // its head of the output row
        std::vector<Run> runs;  // one a span
        std::vector<float> scores;
        bool skip = false;  // a NaN score (its output NaN, as the reference's softmax gives) or no key seen
      };
      std::vector<Query> queries;
      std::vector<float> vectors, widened;
      // Rows [first, end) of a span's keys or values, kv head kvh, as the products take them:
      // the stored fp32 rows in place (ld: their stride), else widened, and rounded to bf16
      // with round_bf16 (but bf16 ones, which are already), into `widened`.
      auto span_rows = [&](const KeySpan& s, const void* data, int64_t kvh, int64_t first, int64_t end,
                           int64_t& ld) -> const float* {
        if (s.dtype == DType::F32 && !round_bf16) {
          ld = kv_stride;
          return static_cast<const float*>(data) + first * kv_stride + kvh * head_dim;
        }
        ld = head_dim;
        widened.resize(size_t((end - first) * head_dim));
        const size_t esz = dtype_size(s.dtype);
        for (int64_t k = first; k < end; ++k) {
          float* row = widened.data() + (k - first) * head_dim;
          widen(static_cast<const uint8_t*>(data) + (k * kv_stride + kvh * head_dim) * esz, s.dtype, head_dim, row);
          if (s.dtype != DType::BF16)
            for (int64_t d = 0; d < head_dim; ++d) row[d] = input(row[d]);
        }
        return widened.data();
      };
      // fn(query, run, first, end, rows, ld) for each query's part [first, end) of each tile of
      // span `si`'s keys or values (`data`) that a query not skipped sees, `rows` its rows.
      auto for_each_tile = [&](const KeySpan& span, size_t si, const void* data, int64_t kvh, auto&& fn) {
        int64_t lo = span.count, hi = 0;
        for (const Query& query : queries)
          if (!query.skip && query.runs[si].end > query.runs[si].first) {
            lo = std::min(lo, query.runs[si].first);
            hi = std::max(hi, query.runs[si].end);
          }
        for (int64_t t0 = lo; t0 < hi; t0 += tile_keys) {
          const int64_t t1 = std::min(hi, t0 + tile_keys);
          int64_t ld = 0;
          const float* rows = nullptr;
          for (Query& query : queries) {
            const Run& run = query.runs[si];
            const int64_t first = std::max(run.first, t0), end = std::min(run.end, t1);
            if (query.skip || first >= end) continue;
            if (!rows) rows = span_rows(span, data, kvh, t0, t1, ld);
            fn(query, run, first, end, rows + (first - t0) * ld, ld);
          }
        }
      };
      for (int64_t task = b; task < e; ++task) {
        const Block& block = blocks[task / num_kv_heads];
        const AttentionSegment& seg = *block.seg;
        const int64_t kvh = task % num_kv_heads, count = (block.end - block.first) * group;
        queries.resize(size_t(count));
        vectors.resize(size_t(count * head_dim));
        for (int64_t n = 0; n < count; ++n) {
          const int64_t r = block.first + n / group, h = kvh * group + n % group, i = seg.first_row + r;
          const int64_t p = seg.first_position + r;
          Query& query = queries[n];
          query.q = vectors.data() + n * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) query.q[d] = input(q.row(i)[h * head_dim + d]);
          query.out = out.row(i) + h * head_dim;
          query.runs.assign(seg.spans.size(), Run{});
          size_t seen = 0;
          for (size_t si = 0; si < seg.spans.size(); ++si) {
            const KeySpan& s = seg.spans[si];
            Run run{0, s.count, seen};
            if (seg.causal) {
              run.end = std::min(run.end, p - s.first_position + 1);
              if (seg.window) run.first = std::max<int64_t>(0, p - seg.window + 1 - s.first_position);
            }
            if (run.end <= run.first) continue;
            query.runs[si] = run;
            seen += size_t(run.end - run.first);
          }
          query.scores.resize(seen);
          query.skip = seen == 0;
        }
        for (size_t si = 0; si < seg.spans.size(); ++si)
          for_each_tile(seg.spans[si], si, seg.spans[si].keys, kvh,
                        [&](Query& query, const Run& run, int64_t first, int64_t end, const float* keys, int64_t ld) {
                          cpu::dot_rows(query.q, head_dim, 1, keys, ld, end - first, head_dim,
                                        query.scores.data() + run.scores_at + (first - run.first), 1);
                        });
        for (Query& query : queries) {
          float best = -INFINITY;
          bool nan = false;
          for (const float score : query.scores) {
            best = std::max(best, score);  // (std::max keeps `best` where the score is NaN)
            nan = nan || std::isnan(score);
          }
          std::fill(query.out, query.out + head_dim, nan ? NAN : 0.0f);
          query.skip = nan || best == -INFINITY;  // no visible key: zeros (cannot happen for a well-formed batch)
          if (query.skip) continue;
          cpu::softmax(query.scores.data(), int64_t(query.scores.size()));
          for (float& sc : query.scores) sc = input(sc);
        }
        for (size_t si = 0; si < seg.spans.size(); ++si)
          for_each_tile(seg.spans[si], si, seg.spans[si].values, kvh,
                        [&](Query& query, const Run& run, int64_t first, int64_t end, const float* values, int64_t ld) {
                          cpu::add_rows_times(query.scores.data() + run.scores_at + (first - run.first), 0, 1, values,
                                              ld, end - first, head_dim, query.out, head_dim);
                        });
      }
    });
  }

  void gelu_glu(const Activation& x, Activation& out) override {
    const int64_t inter = x.cols / 2;
    pool_->parallel_for(x.rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float *gate = x.row(i), *up = gate + inter;
        if (!exact_gelu_) {
          cpu::gelu_tanh_times(gate, up, inter, out.row(i));
          continue;
        }
        for (int64_t j = 0; j < inter; ++j) out.row(i)[j] = gelu_erf(gate[j]) * up[j];
      }
    });
  }
  bool use_exact_gelu() override { return exact_gelu_ = true; }

  Routing route(const Activation& normed, const Weight& proj, const Weight& per_expert_scale_weight,
                int top_k) override {
    const int64_t tokens = normed.rows, hidden = normed.cols, experts = proj.shape[0];
    const float* per_expert_scale = static_cast<const float*>(per_expert_scale_weight.data);
    Activation scaled = alloc(tokens, hidden);
    const float root = std::pow(float(hidden), -0.5f);
    for (int64_t i = 0; i < tokens * hidden; ++i) scaled.data[i] = normed.data[i] * root;
    Activation scores = alloc(tokens, experts);
    linear(scaled, proj, scores, -1);
    softmax(scores);
    Routing r;
    r.top_k = top_k;
    r.experts = std::shared_ptr<int32_t>(new int32_t[tokens * top_k], std::default_delete<int32_t[]>());
    r.weights = alloc(tokens, top_k);
    std::vector<int32_t> order(experts);
    for (int64_t i = 0; i < tokens; ++i) {
      const float* p = scores.row(i);
      std::iota(order.begin(), order.end(), 0);
      // Highest probability first; the lower expert id wins a tie.
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                        [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      float sum = 0;
      for (int k = 0; k < top_k; ++k) sum += p[order[k]];
      for (int k = 0; k < top_k; ++k) {
        r.experts.get()[i * top_k + k] = order[k];
        r.weights.data[i * top_k + k] = p[order[k]] / sum * per_expert_scale[order[k]];
      }
    }
    return r;
  }

  void experts(const Activation& x, const Routing& routing, const Weight& gate_up, const Weight& down,
               Activation& out) override {
    const int64_t num_experts = gate_up.shape[0], inter2 = gate_up.shape[1], hidden = x.cols;
    std::fill(out.data, out.data + out.size(), 0.0f);
    // Group (token, slot) pairs by expert, then run each expert once over its rows.
    std::vector<std::vector<int64_t>> assigned(num_experts);
    for (int64_t a = 0; a < routing.weights.size(); ++a) assigned[routing.experts.get()[a]].push_back(a);
    for (int64_t e = 0; e < num_experts; ++e) {
      const auto& rows = assigned[e];
      if (rows.empty()) continue;
      const int64_t r = int64_t(rows.size());
      Activation xin = alloc(r, hidden), gu = alloc(r, inter2), act = alloc(r, inter2 / 2), y = alloc(r, hidden);
      for (int64_t i = 0; i < r; ++i) std::memcpy(xin.row(i), x.row(rows[i] / routing.top_k), hidden * sizeof(float));
      // The rows are in token order, so the encoder's tokens (the batch's first) lead.
      const int64_t encoder = std::count_if(rows.begin(), rows.end(),
                                            [&](int64_t a) { return a / routing.top_k < routing.encoder_tokens; });
      if (gate_up.input_quant.scheme != ActivationScheme::None)
        quantize_input(xin, gate_up.input_quant, encoder, int(e));
      linear(xin, gate_up, gu, int(e));
      gelu_glu(gu, act);
      if (down.input_quant.scheme != ActivationScheme::None) quantize_input(act, down.input_quant, encoder, int(e));
      linear(act, down, y, int(e));
      // With bf16 activations (bf16 inputs) each expert's output is kept as bf16, as the
      // reference in bf16 has it (and the CUDA backend stores it).
      if (down.input_quant.scheme == ActivationScheme::Bf16)
        for (int64_t i = 0; i < y.size(); ++i) y.data[i] = round_to_dtype(y.data[i], DType::BF16);
      for (int64_t i = 0; i < r; ++i) {
        const float wgt = routing.weights.data[rows[i]];
        float* o = out.row(rows[i] / routing.top_k);
        for (int64_t j = 0; j < hidden; ++j) o[j] += wgt * y.row(i)[j];
      }
    }
  }

  // FP8: one scale per row. NVFP4: one per 16 values (the loader checked that they divide
  // a row), under the row's phase's global scale. Bf16: each value rounded to bf16.
  void quantize_input(Activation& x, const ActivationQuant& quant, int64_t encoder_rows, int expert) override {
    pool_->parallel_for(x.rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        float* v = x.row(i);
        if (quant.scheme == ActivationScheme::Bf16) {
          for (int64_t j = 0; j < x.cols; ++j) v[j] = round_to_dtype(v[j], DType::BF16);
        } else if (quant.scheme == ActivationScheme::Fp8Token) {
          float amax = 0;
          for (int64_t j = 0; j < x.cols; ++j) amax = std::max(amax, std::abs(v[j]));
          const float s = fp8_token_scale(amax);
          for (int64_t j = 0; j < x.cols; ++j) v[j] = fake_quantize_e4m3(v[j], s);
        } else {
          const float global = quant.global_scale(i < encoder_rows, expert);
          for (int64_t g = 0; g < x.cols; g += kNvfp4Group) fake_quantize_nvfp4_group(v + g, global);
        }
      }
    });
  }

  void add(const Activation& a, const Activation& b, Activation& y) override {
    for (int64_t i = 0; i < a.size(); ++i) y.data[i] = a.data[i] + b.data[i];
  }
  void scale(Activation& x, float s) override {
    for (int64_t i = 0; i < x.size(); ++i) x.data[i] *= s;
  }
  void softcap(Activation& x, float cap) override {
    pool_->parallel_for(x.size(), 4096, [&](int64_t b, int64_t e) { cpu::softcap(x.data + b, e - b, cap); });
  }
  void softmax(Activation& x) override {
    pool_->parallel_for(x.rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) cpu::softmax(x.row(i), x.cols);
    });
  }

  std::vector<RowSample> sample(Activation& logits, float cap, float temperature, const float* bias,
                                const RandomKey& key, DType feedback_dtype, bool softmax_feedback) override {
    const int64_t vocab = logits.cols;
    std::vector<RowSample> out(logits.rows);
    pool_->parallel_for(logits.rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        float* l = logits.row(row);
        float best = -INFINITY, best_noisy = -INFINITY;
        RowSample& r = out[row];
        if (cap > 0) cpu::softcap(l, vocab, cap);
        for (int64_t j = 0; j < vocab; ++j) {
          // (An id excluded, biased by -inf, is -inf whatever its logit, NaN too, as on the GPU.)
          l[j] = !bias ? l[j] / temperature : bias[j] == -INFINITY ? -INFINITY : (l[j] + bias[j]) / temperature;
          if (l[j] > best) best = l[j], r.argmax = int32_t(j);
        }
        // The candidate: the first largest l + Gumbel noise. Noise is drawn only for the four
        // ids of a draw where one might reach the best id's noisy logit (kGumbelMin and
        // kGumbelMax bound the noise), as the CUDA sampler does: a trained model's rows skip
        // nearly every draw, and the candidate is the same.
        const float reach = best + kGumbelMin;
        for (int64_t v = 0; v < vocab; v += 4) {
          const int64_t end = std::min(v + 4, vocab);
          bool draw = false;
          for (int64_t j = v; j < end; ++j) draw |= !(l[j] + kGumbelMax < reach);
          if (!draw) continue;
          const Philox4 bits = key.draw(uint32_t(row), uint32_t(v));
          for (int64_t j = v; j < end; ++j) {
            const float noisy = l[j] + gumbel(bits[j - v]);
            if (noisy > best_noisy) best_noisy = noisy, r.candidate = int32_t(j);
          }
        }
        // Entropy as torch.distributions.Categorical computes it: -sum(p * log p) with
        // log p = l - logsumexp(l), clamped so that p = 0 contributes 0 rather than NaN.
        const float log_z = best + std::log(cpu::sum_exp(l, vocab, best));
        r.entropy = cpu::entropy(l, vocab, log_z);
        if (feedback_dtype != DType::F32) {
          // A cold step's scaled logits can pass fp16's range (a softcap of 30 below
          // temperature 4.6e-4), where the reference's cast gives infinities and its softmax
          // NaN. Such a row, shifted by its largest logit first, has the same softmax; rows
          // within range are cast as the reference casts them.
          const bool overflows = std::isfinite(best) && std::isinf(round_to_dtype(best, feedback_dtype));
          const float shift = overflows ? best : 0.0f;
          for (int64_t j = 0; j < vocab; ++j) l[j] = round_to_dtype(l[j] - shift, feedback_dtype);
        }
        if (softmax_feedback) cpu::softmax(l, vocab);
      }
    });
    return out;
  }

 private:
  // A weight of `shape` stored as `as`, whose values [b, e) store(b, e, out) writes at `out`, a
  // chunk at a time on the pool: no fp32 copy of the whole weight on the way.
  template <class Store>
  Weight stored_in_chunks(const std::vector<int64_t>& shape, DType as, Store store) {
    Weight w;
    w.dtype = as;
    w.shape = shape;
    auto buf = std::make_shared<std::vector<uint8_t>>(size_t(w.numel()) * dtype_size(as));
    pool_->parallel_for(w.numel(), 1 << 16,
                        [&](int64_t b, int64_t e) { store(b, e, buf->data() + b * dtype_size(as)); });
    w.data = buf->data();
    w.storage = buf;
    return w;
  }

  // rms_norm and add_rms_norm: per group of x, the normed value x * (mean(x^2) + eps)^-0.5
  // [* weight] is stored in y, or (accumulate) added to y's value, the sum times `scale`.
  void norm_groups(const Activation& x, const Weight* weight, int64_t group, float eps, bool accumulate,
                   Activation& y, float scale = 1.0f) {
    const float* w = weight ? static_cast<const float*>(weight->data) : nullptr;
    const int64_t groups = x.size() / group;
    pool_->parallel_for(groups, 64, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g) {
        const float* xi = x.data + g * group;
        float* yi = y.data + g * group;
        const float inv = std::pow(cpu::sum_squares(xi, group) / float(group) + eps, -0.5f);
        for (int64_t j = 0; j < group; ++j) {
          const float normed = xi[j] * inv * (w ? w[j] : 1.0f);
          yi[j] = accumulate ? (yi[j] + normed) * scale : normed;
        }
      }
    });
  }

  std::shared_ptr<ThreadPool> pool_;
  bool exact_gelu_ = false;  // use_exact_gelu
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int num_threads) { return std::make_unique<CpuBackend>(num_threads); }

}  // namespace diffuserve
