// The CUDA attention (cuda/attention.cu, cuda/attention_mma.cu) on its own: correctness
// against a double-precision host reference on random inputs, as they are and rounded to
// bf16, over head dims 64 / 128 / 256 / 512 (the tensor-core kernels: mma.sync, and wgmma for 256 and 512
// with bf16 inputs on Hopper) and 24 / 80 (the generic one), GQA ratios 1 to 16, causal and non-causal segments,
// sliding windows, several segments of different lengths in one launch with query rows between them that no segment
// owns (they must stay untouched), spans of 16 keys cut at misaligned positions and spans of random lengths, and
// segments whose keys the plan cuts into pieces (split-KV) as well as uncut ones; bitwise batch invariance (a segment
// alone against the same segment among others, and a rerun); then timings at DiffusionGemma-26B shapes (a denoise pass:
// 256 canvas rows per request over its context; inputs as they are and rounded to bf16, the cache's pages fp32 or, as
// the engine keeps them with bf16 inputs on Hopper, bf16: the wgmma kernel reads them in place, and must give the same
// bits as from fp32 pages it converts), and a commit's pass (the same rows, causal). Before any of that, host
// checks of the plan that need no GPU: every row group's pieces are disjoint, in key order, cover every key its rows
// can see, and get consecutive slots and one merge where there are several; a segment's pieces are the same alone and
// batched; a prompt's rows after an earlier pass (a prefix-cache hit, a continued prefill) meet their keys in
// the pieces, chunks and slots they do when it runs whole. Build and run:
//   nvcc -std=c++20 -arch=sm_90a -DDIFFUSERVE_SM90A -O3 -I cpp/src -I cpp/include -I cuda \
//       benchmarks/attention_bench.cu cuda/attention.cu cuda/attention_mma.cu cuda/attention_wgmma.cu \
//       cuda/launch.cu -o /tmp/attention_bench && /tmp/attention_bench
// (--check: the checks alone; --check-bf16: those with bf16 inputs alone; --time [GRID]: the
// timings alone, at BATCHxCONTEXT,... where given; --time-1k: those of batch 1 at context 1K;
// --host: the plan checks alone, on a machine without a GPU).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "attention_keys.cuh"
#include "bench_common.cuh"
#include "kernels.h"

using namespace kernel_bench;
using namespace diffuserve;
using namespace diffuserve::cuda;

namespace {

// One segment: `rows` queries at positions first_position.., keys at positions
// [key_begin, key_end) cut into spans at multiples of `block` (0: spans of random lengths
// 1 to 40), each span stored at a random place of the problem's K/V storage.
struct SegmentSpec {
  int64_t rows, first_position;
  bool causal;
  int64_t window;
  int64_t key_begin, key_end;
  int block;
  int64_t gap = 0;  // query rows that no segment owns, before this one
};

// Q (rows x heads x dim), K/V storage (rows x kv_heads x dim each) and the segments over
// them, spans as storage rows until `segments` turns them into pointers.
struct Problem {
  int heads = 0, kv_heads = 0, dim = 0;
  int64_t rows = 0, storage_rows = 0;
  std::vector<float> q, k, v;
  std::vector<AttentionSegment> segs;  // KeySpan::keys/values: nullptr + storage row
  std::vector<int64_t> span_rows;      // per span of all segments, its first storage row
};

Problem make_problem(int heads, int kv_heads, int dim, const std::vector<SegmentSpec>& specs, unsigned seed) {
  std::mt19937 rng(seed);
  Problem p;
  p.heads = heads, p.kv_heads = kv_heads, p.dim = dim;
  std::vector<std::vector<int64_t>> lengths;
  for (const SegmentSpec& s : specs) {
    AttentionSegment a;
    p.rows += s.gap;
    a.first_row = p.rows, a.rows = s.rows, a.first_position = s.first_position, a.causal = s.causal,
    a.window = s.window;
    p.rows += s.rows;
    for (int64_t pos = s.key_begin; pos < s.key_end;) {
      const int64_t end = std::min(s.key_end, s.block ? (pos / s.block + 1) * s.block : pos + 1 + int64_t(rng() % 40));
      a.spans.push_back({nullptr, nullptr, end - pos, pos});
      pos = end;
    }
    p.segs.push_back(a);
  }
  // Spans at shuffled places of the storage, as a paged cache has them.
  std::vector<std::pair<int, int>> order;  // (segment, span)
  for (size_t s = 0; s < p.segs.size(); ++s)
    for (size_t i = 0; i < p.segs[s].spans.size(); ++i) order.push_back({int(s), int(i)});
  std::shuffle(order.begin(), order.end(), rng);
  std::map<std::pair<int, int>, int64_t> first_row;
  for (const auto& [s, i] : order) first_row[{s, i}] = p.storage_rows, p.storage_rows += p.segs[s].spans[i].count;
  for (size_t s = 0; s < p.segs.size(); ++s)
    for (size_t i = 0; i < p.segs[s].spans.size(); ++i) p.span_rows.push_back(first_row[{int(s), int(i)}]);
  std::normal_distribution<float> d(0.0f, 1.0f);
  const float q_scale = 2.0f / std::sqrt(float(dim));  // scores of a few units, as after q/k norms
  p.q.resize(size_t(p.rows * heads * dim));
  for (auto& x : p.q) x = d(rng) * q_scale;
  p.k.resize(size_t(p.storage_rows * kv_heads * dim));
  p.v.resize(p.k.size());
  for (auto& x : p.k) x = d(rng);
  for (auto& x : p.v) x = d(rng);
  return p;
}

// The problem's segments with spans pointing into K and V storage at `k` and `v`; where
// bf16 copies of the storage are given (k16, v16), every span but a segment's last points
// into those instead (bf16_cache: a bf16 cache's pages; the last stands for the batch's own
// rows), and (rounded) the fp32 spans name their rows there as already rounded
// (KeySpan::rounded_keys, as the key and value norms write them).
std::vector<AttentionSegment> segments(const Problem& p, const float* k, const float* v, const __nv_bfloat16* k16,
                                       const __nv_bfloat16* v16, bool bf16_cache, bool rounded) {
  std::vector<AttentionSegment> segs = p.segs;
  const int64_t kv_cols = int64_t(p.kv_heads) * p.dim;
  size_t n = 0;
  for (auto& s : segs)
    for (size_t i = 0; i < s.spans.size(); ++i) {
      KeySpan& span = s.spans[i];
      const int64_t at = p.span_rows[n++] * kv_cols;
      if (k16 && bf16_cache && i + 1 < s.spans.size()) {
        span.keys = k16 + at, span.values = v16 + at, span.dtype = DType::BF16;
      } else {
        span.keys = k + at, span.values = v + at;
        if (k16 && rounded) span.rounded_keys = k16 + at, span.rounded_values = v16 + at;
      }
    }
  return segs;
}

std::vector<__nv_bfloat16> rounded_to_bf16(const std::vector<float>& x) {
  std::vector<__nv_bfloat16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16(x[i]);
  return y;
}

// Runs the attention on the GPU (inputs rounded to bf16 or not; bf16_cache: the spans but
// each segment's last read from bf16 copies of K and V; rows_rounded: the fp32 spans' rows
// rounded already, in those copies, as `segments` says, and Q's rows too); returns the output (rows x heads x
// dim), NaN where nothing was written. Its bf16 copy (AttentionOutput::bf16) must be every
// written value rounded to bf16, bit for bit.
std::vector<float> run(const Problem& p, bool round_bf16, AttentionPlan* plan_out = nullptr, bool bf16_cache = false,
                       bool rows_rounded = false) {
  float* q = upload(p.q);
  float* k = upload(p.k);
  float* v = upload(p.v);
  __nv_bfloat16* k16 = bf16_cache || rows_rounded ? upload(rounded_to_bf16(p.k)) : nullptr;
  __nv_bfloat16* v16 = bf16_cache || rows_rounded ? upload(rounded_to_bf16(p.v)) : nullptr;
  __nv_bfloat16* q16 = rows_rounded ? upload(rounded_to_bf16(p.q)) : nullptr;
  const AttentionPlan plan = plan_attention(segments(p, k, v, k16, v16, bf16_cache, rows_rounded), p.heads, p.kv_heads,
                                            p.dim, attention_mma_resident_items(p.dim, round_bf16), round_bf16);
  const AttentionTables tables{upload(plan.segments), upload(plan.spans), upload(plan.items), upload(plan.merges)};
  void* scratch = nullptr;
  check(cudaMalloc(&scratch, std::max<size_t>(plan.scratch_bytes(), 1)), "malloc scratch");
  float* out = nullptr;
  const size_t out_bytes = sizeof(float) * p.q.size();
  check(cudaMalloc(&out, out_bytes), "malloc out");
  check(cudaMemset(out, 0xff, out_bytes), "memset out");  // NaN
  __nv_bfloat16* out_bf16 = nullptr;
  check(cudaMalloc(&out_bf16, out_bytes / 2), "malloc out_bf16");
  attention({q, q16}, {out, out_bf16}, plan, tables, scratch, p.heads, p.kv_heads, nullptr);
  check(cudaDeviceSynchronize(), "attention");
  std::vector<float> result(p.q.size());
  std::vector<__nv_bfloat16> rounded(p.q.size());
  check(cudaMemcpy(result.data(), out, out_bytes, cudaMemcpyDeviceToHost), "download");
  check(cudaMemcpy(rounded.data(), out_bf16, out_bytes / 2, cudaMemcpyDeviceToHost), "download bf16");
  size_t copies_differ = 0;
  for (size_t i = 0; i < result.size(); ++i) {
    const __nv_bfloat16 expected = __float2bfloat16(result[i]);
    copies_differ += !std::isnan(result[i]) && std::memcmp(&expected, &rounded[i], sizeof expected) != 0;
  }
  if (copies_differ) report(false, "bf16 copy of the output", std::to_string(copies_differ) + " values differ");
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(q16), cudaFree(k16), cudaFree(v16), cudaFree(out), cudaFree(out_bf16),
      cudaFree(scratch);
  cudaFree(const_cast<DeviceAttentionSegment*>(tables.segments)), cudaFree(const_cast<DeviceKeySpan*>(tables.spans));
  cudaFree(const_cast<AttentionItem*>(tables.items)), cudaFree(const_cast<AttentionMerge*>(tables.merges));
  if (plan_out) *plan_out = plan;
  return result;
}

// Whether two outputs are the same bits; a report line named `name` says so.
void report_bitwise(const std::vector<float>& a, const std::vector<float>& b, const std::string& name) {
  const size_t differ = size_t(std::inner_product(a.begin(), a.end(), b.begin(), int64_t(0), std::plus<>(),
                                                  [](float x, float y) { return std::memcmp(&x, &y, sizeof x) != 0; }));
  report(a.size() == b.size() && !differ, name, differ ? std::to_string(differ) + " values differ" : "bitwise");
}

// p with Q, K and V rounded to bf16, as the kernels multiply them with activations "bfloat16".
Problem rounded_inputs(const Problem& p) {
  Problem r = p;
  for (std::vector<float>* x : {&r.q, &r.k, &r.v})
    for (float& e : *x) e = __bfloat162float(__float2bfloat16(e));
  return r;
}

// Row r, head h of segment s in double: the output and the largest |value| it weighs (the
// scale of the error); no visible key gives zeros.
std::vector<double> reference(const Problem& p, const AttentionSegment& s, int64_t r, int h, double& scale) {
  const int kvh = h / (p.heads / p.kv_heads), d = p.dim;
  const int64_t kv_cols = int64_t(p.kv_heads) * d, pos = s.first_position + r;
  const float* qi = &p.q[size_t((s.first_row + r) * p.heads * d + int64_t(h) * d)];
  std::vector<double> scores;
  std::vector<const float*> values;
  const size_t span0 = size_t(&s - &p.segs[0]);
  size_t n = 0;
  for (size_t i = 0; i < span0; ++i) n += p.segs[i].spans.size();
  for (const KeySpan& span : s.spans) {
    const int64_t row0 = p.span_rows[n++];
    for (int64_t key = 0; key < span.count; ++key) {
      const int64_t j = span.first_position + key;
      if (s.causal && (j > pos || (s.window && j <= pos - s.window))) continue;
      const float* kk = &p.k[size_t((row0 + key) * kv_cols + int64_t(kvh) * d)];
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double(qi[c]) * double(kk[c]);
      scores.push_back(dot);
      values.push_back(&p.v[size_t((row0 + key) * kv_cols + int64_t(kvh) * d)]);
    }
  }
  std::vector<double> o(size_t(d), 0.0);
  scale = 0;
  if (scores.empty()) return o;
  const double best = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (double& x : scores) sum += (x = std::exp(x - best));
  for (size_t i = 0; i < scores.size(); ++i)
    for (int c = 0; c < d; ++c) {
      o[size_t(c)] += scores[i] / sum * double(values[i][c]);
      scale = std::max(scale, double(std::fabs(values[i][c])));
    }
  return o;
}

// Checks `out` against the reference on every (row, head) of every segment (or `samples`
// random ones), and that rows no segment owns were left alone. The tolerance, relative to
// the largest |value|: 2e-4 for fp32-like inputs; 4e-3 for bf16 ones, as the kernel rounds
// the probabilities too (each to 2^-9 of itself) and the reference does not. The
// references are computed on every core (those of the 26B shapes, whole, took minutes on one).
void verify(const Problem& p, const std::vector<float>& out, const std::string& name, const AttentionPlan& plan,
            int samples = 0) {
  const double tolerance = plan.round_bf16 ? 4e-3 : 2e-4;
  const Problem inputs = plan.round_bf16 ? rounded_inputs(p) : p;
  const int d = p.dim;
  // The vectors checked, in order: (segment, row, head).
  std::vector<std::tuple<size_t, int64_t, int>> vectors;
  std::mt19937_64 rng(1);
  std::vector<char> owned(size_t(p.rows), 0);
  for (size_t i = 0; i < p.segs.size(); ++i) {
    const AttentionSegment& s = p.segs[i];
    std::fill_n(owned.begin() + s.first_row, s.rows, 1);
    if (samples) {
      for (int k = 0; k < samples && s.rows; ++k) vectors.push_back({i, int64_t(rng() % s.rows), int(rng() % p.heads)});
    } else {
      for (int64_t r = 0; r < s.rows; ++r)
        for (int h = 0; h < p.heads; ++h) vectors.push_back({i, r, h});
    }
  }
  // Each vector's worst error and its first failing dims (dim, got, want), over the threads.
  struct Checked {
    double worst = 0;
    std::vector<std::tuple<int, float, double>> failing;
  };
  std::vector<Checked> checked(vectors.size());
  const size_t threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (size_t i = t; i < vectors.size(); i += threads) {
        const auto [seg, r, h] = vectors[i];
        const AttentionSegment& s = inputs.segs[seg];
        double scale;
        const std::vector<double> want = reference(inputs, s, r, h, scale);
        const float* got = &out[size_t((s.first_row + r) * p.heads * d + int64_t(h) * d)];
        for (int c = 0; c < d; ++c) {
          const double err = std::fabs(double(got[c]) - want[size_t(c)]) / (scale + 1e-30);
          checked[i].worst = std::max(checked[i].worst, std::isnan(err) ? INFINITY : err);
          if (!(err <= tolerance) && checked[i].failing.size() < 5)
            checked[i].failing.push_back({c, got[c], want[size_t(c)]});
        }
      }
    });
  for (std::thread& t : pool) t.join();
  double worst = 0;
  int64_t bad = 0;
  for (size_t i = 0; i < vectors.size(); ++i) {
    worst = std::max(worst, checked[i].worst);
    const auto [seg, r, h] = vectors[i];
    for (const auto& [c, got, want] : checked[i].failing)
      if (bad++ < 5)
        std::printf("    %s: row %ld head %d dim %d: got %.8g want %.8g\n", name.c_str(),
                    long(p.segs[seg].first_row + r), h, c, got, want);
  }
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t c = 0; !owned[size_t(r)] && c < int64_t(p.heads) * d; ++c)
      if (!std::isnan(out[size_t(r * p.heads * d + c)]) && bad++ < 5)
        std::printf("    %s: row %ld (no segment's) written\n", name.c_str(), long(r));
  char detail[160];
  std::snprintf(detail, sizeof detail, "%s (%zu vectors, worst err / max|v| %.1e; %zu items, %zu merges, %ld slots)",
                bad ? "MISMATCH" : "match", vectors.size(), worst, plan.items.size(), plan.merges.size(),
                long(plan.slots));
  report(!bad, name, detail);
}

// ---- the plan, on the host ------------------------------------------------------------

// The plan's pieces per output (segment, first row, kv head), in raw key indices of the
// segment (its spans one after the other): (begin, end, slot rank or -1).
using Output = std::tuple<int, int, int>;  // segment, row0, kv_head
using PieceOf = std::tuple<int64_t, int64_t, int>;
std::map<Output, std::vector<PieceOf>> pieces_by_output(const AttentionPlan& plan, std::string& error) {
  std::map<Output, std::vector<PieceOf>> by;
  std::map<Output, const AttentionMerge*> merge_of;
  for (const AttentionMerge& m : plan.merges) {
    if (merge_of.count({m.segment, m.row0, m.kv_head})) error = "two merges for one output";
    merge_of[{m.segment, m.row0, m.kv_head}] = &m;
  }
  for (const AttentionItem& it : plan.items) {
    const DeviceAttentionSegment& s = plan.segments[size_t(it.segment)];
    auto raw = [&](int span, int key) {
      int64_t before = 0;
      for (int i = s.span_begin; i < span; ++i) before += plan.spans[size_t(i)].count;
      return before + key;
    };
    const bool empty = it.last_span < it.span;
    if (!empty && (it.span < s.span_begin || it.last_span >= s.span_begin + s.span_count)) error = "span out of segment";
    const int64_t begin = empty ? 0 : raw(it.span, it.key), end = empty ? 0 : raw(it.last_span, it.last_end);
    int rank = -1;
    if (it.slot >= 0) {
      const auto m = merge_of.find({it.segment, it.row0, it.kv_head});
      if (m == merge_of.end()) error = "a slot without a merge";
      else if (it.slot < m->second->slot || it.slot >= m->second->slot + m->second->pieces) error = "slot outside its merge";
      else rank = it.slot - m->second->slot;
    }
    by[{it.segment, it.row0, it.kv_head}].push_back({begin, end, rank});
  }
  for (auto& [output, pieces] : by) {
    std::sort(pieces.begin(), pieces.end());
    const auto m = merge_of.find(output);
    const int n = int(pieces.size());
    if ((n > 1) != (m != merge_of.end()) || (m != merge_of.end() && m->second->pieces != n)) error = "merge count";
    for (int i = 0; i < n; ++i) {
      if (std::get<2>(pieces[size_t(i)]) != (n > 1 ? i : -1)) error = "slots not in key order";
      if (i && std::get<0>(pieces[size_t(i)]) < std::get<1>(pieces[size_t(i - 1)])) error = "overlapping pieces";
    }
  }
  return by;
}

// An item of the output (its pieces' items share rows and kv head).
const AttentionItem* item_of(const AttentionPlan& plan, const Output& output) {
  const auto [segment, row0, kv_head] = output;
  for (const AttentionItem& it : plan.items)
    if (it.segment == segment && it.row0 == row0 && it.kv_head == kv_head) return &it;
  return nullptr;
}

// The plan of `p` for `resident` concurrent items: outputs, pieces, slots and merges
// consistent, every visible key in a piece; returns the pieces per output.
std::map<Output, std::vector<PieceOf>> check_plan(const Problem& p, int resident, const std::string& name,
                                                  AttentionPlan* plan_out = nullptr) {
  const AttentionPlan plan = plan_attention(p.segs, p.heads, p.kv_heads, p.dim, resident, false);
  std::string error;
  std::map<Output, std::vector<PieceOf>> by = pieces_by_output(plan, error);
  const int group = p.heads / p.kv_heads;
  int64_t rows_covered = 0;
  for (const auto& [output, pieces] : by) {
    const auto [segment, row0, kv_head] = output;
    const AttentionSegment& s = p.segs[size_t(segment)];
    const AttentionItem* item = item_of(plan, output);
    if (item->rows * group > std::max(plan.queries_per_slot, 16)) error = "too many query vectors in a block";
    if (kv_head == 0) rows_covered += item->rows;
    // Every key some row of the group sees lies in one of its pieces.
    int64_t raw = 0;
    for (const KeySpan& span : s.spans)
      for (int64_t key = 0; key < span.count; ++key, ++raw) {
        const int64_t j = span.first_position + key;
        bool seen = false;
        for (int64_t r = row0; r < row0 + item->rows && !seen; ++r) {
          const int64_t pos = s.first_position + r;
          seen = !s.causal || (j <= pos && (s.window == 0 || j > pos - s.window));
        }
        bool in_piece = false;
        for (const PieceOf& piece : pieces) in_piece |= raw >= std::get<0>(piece) && raw < std::get<1>(piece);
        if (seen && !in_piece) error = "a visible key in no piece";
      }
  }
  int64_t rows = 0;
  for (const AttentionSegment& s : p.segs) rows += s.rows;
  if (rows_covered != rows) error = "rows not covered once";
  int64_t slots = 0;
  for (const AttentionMerge& m : plan.merges) slots += m.pieces;
  if (slots != plan.slots) error = "slots not all merged";
  char detail[160];
  std::snprintf(detail, sizeof detail, "%s (%zu items, %zu merges, %ld slots)",
                error.empty() ? "consistent" : error.c_str(), plan.items.size(), plan.merges.size(), long(plan.slots));
  report(error.empty(), "plan " + name + " (host, resident " + std::to_string(resident) + ")", detail);
  if (plan_out) *plan_out = plan;
  return by;
}

// The problem of segment `s` of `p` alone (the same queries, keys and values, at row 0).
Problem alone(const Problem& p, int s) {
  Problem a = p;
  const AttentionSegment& seg = p.segs[size_t(s)];
  const int64_t cols = int64_t(p.heads) * p.dim;
  a.rows = seg.rows;
  a.q.assign(p.q.begin() + seg.first_row * cols, p.q.begin() + (seg.first_row + seg.rows) * cols);
  a.segs = {seg};
  a.segs[0].first_row = 0;
  size_t first = 0;
  for (int i = 0; i < s; ++i) first += p.segs[size_t(i)].spans.size();
  a.span_rows.assign(p.span_rows.begin() + int64_t(first), p.span_rows.begin() + int64_t(first + seg.spans.size()));
  return a;
}

// Test problems: the kinds of segment the engine makes, and odd ones.
SegmentSpec decoder(int64_t rows, int64_t context, int64_t window = 0, int block = 16) {  // a canvas over its context
  const int64_t begin = window ? std::max<int64_t>(0, context - (window - 1)) : 0;
  return {rows, context, false, window, begin, context + rows, block};
}
SegmentSpec encoder(int64_t rows, int64_t first, int64_t window, int block = 16) {  // a prompt chunk, causal
  const int64_t begin = window ? std::max<int64_t>(0, first - (window - 1)) : 0;
  return {rows, first, true, window, begin, first + rows, block};
}

struct Case {
  std::string name;
  std::vector<SegmentSpec> segs;
};
std::vector<Case> cases() {
  SegmentSpec gapped = encoder(33, 20, 0);
  gapped.gap = 3;
  SegmentSpec tail = decoder(64, 1279, 0, 16);
  tail.gap = 5;
  return {
      {"decoder 37 rows, 337 keys", {decoder(37, 300)}},
      {"encoder 70 rows, window 40 (spans cut at 6)", {encoder(70, 54, 40)}},
      {"encoder 45 rows, window 17, random spans", {encoder(45, 100, 17, 0)}},
      {"3 segments, gaps, random spans", {decoder(5, 700, 0, 0), gapped, tail}},
      {"decoder 3 rows, 5000 keys, random spans (split)", {decoder(3, 5000, 0, 0)}},
      {"encoder 200 rows after 900, no window", {encoder(200, 900, 0)}},
  };
}

// A prompt's rows as the kernels walk their keys, by position: for each row, the chunks of
// `kKeys` slots that hold keys it sees, each as those keys' positions and slots, and after
// each piece of its item an empty chunk (so the pieces too must agree). A piece's
// keys that some row of the item sees come one after the other into its chunks (KeyWalk),
// the walk's first key at its slot on the item's grid (KeyWalk::first_slot); a chunk with no
// key a row sees changes nothing of its result, and rows alike here get the same bits.
using Chunk = std::vector<std::pair<int64_t, int>>;
using RowPlan = std::vector<Chunk>;
template <int kKeys>
std::map<int64_t, RowPlan> row_plans(const Problem& p, int resident, std::string& error) {
  const AttentionPlan plan = plan_attention(p.segs, p.heads, p.kv_heads, p.dim, resident, false);
  const AttentionSegment& s = p.segs.at(0);
  auto sees = [&](int64_t row, int64_t key) { return !s.causal || (key <= row && (s.window == 0 || key > row - s.window)); };
  std::map<int64_t, RowPlan> rows;
  for (const auto& [output, pieces] : pieces_by_output(plan, error)) {
    if (std::get<2>(output)) continue;  // kv head 0's items stand for the others'
    const AttentionItem& item = *item_of(plan, output);
    const int64_t first = s.first_position + item.row0, last = first + item.rows - 1;
    for (const PieceOf& piece : pieces) {
      std::vector<int64_t> walk;  // the piece's keys some row of the item sees, in order
      int64_t raw = 0;
      for (const KeySpan& span : s.spans)
        for (int64_t k = 0; k < span.count; ++k, ++raw) {
          const int64_t key = span.first_position + k;
          const bool some_row_sees = !s.causal || (key <= last && (s.window == 0 || key > first - s.window));
          if (raw >= std::get<0>(piece) && raw < std::get<1>(piece) && some_row_sees) walk.push_back(key);
        }
      KeyWalk grid{};
      grid.grid = item.grid;
      std::vector<Chunk> chunks;
      for (size_t i = 0, slot = kKeys; i < walk.size(); ++i, ++slot) {
        if (slot == kKeys) chunks.emplace_back(), slot = i ? 0 : size_t(grid.first_slot<kKeys>(walk[0]));
        chunks.back().push_back({walk[i], int(slot)});
      }
      for (int64_t row = first; row <= last; ++row) {
        for (const Chunk& chunk : chunks) {
          Chunk seen;
          for (const auto& key : chunk)
            if (sees(row, key.first)) seen.push_back(key);
          if (!seen.empty()) rows[row].push_back(seen);
        }
        rows[row].emplace_back();  // the piece's end: a row must be merged from the same pieces
      }
    }
  }
  return rows;
}

// A prompt's rows after its first `hit` tokens ran in an earlier pass (a prefix-cache hit, a
// chunk of a long prompt, a prefill continued, a commit), as a segment of their own over all
// its keys (those the sliding window keeps): each row must be walked as when the prompt ran
// whole (the same bits), in every kernel's chunks (16, 32 and 64 keys). Row groups lie at
// multiples of the rows a block takes (a power of two), the chunks on a grid of key
// positions from the whole group's first window, and (without a window) the pieces at key
// positions set by the group's position, so that holds at any hit.
void check_prefix_hit_plan(int heads, int kv_heads, int dim, int64_t length, int64_t hit, int64_t window) {
  const SegmentSpec whole = encoder(length, 0, window), rest = encoder(length - hit, hit, window);
  const Problem whole_problem = make_problem(heads, kv_heads, dim, {whole}, 1);
  const Problem rest_problem = make_problem(heads, kv_heads, dim, {rest}, 1);
  std::string error;
  int64_t differ = 0;
  auto compare = [&](auto keys) {
    constexpr int kKeys = decltype(keys)::value;
    const std::map<int64_t, RowPlan> a = row_plans<kKeys>(whole_problem, 132, error);
    const std::map<int64_t, RowPlan> b = row_plans<kKeys>(rest_problem, 132, error);
    for (int64_t pos = hit; pos < length; ++pos) differ += !a.count(pos) || !b.count(pos) || a.at(pos) != b.at(pos);
  };
  compare(std::integral_constant<int, 16>{});
  compare(std::integral_constant<int, 32>{});
  compare(std::integral_constant<int, 64>{});
  char name[160];
  std::snprintf(name, sizeof name, "plan d%d %d/%d heads: %ld rows after %ld in a pass before, window %ld (host)", dim,
                heads, kv_heads, long(length - hit), long(hit), long(window));
  report(error.empty() && !differ, name,
         !error.empty() ? error : differ ? std::to_string(differ) + " rows walked otherwise" : "walked as whole");
}

void host_checks() {
  for (int dim : {64, 256, 512, 24})
    for (const Case& c : cases()) {
      const Problem p = make_problem(16, 4, dim, c.segs, 1);
      for (int resident : {1, 132, 264})
        check_plan(p, resident, "d" + std::to_string(dim) + " " + c.name);
    }
  // Batch invariance of the plan: each segment's pieces, alone and among the others.
  for (int dim : {256, 512}) {
    const Problem p = make_problem(16, dim == 256 ? 8 : 2, dim, cases()[3].segs, 2);
    AttentionPlan batched_plan;
    const auto batched = check_plan(p, 132, "d" + std::to_string(dim) + " batch", &batched_plan);
    for (int s = 0; s < int(p.segs.size()); ++s) {
      const auto by = check_plan(alone(p, s), 132, "d" + std::to_string(dim) + " segment " + std::to_string(s) + " alone");
      bool same = true;
      for (const auto& [output, pieces] : by) {
        const auto it = batched.find({s, std::get<1>(output), std::get<2>(output)});
        same &= it != batched.end() && it->second == pieces;
      }
      report(same, "plan d" + std::to_string(dim) + " segment " + std::to_string(s) + " alone = batched (host)",
             same ? "same pieces" : "DIFFERENT pieces");
    }
  }
  // A prompt's rows after a pass before, walked as when it runs whole: GQA groups of 2, 4
  // and 3 (whose rows a block are no power of two), windows or none, the earlier pass's end
  // on a block's rows or not.
  for (const auto& [heads, kv_heads, window] : {std::tuple{16, 8, 100}, {16, 4, 100}, {16, 8, 0}, {6, 2, 0}, {6, 2, 100}})
    for (const auto& [length, hit] : {std::pair<int64_t, int64_t>{587, 576}, {300, 288}, {700, 16}, {700, 592}, {400, 37}, {260, 255}})
      check_prefix_hit_plan(heads, kv_heads, 64, length, hit, window);
  // Without a window a causal segment's keys are cut into pieces by each row group's
  // position: rows past 512 keys are merged from two to five pieces, whatever pass they run in.
  for (const auto& [heads, kv_heads, dim] : {std::tuple{16, 2, 512}, {16, 8, 256}, {6, 2, 64}})
    for (const auto& [length, hit] : {std::pair<int64_t, int64_t>{1300, 1024}, {1300, 1037}, {2100, 600}, {4500, 4130}})
      check_prefix_hit_plan(heads, kv_heads, dim, length, hit, 0);
  // bf16 keys (a bf16 cache's pages) only where the wgmma kernel runs: the plan of another
  // kernel refuses them by name (here head dim 64; on a machine without the wgmma kernel, any).
  {
    std::vector<AttentionSegment> segs = make_problem(16, 4, 64, cases()[0].segs, 1).segs;
    for (AttentionSegment& s : segs)
      for (KeySpan& span : s.spans) span.dtype = DType::BF16;
    std::string error;
    try {
      plan_attention(segs, 16, 4, 64, 132, true);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
    report(error.find("wgmma") != std::string::npos, "plan d64: bf16 keys refused (host)", error);
  }
  // How the 26B shapes are cut on an H200 (132 multiprocessors, one block each).
  for (int batch : {1, 4})
    for (int64_t context : {1024, 8192}) {
      std::vector<SegmentSpec> sliding(size_t(batch), decoder(256, context, 1024)), full(size_t(batch), decoder(256, context));
      AttentionPlan plan;
      check_plan(make_problem(16, 8, 256, sliding, 3), 132, "sliding b" + std::to_string(batch) + " ctx " + std::to_string(context), &plan);
      check_plan(make_problem(16, 2, 512, full, 3), 132, "full b" + std::to_string(batch) + " ctx " + std::to_string(context), &plan);
    }
}

// ---- on the GPU ---------------------------------------------------------------------------

// bf16_only: the checks with inputs rounded to bf16 alone (--check-bf16).
void correctness(bool bf16_only) {
  const int ratios[][2] = {{4, 4}, {8, 4}, {16, 4}, {16, 2}, {16, 1}};
  auto named = [](const char* round, int dim, int heads, int kv_heads, const std::string& what) {
    return std::string(round) + "d" + std::to_string(dim) + " " + std::to_string(heads) + "/" +
           std::to_string(kv_heads) + " " + what;
  };
  // First the checks that take least (no full host reference): the 26B shapes, sampled (a
  // sliding and a full layer of one request), and batch invariance.
  for (bool round_bf16 : {false, true}) {
    if (bf16_only && !round_bf16) continue;
    const std::string round = round_bf16 ? "bf16 " : "";
    const Problem sliding = make_problem(16, 8, 256, {decoder(256, 1024, 1024)}, 4);
    AttentionPlan plan;
    const std::vector<float> sliding_out = run(sliding, round_bf16, &plan);
    verify(sliding, sliding_out, round + "26B sliding 256 rows, 1279 keys (sampled)", plan, 300);
    const Problem full = make_problem(16, 2, 512, {decoder(256, 1024)}, 5);
    const std::vector<float> full_out = run(full, round_bf16, &plan);
    verify(full, full_out, round + "26B full 256 rows, 1280 keys (sampled)", plan, 300);
    if (round_bf16 && attention_wgmma_serves(256, true)) {
      report_bitwise(run(sliding, true, nullptr, true), sliding_out, "bf16 26B sliding: bf16 cache = fp32 cache");
      report_bitwise(run(full, true, nullptr, true), full_out, "bf16 26B full: bf16 cache = fp32 cache");
    }
  }
  // Batch invariance: each segment alone and among the others, bitwise; and a rerun.
  for (bool round_bf16 : {false, true})
    for (int dim : {64, 256, 512}) {
      if (bf16_only && !round_bf16) continue;
      const std::string name = std::string(round_bf16 ? "bf16 " : "") + "d" + std::to_string(dim);
      const Problem p = make_problem(16, dim == 512 ? 2 : 8, dim,
                                     {decoder(40, 3000, 0, 0), encoder(100, 500, 300), decoder(256, 1024, 1024)}, 6);
      const std::vector<float> batched = run(p, round_bf16), again = run(p, round_bf16);
      report_bitwise(batched, again, name + " rerun");
      if (round_bf16 && attention_wgmma_serves(dim, true)) {
        report_bitwise(run(p, true, nullptr, true), batched, name + " bf16 cache = fp32 cache");
        // The fp32 spans' rows rounded already: the plan reads them and converts nothing.
        for (bool bf16_cache : {false, true}) {
          AttentionPlan plan;
          const std::vector<float> out = run(p, true, &plan, bf16_cache, true);
          const std::string which = name + (bf16_cache ? " bf16 cache" : " fp32 cache") + ", rows rounded";
          report(plan.rounded_keys && plan.rounded_values && plan.packed_rows == 0, which + ": no pre-pass",
                 std::to_string(plan.packed_rows) + " rows converted");
          report_bitwise(out, batched, which + " = fp32 cache");
        }
      }
      const int64_t cols = int64_t(p.heads) * p.dim;
      for (int s = 0; s < int(p.segs.size()); ++s) {
        const std::vector<float> single = run(alone(p, s), round_bf16);
        const int64_t first = p.segs[size_t(s)].first_row * cols;
        report_bitwise(single,
                       std::vector<float>(batched.begin() + first, batched.begin() + first + int64_t(single.size())),
                       name + " segment " + std::to_string(s) + " alone = batched");
      }
    }
  // Every (row, head) against the reference. bf16 inputs: every ratio at head dims 512 and
  // 256 (on Hopper, attention_wgmma.cu's kernel), 16/2 at 64; before the fp32 checks.
  for (int dim : {512, 256, 64})
    for (const auto& [heads, kv_heads] : ratios)
      for (const Case& c : cases()) {
        if (dim == 64 && !(heads == 16 && kv_heads == 2)) continue;
        const Problem p = make_problem(heads, kv_heads, dim, c.segs, unsigned(dim + heads * 5 + kv_heads));
        AttentionPlan plan;
        const std::vector<float> out = run(p, true, &plan);
        verify(p, out, named("bf16 ", dim, heads, kv_heads, c.name), plan);
      }
  for (int dim : {64, 128, 256, 512})
    for (const auto& [heads, kv_heads] : ratios)
      for (const Case& c : cases()) {
        if (bf16_only) break;
        const Problem p = make_problem(heads, kv_heads, dim, c.segs, unsigned(dim + heads * 7 + kv_heads));
        AttentionPlan plan;
        const std::vector<float> out = run(p, false, &plan);
        verify(p, out, named("", dim, heads, kv_heads, c.name), plan);
      }
  for (int dim : {24, 80})  // the generic kernel
    for (const auto& [heads, kv_heads] : {std::pair{8, 2}, std::pair{4, 4}})
      for (const Case& c : cases())
        for (bool round_bf16 : {false, true}) {
          if (bf16_only && !round_bf16) continue;
          const Problem p = make_problem(heads, kv_heads, dim, c.segs, unsigned(dim + heads));
          AttentionPlan plan;
          const std::vector<float> out = run(p, round_bf16, &plan);
          verify(p, out, named(round_bf16 ? "bf16 " : "", dim, heads, kv_heads, c.name), plan);
        }
}

__global__ void random_fill_kernel(float* x, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = (uint32_t(i) ^ seed) * 2654435761u ^ uint32_t(i >> 32);
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    x[i] = float(h >> 8) / float(1 << 24) - 0.5f;
  }
}

__global__ void round_kernel(const float* x, int64_t n, __nv_bfloat16* y) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16(x[i]);
}

// Times attention() (the main kernel and the merge) for `batch` requests of a denoise pass:
// 256 canvas rows each over `context` cached keys (sliding layers: the last window - 1) in
// 16-key blocks scattered over a cache pool of about kPoolBytes (as a serving engine's: the
// pages' addresses far apart), plus the canvas's own keys.
// bf16_cache: the cache's pages in bf16 (the engine's with bf16 inputs on Hopper), the
// batch's own rows fp32, and (rounded_rows) rounded already beside them, as the engine's key
// and value norms write them (no pre-pass), and Q's rows too, as its query norms do.
void bench(const char* name, int heads, int kv_heads, int dim, int64_t window, int batch, int64_t context,
           bool round_bf16, bool bf16_cache = false, bool rounded_rows = false, bool commit = false) {
  constexpr int64_t kCanvas = 256, kPoolBytes = int64_t(4) << 30;
  const int64_t cached = window ? std::min(context, window - 1) : context, kv_cols = int64_t(kv_heads) * dim;
  const int64_t first_block = (context - cached) / 16, blocks_per_segment = (context + 15) / 16 - first_block;
  const int64_t pool_blocks = std::max(batch * blocks_per_segment, kPoolBytes / (16 * kv_cols * 4));
  const int64_t pool_rows = pool_blocks * 16 + batch * kCanvas;
  float *q, *out, *k, *v;
  check(cudaMalloc(&q, sizeof(float) * size_t(batch * kCanvas * heads * dim)), "q");
  check(cudaMalloc(&out, sizeof(float) * size_t(batch * kCanvas * heads * dim)), "out");
  check(cudaMalloc(&k, sizeof(float) * size_t(pool_rows * kv_cols)), "k");
  check(cudaMalloc(&v, sizeof(float) * size_t(pool_rows * kv_cols)), "v");
  random_fill_kernel<<<4096, 256>>>(q, batch * kCanvas * heads * dim, 1);
  random_fill_kernel<<<4096, 256>>>(k, pool_rows * kv_cols, 2);
  random_fill_kernel<<<4096, 256>>>(v, pool_rows * kv_cols, 3);
  __nv_bfloat16 *k16 = nullptr, *v16 = nullptr, *q16 = nullptr;
  if (rounded_rows) {
    check(cudaMalloc(&q16, sizeof(__nv_bfloat16) * size_t(batch * kCanvas * heads * dim)), "q16");
    round_kernel<<<4096, 256>>>(q, batch * kCanvas * heads * dim, q16);
  }
  if (bf16_cache) {
    check(cudaMalloc(&k16, sizeof(__nv_bfloat16) * size_t(pool_rows * kv_cols)), "k16");
    check(cudaMalloc(&v16, sizeof(__nv_bfloat16) * size_t(pool_rows * kv_cols)), "v16");
    round_kernel<<<4096, 256>>>(k, pool_rows * kv_cols, k16);
    round_kernel<<<4096, 256>>>(v, pool_rows * kv_cols, v16);
  }
  check(cudaDeviceSynchronize(), "fill");
  std::vector<int64_t> block_of(
      static_cast<size_t>(pool_blocks));  // cache blocks in shuffled order (the first ones used)
  std::iota(block_of.begin(), block_of.end(), 0);
  std::shuffle(block_of.begin(), block_of.end(), std::mt19937(7));
  std::vector<AttentionSegment> segs;
  for (int b = 0; b < batch; ++b) {
    AttentionSegment s{b * kCanvas, kCanvas, context, commit, window, {}};  // a commit: the block's rows, causal
    for (int64_t pos = context - cached; pos < context;) {
      const int64_t end = std::min(context, (pos / 16 + 1) * 16);
      const int64_t row = block_of[size_t(b * blocks_per_segment + pos / 16 - first_block)] * 16 + pos % 16;
      if (bf16_cache) s.spans.push_back({k16 + row * kv_cols, v16 + row * kv_cols, end - pos, pos, DType::BF16});
      else s.spans.push_back({k + row * kv_cols, v + row * kv_cols, end - pos, pos});
      pos = end;
    }
    const int64_t own = pool_blocks * 16 + b * kCanvas;
    s.spans.push_back({k + own * kv_cols, v + own * kv_cols, kCanvas, context});
    if (rounded_rows)
      s.spans.back().rounded_keys = k16 + own * kv_cols, s.spans.back().rounded_values = v16 + own * kv_cols;
    segs.push_back(s);
  }
  const int resident = attention_mma_resident_items(dim, round_bf16);
  const auto t0 = std::chrono::steady_clock::now();
  const AttentionPlan plan = plan_attention(segs, heads, kv_heads, dim, resident, round_bf16);
  const double plan_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  const AttentionTables tables{upload(plan.segments), upload(plan.spans), upload(plan.items), upload(plan.merges)};
  void* scratch = nullptr;
  check(cudaMalloc(&scratch, std::max<size_t>(plan.scratch_bytes(), 1)), "scratch");
  auto call = [&] { attention({q, q16}, {out, nullptr}, plan, tables, scratch, heads, kv_heads, nullptr); };
  const double us = time_ms(call) * 1e3, keys = double(cached + kCanvas);
  // Useful work (QK and PV, no masking here) and the K/V bytes (fp32) the items stream (each item its piece).
  const double flops = 4.0 * batch * kCanvas * heads * keys * dim;
  double streamed = 0;
  for (const AttentionItem& it : plan.items) {
    int64_t n = 0;
    for (int i = it.span; i <= it.last_span; ++i)
      n += (i == it.last_span ? it.last_end : plan.spans[size_t(i)].count) - (i == it.span ? it.key : 0);
    streamed += double(n) * dim * 8;
  }
  std::printf(
      "%-14s %-10s batch %2d context %6ld: %9.1f us  %6.1f TFLOP/s (useful)  %5.2f TB/s K/V streamed  %6zu "
      "items %5zu merges  plan %.0f us\n",
      name,
      !round_bf16    ? "fp32"
      : rounded_rows ? "bf16 rows"
      : bf16_cache   ? "bf16 cache"
                     : "bf16",
      batch, long(context), us, flops / (us * 1e-6) / 1e12, streamed / (us * 1e-6) / 1e12, plan.items.size(),
      plan.merges.size(), plan_us);
  cudaFree(q), cudaFree(out), cudaFree(k), cudaFree(v), cudaFree(q16), cudaFree(k16), cudaFree(v16), cudaFree(scratch);
  cudaFree(const_cast<DeviceAttentionSegment*>(tables.segments)), cudaFree(const_cast<DeviceKeySpan*>(tables.spans));
  cudaFree(const_cast<AttentionItem*>(tables.items)), cudaFree(const_cast<AttentionMerge*>(tables.merges));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  host_checks();
  if (mode == "--host") {
    std::printf("%s\n", failures ? "HOST CHECK FAILURES" : "all host checks passed");
    return failures ? 1 : 0;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device");
  std::printf("%s, %d SMs; resident items: d256 %d (rounded inputs %d%s), d512 %d (rounded inputs %d%s)\n", prop.name,
              prop.multiProcessorCount, attention_mma_resident_items(256, false),
              attention_mma_resident_items(256, true), attention_wgmma_serves(256, true) ? ", wgmma" : "",
              attention_mma_resident_items(512, false), attention_mma_resident_items(512, true),
              attention_wgmma_serves(512, true) ? ", wgmma" : "");
  if (mode != "--time" && mode != "--time-1k") {
    correctness(mode == "--check-bf16");
    std::printf("%s\n", failures ? "CORRECTNESS FAILURES" : "all correctness checks passed");
  }
  if (mode == "--check" || mode == "--check-bf16") return failures ? 1 : 0;

  // DiffusionGemma-26B, one layer call of a denoise pass: sliding layers (16 query heads,
  // 8 KV heads, head_dim 256, window 1024) and full-attention layers (16 / 2 / 512), at
  // batch 1, 4, 16 x context 1K, 8K, 32K, or the grid given after --time (BATCHxCONTEXT,...).
  std::vector<std::pair<int, int64_t>> grid;
  if (mode == "--time-1k") grid = {{1, 1024}};
  else if (mode == "--time" && argc > 2)
    for (char* item = std::strtok(argv[2], ","); item; item = std::strtok(nullptr, ","))
      grid.push_back({std::atoi(item), std::atoll(std::strchr(item, 'x') ? std::strchr(item, 'x') + 1 : "0")});
  else
    for (int batch : {1, 4, 16})
      for (int64_t context : {1024, 8192, 32768}) grid.push_back({batch, context});
  for (const auto& [batch, context] : grid) {
    for (bool round_bf16 : {false, true}) {
      bench("sliding", 16, 8, 256, 1024, batch, context, round_bf16);
      bench("full", 16, 2, 512, 0, batch, context, round_bf16);
    }
    if (attention_wgmma_serves(256, true)) {
      for (bool rounded_rows : {false, true}) {
        bench("sliding", 16, 8, 256, 1024, batch, context, true, true, rounded_rows);
        bench("full", 16, 2, 512, 0, batch, context, true, true, rounded_rows);
      }
      bench("sliding commit", 16, 8, 256, 1024, batch, context, true, true, true, true);
      bench("full commit", 16, 2, 512, 0, batch, context, true, true, true, true);
    }
  }
  return failures ? 1 : 0;
}
