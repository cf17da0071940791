// The runtime's mechanism for serving many requests at once: it holds each request's
// state (KV table, sampler state of the block in progress) and executes the batches a
// scheduler asks for. Which requests run, when they are admitted and whom to preempt is
// the scheduler's business (python/diffuserve/scheduler.py); this class only carries out.
//
// A step runs up to `max_steps` forward passes. Each pass is one mixed-phase batch: the
// encoder rows (prompt chunks, committed blocks) of some requests and the canvases of
// the requests that are denoising. A request whose pending tokens are all encoded in a
// pass denoises in that same pass (its canvas reads the fresh KV in each layer), so a
// commit and the next block's first step, or a prompt's last chunk and its first step,
// cost one forward instead of two.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "diffuserve/diffuserve.h"
#include "diffuserve/generate.h"

namespace diffuserve {

struct RequestState;

// What the scheduler asks one request to do in a step.
struct StepPlan {
  uint64_t id = 0;
  int64_t max_encode_tokens = 0;  // pending prompt/commit tokens it may encode in the first pass
};

// Every method taking an id throws InvalidArgument when the engine holds no such request
// (never added, finished, or aborted; abort() of a finished one step() has yet to return
// drops its output). Its calls take the model's turn (diffuserve.h), so
// threads may share an engine; interrupt() is meant for another thread.
class Engine {
 public:
  // fuse_commit: a request denoises in the same pass that encodes its last pending
  // tokens (false: that encoding gets a pass of its own, as in the reference).
  explicit Engine(std::shared_ptr<Model> model, bool fuse_commit = true);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and registers a request; it waits (holding no KV) until admitted. Throws
  // InvalidArgument for bad parameters, or a request the KV cache could never hold.
  void add(uint64_t id, std::vector<int32_t> prompt, const SamplingParams& params);
  // Takes a waiting request in: adopts its cached prefix and reserves KV for its first
  // `encode_tokens` (>= 0). False (and it stays waiting, holding nothing) if the KV is short.
  bool admit(uint64_t id, int64_t encode_tokens);
  // Reserves KV for a running request's next `encode_tokens`; false if the KV is short.
  bool reserve(uint64_t id, int64_t encode_tokens);
  // Frees a running request's KV; it waits again and will recompute (the block in
  // progress restarts; its random draws are keyed by step, so the output is unchanged).
  void preempt(uint64_t id);
  // Drops a request wherever it is; its KV is freed at once.
  void abort(uint64_t id);

  // Runs up to `max_steps` (>= 1) passes over the planned requests (each admitted, each
  // once, each canvas at most max_batched_tokens rows where the step would denoise it: its
  // pending tokens all planned), each pass at most
  // `max_batched_tokens` (>= 1) rows: a prompt chunk planned past that is cut to it. The
  // first pass runs the plan; later ones give their rows to blocks to commit and denoise
  // steps first, and the rest to the prompts' next chunks (where the KV cache has room). Returns
  // the requests that finished; none when it could run no pass (the KV cache had no room for
  // their tokens). A step that throws (out of memory, say) after requests finished in its
  // earlier passes keeps their outputs (the engine holds those requests no more): the next
  // step returns them, or take_finished() does at once; abort() drops one.
  std::vector<std::pair<uint64_t, GenerationOutput>> step(const std::vector<StepPlan>& plan, int max_steps,
                                                          int64_t max_batched_tokens);
  std::vector<std::pair<uint64_t, GenerationOutput>> take_finished();
  // Ends the step in progress after its current pass (or the next step after its first):
  // a step of many passes over a large batch takes tens of seconds on a CPU, and a caller
  // with a request to abort should not wait for all of them. Any thread may call it, also
  // while step() runs (it takes no lock).
  void interrupt() { interrupted_ = true; }

  // Tokens a request must encode before its next denoise step (prompt or committed blocks).
  int64_t pending_tokens(uint64_t id) const;
  // The request's canvas length (rows of one denoise step).
  int canvas_length(uint64_t id) const;
  // Tokens generated so far (whole finished blocks).
  std::vector<int32_t> generated(uint64_t id) const;
  // Denoise steps of each block finished so far (GenerationOutput::denoise_steps, to come).
  std::vector<int> denoise_steps(uint64_t id) const;
  // The argmax canvas of the block in progress, cut where max_new_tokens cuts the last block
  // (empty between blocks, and where its latest logits held NaN or infinity: the request
  // fails at its next step): a draft to stream.
  std::vector<int32_t> draft(uint64_t id) const;
  // Requests held: added, and neither finished nor aborted.
  size_t size() const;
  // Forward passes run so far.
  int64_t passes() const;

 private:
  RequestState& get(uint64_t id) const;
  std::shared_ptr<Model> model_;
  bool fuse_commit_;
  int64_t passes_ = 0;
  std::atomic<bool> interrupted_ = false;
  std::map<uint64_t, std::unique_ptr<RequestState>> requests_;
  std::vector<std::pair<uint64_t, GenerationOutput>> finished_;  // finished, not yet returned by step()
};

}  // namespace diffuserve
