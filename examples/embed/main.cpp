// Loads a DiffusionGemma checkpoint, prefills a prompt and runs one denoise step, then
// generates from the same prompt: the smallest native service built on diffuserve.
//
//   embed CHECKPOINT_DIR [TOKEN_ID ...]
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <vector>

#include "diffuserve/diffuserve.h"
#include "diffuserve/generate.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR [PROMPT_TOKEN_ID ...]\n", argv[0]);
    return 2;
  }
  try {
    auto model = diffuserve::Model::load(argv[1]);
    const diffuserve::ModelConfig& config = model->config();

    std::vector<int32_t> prompt;
    for (int i = 2; i < argc; ++i) {
      int32_t id = 0;
      const char* end = argv[i] + std::strlen(argv[i]);
      const auto [at, error] = std::from_chars(argv[i], end, id);
      if (error != std::errc() || at != end) {
        std::fprintf(stderr, "error: '%s' is not a token id\n", argv[i]);
        return 2;
      }
      prompt.push_back(id);  // (the model refuses one outside its vocabulary)
    }
    if (prompt.empty()) prompt = {2, 10, 11, 12};  // a few ids that exist in any vocabulary

    auto seq = model->new_sequence();
    seq->prefill(prompt);

    // The first step of a block: a canvas of pad tokens, no self-conditioning.
    const bool pad_ok = config.pad_token_id >= 0 && config.pad_token_id < config.vocab_size;
    std::vector<int32_t> canvas(config.canvas_length, pad_ok ? config.pad_token_id : 0);
    std::vector<float> logits = seq->denoise(canvas);

    std::printf("loaded %s: %d layers, vocab %d, canvas %d\n", argv[1], config.num_layers, config.vocab_size,
                config.canvas_length);
    std::printf("prefilled %lld tokens; denoised canvas argmax:", static_cast<long long>(seq->length()));
    for (int p = 0; p < std::min(config.canvas_length, 8); ++p) {
      const float* row = logits.data() + static_cast<size_t>(p) * config.vocab_size;
      std::printf(" %ld", static_cast<long>(std::max_element(row, row + config.vocab_size) - row));
    }
    std::printf("%s\n", config.canvas_length > 8 ? " ..." : "");

    // Whole-request generation: the sampler and every block's denoise loop run in the runtime.
    diffuserve::SamplingParams params = diffuserve::sampling_defaults(config);
    params.max_new_tokens = 2 * config.canvas_length;
    params.seed = 42;
    const diffuserve::GenerationOutput out = diffuserve::generate(*model, {prompt}, {params})[0];
    std::printf("generated %zu tokens (%s), steps per block:", out.token_ids.size(), out.finish_reason.c_str());
    for (int steps : out.denoise_steps) std::printf(" %d", steps);
    std::printf("\ntokens:");
    for (int32_t t : out.token_ids) std::printf(" %d", t);
    std::printf("\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
