// The CUDA backend: the Backend interface (cpp/src/backend.h) on one GPU. Activations are
// fp32 and weights bf16 in device memory, the linears' packed where the checkpoint is FP8
// (one scale per row) or NVFP4 (keeps_packed); the kernels are in gemm.cu, attention.cu and
// kernels.cu. Every op is queued on one stream. Small per-call tables (token ids, positions,
// KV slots, attention plans) are copied up with each call; the MoE's expert layout is
// planned on the device. A block's sampler state stays on the device, and a steady batch of
// denoise steps (Backend::repeat) is recorded once into a CUDA graph whose while node loops
// on the device until a block stops: no host round trip between steps.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend.h"
#include "diffuserve/errors.h"
#include "kernels.h"
#include "sampler.h"
#include "thread_pool.h"
#ifdef DIFFUSERVE_WITH_CUBLASLT
#include "cublaslt_gemm.h"
#endif

namespace diffuserve {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(status));
}

// `bytes` rounded up to a multiple of 256: the alignment of the pieces of one allocation.
size_t aligned_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Device allocations are recycled by size: a forward pass allocates the same shapes over
// and over, and cudaMalloc/cudaFree would synchronise the device each time.
class DevicePool : public std::enable_shared_from_this<DevicePool> {
 public:
  ~DevicePool() {
    for (auto& [bytes, ptrs] : free_)
      for (void* p : ptrs) cudaFree(p);
  }
  std::shared_ptr<void> get(size_t bytes) {
    bytes = std::max<size_t>(256, aligned_256(bytes));
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& ptrs = free_[bytes];
      if (!ptrs.empty()) p = ptrs.back(), ptrs.pop_back();
    }
    if (!p && cudaMalloc(&p, bytes) != cudaSuccess) {
      // The free lists keep every size ever used: give them back to the driver, then try
      // once more.
      cudaGetLastError();
      release_cached();
      if (cudaMalloc(&p, bytes) != cudaSuccess) {
        cudaGetLastError();
        throw InvalidArgument("out of GPU memory allocating " + std::to_string(bytes) + " bytes");
      }
    }
    std::weak_ptr<DevicePool> pool = weak_from_this();
    return std::shared_ptr<void>(p, [pool, bytes](void* q) {
      if (auto alive = pool.lock()) {
        std::lock_guard<std::mutex> lock(alive->mutex_);
        if (alive->deferring_) alive->deferred_.push_back({bytes, q});
        else alive->free_[bytes].push_back(q);
      } else {
        cudaFree(q);
      }
    });
  }

  // While one lives, blocks given back are not handed out again: two streams' work may be
  // in flight, and a block one of them frees may still be in use by the other until both
  // are joined. Made after the fork, destroyed after the join.
  class Deferral {
   public:
    explicit Deferral(DevicePool& pool) : pool_(pool) {
      std::lock_guard<std::mutex> lock(pool_.mutex_);
      ++pool_.deferring_;
    }
    ~Deferral() {
      std::lock_guard<std::mutex> lock(pool_.mutex_);
      if (--pool_.deferring_) return;
      for (const auto& [bytes, q] : pool_.deferred_) pool_.free_[bytes].push_back(q);
      pool_.deferred_.clear();
    }
    Deferral(const Deferral&) = delete;
    Deferral& operator=(const Deferral&) = delete;

   private:
    DevicePool& pool_;
  };

  // The blocks given back, back to the driver.
  void release_cached() {
    cudaDeviceSynchronize();  // no queued kernel may still use a block about to be freed
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [bytes, ptrs] : free_)
      for (void* q : ptrs) cudaFree(q);
    free_.clear();
    cudaGetLastError();
  }

 private:
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
  int deferring_ = 0;                                // live Deferrals
  std::vector<std::pair<size_t, void*>> deferred_;  // blocks given back under one (size, block)
};

// The memory a recorded repeat body owns (Backend::repeat): bump-allocated from chunks that
// no kernel uses outside the recording and that are kept from one recording to the next.
// Never the pool's: the body's kernels reuse the pool's blocks as scratch in every run, and
// bytes written once while recording (tables, token ids) must stay as written.
class RecordingArena {
 public:
  ~RecordingArena() {
    for (void* chunk : chunks_) cudaFree(chunk);
  }
  void* get(size_t bytes) {
    bytes = aligned_256(std::max<size_t>(bytes, 1));
    while (current_ < chunks_.size() && used_ + bytes > sizes_[current_]) ++current_, used_ = 0;
    if (current_ == chunks_.size()) {
      void* chunk = nullptr;
      const size_t size = std::max(bytes, kChunkBytes);
      if (cudaMalloc(&chunk, size) != cudaSuccess) {
        cudaGetLastError();
        throw InvalidArgument("out of GPU memory allocating " + std::to_string(size) + " bytes");
      }
      chunks_.push_back(chunk);
      sizes_.push_back(size);
      used_ = 0;
    }
    void* p = static_cast<uint8_t*>(chunks_[current_]) + used_;
    used_ += bytes;
    return p;
  }
  void reset() { current_ = 0, used_ = 0; }  // once nothing recorded is left to run

 private:
  static constexpr size_t kChunkBytes = size_t(4) << 20;
  std::vector<void*> chunks_;
  std::vector<size_t> sizes_;
  size_t current_ = 0, used_ = 0;
};

// DIFFUSERVE_PROFILE=1: every op synchronises and its time is added to a per-op total,
// printed when the backend goes away. For finding where a step's time goes.
class OpProfile {
 public:
  OpProfile() : enabled_(std::getenv("DIFFUSERVE_PROFILE") != nullptr) {}
  bool enabled() const { return enabled_; }
  ~OpProfile() {
    if (!enabled_) return;
    double total = 0;
    for (auto& [name, t] : totals_) total += t.first;
    std::fprintf(stderr, "diffuserve CUDA op profile (%.1f ms total):\n", total);
    for (auto& [name, t] : totals_)
      std::fprintf(stderr, "  %-14s %9.1f ms %7ld calls\n", name.c_str(), t.first, long(t.second));
  }
  struct Scope {
    OpProfile* profile;
    const char* name;
    std::chrono::steady_clock::time_point start;
    ~Scope() {
      if (!profile) return;
      cudaDeviceSynchronize();
      auto& t = profile->totals_[name];
      t.first += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      t.second += 1;
    }
  };
  Scope scope(const char* name) {
    if (!enabled_) return {nullptr, name, {}};
    cudaDeviceSynchronize();
    return {this, name, std::chrono::steady_clock::now()};
  }

 private:
  bool enabled_;
  std::map<std::string, std::pair<double, int64_t>> totals_;
};

class CudaBackend final : public Backend {
 public:
  // name: the device as the caller wrote it ("cuda", "cuda:1"), for the errors.
  CudaBackend(int device, const std::string& name) : device_(device), pool_(std::make_shared<DevicePool>()) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();
      throw InvalidArgument("device '" + name + "' is not available: no CUDA GPU was found");
    }
    if (device < 0 || device >= count)
      throw InvalidArgument("device '" + name + "' is not available: only " + std::to_string(count) + " GPU(s)");
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate");
    // The branch stream runs ahead of the main one where both have blocks waiting for a
    // multiprocessor: its short kernels fill the gaps of the main branch's long ones. That
    // holds for kernels launched from the host. A recorded graph (repeat, below) runs every
    // kernel at the priority of the stream it is launched into: there the dense MLP's
    // kernels wait until the experts' up product has placed its last blocks. Instantiated
    // with the kernels' own priorities (cudaGraphInstantiateFlagUseNodePriority), the MLP
    // ran at once, but the experts' products, whose blocks it displaced, lost more than the
    // layer's end gained (twenty-sixth session, H200, batch 1 / 4 / 16 at 1K, two runs each:
    // 17.7 / 39.1 / 127.1 and 17.6 / 39.3 / 126.7 ms a step, against 17.5 / 38.7 / 126.9 and
    // 17.5 / 39.1 / 127.2 without); nor did they gain with the MLP's branch joined before the
    // experts' products (17.3 / 36.9-37.0 / 118.7 against 17.3 / 36.8-36.9 / 118.4-118.5,
    // thirty-fourth session): graphs keep the launch stream's priority.
    int least = 0, greatest = 0;
    check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    check(cudaStreamCreateWithPriority(&branch_, cudaStreamNonBlocking, greatest), "cudaStreamCreate");
    check(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), "cudaEventCreate");
    for (cudaEvent_t& e : copied_up_) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    // DIFFUSERVE_CUDA_GRAPHS=0 runs repeat's steps one by one from the host (to compare);
    // the op profile synchronises around every op, which a recording cannot.
    graphs_ = !cuda::switched_off("DIFFUSERVE_CUDA_GRAPHS") && !profile_.enabled();
    // DIFFUSERVE_CUDA_BRANCHES=0 queues concurrently's branches one after the other (to compare).
    branches_ = !cuda::switched_off("DIFFUSERVE_CUDA_BRANCHES");
    // DIFFUSERVE_NORM_PRODUCT_INPUTS=0 leaves every product to convert its input itself (to compare).
    product_inputs_ = !cuda::switched_off("DIFFUSERVE_NORM_PRODUCT_INPUTS");
#ifdef DIFFUSERVE_WITH_CUBLASLT
    // DIFFUSERVE_CUBLASLT=0 keeps every product on gemm.cu (to compare the two).
    if (!cuda::switched_off("DIFFUSERVE_CUBLASLT")) cublaslt_ = std::make_unique<cuda::CublasLtGemm>();
#endif
  }

  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(join_);
    cudaEventDestroy(fork_);
    for (cudaEvent_t e : copied_up_) cudaEventDestroy(e);
    cudaStreamDestroy(branch_);
    cudaStreamDestroy(side_);
    cudaStreamDestroy(stream_);
  }

  Activation alloc(int64_t rows, int64_t cols) override {
    Activation a = alloc_output(rows, cols);
    check(cudaMemsetAsync(a.data, 0, size_t(std::max<int64_t>(a.size(), 1)) * sizeof(float), stream_),
          "cudaMemsetAsync");
    return a;
  }
  Activation alloc_output(int64_t rows, int64_t cols) override {
    bind();
    Activation a;
    a.rows = rows;
    a.cols = cols;
    a.storage = pool_->get(size_t(std::max<int64_t>(rows * cols, 1)) * sizeof(float));
    a.data = static_cast<float*>(a.storage.get());
    return a;
  }

  // An output matrix with its product input in the form `input` (none: without).
  Activation alloc_with_product_input(int64_t rows, int64_t cols, std::optional<cuda::GemmInput> input) {
    Activation a = alloc_output(rows, cols);
    if (!input || !product_inputs_) return a;
    auto storage = pool_->get(cuda::prepared_x_bytes(rows, cols, *input));
    const cuda::PreparedX layout = cuda::prepared_x(storage.get(), rows, cols, *input);
    a.product_input = {1 + int(*input), layout.rows, layout.row_bytes(), layout.scales, std::move(storage)};
    return a;
  }

  // The form every reader's product takes its input in, where a norm can write it
  // (preparable_input) and the readers agree: their pre-passes then find it written.
  Activation alloc_product_input(int64_t rows, int64_t cols, const std::vector<const Weight*>& readers) override {
    std::optional<cuda::GemmInput> input;
    for (const Weight* w : readers) {
      const std::optional<cuda::GemmInput> own = preparable_input(*w);
      if (!own || w->shape.back() != cols || (input && *own != *input)) return alloc_output(rows, cols);
      input = own;
    }
    return alloc_with_product_input(rows, cols, input);
  }
  // The soft embedding's product (linear_nt) takes the feedback rounded to bf16.
  Activation alloc_logits(int64_t rows, int64_t cols) override {
    return alloc_with_product_input(rows, cols, cuda::GemmInput::RoundBf16);
  }
  // The wgmma attention reads queries, keys and values as bf16 rows: the norms that make them
  // write those rows beside them, and the attention rounds (or its pre-pass converts) none.
  Activation alloc_attention_rows(int64_t rows, int64_t cols, int64_t head_dim, bool round_bf16) override {
    if (!cuda::attention_wgmma_serves(int(head_dim), round_bf16) ||
        cuda::gemm_padded_k(cols, cuda::GemmInput::RoundBf16) != cols)
      return alloc_output(rows, cols);
    return alloc_with_product_input(rows, cols, cuda::GemmInput::RoundBf16);
  }

  std::shared_ptr<void> alloc_bytes(size_t bytes) override {
    bind();
    if (recording_) return std::shared_ptr<void>(arena_.get(bytes), [](void*) {});  // written once, while recording
    return pool_->get(bytes);
  }
  void write_bytes(void* dst, const void* src, size_t bytes) override {
    bind();
    if (!bytes) return;
    if (recording_) {  // now, outside the recording, into the arena: the body reads them every run
      check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, side_), "write_bytes");
      check(cudaStreamSynchronize(side_), "write_bytes");
      return;
    }
    check(cudaMemcpyAsync(dst, stage(src, bytes), bytes, cudaMemcpyHostToDevice, stream_), "write_bytes");
  }
  void read_bytes(void* dst, const void* src, size_t bytes) override {
    bind();
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "read_bytes");
    check(cudaStreamSynchronize(stream_), "read_bytes");
  }
  void synchronize() override {
    bind();
    check(cudaStreamSynchronize(stream_), "synchronize");
  }

  // The attention's limits (query heads per KV head; the generic kernel's shared memory) and
  // the router's (experts), asked before the weights load.
  std::string unsupported(const ModelConfig& config, bool round_bf16) const override {
    bind();
    for (const LayerConfig& L : config.layers)
      if (std::string why = cuda::attention_unsupported(L.head_dim, config.num_heads / L.num_kv_heads, round_bf16);
          !why.empty())
        return why;
    if (config.num_experts > cuda::route_max_experts())
      return "the CUDA router takes at most " + std::to_string(cuda::route_max_experts()) +
             " experts; this model has " + std::to_string(config.num_experts);
    return "";
  }

  // bf16 where every layer's attention is the wgmma kernel's (the only one reading bf16 keys):
  // with activations "bfloat16", head dims 256 and 512, on Hopper.
  DType kv_cache_dtype(const ModelConfig& config, bool round_bf16) const override {
    bind();
    for (const LayerConfig& L : config.layers)
      if (!cuda::attention_wgmma_serves(L.head_dim, round_bf16)) return DType::F32;
    return DType::BF16;
  }

  int64_t default_kv_cache_bytes() override {  // most of what the weights left free
    return int64_t(double(free_memory_bytes()) * 0.8);
  }
  int64_t free_memory_bytes() override {  // the pool's cached blocks count: it gives them back first
    bind();
    pool_->release_cached();
    size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return int64_t(free);
  }
  int64_t memory_bytes() override {
    bind();
    size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return int64_t(total);
  }

  Weight upload(const void* host, DType dtype, const std::vector<int64_t>& shape, DType as,
                std::shared_ptr<const void>) override {
    bind();
    if (as != DType::F32 && as != DType::BF16)
      throw InvalidArgument(std::string("the CUDA backend keeps weights in bf16 (or fp32 for norms), not ") +
                            dtype_name(as));
    Weight w;
    w.dtype = as;
    w.shape = shape;
    auto storage = pool_->get(size_t(w.numel()) * dtype_size(as));
    copy_up(storage.get(), host, dtype, w.numel(), as);
    w.data = storage.get();
    w.storage = storage;
    return w;
  }

  // Expert stacks whose products take the wgmma tiles with operands alike (bf16, or E4M3 with
  // FP8 per-token inputs), [E, N, K] with N a multiple of 128 and rows of whole 128-byte
  // slices, are stored tiled, in place: each stage's 128 rows one contiguous 16 KB run
  // (gemm_tile.cuh), as the MoE's GEMM streams them best. A bf16 gate_up stack whose down
  // product takes its input as bf16 planes it may be handed (preparable_input) is also
  // paired (Weight::paired): its product then writes the activation itself, as the down
  // product takes it, where the down product's pre-pass had computed it from gate_up's fp32
  // outputs (one launch a layer fewer, and no fp32 outputs).
  void lay_out_experts(Weight& gate_up, Weight& down) override {
    const std::optional<cuda::GemmInput> down_input = preparable_input(down);
    lay_out(gate_up, gate_up.format == WeightFormat::Plain && !gate_up.row_scales && down_input &&
                         *down_input != cuda::GemmInput::Fp8Token);
    lay_out(down, false);
  }
  // One stack stored tiled, if its products take the wgmma tiles (`paired`: its rows paired,
  // tile_matrices). The rows pass through a buffer of their own, not the pool's (which would
  // keep it).
  void lay_out(Weight& w, bool paired) {
    bind();
    if (w.shape.size() != 3 || w.tiled) return;
    const int64_t row_bytes = cuda::weight_row_bytes(w.format, w.shape[2]);
    if (!cuda::gemm_has_wgmma_tile(gemm_input(w), w.format) || w.shape[1] % 128 || row_bytes % 128) return;
    const size_t bytes = size_t(w.shape[0] * w.shape[1] * row_bytes);
    void* rows = nullptr;
    if (cudaMalloc(&rows, bytes) != cudaSuccess) {  // no room for the copy: the stack stays as rows
      cudaGetLastError();
      return;
    }
    auto* values = static_cast<uint8_t*>(const_cast<void*>(w.data));
    check(cudaMemcpyAsync(rows, values, bytes, cudaMemcpyDeviceToDevice, stream_), "lay_out_experts");
    cuda::tile_matrices(static_cast<const uint8_t*>(rows), w.shape[0], w.shape[1], row_bytes, paired, values, stream_);
    check(cudaStreamSynchronize(stream_), "lay_out_experts");
    cudaFree(rows);
    w.tiled = true;
    w.paired = paired;
  }

  // Plain bf16 linears of one shape into one allocation, one after another, for cuBLASLt's
  // batched product (CublasLtGemm::multiply): at batch 1 a layer's K or V product alone
  // fills half the GPU.
  void place_together(const std::vector<Weight*>& ws) override {
    bind();
    for (const Weight* w : ws)
      if (w->format != WeightFormat::Plain || w->dtype != DType::BF16 || w->row_scales || w->tiled ||
          w->shape != ws.front()->shape)
        return;
    const size_t bytes = size_t(ws.front()->numel()) * dtype_size(DType::BF16);
    auto storage = pool_->get(bytes * ws.size());
    auto* base = static_cast<uint8_t*>(storage.get());
    for (size_t i = 0; i < ws.size(); ++i)
      check(cudaMemcpyAsync(base + i * bytes, ws[i]->data, bytes, cudaMemcpyDeviceToDevice, stream_), "place_together");
    check(cudaStreamSynchronize(stream_), "place_together");
    for (size_t i = 0; i < ws.size(); ++i) ws[i]->data = base + i * bytes, ws[i]->storage = storage;
    pool_->release_cached();  // the weights' old blocks: the KV cache's default size counts the memory free
  }

  // FP8 with one scale per output row (per channel, or per tensor repeated), and NVFP4's
  // 16-value groups, are what the GEMM dequantizes in its main loop.
  bool keeps_packed(const PackedWeight& w) const override {
    return w.format == WeightFormat::Fp8 ? w.group_size == w.cols() : w.group_size == 16;
  }

  Weight upload_packed(const PackedWeight& host) override {
    bind();
    if (!keeps_packed(host)) throw InvalidArgument("the CUDA backend does not keep this packed weight layout");
    if (host.format == WeightFormat::Nvfp4 && host.shape.size() == 2) return upload_decoded_nvfp4(host);
    Weight w;
    w.format = host.format;
    w.dtype = host.format == WeightFormat::Fp8 ? DType::F8_E4M3 : DType::U8;
    w.shape = host.shape;
    const std::vector<float>& row_scales = host.format == WeightFormat::Fp8 ? host.scales : host.global_scales;
    // One allocation: the values, the row scales, the group scales, each 256-byte aligned.
    const size_t values = aligned_256(host.values.size()), scales = aligned_256(row_scales.size() * sizeof(float));
    auto storage = pool_->get(values + scales + host.group_scales.size());
    auto* base = static_cast<uint8_t*>(storage.get());
    copy_up(base, host.values.data(), host.values.size());
    copy_up(base + values, row_scales.data(), row_scales.size() * sizeof(float));
    copy_up(base + values + scales, host.group_scales.data(), host.group_scales.size());
    if (host.format == WeightFormat::Nvfp4) {  // the layout the GEMM decodes (packed_decode.cuh)
      cuda::lay_out_nvfp4(base, base + values + scales, int64_t(host.group_scales.size()), stream_);
      check(cudaStreamSynchronize(stream_), "laying out an NVFP4 weight");
    }
    w.data = base;
    w.row_scales = reinterpret_cast<const float*>(base + values);
    w.group_scales = host.group_scales.empty() ? nullptr : base + values + scales;
    w.storage = storage;
    return w;
  }

  // A dense NVFP4 linear is decoded once, here, into a plain bf16 weight: the values times
  // their group scales (exact in bf16: packed_decode.cuh), with the reciprocal of each row's
  // global scale as its row factor (Weight::row_scales). At a canvas's rows these products
  // are bound by latency, not by the weights' bytes, and cuBLASLt's kernels run them several
  // times faster than gemm.cu's decoding main loop (README, "Quantized checkpoints"), for
  // 3.5x the memory of the packed bytes. Expert stacks stay packed: their products stream
  // the 4-bit bytes.
  // The packed bytes pass through a buffer of their own, not the pool's (which would keep it).
  Weight upload_decoded_nvfp4(const PackedWeight& host) {
    const int64_t rows = host.rows(), cols = host.cols();
    const size_t values = aligned_256(size_t(rows * cols) * 2);
    auto storage = pool_->get(values + size_t(rows) * sizeof(float));
    auto* base = static_cast<uint8_t*>(storage.get());
    std::vector<float> factors(host.global_scales.size());
    for (size_t r = 0; r < factors.size(); ++r) factors[r] = 1.0f / host.global_scales[r];
    copy_up(base + values, factors.data(), factors.size() * sizeof(float));
    // A linear's rows share its global scale; gate and up stacked are two runs.
    int64_t run = 1;
    while (run < rows && factors[run] == factors[0]) ++run;
    for (int64_t r = 0; r < rows && run; ++r)
      if (rows % run || factors[r] != factors[r / run * run]) run = 0;
    const size_t packed_bytes = aligned_256(host.values.size());
    void* buffer = nullptr;
    if (cudaMalloc(&buffer, packed_bytes + host.group_scales.size()) != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error("out of GPU memory decoding an NVFP4 weight");
    }
    const std::unique_ptr<void, cudaError_t (*)(void*)> freed(buffer, cudaFree);
    auto* packed = static_cast<uint8_t*>(buffer);
    copy_up(packed, host.values.data(), host.values.size());
    copy_up(packed + packed_bytes, host.group_scales.data(), host.group_scales.size());
    cuda::decode_nvfp4(packed, packed + packed_bytes, rows, cols, reinterpret_cast<__nv_bfloat16*>(base), stream_);
    check(cudaStreamSynchronize(stream_), "decoding an NVFP4 weight");
    Weight w;
    w.dtype = DType::BF16;
    w.shape = host.shape;
    w.data = base;
    w.row_scales = reinterpret_cast<const float*>(base + values);
    w.factor_rows = run;
    w.storage = storage;
    return w;
  }

  Weight random_weight(const std::vector<int64_t>& shape, DType as, uint64_t seed, float scale) override {
    bind();
    Weight w;
    w.dtype = DType::BF16;
    w.shape = shape;
    if (as == DType::F32) {  // small weights: drawn on the host
      std::vector<float> host(w.numel());
      random_weight_values(seed, 0, host.size(), scale, host.data());
      return upload(host.data(), DType::F32, shape, DType::F32, nullptr);
    }
    auto storage = pool_->get(size_t(w.numel()) * 2);
    cuda::random_bf16(static_cast<__nv_bfloat16*>(storage.get()), w.numel(), seed, scale, stream_);
    w.data = storage.get();
    w.storage = storage;
    return w;
  }

  void to_host(const Activation& a, float* out) override { read_bytes(out, a.data, a.size() * sizeof(float)); }
  void from_host(const float* in, Activation& a) override { copy_up(a.data, in, a.size() * sizeof(float)); }
  void copy_rows(const Activation& src, int64_t src_row, Activation& dst, int64_t dst_row, int64_t n) override {
    auto timed = op("copy_rows");
    check(cudaMemcpyAsync(dst.row(dst_row), src.row(src_row), n * src.cols * sizeof(float), cudaMemcpyDeviceToDevice,
                          stream_),
          "copy_rows");
    const ProductInput &from = src.product_input, &to = dst.product_input;
    if (from.kind && from.kind == to.kind && from.row_bytes == to.row_bytes) {
      check(cudaMemcpyAsync(to.data + dst_row * to.row_bytes, from.data + src_row * from.row_bytes, n * from.row_bytes,
                            cudaMemcpyDeviceToDevice, stream_),
            "copy_rows");
      if (from.row_scales)
        check(cudaMemcpyAsync(to.row_scales + dst_row, from.row_scales + src_row, n * sizeof(float),
                              cudaMemcpyDeviceToDevice, stream_),
              "copy_rows");
    }
  }
  void scatter_rows(const Activation& src, const std::vector<int64_t>& dst_rows, KvRows& dst) override {
    auto timed = op("scatter_rows");
    const int64_t* rows = upload_table(dst_rows);
    if (dst.dtype == DType::BF16)
      cuda::scatter_rows(src.data, src.cols, rows, int64_t(dst_rows.size()), static_cast<__nv_bfloat16*>(dst.data),
                         stream_);
    else cuda::scatter_rows(src.data, src.cols, rows, int64_t(dst_rows.size()), static_cast<float*>(dst.data), stream_);
  }

  void embed(const Weight& table, const int32_t* ids, float scale, Activation& out) override {
    auto timed = op("embed");
    cuda::embed(bf16(table), table.shape[1], ids, out.rows, scale, out.data, stream_);
  }

  void linear(const Activation& x, const Weight& w, Activation& y, int expert) override {
    auto timed = op("linear");
    const cuda::ExpertStack stack = matrices(w);
    gemm_dense(x, stack.expert(std::max(expert, 0)), w.format, stack.n, stack.k, cuda::GemmInput::Split, y);
  }

  // One product over the weights, each on all of x's rows, where their inputs are all taken
  // alike inside it (gemm_input: plain, rounded to bf16, or FP8 per token, each quantized by
  // the pre-pass alone): on cuBLASLt, or one gemm.cu launch with a segment a weight (its
  // segments need 16-byte aligned matrices, as allocations give them).
  void linears(const Activation& x, const std::vector<const Weight*>& ws, Activation& y,
               int64_t encoder_rows) override {
    const cuda::GemmInput input = gemm_input(*ws.front());
    for (const Weight* w : ws)
      if (reinterpret_cast<uintptr_t>(w->data) % 16 || gemm_input(*w) != input ||
          (input == cuda::GemmInput::Split && w->input_quant.scheme != ActivationScheme::None))
        return Backend::linears(x, ws, y, encoder_rows);
    auto timed = op("linear");
    const cuda::ExpertStack first = matrices(*ws.front());
    std::vector<cuda::GemmMatrix> weights;
    std::vector<float*> outputs;
    for (size_t i = 0; i < ws.size(); ++i) {
      const Weight& w = *ws[i];
      if (w.shape != ws.front()->shape || w.format != ws.front()->format || w.dtype != ws.front()->dtype)
        throw InvalidArgument("linears: the weights differ in shape, format or dtype");
      weights.push_back(matrices(w).expert(0));
      outputs.push_back(y.data + int64_t(i) * x.rows * y.cols);
    }
    auto scratch = pool_->get(cuda::gemm_scratch_bytes(x.rows, first.n, first.k, input));
    // cuBLASLt's plan depends on each output's alignment: with rows of a multiple of 4
    // floats every block of y is 16-byte aligned, whatever x.rows (batch invariance).
    const cuda::PreparedX x_prepared = prepared(x, input, first.format);
    if (y.cols % 4 == 0 && products_on_cublaslt(x, false, x_prepared, weights, first.format, first.n, first.k, input,
                                                outputs, y.cols, scratch.get()))
      return;
    const int tile = cuda::gemm_tile_rows(x.rows, int64_t(ws.size()), first.n, input, first.format);
    std::vector<cuda::GemmSegment> segments(ws.size());
    std::vector<cuda::GemmTile> tiles;
    for (size_t i = 0; i < ws.size(); ++i) {
      segments[i].x_row = 0;
      segments[i].y_row = int64_t(i) * x.rows;
      segments[i].rows = int(x.rows);
      segments[i].w = weights[i];
      for (int64_t m0 = 0; m0 < x.rows; m0 += tile) tiles.push_back({int(i), int(m0)});
    }
    cuda::gemm(x.data, x.rows, x.cols, false, nullptr, upload_table(segments), upload_table(tiles), int(tiles.size()),
               tile, ws.front()->format, weights.front().tiled, first.n, first.k, input, y.data, nullptr, y.cols, x_prepared,
               {}, scratch.get(), stream_);
  }

  void quantized_linear(const Activation& x, const Weight& w, Activation& y, int64_t encoder_rows) override {
    const cuda::GemmInput input = gemm_input(w);
    if (input == cuda::GemmInput::Split) return Backend::quantized_linear(x, w, y, encoder_rows);
    auto timed = op("linear");
    const cuda::ExpertStack stack = matrices(w);
    gemm_dense(x, stack.expert(0), w.format, stack.n, stack.k, input, y);
  }

  // The activation in the product's pre-pass, where it can be (gated_input).
  void gelu_glu_linear(const Activation& x, const Weight& w, Activation& y, int64_t encoder_rows) override {
    if (!gated_input(w)) return Backend::gelu_glu_linear(x, w, y, encoder_rows);
    auto timed = op("linear");
    const cuda::ExpertStack stack = matrices(w);
    gemm_dense(x, stack.expert(0), w.format, stack.n, stack.k, gemm_input(w), y, /*gated=*/true);
  }

  // y = round_bf16(x) @ w with w [K, N] (the reference casts the probabilities to the
  // weight dtype first; the GEMM rounds X itself). The product runs on a transposed copy
  // of w ([N, K], made once per weight), which the GEMM reads along K like every other
  // weight.
  void linear_nt(const Activation& x, const Weight& w, Activation& y) override {
    auto timed = op("linear_nt");
    const int64_t k = w.shape[0], n = w.shape[1];
    auto& t = transposed_[w.data];
    if (!t) {  // once; while recording, now on the side (not in every run of the body), into
               // memory of its own (a pool block may be one of the body's scratch)
      if (recording_) {
        void* fresh = nullptr;
        check(cudaMalloc(&fresh, size_t(k * n) * 2), "linear_nt");
        t = std::shared_ptr<void>(fresh, cudaFree);
      } else {
        t = pool_->get(size_t(k * n) * 2);
      }
      cuda::transpose_bf16(bf16(w), k, n, static_cast<__nv_bfloat16*>(t.get()), recording_ ? side_ : stream_);
      if (recording_) check(cudaStreamSynchronize(side_), "linear_nt");
    }
    gemm_dense(x, {t.get(), nullptr, nullptr}, WeightFormat::Plain, n, k, cuda::GemmInput::RoundBf16, y);
  }

  void rms_norm(const Activation& x, const Weight* weight, int64_t group, float eps, Activation& y) override {
    auto timed = op("rms_norm");
    if (y.product_input.kind && group != y.cols) throw InvalidArgument("rms_norm: a product input takes whole rows");
    cuda::rms_norms(x.data, written({weight}, {&y}), {}, {}, x.size() / group, group, eps, stream_);
  }
  void rms_norms(const Activation& x, const std::vector<const Weight*>& weights, float eps,
                 const std::vector<Activation*>& outputs) override {
    auto timed = op("rms_norm");
    for (size_t first = 0; first < weights.size(); first += cuda::kMaxNormOutputs) {  // full launches, then the rest
      const size_t last = std::min(weights.size(), first + cuda::kMaxNormOutputs);
      const std::vector<const Weight*> part_weights(weights.begin() + first, weights.begin() + last);
      const std::vector<Activation*> part_outputs(outputs.begin() + first, outputs.begin() + last);
      cuda::rms_norms(x.data, written(part_weights, part_outputs), {}, {}, x.rows, x.cols, eps, stream_);
    }
  }
  void add_rms_norm(const Activation& x, const Weight* weight, float eps, Activation& y, float scale) override {
    auto timed = op("add_rms_norm");
    cuda::rms_norms(x.data, added(weight, y, scale), {}, {}, x.rows, x.cols, eps, stream_);
  }
  void add_rms_norm_then_norms(const Activation& x, const Weight* weight, float eps, Activation& y,
                               const std::vector<const Weight*>& weights,
                               const std::vector<Activation*>& outputs) override {
    if (weights.size() > size_t(cuda::kMaxNormOutputs))
      return Backend::add_rms_norm_then_norms(x, weight, eps, y, weights, outputs);
    auto timed = op("add_rms_norm");
    cuda::rms_norms(x.data, added(weight, y, 1.0f), written(weights, outputs), {}, x.rows, x.cols, eps, stream_);
  }
  void add_rms_norm_twice(const Activation& x, const Weight* x_weight, Activation& y, const Weight* y_first_weight,
                          const Weight* y_weight, float eps, Activation& h, float scale, const Weight* next_weight,
                          Activation* next) override {
    norms_twice(x.data, {}, x_weight, y, y_first_weight, y_weight, eps, h, scale, next_weight, next);
  }

  void add_experts_rms_norm_twice(const ExpertOutput& x, const Weight* x_weight, Activation& y,
                                  const Weight* y_first_weight, const Weight* y_weight, float eps, Activation& h,
                                  float scale, const Weight* next_weight, Activation* next) override {
    const int64_t tokens = x.tokens(), hidden = y.cols;
    if (!x.top_k || !cuda::rms_norms_take_sums(hidden)) {
      Activation summed = x.summed;
      if (x.top_k) sum_experts(x, summed = alloc_output(tokens, hidden));
      return add_rms_norm_twice(summed, x_weight, y, y_first_weight, y_weight, eps, h, scale, next_weight, next);
    }
    norms_twice(nullptr, expert_sums(x), x_weight, y, y_first_weight, y_weight, eps, h, scale, next_weight, next);
  }
  // add_rms_norm_twice's pass over x's rows, or over the sums of `sums` (x null). Rows the
  // row kernel takes norm y's old values in the same pass; others in a pass before.
  void norms_twice(const float* x, const cuda::ExpertSums& sums, const Weight* x_weight, Activation& y,
                   const Weight* y_first_weight, const Weight* y_weight, float eps, Activation& h, float scale,
                   const Weight* next_weight, Activation* next) {
    cuda::NormOutputs first = added(x_weight, y, 1.0f);
    if (cuda::rms_norms_take_sums(y.cols)) {
      first.norm_old = true;
      first.old_weight = y_first_weight ? static_cast<const float*>(y_first_weight->data) : nullptr;
    } else {
      rms_norm(y, y_first_weight, y.cols, eps, y);
    }
    auto timed = op("add_rms_norm");
    cuda::rms_norms(x, first, added(y_weight, h, scale),
                    next ? written({next_weight}, {next}) : cuda::NormOutputs{}, y.rows, y.cols, eps, stream_, sums);
  }

  void rms_norm_rope(Activation& x, const Weight& weight, int64_t head_dim, float eps, const Weight& inv_freq,
                     const std::vector<int64_t>& positions) override {
    auto timed = op("rms_norm_rope");
    const int64_t* at = upload_table(positions);
    cuda::rms_norm_rope({{heads(x, 0, x, weight, head_dim, at)}, 1}, head_dim, eps,
                        static_cast<const float*>(inv_freq.data), stream_);
  }
  void key_value_norms(Activation& kv, const Weight& k_weight, int64_t head_dim, float eps, const Weight& inv_freq,
                       const std::vector<int64_t>& positions) override {
    auto timed = op("rms_norm_rope");
    const int64_t n = kv.rows / 2;
    Activation k = kv.view(0, n), v = kv.view(n, n);
    const int64_t* at = upload_table(positions);
    cuda::rms_norm_rope({{heads(k, 0, k, k_weight, head_dim, at), heads(v, 0, v, {}, head_dim, nullptr)}, 2}, head_dim,
                        eps, static_cast<const float*>(inv_freq.data), stream_);
  }
  void split_qkv_norms(const Activation& qkv, int64_t q_first, const Weight& q_weight, const Weight& k_weight,
                       int64_t head_dim, float eps, const Weight& inv_freq, const std::vector<int64_t>& positions,
                       Activation& q, Activation& kv) override {
    auto timed = op("rms_norm_rope");
    const int64_t n = qkv.rows, v_col = qkv_value_column(qkv, q_first, q, kv);
    Activation k = kv.view(0, n), v = kv.view(n, n);
    const int64_t* at = upload_table(positions);
    cuda::rms_norm_rope({{heads(qkv.view(q_first, q.rows), 0, q, q_weight, head_dim, at + q_first),
                          heads(qkv, q.cols, k, k_weight, head_dim, at), heads(qkv, v_col, v, {}, head_dim, nullptr)},
                         3},
                        head_dim, eps, static_cast<const float*>(inv_freq.data), stream_);
  }

  // rms_norm_rope's part for dst's heads, read from src's columns from `col` on (weight empty:
  // the unscaled norm), also rounded into dst's bf16 rows where it keeps them (alloc_attention_rows).
  static cuda::HeadNorms heads(const Activation& src, int64_t col, const Activation& dst, const Weight& weight,
                               int64_t head_dim, const int64_t* positions) {
    cuda::HeadNorms part{
        src.data + col, src.cols, dst.data, dst.rows, dst.cols / head_dim, static_cast<const float*>(weight.data),
        positions};
    part.rounded = rounded_rows(dst);
    return part;
  }

  void attention(const Activation& q, const std::vector<AttentionSegment>& segments, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, Activation& out, bool round_bf16) override {
    auto timed = op("attention");
    // The kernel's occupancy on this device, asked once per kind (a few driver calls, which
    // every eager pass's every layer had made).
    int& resident_items = attention_resident_items_[{head_dim, round_bf16}];
    if (!resident_items) resident_items = cuda::attention_mma_resident_items(int(head_dim), round_bf16);
    const cuda::AttentionPlan plan =
        cuda::plan_attention(segments, int(num_heads), int(num_kv_heads), int(head_dim), resident_items, round_bf16);
    if (plan.items.empty()) return;
    const cuda::AttentionTables tables{upload_table(plan.segments), upload_table(plan.spans), upload_table(plan.items),
                                       upload_table(plan.merges)};
    auto scratch = pool_->get(plan.scratch_bytes());
    // out's product input (alloc_product_input): the kernels write it beside the values
    // where it is bf16-rounded rows with nothing padded; any other form a pass after them.
    __nv_bfloat16* const rounded = rounded_rows(out);
    cuda::attention({q.data, rounded_rows(q)}, {out.data, rounded}, plan, tables, scratch.get(), int(num_heads),
                    int(num_kv_heads), stream_);
    if (!rounded) write_product_input(out);
  }

  void gelu_glu(const Activation& x, Activation& out) override {
    auto timed = op("gelu_glu");
    cuda::gelu_glu(x.data, x.rows, x.cols / 2, out.data, stream_);
  }

  // The router in one launch (cuda::route): scores fp32-like, as the reference ranks
  // near-tied experts, times hidden^-0.5, then softmax and top k.
  Routing route(const Activation& normed, const Weight& proj, const Weight& per_expert_scale, int top_k) override {
    auto timed = op("route");
    const int64_t tokens = normed.rows, experts = proj.shape[0];
    Routing r;
    r.top_k = top_k;
    r.experts = std::static_pointer_cast<int32_t>(pool_->get(size_t(tokens) * top_k * sizeof(int32_t)));
    r.weights = alloc_output(tokens, top_k);
    cuda::route(normed.data, tokens, normed.cols, bf16(proj), int(experts), std::pow(float(normed.cols), -0.5f), top_k,
                static_cast<const float*>(per_expert_scale.data), r.experts.get(), r.weights.data, stream_);
    return r;
  }

  // The expert layout is planned on the device from the routing, so nothing here waits
  // for the GPU: tiles are launched for the most the plan can need, the unused ones exit.
  // The sum of each token's experts' rows is left to the norm pass that reads them
  // (add_experts_rms_norm_twice): a launch fewer a layer on the step's chain of kernels.
  ExpertOutput experts_unsummed(const Activation& x, const Routing& routing, const Weight& gate_up,
                                const Weight& down) override {
    auto timed = op("experts");
    const int64_t num_experts = gate_up.shape[0], inter2 = gate_up.shape[1], hidden = x.cols;
    const int64_t pairs = routing.weights.size();
    const int64_t segments = std::max<int64_t>(1, std::min(num_experts, pairs));
    const cuda::GemmInput up_input = gemm_input(gate_up), down_input = gemm_input(down);
    // One tile plan serves both products; where their kinds would take different heights,
    // 64 rows, which every kind has.
    const int64_t rows_per_expert = pairs / segments, n = std::min(inter2, hidden);
    const int up_tile = cuda::gemm_tile_rows(rows_per_expert, segments, n, up_input, gate_up.format, true);
    const int tile_rows =
        up_tile == cuda::gemm_tile_rows(rows_per_expert, segments, n, down_input, down.format, true) ? up_tile : 64;
    const int max_tiles = int((pairs + tile_rows - 1) / tile_rows + num_experts);
    auto row_map = pool_->get(sizeof(int64_t) * size_t(pairs)), inverse = pool_->get(sizeof(int64_t) * size_t(pairs));
    auto up_segments = pool_->get(sizeof(cuda::GemmSegment) * size_t(num_experts));
    auto down_segments = pool_->get(sizeof(cuda::GemmSegment) * size_t(num_experts));
    auto tiles = pool_->get(sizeof(cuda::GemmTile) * size_t(max_tiles));
    auto* device_tiles = static_cast<cuda::GemmTile*>(tiles.get());
    cuda::moe_plan(routing.experts.get(), pairs, routing.top_k, int(num_experts), tile_rows, matrices(gate_up),
                   matrices(down), static_cast<int64_t*>(row_map.get()), static_cast<int64_t*>(inverse.get()),
                   static_cast<cuda::GemmSegment*>(up_segments.get()),
                   static_cast<cuda::GemmSegment*>(down_segments.get()), device_tiles, max_tiles, stream_);
    // With bf16 activations (bf16 inputs) the down product writes its rows as bf16, as the
    // reference in bf16 has each expert's output: half the bytes written and read back.
    const bool rows_bf16 = down_input == cuda::GemmInput::RoundBf16;
    std::shared_ptr<void> y_bf16 = rows_bf16 ? pool_->get(sizeof(__nv_bfloat16) * size_t(pairs * hidden)) : nullptr;
    Activation y = rows_bf16 ? Activation{nullptr, pairs, hidden} : alloc_output(pairs, hidden);
    // Quantized inputs. FP8 per token: the scales are per token, so the token rows are
    // quantized once for all experts, by the GEMM itself or beforehand on a copy. NVFP4:
    // each expert has its own global scales, so each (token, expert) pair gets a row of its
    // own, in the plan's order (the GEMM then gathers nothing).
    const auto* plan_rows = static_cast<const int64_t*>(row_map.get());
    const auto* plan_segments = static_cast<const cuda::GemmSegment*>(up_segments.get());
    auto quantize_nvfp4_rows = [&](const Activation& in, bool gather, const ActivationQuant& quant, Activation& to) {
      cuda::quantize_nvfp4_expert_rows(in.data, gather, plan_rows, plan_segments, int(num_experts), to.rows, to.cols,
                                       routing.encoder_tokens, upload_table(quant.encoder_global_scale),
                                       upload_table(quant.decoder_global_scale), to.data, stream_);
    };
    Activation input = x;
    const int64_t* up_rows = plan_rows;
    if (gate_up.input_quant.scheme == ActivationScheme::Nvfp4) {
      input = alloc_output(pairs, hidden);
      quantize_nvfp4_rows(x, true, gate_up.input_quant, input);
      up_rows = nullptr;
    } else if (gate_up.input_quant.scheme != ActivationScheme::None && up_input == cuda::GemmInput::Split) {
      input = alloc_output(x.rows, x.cols);
      copy_rows(x, 0, input, 0, x.rows);
      quantize_input(input, gate_up.input_quant, routing.encoder_tokens, -1);
    }
    auto up_scratch = pool_->get(cuda::gemm_scratch_bytes(input.rows, inter2, hidden, up_input));
    auto up_product = [&](float* y_up, const cuda::PreparedX& act) {
      cuda::gemm(input.data, input.rows, input.cols, false, up_rows,
                 static_cast<const cuda::GemmSegment*>(up_segments.get()), device_tiles, max_tiles, tile_rows,
                 gate_up.format, gate_up.tiled, inter2, hidden, up_input, y_up, nullptr, inter2,
                 prepared(input, up_input, gate_up.format), act, up_scratch.get(), stream_);
    };
    auto down_scratch = pool_->get(cuda::gemm_scratch_bytes(pairs, hidden, inter2 / 2, down_input));
    auto down_product = [&](const float* x_down, bool gated, const cuda::PreparedX& x_prepared) {
      cuda::gemm(x_down, pairs, gated ? inter2 : inter2 / 2, gated, nullptr,
                 static_cast<const cuda::GemmSegment*>(down_segments.get()), device_tiles, max_tiles, tile_rows,
                 down.format, down.tiled, hidden, inter2 / 2, down_input, y.data,
                 static_cast<__nv_bfloat16*>(y_bf16.get()), y.cols, x_prepared, {}, down_scratch.get(), stream_);
    };
    if (gate_up.paired) {  // the up product writes the activation as the down product takes it
      auto act = pool_->get(cuda::prepared_x_bytes(pairs, inter2 / 2, down_input));
      const cuda::PreparedX act_rows = cuda::prepared_x(act.get(), pairs, inter2 / 2, down_input);
      up_product(nullptr, act_rows);
      down_product(nullptr, false, act_rows);
    } else {
      Activation gu = alloc_output(pairs, inter2);
      up_product(gu.data, {});
      // The activation: in the down product's pre-pass where it can be (gated_input).
      const bool gated = gated_input(down);
      Activation act = gu;
      if (!gated) {
        act = alloc_output(pairs, inter2 / 2);
        cuda::gelu_glu(gu.data, pairs, inter2 / 2, act.data, stream_);
        if (down.input_quant.scheme == ActivationScheme::Nvfp4) quantize_nvfp4_rows(act, false, down.input_quant, act);
        else if (down_input == cuda::GemmInput::Split) quantize_input(act, down.input_quant, 0, -1);
      }
      down_product(act.data, gated, {});
    }
    return {{}, y, {inverse, static_cast<const int64_t*>(inverse.get())}, routing.weights, routing.top_k, y_bf16};
  }
  void experts(const Activation& x, const Routing& routing, const Weight& gate_up, const Weight& down,
               Activation& out) override {
    sum_experts(experts_unsummed(x, routing, gate_up, down), out);
  }
  // out = the weighted sums of an unsummed experts' output.
  void sum_experts(const ExpertOutput& e, Activation& out) {
    const cuda::ExpertSums sums = expert_sums(e);
    cuda::combine_experts(sums.y, sums.y_bf16, sums.inverse, sums.weights, e.weights.rows, e.top_k, e.rows.cols,
                          out.data, stream_);
  }
  static cuda::ExpertSums expert_sums(const ExpertOutput& e) {
    return {e.rows.data, static_cast<const __nv_bfloat16*>(e.rows_bf16.get()), e.pair_rows.get(), e.weights.data,
            e.top_k};
  }

  void add(const Activation& a, const Activation& b, Activation& y) override {
    auto timed = op("add");
    cuda::add(a.data, b.data, y.data, a.size(), stream_);
  }
  void scale(Activation& x, float s) override {
    auto timed = op("scale");
    cuda::scale(x.data, s, x.size(), stream_);
  }
  void softcap(Activation& x, float cap) override {
    auto timed = op("softcap");
    cuda::softcap(x.data, cap, x.size(), stream_);
  }
  void softmax(Activation& x) override {
    auto timed = op("softmax");
    cuda::softmax_rows(x.data, x.rows, x.cols, stream_);
  }

  void quantize_input(Activation& x, const ActivationQuant& quant, int64_t encoder_rows, int expert) override {
    auto timed = op("quantize_input");
    const bool nvfp4 = quant.scheme == ActivationScheme::Nvfp4;
    cuda::quantize_input(x.data, x.rows, x.cols, quant.scheme, encoder_rows,
                         nvfp4 ? quant.global_scale(true, expert) : 0.0f,
                         nvfp4 ? quant.global_scale(false, expert) : 0.0f, stream_);
  }

  std::vector<RowSample> sample(Activation& logits, float cap, float temperature, const float* bias,
                                const RandomKey& key, DType feedback_dtype, bool softmax_feedback) override {
    auto timed = op("sample");
    auto out = pool_->get(size_t(logits.rows) * sizeof(cuda::DeviceRowSample));
    auto* device_out = static_cast<cuda::DeviceRowSample*>(out.get());
    sample_rows(logits, cap, temperature, bias, key, {}, feedback_dtype == DType::BF16, softmax_feedback,
                device_out);
    std::vector<cuda::DeviceRowSample> host(logits.rows);
    read_bytes(host.data(), device_out, host.size() * sizeof(host[0]));
    std::vector<RowSample> rows(logits.rows);
    for (size_t i = 0; i < host.size(); ++i) rows[i] = {host[i].argmax, host[i].candidate, host[i].entropy};
    return rows;
  }

  // The sampler's row pass at the step the block's counter says, then its update, both on
  // the device.
  void denoise_step(Activation& logits, CanvasState& canvas) override {
    auto timed = op("denoise_step");
    const CanvasParams& p = canvas.params;
    auto rows = pool_->get(size_t(logits.rows) * sizeof(cuda::DeviceRowSample));
    auto* device_rows = static_cast<cuda::DeviceRowSample*>(rows.get());
    const cuda::DeviceSchedule schedule{canvas.counters, p.t_min, p.t_max, p.max_steps};
    sample_rows(logits, p.softcap, 0.0f, canvas.bias, RandomKey{p.seed, p.block, 0, RandomStream::Candidate},
                schedule, p.feedback_dtype == DType::BF16, p.self_conditioning, device_rows);
    auto scratch = pool_->get(size_t(p.canvas) * (sizeof(int32_t) + 1));
    cuda::update_canvas({p, canvas.tokens, canvas.argmax, canvas.history, canvas.counters, canvas.allowed_ids,
                         canvas.free_position},
                        device_rows, scratch.get(), stream_);
  }

  // The sampler's kernel on `logits`. A softmax feedback goes into the logits' product input
  // (alloc_logits) where the kernel can write it there, as attention does its output; else
  // over the logits, then from there into the product input, where there is one.
  void sample_rows(Activation& logits, float cap, float temperature, const float* bias, const RandomKey& key,
                   const cuda::DeviceSchedule& schedule, bool round_bf16, bool softmax_feedback,
                   cuda::DeviceRowSample* out) {
    __nv_bfloat16* const rounded = softmax_feedback ? rounded_rows(logits) : nullptr;
    cuda::sample_rows(logits.data, logits.rows, logits.cols, cap, temperature, bias, key, schedule, round_bf16,
                      softmax_feedback, rounded, out, stream_);
    if (softmax_feedback && !rounded) write_product_input(logits);
  }

  // Measured on the H200 at 1K (step_latency.py, branches on / off, eighteenth session): the
  // dense MLP beside the experts saves 0.4 / 0.9 ms a batch-1 step with bf16 / FP8_DYNAMIC
  // experts, whose products stream weights at memory bandwidth, and is within 0.3 ms at batch
  // 4 (1,024 rows); at batch 16 it costs 0.7 / 1.5 ms, every product filling the machine. With
  // NVFP4 experts it costs 0.8 / 0.9 / 14 ms at batch 1 / 4 / 16: their decoding products
  // are bound by issue, and a branch beside them takes issue slots and multiprocessors from
  // them (FP8 weights with bf16 X decode too).
  bool experts_leave_room(const Weight& experts, int64_t rows) const override {
    return rows <= 1024 && cuda::gemm_operands_alike(gemm_input(experts), experts.format);
  }

  // The second branch on branch_, which waits for everything queued before it; the main
  // stream waits for it before anything after (also when a branch throws). Nested calls run
  // their branches in order.
  void concurrently(const std::function<void()>& first, const std::function<void()>& second) override {
    if (branched_ || !branches_) return Backend::concurrently(first, second);
    bind();
    check(cudaEventRecord(fork_, stream_), "fork");
    check(cudaStreamWaitEvent(branch_, fork_), "fork");
    const DevicePool::Deferral deferral(*pool_);  // outlives the join below
    struct Join {
      CudaBackend& be;
      bool swapped = false;
      ~Join() {
        if (swapped) std::swap(be.stream_, be.branch_);
        cudaEventRecord(be.join_, be.branch_);
        cudaStreamWaitEvent(be.stream_, be.join_);
        be.branched_ = false;
        for (RecentTable& t : be.recent_tables_) t.branch = nullptr;  // every copy is ordered before what follows
      }
    } join{*this};
    branched_ = true;
    first();
    std::swap(stream_, branch_);
    join.swapped = true;
    second();
  }

  // A steady batch's steps: body() recorded once into the body of a graph's while node,
  // which runs it until a block stops or the runs are done, with no host in between.
  // Recording takes the host a while (a forward's launches, then instantiation: ~16 ms at
  // the 26B shapes); where the device would sit idle through it, it runs the first step
  // meanwhile.
  int repeat(const std::function<void()>& body, const std::vector<const CanvasState*>& canvases, int max_times,
             const std::atomic<bool>& interrupted) override {
    bind();
    if (max_times <= 2 || !graphs_) return Backend::repeat(body, canvases, max_times, interrupted);
    int done = 0;
    if (cudaStreamQuery(stream_) == cudaSuccess) {
      body();
      done = 1;
    }
    cudaGetLastError();  // cudaErrorNotReady is an answer, not a failure
    Recording graph;
    record(body, canvases, max_times - done, graph);
    if (done)
      for (const CanvasState* c : canvases)
        if (canvas_stopped(*this, *c)) return done;
    if (!graph.exec) return done + Backend::repeat(body, canvases, max_times - done, interrupted);
    check(cudaGraphLaunch(graph.exec, stream_), "cudaGraphLaunch");
    int32_t runs = 0;
    read_bytes(&runs, graph.runs.get(), sizeof(runs));
    return done + runs;
  }

 private:
  // A recorded repeat body, ready to launch (exec null where recording failed), and what
  // it owns until it is gone: the arena's bytes, the stop flags' table, the run counter.
  struct Recording {
    CudaBackend* backend = nullptr;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    std::shared_ptr<void> flags, runs;

    Recording() = default;
    Recording(const Recording&) = delete;
    Recording& operator=(const Recording&) = delete;
    ~Recording() {
      if (exec) cudaGraphExecDestroy(exec);
      if (graph) cudaGraphDestroy(graph);
      if (backend) backend->recorded_tables_.clear(), backend->arena_.reset();
    }
  };

  // Records into `r` body() and the run counter's kernel: a graph that loops while no block of
  // `canvases` stopped, up to max_runs runs. Bytes the body writes from the host
  // (alloc_bytes: its tables) are written once, now, into the recording's arena; its
  // scratch from the pool is rewritten in every run, in the order it was recorded. The host
  // records while the device may still run earlier work (nothing recorded touches that
  // work's memory). Where recording fails (an op that a graph cannot hold), the steps run
  // from the host, and later calls do so at once.
  void record(const std::function<void()>& body, const std::vector<const CanvasState*>& canvases, int max_runs,
              Recording& r) {
    std::vector<const int32_t*> stopped;
    for (const CanvasState* c : canvases) stopped.push_back(c->counters + kCanvasStopped);
    r.flags = pool_->get(stopped.size() * sizeof(stopped[0]));
    r.runs = pool_->get(sizeof(int32_t));
    const int32_t zero = 0;
    write_bytes(r.flags.get(), stopped.data(), stopped.size() * sizeof(stopped[0]));
    write_bytes(r.runs.get(), &zero, sizeof(zero));
    r.backend = this;
    try {
      check(cudaGraphCreate(&r.graph, 0), "cudaGraphCreate");
      cudaGraphConditionalHandle condition;
      check(cudaGraphConditionalHandleCreate(&condition, r.graph, 1, cudaGraphCondAssignDefault),
            "cudaGraphConditionalHandleCreate");
      cudaGraphNodeParams loop = {};
      loop.type = cudaGraphNodeTypeConditional;
      loop.conditional.handle = condition;
      loop.conditional.type = cudaGraphCondTypeWhile;
      loop.conditional.size = 1;
      cudaGraphNode_t node;
      check(cudaGraphAddNode(&node, r.graph, nullptr, nullptr, 0, &loop), "cudaGraphAddNode");
      check(cudaStreamBeginCaptureToGraph(stream_, loop.conditional.phGraph_out[0], nullptr, nullptr, 0,
                                          cudaStreamCaptureModeRelaxed),
            "cudaStreamBeginCaptureToGraph");
      recording_ = true;
      try {
        body();
        cuda::continue_while(condition, static_cast<const int32_t* const*>(r.flags.get()), int(stopped.size()),
                             static_cast<int32_t*>(r.runs.get()), max_runs, stream_);
        check(cudaGetLastError(), "recording");
      } catch (...) {
        recording_ = false;
        cudaGraph_t partial = nullptr;
        cudaStreamEndCapture(stream_, &partial);
        throw;
      }
      recording_ = false;
      cudaGraph_t recorded = nullptr;
      check(cudaStreamEndCapture(stream_, &recorded), "cudaStreamEndCapture");
      check(cudaGraphInstantiate(&r.exec, r.graph, 0), "cudaGraphInstantiate");
    } catch (const std::exception& e) {
      cudaGetLastError();
      if (r.exec) cudaGraphExecDestroy(r.exec), r.exec = nullptr;
      std::fprintf(stderr, "diffuserve: CUDA graph recording failed (%s); denoise steps run from the host\n",
                   e.what());
      graphs_ = false;
    }
  }

  // The calling thread's current device made this backend's (the engine may run on another
  // thread than the one that loaded the model), then an op's profile scope.
  void bind() const {
    thread_local int bound = -1;
    if (bound != device_) {
      check(cudaSetDevice(device_), "cudaSetDevice");
      bound = device_;
    }
  }
  OpProfile::Scope op(const char* name) {
    bind();
    return profile_.scope(name);
  }

  // y = X @ w^T, X = x or, gated, gelu_glu of x's [gate | up] rows (cuda::gemm).
  void gemm_dense(const Activation& x, const cuda::GemmMatrix& w, WeightFormat format, int64_t n, int64_t k,
                  cuda::GemmInput input, Activation& y, bool gated = false) {
    auto scratch = pool_->get(cuda::gemm_scratch_bytes(x.rows, n, k, input));
    const cuda::PreparedX x_prepared = gated ? cuda::PreparedX{} : prepared(x, input, format);
    if (products_on_cublaslt(x, gated, x_prepared, {w}, format, n, k, input, {y.data}, y.cols, scratch.get())) return;
    const cuda::GemmSegment seg{0, 0, int(x.rows), w};
    const int tile = cuda::gemm_tile_rows(x.rows, 1, n, input, format);
    cuda::gemm(x.data, x.rows, x.cols, gated, nullptr, &seg, nullptr, int((x.rows + tile - 1) / tile), tile, format,
               w.tiled, n, k, input, y.data, nullptr, y.cols, x_prepared, {}, scratch.get(), stream_);
  }

  // Products of X (x's rows, or gated as gemm_dense says) with weights ws[i] ([n, k] each;
  // plain bf16 with bf16 planes of X, or FP8 with FP8 per-token X) into ys[i] (rows ldy
  // apart) on cuBLASLt, where the build has it and it takes them all; false, having done
  // nothing, otherwise. The choice depends on the shapes alone, never on the rows (batch
  // invariance).
  bool products_on_cublaslt(const Activation& x, bool gated, const cuda::PreparedX& x_prepared,
                            const std::vector<cuda::GemmMatrix>& ws, WeightFormat format, int64_t n, int64_t k,
                            cuda::GemmInput input, const std::vector<float*>& ys, int64_t ldy, void* scratch) {
#ifdef DIFFUSERVE_WITH_CUBLASLT
    if (!cublaslt_ || !cuda::gemm_operands_alike(input, format)) return false;
    for (size_t i = 0; i < ws.size(); ++i)
      if (!cublaslt_->supports(input, ws[i], n, k, ys[i], ldy, stream_)) return false;
    cublaslt_->multiply(x.data, x.rows, x.cols, gated, input, ws, n, k, ys, ldy, x_prepared, scratch, stream_);
    return true;
#else
    (void)x, (void)gated, (void)x_prepared, (void)ws, (void)format, (void)n, (void)k, (void)input, (void)ys, (void)ldy,
        (void)scratch;
    return false;
#endif
  }

  // How the GEMM takes a weight's input: FP8 weights with FP8 per-token inputs quantize it
  // in the GEMM's pre-pass (to E4M3 codes: no fake-quantized copy of X), and weights with
  // bf16 inputs (plain, or FP8 / NVFP4 decoded in the main loop) round it there (one bf16
  // plane); everything else multiplies X as it is (quantized beforehand where input_quant
  // says) in bf16 hi/lo.
  static cuda::GemmInput gemm_input(const Weight& w) {
    if (w.format == WeightFormat::Fp8 && w.input_quant.scheme == ActivationScheme::Fp8Token)
      return cuda::GemmInput::Fp8Token;
    if (w.input_quant.scheme == ActivationScheme::Bf16) return cuda::GemmInput::RoundBf16;
    return cuda::GemmInput::Split;
  }

  // Whether the MLP's activation can be computed in the pre-pass of w's product (cuda::gemm's
  // `gated`): where that pass is all that touches the product's input, plain inputs
  // (fp32-like), bf16 ones or FP8 codes; not where the input is quantized beforehand.
  static bool gated_input(const Weight& w) {
    return w.input_quant.scheme == ActivationScheme::None || gemm_input(w) != cuda::GemmInput::Split;
  }

  // The input a product of w takes as gemm()'s pre-pass writes it, where a norm may write it
  // instead (alloc_product_input): not where the kernel decodes packed weights (K permuted)
  // or the input is quantized beforehand (quantize_input).
  static std::optional<cuda::GemmInput> preparable_input(const Weight& w) {
    if (w.empty()) return std::nullopt;
    const cuda::GemmInput input = gemm_input(w);
    if (!cuda::gemm_operands_alike(input, w.format) ||
        (input == cuda::GemmInput::Split && w.input_quant.scheme != ActivationScheme::None))
      return std::nullopt;
    return input;
  }
  // x's product input (alloc_product_input) as the GEMM reads it; rows null where x has none.
  static cuda::PreparedX product_rows(const Activation& x) {
    const ProductInput& p = x.product_input;
    if (!p.kind) return {};
    const auto input = cuda::GemmInput(p.kind - 1);
    return {p.data, p.row_scales, cuda::gemm_padded_k(x.cols, input), input};
  }
  // ... where a product of `input` X with `format` weights takes it so; rows null otherwise.
  static cuda::PreparedX prepared(const Activation& x, cuda::GemmInput input, WeightFormat format) {
    if (x.product_input.kind != 1 + int(input) || !cuda::gemm_operands_alike(input, format)) return {};
    return product_rows(x);
  }
  // x's product input where it is bf16-rounded rows of exactly x's columns, which kernels
  // write beside their fp32 outputs; null otherwise.
  static __nv_bfloat16* rounded_rows(const Activation& x) {
    const cuda::PreparedX p = product_rows(x);
    return p.rows && p.input == cuda::GemmInput::RoundBf16 && p.kp == x.cols ? reinterpret_cast<__nv_bfloat16*>(p.rows)
                                                                             : nullptr;
  }
  // x's product input (if any) written from its values by the products' pre-pass.
  void write_product_input(const Activation& x) {
    const cuda::PreparedX p = product_rows(x);
    if (p.rows) cuda::write_gemm_input(x.data, x.rows, x.cols, false, x.cols, false, p, stream_);
  }

  static const __nv_bfloat16* bf16(const Weight& w) {
    if (w.format != WeightFormat::Plain || w.dtype != DType::BF16)
      throw InvalidArgument("this CUDA op needs bf16 weights");
    return static_cast<const __nv_bfloat16*>(w.data);
  }

  // A norm's outputs for the kernels: each weights[i] (null: none) into outputs[i] (at most
  // kMaxNormOutputs), or one added to y: y = (y + norm * weight) * scale.
  static cuda::NormOutputs written(const std::vector<const Weight*>& weights, const std::vector<Activation*>& outputs) {
    cuda::NormOutputs outs{};
    for (size_t i = 0; i < weights.size(); ++i) {
      outs.weight[i] = weights[i] ? static_cast<const float*>(weights[i]->data) : nullptr;
      outs.y[i] = outputs[i]->data;
      outs.prepared[i] = product_rows(*outputs[i]);
    }
    outs.count = int(weights.size());
    return outs;
  }
  static cuda::NormOutputs added(const Weight* weight, Activation& y, float scale) {
    cuda::NormOutputs outs = written({weight}, {&y});
    outs.accumulate = true;
    outs.scale = scale;
    return outs;
  }

  // A linear's weight ([N, K]) or expert stack ([E, N, K]) as the GEMM reads it.
  static cuda::ExpertStack matrices(const Weight& w) {
    if (w.format == WeightFormat::Plain) bf16(w);  // checks the dtype
    return {{w.data, w.row_scales, w.group_scales, w.tiled, w.factor_rows},
            w.format,
            w.shape[w.shape.size() - 2],
            w.shape.back()};
  }

  // Copies a small host table to the device for the next kernels, without waiting: the
  // bytes go through a pinned staging ring (so the host table may go away at once), and
  // the device copy stays among the recent tables until the kernels that read it are
  // queued (a launch reads at most 4, of 16 kept); after that its memory may go back to
  // the pool, since the stream runs whatever reuses it after those kernels.
  // Kernels only read tables, so one equal to a recent upload is not copied again: a
  // pass's layers ask for the same positions and attention plans over and over (at the
  // 26B shapes that saves ~130 copies a pass, each a queued operation and its gap).
  // While recording a repeat body, tables are the body's own (alloc_bytes, write_bytes),
  // remembered among themselves alike. Within concurrently, a table copied by one branch
  // serves only that branch (the other's stream is not ordered after the copy) until the
  // join.
  template <typename T>
  const T* upload_table(const std::vector<T>& table) {
    if (table.empty()) return nullptr;
    const size_t size = table.size() * sizeof(T);
    const auto* first = reinterpret_cast<const uint8_t*>(table.data());
    std::vector<RecentTable>& recent = recording_ ? recorded_tables_ : recent_tables_;
    for (auto it = recent.begin(); it != recent.end(); ++it)
      if (it->bytes.size() == size && (!it->branch || it->branch == stream_) &&
          std::memcmp(it->bytes.data(), first, size) == 0) {
        std::rotate(recent.begin(), it, it + 1);  // most recent first
        return static_cast<const T*>(recent.front().device.get());
      }
    auto storage = alloc_bytes(size);
    write_bytes(storage.get(), table.data(), size);
    recent.insert(recent.begin(), RecentTable{std::vector<uint8_t>(first, first + size), storage,
                                              branched_ && !recording_ ? stream_ : nullptr});
    if (!recording_ && recent.size() > kRecentTables) recent.pop_back();
    return static_cast<const T*>(storage.get());
  }

  // `bytes` of host memory copied into the pinned staging ring, for an asynchronous copy
  // up from there.
  const void* stage(const void* src, size_t bytes) {
    const size_t aligned = aligned_256(bytes);
    if (aligned > kStagingBytes) throw InvalidArgument("table of " + std::to_string(bytes) + " bytes is too large");
    if (staging_used_ + aligned > kStagingBytes) empty_staging();  // wrap
    uint8_t* host = staging() + staging_used_;
    staging_used_ += aligned;
    std::memcpy(host, src, bytes);
    return host;
  }
  uint8_t* staging() {
    if (!staging_) {
      void* p = nullptr;
      check(cudaMallocHost(&p, kStagingBytes), "cudaMallocHost");
      staging_ = std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { cudaFreeHost(q); });
    }
    return staging_.get();
  }
  // The copies out of the staging ring's bytes done, and all of it free again.
  void empty_staging() {
    check(cudaStreamSynchronize(stream_), "stage");
    check(cudaStreamSynchronize(branch_), "stage");
    staging_used_ = 0;
  }

  // Large host data (weights) to the device in stream order, waiting for it: `n` values of
  // type `from` stored as `to` (copied as they are where the two are alike). They pass
  // through the staging ring's two halves a chunk at a time, the worker threads converting
  // (or copying) a chunk into one half while the other half's copy up runs. A checkpoint's
  // values lie in its mapped file, pageable memory, which copies up at a fraction of pinned
  // memory's rate, and each weight had been converted whole first, into floats (4 bytes a
  // value) and back, on one thread.
  void copy_up(void* dst, const void* src, DType from, int64_t n, DType to) {
    bind();
    if (!threads_) threads_ = ThreadPool::make(0);
    empty_staging();
    const size_t in_size = dtype_size(from), out_size = dtype_size(to);
    const int64_t chunk = int64_t(kStagingBytes / 2 / out_size);
    for (int64_t first = 0, half = 0; first < n; first += chunk, half ^= 1) {
      const int64_t count = std::min(chunk, n - first);
      uint8_t* host = staging() + half * (kStagingBytes / 2);
      check(cudaEventSynchronize(copied_up_[half]), "copy to the device");  // the half's last chunk is up
      convert_floats(*threads_, static_cast<const uint8_t*>(src) + size_t(first) * in_size, from, count, host, to);
      check(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + size_t(first) * out_size, host, size_t(count) * out_size,
                            cudaMemcpyHostToDevice, stream_),
            "copy to the device");
      check(cudaEventRecord(copied_up_[half], stream_), "copy to the device");
    }
    check(cudaStreamSynchronize(stream_), "copy to the device");
  }
  void copy_up(void* dst, const void* src, size_t bytes) { copy_up(dst, src, DType::U8, int64_t(bytes), DType::U8); }

  static constexpr size_t kStagingBytes = size_t(64) << 20;
  // Tables remembered: a pass's distinct reused ones (positions; per layer kind, the
  // attention's segments, items and merges) with room for the key spans between them.
  static constexpr size_t kRecentTables = 16;
  struct RecentTable {
    std::vector<uint8_t> bytes;
    std::shared_ptr<void> device;
    cudaStream_t branch;  // within concurrently, the stream its copy is queued on; else null
  };
  int device_;
  OpProfile profile_;
  std::shared_ptr<DevicePool> pool_;
  std::map<const void*, std::shared_ptr<void>> transposed_;  // linear_nt's weights, [N, K]
  std::map<std::pair<int64_t, bool>, int> attention_resident_items_;  // by head dim and rounding
  cudaStream_t stream_ = nullptr;  // every op, in order (within concurrently's second branch: branch_'s)
  cudaStream_t side_ = nullptr;    // one-off copies while recording a graph
  cudaStream_t branch_ = nullptr;  // concurrently's second branch (swapped with stream_ while it is queued)
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  bool branches_ = true;           // concurrently uses branch_
  bool product_inputs_ = true;     // alloc_product_input keeps the products' form of a matrix
  bool branched_ = false;          // within concurrently
  bool graphs_ = true;             // repeat records a graph
  bool recording_ = false;         // repeat is recording its body
  RecordingArena arena_;           // memory the recorded body owns
  std::shared_ptr<uint8_t> staging_;          // pinned host ring for write_bytes and copy_up
  cudaEvent_t copied_up_[2] = {};              // copy_up: each staging half's last copy up done
  std::shared_ptr<ThreadPool> threads_;        // copy_up's (the process's pool, once needed)
  std::vector<RecentTable> recent_tables_;    // most recent first
  std::vector<RecentTable> recorded_tables_;  // the recorded body's
  size_t staging_used_ = 0;
#ifdef DIFFUSERVE_WITH_CUBLASLT
  std::unique_ptr<cuda::CublasLtGemm> cublaslt_;  // null: every product on gemm.cu
#endif
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device, const std::string& name) {
  return std::make_unique<CudaBackend>(device, name);
}

}  // namespace diffuserve
