#include "safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>

#include "diffuserve/errors.h"
#include "json.h"

namespace diffuserve {

std::string shape_string(const std::vector<int64_t>& shape) {
  // A malformed header's shape may have millions of dimensions: a message tells the first.
  constexpr size_t kShown = 16;
  std::string s = "[";
  for (size_t i = 0; i < shape.size() && i < kShown; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() > kShown) s += ", ... (" + std::to_string(shape.size()) + " dimensions)";
  return s + "]";
}

namespace {

// Real headers are a few MB at most; a larger length means a corrupt or hostile file.
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;
// An index names each tensor once: a few MB for the largest checkpoints published.
constexpr uint64_t kMaxIndexBytes = 64ull * 1000 * 1000;

std::string range_string(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

bool is_non_negative_integer(const json::Value& v) {
  return v.is_number() && v.is_integer && v.integer >= 0;
}

// What the next value of `header` held, read as an array of sizes.
enum class Sizes { NotAnArray, NotAllSizes, Read };

// Reads the next value of `header`, where an array of non-negative integers is expected, into
// `out` (what is past an element that is not one: read and dropped).
Sizes read_sizes(json::Reader& header, std::vector<int64_t>& out) {
  out.clear();
  if (header.next() != json::Kind::Array) {
    header.skip();
    return Sizes::NotAnArray;
  }
  Sizes read = Sizes::Read;
  header.array([&] {
    if (read != Sizes::Read || header.next() != json::Kind::Number) {
      header.skip();
      read = Sizes::NotAllSizes;
      return;
    }
    const json::Value size = header.value();
    if (is_non_negative_integer(size)) out.push_back(size.integer);
    else read = Sizes::NotAllSizes;
  });
  return read;
}

// Reads the next value of `header`, tensor `name`'s entry, into its TensorView, checking it
// against a data section of `data_size` bytes at `data`. Its fields may come in any order
// (of a field given twice, the last counts; unknown ones are passed over); what is wrong is
// told in one order, dtype, shape, data_offsets.
TensorView read_entry(json::Reader& header, const std::string& path, const std::string& name, const uint8_t* data,
                      uint64_t data_size) {
  const std::string where = path + ": tensor '" + name + "': ";
  if (header.next() != json::Kind::Object) throw FormatError(where + "header entry is not a JSON object");

  TensorView t;
  t.name = name;
  t.file = path;
  std::optional<std::string> dtype;  // none: missing, or not a string
  Sizes shape = Sizes::NotAnArray, data_offsets = Sizes::NotAnArray;
  std::vector<int64_t> offsets;
  header.object([&](std::string key) {
    if (key == "dtype" && header.next() == json::Kind::String) {
      dtype = header.value().string;
    } else if (key == "dtype") {
      dtype.reset();
      header.skip();
    } else if (key == "shape") {
      shape = read_sizes(header, t.shape);
    } else if (key == "data_offsets") {
      data_offsets = read_sizes(header, offsets);
    } else {
      header.skip();
    }
  });

  if (!dtype) throw FormatError(where + "missing or non-string \"dtype\"");
  if (!dtype_from_name(*dtype, &t.dtype)) {
    throw FormatError(path + ": unknown dtype '" + *dtype + "' for tensor '" + name + "'");
  }
  if (shape == Sizes::NotAnArray) throw FormatError(where + "missing or non-array \"shape\"");
  if (shape == Sizes::NotAllSizes) throw FormatError(where + "\"shape\" entries must be non-negative integers");
  if (data_offsets != Sizes::Read || offsets.size() != 2) {
    throw FormatError(where + "\"data_offsets\" must be two non-negative integers [begin, end]");
  }
  const auto begin = uint64_t(offsets[0]), end = uint64_t(offsets[1]);
  const std::string range = range_string(begin, end);
  if (begin > end) throw FormatError(where + "data_offsets " + range + " end before they begin");
  if (end > data_size) {
    throw FormatError(where + "data_offsets " + range + " run past the end of the data section (" +
                      std::to_string(data_size) +
                      " bytes): the file is truncated or the offsets are out of range");
  }

  // Every dimension is non-negative, so only overflow can make the byte count wrong. Element
  // counts are int64 products of the dimensions in order (numel): with a zero among them the
  // bytes are none, but the product of the others must still fit.
  const std::string what = "shape " + shape_string(t.shape) + " of dtype " + dtype_name(t.dtype);
  uint64_t needed = dtype_size(t.dtype);
  int64_t elements = 1;
  bool too_many = false;
  for (int64_t dim : t.shape) {
    if (__builtin_mul_overflow(needed, uint64_t(dim), &needed)) {
      throw FormatError(where + what + " needs more than 2^64 bytes");
    }
    too_many |= dim && __builtin_mul_overflow(elements, dim, &elements);
  }
  if (needed != end - begin) {
    throw FormatError(where + what + " needs " + std::to_string(needed) +
                      " bytes but data_offsets give " + std::to_string(end - begin));
  }
  if (too_many) throw FormatError(where + what + ": its nonzero dimensions' product passes 2^63");

  t.data = data + begin;
  t.nbytes = size_t(end - begin);
  return t;
}

// The tensors' bytes, in order, tile the data section exactly, as safetensors' own reader
// requires: two tensors sharing bytes would alias weights (a writer's bug), and bytes that
// no tensor claims mean a header entry is missing (a tensor named twice keeps one of its
// entries; a repeat of the same entry leaves nothing unclaimed and loads, as there).
void check_coverage(const std::string& path, const std::map<std::string, TensorView>& tensors, const uint8_t* data,
                    uint64_t data_size) {
  std::vector<const TensorView*> spans;
  for (const auto& [name, t] : tensors) spans.push_back(&t);
  std::sort(spans.begin(), spans.end(), [](const TensorView* a, const TensorView* b) {
    return a->data != b->data ? a->data < b->data : a->nbytes < b->nbytes;
  });
  auto begin = [data](const TensorView& t) { return uint64_t(t.data - data); };
  auto range = [&](const TensorView& t) { return range_string(begin(t), begin(t) + t.nbytes); };
  // Sorted by start, any overlap shows up between neighbours (an empty range inside another
  // counts, as safetensors counts it; at another's start or end it does not).
  for (size_t i = 1; i < spans.size(); ++i) {
    const TensorView& a = *spans[i - 1];
    const TensorView& b = *spans[i];
    if (b.data < a.data + a.nbytes)
      throw FormatError(path + ": tensors '" + a.name + "' " + range(a) + " and '" + b.name + "' " + range(b) +
                        " have overlapping data_offsets");
  }
  uint64_t at = 0;  // the end of the bytes claimed so far
  for (const TensorView* t : spans) {
    if (begin(*t) > at)
      throw FormatError(path + ": data section bytes " + range_string(at, begin(*t)) + " before tensor '" + t->name +
                        "' belong to no tensor (a header entry missing, or a tensor named twice)");
    at = begin(*t) + t->nbytes;
  }
  if (at != data_size)
    throw FormatError(path + ": data section bytes " + range_string(at, data_size) +
                      " at its end belong to no tensor (a header entry missing, or a tensor named twice)");
}

// The file at `path` opened for reading, with its size: a regular file, else FormatError
// naming it. O_NONBLOCK keeps a FIFO from blocking the open until some writer comes (on a
// regular file it changes nothing).
struct OpenFile {
  int fd;
  uint64_t size;
};
OpenFile open_regular_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw FormatError(path + ": cannot open: " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw FormatError(path + ": cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw FormatError(path + ": not a regular file");
  }
  return {fd, uint64_t(st.st_size)};
}

// weight_map values name files under the index's directory, in it or in a subdirectory (as
// transformers reads them); an absolute path or a ".." could escape it.
bool is_inside_directory(const std::string& name) {
  if (name.empty() || name.find('\0') != std::string::npos) return false;
  const std::filesystem::path path(name);
  if (path.is_absolute() || !path.has_filename()) return false;
  return std::none_of(path.begin(), path.end(), [](const std::filesystem::path& part) { return part == ".."; });
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string read_text_file(const std::string& path, uint64_t max_bytes) {
  const auto [fd, size] = open_regular_file(path);
  auto too_large = [&](uint64_t bytes) {
    ::close(fd);
    return FormatError(path + ": " + std::to_string(bytes) + " bytes, over the limit of " + std::to_string(max_bytes) +
                       " for this file (a real one is far smaller: corrupt, or not this file)");
  };
  if (size > max_bytes) throw too_large(size);
  std::string text;
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      throw FormatError(path + ": cannot read: " + std::strerror(err));
    }
    if (n == 0) break;
    if (text.size() + size_t(n) > max_bytes) throw too_large(text.size() + size_t(n));  // grew while read
    text.append(buf, size_t(n));
  }
  ::close(fd);
  return text;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const auto [fd, size] = open_regular_file(path);
  // Also keeps an empty file away from mmap, which rejects a length of 0.
  if (size < 8) {
    ::close(fd);
    throw FormatError(path + ": file is " + std::to_string(size) +
                      " bytes, too short for a safetensors header");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) throw FormatError(path + ": cannot mmap: " + std::strerror(map_errno));
  map_ = map;
  map_size_ = size;

  // The destructor does not run when a constructor throws, so unmap here on failure.
  try {
    const auto* bytes = static_cast<const uint8_t*>(map_);
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];  // little-endian
    if (header_len > size - 8) {
      throw FormatError(path + ": bad header length " + std::to_string(header_len) + ": only " +
                        std::to_string(size - 8) +
                        " bytes follow it (truncated, or not a safetensors file)");
    }
    if (header_len > kMaxHeaderBytes) {
      throw FormatError(path + ": bad header length " + std::to_string(header_len) +
                        ": over the limit of " + std::to_string(kMaxHeaderBytes) + " bytes");
    }
    // Read a value at a time, not parsed whole: a 100 MB header would take gigabytes as
    // json::Values (9 GB for one array of zeros), its tensors a few hundred MB at most. Its
    // syntax is checked first, so that a malformed header is told as such, not by what it
    // means up to the fault.
    const std::string_view text(reinterpret_cast<const char*>(bytes + 8), size_t(header_len));
    const std::string what = path + ": header";
    json::Reader syntax(text, what);
    syntax.skip();
    syntax.end();
    json::Reader header(text, what);
    if (header.next() != json::Kind::Object) throw FormatError(path + ": header is not a JSON object");
    const uint8_t* data = bytes + 8 + header_len;
    const uint64_t data_size = size - 8 - header_len;
    header.object([&](std::string name) {
      if (name != "__metadata__") {  // a tensor named twice: its last entry counts, as in safetensors
        tensors_.insert_or_assign(name, read_entry(header, path, name, data, data_size));
        return;
      }
      // Free-form string metadata; nothing here reads it, but a bad one means a bad file.
      if (header.next() != json::Kind::Object) throw FormatError(path + ": __metadata__ is not a JSON object");
      header.object([&](std::string key) {
        if (header.next() != json::Kind::String)
          throw FormatError(path + ": __metadata__ value for '" + key + "' is not a string");
        header.skip();
      });
    });
    check_coverage(path, tensors_, data, data_size);
  } catch (...) {
    ::munmap(map_, map_size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { ::munmap(map_, map_size_); }

Checkpoint::Checkpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (dir.ends_with(".safetensors") && !fs::is_directory(dir, ec)) {
    files_.push_back(std::make_unique<SafetensorsFile>(dir));
    tensors_ = files_.back()->tensors();
    return;
  }

  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  const std::string single_path = (fs::path(dir) / "model.safetensors").string();
  // A single file wins over an index beside it, as transformers' from_pretrained chooses: the
  // two may hold different weights (shards left from an earlier save), and this loads the ones
  // the reference runs.
  if (fs::exists(single_path, ec)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single_path));
    tensors_ = files_.back()->tensors();
    return;
  }
  if (!fs::exists(index_path, ec)) {
    // A link to nothing (a half-cleaned Hugging Face cache is made of links) is named as such.
    for (const std::string& path : {single_path, index_path})
      if (fs::is_symlink(path, ec))
        throw FormatError(path + ": a symbolic link to " + fs::read_symlink(path, ec).string() +
                          ", which does not exist");
    throw FormatError(dir + ": no model.safetensors or model.safetensors.index.json");
  }

  // weight_map read an entry at a time, as a safetensors header is (its syntax checked first),
  // and the rest (metadata) passed over: parsed whole, an index at its size limit would take
  // gigabytes as json::Values.
  const std::string text = read_text_file(index_path, kMaxIndexBytes);
  json::Reader syntax(text, index_path);
  syntax.skip();
  syntax.end();
  json::Reader index(text, index_path);
  // A repeated key's last value counts, as for any JSON key (Python's json, and so transformers,
  // read it so): each value is judged once the whole index is read. Tensor -> shard, or none
  // where its entry is not a string.
  std::optional<json::Kind> weight_map_kind;
  std::map<std::string, std::optional<std::string>> weight_map;
  if (index.next() == json::Kind::Object)
    index.object([&](std::string key) {
      if (key != "weight_map") return index.skip();
      weight_map.clear();
      if ((weight_map_kind = index.next()) != json::Kind::Object) return index.skip();
      index.object([&](std::string name) {
        std::optional<std::string> shard;
        if (index.next() == json::Kind::String) shard = index.value().string;
        else index.skip();
        weight_map.insert_or_assign(std::move(name), std::move(shard));
      });
    });
  if (!weight_map_kind) throw FormatError(index_path + ": missing \"weight_map\"");
  if (weight_map_kind != json::Kind::Object) throw FormatError(index_path + ": \"weight_map\" is not a JSON object");
  for (const auto& [name, shard] : weight_map)
    if (!shard) throw FormatError(index_path + ": weight_map entry for tensor '" + name + "' is not a string");
  // Shard file name (as a path, normalized: "./a" and "a" are one file, as transformers
  // reads them) -> its opened file, filled in below.
  auto shard_key = [](const std::string& shard) { return fs::path(shard).lexically_normal().string(); };
  std::map<std::string, const SafetensorsFile*> shards;
  for (const auto& [name, shard] : weight_map) {
    if (!is_inside_directory(*shard)) {
      throw FormatError(index_path + ": weight_map entry for tensor '" + name + "' names '" + *shard +
                        "', which is not a file inside " + dir);
    }
    shards.emplace(shard_key(*shard), nullptr);
  }

  // Each shard is opened once; a tensor in a shard but not in weight_map is still loaded,
  // but one stored in two shards is ambiguous.
  for (auto& [shard, file] : shards) {
    files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / shard).string()));
    file = files_.back().get();
    for (const auto& [name, t] : file->tensors()) {
      auto [it, inserted] = tensors_.emplace(name, t);
      if (!inserted) {
        throw FormatError(index_path + ": tensor '" + name + "' is stored in both " +
                          it->second.file + " and " + t.file);
      }
    }
  }
  for (const auto& [name, shard] : weight_map) {
    if (!shards.at(shard_key(*shard))->tensors().contains(name)) {
      throw FormatError(index_path + ": tensor '" + name + "' is listed in weight_map under " + *shard +
                        " but that shard does not contain it");
    }
  }
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void Checkpoint::prefix_names_of_base_model(const std::string& prefix) {
  if (std::any_of(tensors_.begin(), tensors_.end(), [&](const auto& named) { return named.first.starts_with(prefix); }))
    return;
  std::map<std::string, TensorView> prefixed;
  for (auto& [name, view] : tensors_) prefixed.emplace(prefix + name, std::move(view));
  tensors_ = std::move(prefixed);
  added_prefix_ = prefix;
}

}  // namespace diffuserve
