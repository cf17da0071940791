#include "kv_cache.h"

#include <algorithm>
#include <array>
#include <bit>
#include <random>
#include <utility>

#include "diffuserve/errors.h"

namespace diffuserve {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// SipHash-1-3 (Aumasson and Bernstein's keyed hash, at the round counts Rust's HashMap uses)
// under the 128-bit key k0, k1, of a message given as its little-endian 64-bit words: each
// whole word to add(), then finish() with the last 0-7 bytes (as a word) and the length.
class SipHash13 {
 public:
  SipHash13(uint64_t k0, uint64_t k1)
      : v0_(k0 ^ 0x736f6d6570736575ull), v1_(k1 ^ 0x646f72616e646f6dull), v2_(k0 ^ 0x6c7967656e657261ull),
        v3_(k1 ^ 0x7465646279746573ull) {}
  void add(uint64_t m) {
    v3_ ^= m;
    round();  // (one compression round)
    v0_ ^= m;
  }
  uint64_t finish(uint64_t tail, uint64_t bytes) {
    add(tail | (bytes & 0xff) << 56);
    v2_ ^= 0xff;
    for (int r = 0; r < 3; ++r) round();  // (three finalization rounds)
    return v0_ ^ v1_ ^ v2_ ^ v3_;
  }

 private:
  void round() {
    v0_ += v1_, v1_ = std::rotl(v1_, 13), v1_ ^= v0_, v0_ = std::rotl(v0_, 32);
    v2_ += v3_, v3_ = std::rotl(v3_, 16), v3_ ^= v2_;
    v0_ += v3_, v3_ = std::rotl(v3_, 21), v3_ ^= v0_;
    v2_ += v1_, v1_ = std::rotl(v1_, 17), v1_ ^= v2_, v2_ = std::rotl(v2_, 32);
  }
  uint64_t v0_, v1_, v2_, v3_;
};

}  // namespace

// A random key a cache: which bucket a key goes to cannot be aimed at (many keys in one
// bucket would make each look-up walk them all, on the engine's thread).
PrefixTree::KeyHash::KeyHash() {
  std::random_device random;
  k0 = uint64_t(random()) << 32 | random(), k1 = uint64_t(random()) << 32 | random();
}

// The parent and the tokens as little-endian bytes, hashed (keys compare whole): the parent
// a word, then the tokens two a word (4 bytes each), an odd last one the tail.
size_t PrefixTree::KeyHash::operator()(KeyView key) const {
  SipHash13 hash(k0, k1);
  hash.add(key.parent);
  const std::span<const int32_t> t = key.tokens;
  const size_t pairs = t.size() / 2;
  for (size_t i = 0; i < pairs; ++i) hash.add(uint64_t(uint32_t(t[2 * i])) | uint64_t(uint32_t(t[2 * i + 1])) << 32);
  const uint64_t tail = t.size() % 2 ? uint64_t(uint32_t(t.back())) : 0;
  return size_t(hash.finish(tail, 8 + 4 * uint64_t(t.size())));
}

uint64_t PrefixTree::find(uint64_t parent, std::span<const int32_t> tokens) const {
  const auto it = ids_.find(KeyView{parent, tokens});
  return it == ids_.end() ? 0 : it->second;
}

uint64_t PrefixTree::hold(uint64_t parent, std::span<const int32_t> tokens) {
  auto it = ids_.find(KeyView{parent, tokens});
  if (it == ids_.end()) {  // (the key's copy only for a new node)
    it = ids_.emplace(Key{parent, {tokens.begin(), tokens.end()}}, next_id_).first;
    nodes_.emplace(next_id_++, Node{&it->first, 0});
  }
  hold(it->second);
  return it->second;
}

void PrefixTree::release(uint64_t node) {
  const auto it = nodes_.find(node);
  if (--it->second.refs > 0) return;
  ids_.erase(ids_.find(KeyView(*it->second.key)));
  nodes_.erase(it);
}

KvCache::KvCache(Backend& backend, const ModelConfig& config, int64_t memory_bytes, int block_size, int max_seqs,
                 DType dtype)
    : config_(config), block_size_(block_size), window_(config.sliding_window), dtype_(dtype) {
  if (block_size < 1) throw InvalidArgument("kv block_size must be >= 1");
  if (dtype != DType::F32 && dtype != DType::BF16) throw InvalidArgument("the KV cache stores fp32 or bf16");
  if (max_seqs < 1) throw InvalidArgument("max_num_seqs must be >= 1");
  for (const LayerConfig& L : config.layers) group_of_.push_back(L.sliding ? kSlidingGroup : kFullGroup);

  int64_t per_block[kNumGroups] = {0, 0};
  for (const LayerConfig& L : config.layers)
    per_block[L.sliding ? kSlidingGroup : kFullGroup] +=
        2 * int64_t(L.num_kv_heads) * L.head_dim * block_size * int64_t(dtype_size(dtype));
  // A sequence's sliding layers hold its window plus a commit and a canvas in flight.
  const int64_t sliding_per_seq = ceil_div(window_ - 1 + 2 * int64_t(config.canvas_length), block_size) + 1;
  int64_t sliding_bytes = 0;
  if (per_block[kSlidingGroup]) {
    // (A window of billions of tokens, which a config may give, overflows the product: then half.)
    int64_t wanted;
    const bool overflow =
        __builtin_mul_overflow(int64_t(max_seqs) * sliding_per_seq, per_block[kSlidingGroup], &wanted);
    sliding_bytes =
        per_block[kFullGroup] ? (overflow ? memory_bytes / 2 : std::min(wanted, memory_bytes / 2)) : memory_bytes;
  }
  const int64_t blocks[kNumGroups] = {
      per_block[kFullGroup] ? (memory_bytes - sliding_bytes) / per_block[kFullGroup] : 0,
      per_block[kSlidingGroup] ? sliding_bytes / per_block[kSlidingGroup] : 0};
  for (int g = 0; g < kNumGroups; ++g) {
    if (per_block[g] && blocks[g] < 1)
      throw InvalidArgument("kv_cache_memory_bytes " + std::to_string(memory_bytes) + " leaves " +
                            std::to_string(g == kSlidingGroup ? sliding_bytes : memory_bytes - sliding_bytes) +
                            " bytes to the " + (g == kSlidingGroup ? "sliding" : "full") +
                            "-attention layers, too few for one KV block of theirs (" + std::to_string(per_block[g]) +
                            " bytes at kv_block_size " + std::to_string(block_size) + ")");
    if (blocks[g] > INT32_MAX)
      throw InvalidArgument("kv_cache_memory_bytes " + std::to_string(memory_bytes) +
                            " makes more than 2^31 KV blocks");
    Pool& p = pools_[g];
    p.num_blocks = blocks[g];
    p.refcount.assign(blocks[g], 0);
    p.node_of.assign(blocks[g], 0);
    p.idle_pos.resize(blocks[g]);
    for (int64_t b = blocks[g] - 1; b >= 0; --b) p.free.push_back(int32_t(b));
  }
  // Zero-filled rows (alloc's fp32 matrices are, and as one long row they hold any dtype's
  // bytes): a slot is written before any attention reads it, but never garbage.
  auto rows_of = [&](int64_t rows, int64_t cols) {
    const int64_t bytes = rows * cols * int64_t(dtype_size(dtype));
    Activation a = backend.alloc(1, (bytes + 3) / 4);
    return KvRows{a.data, rows, cols, dtype, a.storage};
  };
  for (size_t i = 0; i < config.layers.size(); ++i) {
    const LayerConfig& L = config.layers[i];
    const int64_t rows = pools_[group_of_[i]].num_blocks * block_size;
    keys_.push_back(rows_of(rows, int64_t(L.num_kv_heads) * L.head_dim));
    values_.push_back(rows_of(rows, int64_t(L.num_kv_heads) * L.head_dim));
  }
}

KvStats KvCache::stats() const {
  KvStats s;
  for (const Pool& p : pools_) {
    s.blocks_total += p.num_blocks;
    s.blocks_free += int64_t(p.free.size() + p.idle.size());
  }
  s.prefix_cache_queries = prefix_queries_;
  s.prefix_cache_hits = prefix_hits_;
  return s;
}

int64_t KvCache::first_needed(KvGroup g, int64_t length) const {
  if (g == kFullGroup) return 0;
  return std::max<int64_t>(0, length - (window_ - 1)) / block_size_;
}

int32_t KvCache::allocate(KvGroup g) {
  Pool& p = pools_[g];
  int32_t b;
  if (!p.free.empty()) {
    b = p.free.back();
    p.free.pop_back();
  } else {  // evict the least recently used cached block
    b = p.idle.front();
    p.idle.pop_front();
    p.cached.erase(p.node_of[b]);
    prefixes_.release(std::exchange(p.node_of[b], 0));
  }
  p.refcount[b] = 1;
  return b;
}

void KvCache::take(KvGroup g, int32_t b) {
  Pool& p = pools_[g];
  if (p.refcount[b]++ == 0) p.idle.erase(p.idle_pos[b]);
}

void KvCache::drop(KvGroup g, int32_t b) {
  Pool& p = pools_[g];
  if (--p.refcount[b] > 0) return;
  if (p.node_of[b]) {
    p.idle_pos[b] = p.idle.insert(p.idle.end(), b);  // stays cached, most recently used
  } else {
    p.free.push_back(b);
  }
}

bool KvCache::reserve(KvTable& table, int64_t new_tokens) {
  const int64_t end_block = ceil_div(table.length() + new_tokens, block_size_);
  int64_t need[kNumGroups];
  for (int g = 0; g < kNumGroups; ++g) {
    need[g] = pools_[g].num_blocks ? std::max<int64_t>(0, end_block - int64_t(table.blocks[g].size())) : 0;
    if (need[g] > available(KvGroup(g))) return false;
  }
  for (int g = 0; g < kNumGroups; ++g)
    for (int64_t i = 0; i < need[g]; ++i) table.blocks[g].push_back(allocate(KvGroup(g)));
  return true;
}

void KvCache::append(KvTable& table, std::span<const int32_t> tokens) {
  const int64_t before = table.length();
  table.tokens.insert(table.tokens.end(), tokens.begin(), tokens.end());
  // Cache each block that just became full, in both groups: its KV is now final.
  for (int64_t b = before / block_size_; (b + 1) * block_size_ <= table.length(); ++b) {
    if (int64_t(table.prefix_nodes.size()) > b) continue;
    const uint64_t parent = b ? table.prefix_nodes[b - 1] : 0;
    const uint64_t node = prefixes_.hold(parent, std::span(table.tokens).subspan(b * block_size_, block_size_));
    table.prefix_nodes.push_back(node);
    for (int g = 0; g < kNumGroups; ++g) {
      if (!pools_[g].num_blocks || table.blocks[g][b] < 0) continue;
      Pool& p = pools_[g];
      const int32_t block = table.blocks[g][b];
      if (p.node_of[block]) continue;
      const auto twin = p.cached.find(node);
      if (twin != p.cached.end() && p.refcount[twin->second] > 0) continue;  // a twin in use is cached already
      p.node_of[block] = node;
      prefixes_.hold(node);
      if (twin != p.cached.end()) {
        // An idle twin (a prefix match that stopped short left it unused, at the front of the
        // LRU list) gives its place to this copy, which goes back to the list as the most
        // recently used: kept, the twin was the next evicted, by this sequence's next block,
        // and a prompt sent right after itself found none of its prefix.
        const int32_t old = std::exchange(twin->second, block);
        p.idle.erase(p.idle_pos[old]);
        p.free.push_back(old);
        prefixes_.release(std::exchange(p.node_of[old], 0));
      } else {
        p.cached[node] = block;
      }
    }
  }
  // Sliding blocks wholly before the window are never read again.
  if (pools_[kSlidingGroup].num_blocks) {
    const int64_t keep_from = first_needed(kSlidingGroup, table.length());
    auto& blocks = table.blocks[kSlidingGroup];
    for (int64_t b = 0; b < keep_from && b < int64_t(blocks.size()); ++b)
      if (blocks[b] >= 0) drop(kSlidingGroup, std::exchange(blocks[b], -1));
  }
}

std::array<int64_t, kNumGroups> KvCache::most_blocks(int64_t total_tokens, int64_t chunk) const {
  // The sliding layers hold the window and a chunk, in one block more than those tokens fill
  // (the window's start need not be a block's), or the whole sequence where that is shorter (a
  // window far past the sequence, which a config may give, asks no more than full attention;
  // nor does a sequence of one block, which its one sliding block holds: the extra block had
  // left a cache of one sliding block holding no sequence at all).
  const int64_t full = ceil_div(total_tokens, block_size_);
  const int64_t sliding_tokens = std::min(total_tokens, window_ - 1 + chunk);
  return {full, std::min(full, ceil_div(sliding_tokens, block_size_) + 1)};
}

bool KvCache::could_hold(int64_t total_tokens, int64_t chunk) const {
  const std::array<int64_t, kNumGroups> most = most_blocks(total_tokens, chunk);
  for (int g = 0; g < kNumGroups; ++g)
    if (pools_[g].num_blocks && most[g] > pools_[g].num_blocks) return false;
  return true;
}

bool KvCache::could_continue(const KvTable& table, int64_t new_tokens, int64_t chunk) const {
  // At most most_blocks are the table's at once; what is free is its to use, and so are the
  // blocks it holds alone, as the chunks' passes free sliding blocks behind the window (one
  // it shares through the prefix cache stays held by the other).
  const std::array<int64_t, kNumGroups> most = most_blocks(table.length() + new_tokens, chunk);
  for (int g = 0; g < kNumGroups; ++g) {
    const Pool& p = pools_[g];
    if (!p.num_blocks) continue;
    const auto& blocks = table.blocks[g];
    const int64_t own = std::count_if(blocks.begin(), blocks.end(), [&](int32_t b) {
      return b >= 0 && (g == kFullGroup || p.refcount[b] == 1);
    });
    if (most[g] > own + available(KvGroup(g))) return false;
  }
  return true;
}

int64_t KvCache::longest_sequence(int64_t limit, int64_t chunk) const {
  int64_t lo = 0, hi = std::max<int64_t>(0, limit);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (could_hold(mid, chunk)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

int64_t KvCache::match_prefix(KvTable& table, std::span<const int32_t> prompt) {
  if (table.length() != 0) throw InvalidArgument("match_prefix: the sequence is not empty");
  // The prompt's whole blocks' prefix nodes, as far as the tree and the full pool's cache
  // hold them.
  std::vector<uint64_t> nodes;
  const int64_t max_blocks = int64_t(prompt.size()) / block_size_;
  for (int64_t b = 0; b < max_blocks; ++b) {
    const uint64_t node = prefixes_.find(b ? nodes.back() : 0, prompt.subspan(b * block_size_, block_size_));
    if (!node || (pools_[kFullGroup].num_blocks && !pools_[kFullGroup].cached.count(node))) break;
    nodes.push_back(node);
  }
  // The sliding pool must still hold the window before the cut; shorten until it does.
  int64_t k = int64_t(nodes.size());
  auto sliding_ok = [&](int64_t blocks) {
    if (!pools_[kSlidingGroup].num_blocks) return true;
    for (int64_t b = first_needed(kSlidingGroup, blocks * block_size_); b < blocks; ++b)
      if (!pools_[kSlidingGroup].cached.count(nodes[b])) return false;
    return true;
  };
  while (k > 0 && !sliding_ok(k)) --k;
  if (k == 0) return 0;

  for (int g = 0; g < kNumGroups; ++g) {
    if (!pools_[g].num_blocks) continue;
    const int64_t from = first_needed(KvGroup(g), k * block_size_);
    for (int64_t b = 0; b < k; ++b) {
      int32_t block = -1;
      if (b >= from) {
        block = pools_[g].cached.at(nodes[b]);
        take(KvGroup(g), block);
      }
      table.blocks[g].push_back(block);
    }
  }
  table.prefix_nodes.assign(nodes.begin(), nodes.begin() + k);
  for (uint64_t node : table.prefix_nodes) prefixes_.hold(node);
  table.tokens.assign(prompt.begin(), prompt.begin() + k * block_size_);
  return k * block_size_;
}

void KvCache::release(KvTable& table) {
  // Last block first, so that eviction (least recently dropped first) takes a cached prefix
  // from its end: its first block's going takes its prefix node, and with it every later
  // block's only way to be found (dropped first to last, one evicted block had lost a whole
  // cached prefix).
  for (int g = 0; g < kNumGroups; ++g) {
    for (auto b = table.blocks[g].rbegin(); b != table.blocks[g].rend(); ++b)
      if (*b >= 0) drop(KvGroup(g), *b);
    table.blocks[g].clear();
  }
  for (uint64_t node : table.prefix_nodes) prefixes_.release(node);
  table.prefix_nodes.clear();
  table.tokens.clear();
}

int64_t KvCache::slot(const KvTable& table, int layer, int64_t pos) const {
  const int32_t block = table.blocks[group_of_[layer]][pos / block_size_];
  return int64_t(block) * block_size_ + pos % block_size_;
}

std::vector<KeySpan> KvCache::spans(const KvTable& table, int layer, int64_t begin, int64_t end) const {
  std::vector<KeySpan> out;
  const KvRows &k = keys_[layer], &v = values_[layer];
  for (int64_t pos = begin; pos < end;) {
    const int64_t block_end = std::min(end, (pos / block_size_ + 1) * block_size_);
    const int64_t row = slot(table, layer, pos);
    out.push_back(KeySpan{k.row(row), v.row(row), block_end - pos, pos, dtype_});
    pos = block_end;
  }
  return out;
}

}  // namespace diffuserve
