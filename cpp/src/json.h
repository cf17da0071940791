// A small JSON reader: enough for config.json, generation_config.json, safetensors
// headers and index files. Parse errors throw diffuserve::FormatError with the byte offset.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace diffuserve::json {

enum class Kind { Null, Bool, Number, String, Array, Object };

class Value {
 public:
  Kind kind = Kind::Null;
  bool boolean = false;
  double number = 0.0;
  bool is_integer = false;   // the literal had no fraction or exponent
  int64_t integer = 0;       // exact value when is_integer
  std::string string;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  bool is_null() const { return kind == Kind::Null; }
  bool is_object() const { return kind == Kind::Object; }
  bool is_array() const { return kind == Kind::Array; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Number; }
  bool is_bool() const { return kind == Kind::Bool; }

  // Member lookup on an object; nullptr when absent (or when this is not an object).
  const Value* find(const std::string& key) const;
};

// Parses a whole document; trailing non-whitespace is an error. `what` names the
// source (a file path) in error messages.
Value parse(std::string_view text, const std::string& what);

}  // namespace diffuserve::json
