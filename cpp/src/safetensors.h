// Reads safetensors checkpoints by memory-mapping them: a single `model.safetensors`, or
// shards listed by `model.safetensors.index.json`. Every header is checked in full when
// the file is opened (header length, JSON, dtypes, shapes against byte counts, offsets
// inside the data section and not overlapping), so later reads cannot go out of bounds.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "diffuserve/dtype.h"

namespace diffuserve {

// "[2, 3]": how error messages spell a shape (its first 16 dimensions and their count past that).
std::string shape_string(const std::vector<int64_t>& shape);

// The whole of the regular file at `path` (config.json, an index): FormatError naming it
// when it cannot be opened or read, is not a regular file (a FIFO, a directory), or is
// larger than `max_bytes` (a hostile or corrupt file, kept from taking the memory).
std::string read_text_file(const std::string& path, uint64_t max_bytes);

// A tensor inside a mapped file: no copy, valid while its SafetensorsFile lives.
struct TensorView {
  std::string name;
  std::string file;  // the path it came from, for error messages
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
};

// One mapped .safetensors file.
class SafetensorsFile {
 public:
  // Throws FormatError naming `path` (and the tensor, where one is at fault).
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

// All tensors of a checkpoint directory, across shards.
class Checkpoint {
 public:
  // `dir` holds model.safetensors or model.safetensors.index.json (the single file wins, as in transformers).
  explicit Checkpoint(const std::string& dir);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorView* find(const std::string& name) const;
  // Where no tensor's name starts with `prefix`, every name gets it: a base model's checkpoint
  // read as the full model's (whose base model's tensors are under "model."), as transformers
  // loads one. Each view keeps its stored name, for messages.
  void prefix_names_of_base_model(const std::string& prefix);
  // The prefix that prefix_names_of_base_model gave every name ("" where it gave none).
  const std::string& added_prefix() const { return added_prefix_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView> tensors_;
  std::string added_prefix_;
};

}  // namespace diffuserve
