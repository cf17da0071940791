// The paged KV cache: fixed-size blocks of token rows, per-sequence block tables,
// refcounted blocks and automatic prefix caching.
//
// Layers are split into two groups with separate block pools, because they need very
// different amounts of history:
//   full-attention layers keep every token's KV for the life of the sequence;
//   sliding-window layers only ever read the last window - 1 tokens (the encoder's query
//   at p sees keys > p - window; the decoder sees the last window - 1 committed tokens),
//   so their blocks are released as the sequence moves past them.
// For the real model that is ~205 KB of bf16 KV per token inside the window against
// ~20 KB beyond it. Keys and values are stored as the backend's attention takes them
// (Backend::kv_cache_dtype): fp32, or bf16 with activations "bfloat16".
//
// Full-attention layers have no v_proj: V = v_norm(k_proj(x)) while K =
// rope(k_norm(k_proj(x))). V could be recovered from K (undo the rotation, divide by the
// k_norm weight), halving those layers' memory, but dividing by learned weights that may
// be near zero loses precision and costs work on every read. We store V.
//
// Prefix caching: once a block holds block_size committed tokens it becomes a node of a
// prefix tree, keyed by its parent node (the blocks before it: a token's KV depends on every
// token before it) and its tokens, compared exactly. A block that no sequence references
// stays cached (LRU) until its memory is needed, and a new sequence whose tokens start with
// the same blocks takes them instead of recomputing. (Keyed by a 64-bit hash of its tokens
// alone, a block could be matched by other tokens of the same hash: colliding blocks are
// found in a second for FNV-1a, and a request could hand another its KV.)
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend.h"
#include "diffuserve/config.h"

namespace diffuserve {

enum KvGroup { kFullGroup = 0, kSlidingGroup = 1, kNumGroups = 2 };

// One sequence's view of the cache.
struct KvTable {
  std::vector<int32_t> blocks[kNumGroups];  // logical block -> pool block (-1: released)
  std::vector<uint64_t> prefix_nodes;       // each full block's node of the prefix tree
  std::vector<int32_t> tokens;              // every token whose KV is in the cache
  int64_t length() const { return int64_t(tokens.size()); }
};

struct KvStats {
  int64_t blocks_total = 0;
  int64_t blocks_free = 0;  // not referenced by any sequence (cached-but-idle ones count)
  int64_t prefix_cache_queries = 0;  // prompt tokens looked up
  int64_t prefix_cache_hits = 0;     // of those, tokens found cached
};

// The prefix tree of the cache's full blocks: node ids (never 0, never reused) for each
// (parent node, block tokens) held, each kept while any sequence's table or cached block
// refers to it.
class PrefixTree {
 public:
  // The node of `tokens` after `parent` (0: the sequence's start); 0 where there is none.
  uint64_t find(uint64_t parent, std::span<const int32_t> tokens) const;
  // That node, added where there is none, with one reference more.
  uint64_t hold(uint64_t parent, std::span<const int32_t> tokens);
  void hold(uint64_t node) { ++nodes_.at(node).refs; }
  // One reference fewer; the node goes with its last.
  void release(uint64_t node);

 private:
  struct Key {
    uint64_t parent;
    std::vector<int32_t> tokens;
  };
  // A key as the look-ups see it, without copying its tokens (the maps' transparent hash and
  // equality take both).
  struct KeyView {
    uint64_t parent;
    std::span<const int32_t> tokens;
    KeyView(uint64_t parent, std::span<const int32_t> tokens) : parent(parent), tokens(tokens) {}
    KeyView(const Key& key) : parent(key.parent), tokens(key.tokens) {}  // (implicit: the maps convert their keys)
  };
  struct KeyHash {
    using is_transparent = void;
    KeyHash();
    size_t operator()(KeyView key) const;
    uint64_t k0, k1;
  };
  struct KeyEqual {
    using is_transparent = void;
    bool operator()(KeyView a, KeyView b) const {
      return a.parent == b.parent && std::ranges::equal(a.tokens, b.tokens);
    }
  };
  struct Node {
    const Key* key;  // its key in ids_ (an unordered_map's elements stay where they are)
    int64_t refs;
  };
  std::unordered_map<Key, uint64_t, KeyHash, KeyEqual> ids_;
  std::unordered_map<uint64_t, Node> nodes_;
  uint64_t next_id_ = 1;
};

class KvCache {
 public:
  // Splits `memory_bytes` between the groups: the sliding pool gets what `max_seqs`
  // sequences' windows need (at most half the budget), the full pool the rest. Keys and
  // values are stored as `dtype` (F32 or BF16).
  KvCache(Backend& backend, const ModelConfig& config, int64_t memory_bytes, int block_size, int max_seqs, DType dtype);

  int block_size() const { return block_size_; }
  KvStats stats() const;

  // Allocates the blocks for `new_tokens` more tokens; false (and nothing changed) if
  // either pool lacks them.
  bool reserve(KvTable& table, int64_t new_tokens);
  // Records `tokens` as encoded (their KV rows written): caches newly full blocks and
  // releases sliding blocks the sequence can no longer read.
  void append(KvTable& table, std::span<const int32_t> tokens);
  // Adopts the longest cached prefix of `prompt` (whole blocks); returns the number of tokens
  // taken from the cache.
  int64_t match_prefix(KvTable& table, std::span<const int32_t> prompt);
  // Counts a prefix lookup of `queried` prompt tokens of which `hit` were cached.
  void record_prefix_query(int64_t queried, int64_t hit) { prefix_queries_ += queried, prefix_hits_ += hit; }
  // Whether an otherwise empty cache could hold a sequence of `total_tokens` encoded
  // `chunk` tokens at a time.
  bool could_hold(int64_t total_tokens, int64_t chunk) const;
  // Whether `table` could take `new_tokens` more, `chunk` tokens a pass, from the cache as it
  // is now (the other sequences holding what they hold): what a continued prefill checks
  // before its first chunk, so that it does not stop half done.
  bool could_continue(const KvTable& table, int64_t new_tokens, int64_t chunk) const;
  // The most tokens, at most `limit`, that could_hold admits at `chunk` tokens at a time (0:
  // none). could_hold only grows harder with the total: a bisection.
  int64_t longest_sequence(int64_t limit, int64_t chunk) const;
  // Drops every reference of `table`; it is empty afterwards.
  void release(KvTable& table);

  // Where layer `layer`'s KV for absolute position `pos` lives (row in the layer's pool).
  int64_t slot(const KvTable& table, int layer, int64_t pos) const;
  // Key spans of `layer` covering positions [begin, end) of `table`, one per block.
  std::vector<KeySpan> spans(const KvTable& table, int layer, int64_t begin, int64_t end) const;
  KvRows& keys(int layer) { return keys_[layer]; }
  KvRows& values(int layer) { return values_[layer]; }
  DType dtype() const { return dtype_; }
  KvGroup group_of(int layer) const { return group_of_[layer]; }

 private:
  struct Pool {
    int64_t num_blocks = 0;
    std::vector<int32_t> refcount;
    std::vector<int32_t> free;                             // never-used or evicted blocks
    std::list<int32_t> idle;                               // cached, unreferenced: LRU first
    std::vector<std::list<int32_t>::iterator> idle_pos;    // valid when in `idle`
    std::vector<uint64_t> node_of;                         // its prefix node; 0: not cached
    std::unordered_map<uint64_t, int32_t> cached;          // prefix node -> block
  };

  int32_t allocate(KvGroup g);
  void take(KvGroup g, int32_t block);  // a reference to a cached block
  void drop(KvGroup g, int32_t block);
  int64_t available(KvGroup g) const { return int64_t(pools_[g].free.size() + pools_[g].idle.size()); }
  // The most blocks of each group a sequence of `total_tokens`, encoded `chunk` tokens at a
  // time, holds at once (could_hold and could_continue count them).
  std::array<int64_t, kNumGroups> most_blocks(int64_t total_tokens, int64_t chunk) const;
  // First logical block that group g must still hold for a sequence of `length` tokens.
  int64_t first_needed(KvGroup g, int64_t length) const;

  const ModelConfig& config_;
  int block_size_;
  int64_t window_;  // sliding window
  DType dtype_;
  Pool pools_[kNumGroups];
  PrefixTree prefixes_;
  std::vector<KvGroup> group_of_;
  std::vector<KvRows> keys_, values_;  // per layer: [num_blocks * block_size, kv_cols]
  int64_t prefix_queries_ = 0, prefix_hits_ = 0;
};

}  // namespace diffuserve
