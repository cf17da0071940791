// A small JSON reader: enough for config.json, generation_config.json, safetensors
// headers and index files. Parse errors throw diffuserve::FormatError with the byte offset.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
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

// An ASCII digit (std::isdigit takes an unsigned char's value: a negative char, any byte of a
// UTF-8 character, is undefined there).
inline bool is_digit(char c) { return c >= '0' && c <= '9'; }

// A document read one value at a time, in order, for text too large to hold whole as Values:
// a safetensors header may be 100 MB, which as Values would take gigabytes (a Value is over
// a hundred bytes, an array's 0 two). parse() reads through it too, so the errors are the
// same. Each read takes the next value; after an error the reader is done.
class Reader {
 public:
  Reader(std::string_view text, std::string what) : text_(text), what_(std::move(what)) {}

  // The next value's kind, from its first character (whitespace skipped); a value that then
  // turns out malformed (a number's kind is the default) throws as it is read.
  Kind next();
  Value value();  // the next value, whole
  void skip();    // the next value, checked and dropped: only its strings are held, one at a time
  // The next value, an object (next() says): member(key) for each member in order, which
  // must read the member's value (value, skip, object or array, once).
  void object(const std::function<void(std::string key)>& member);
  // The next value, an array: element() for each element in order, which reads it.
  void array(const std::function<void()>& element);
  void end();  // only whitespace is left

 private:
  std::string_view text_;
  std::string what_;  // the source, for error messages
  size_t pos_ = 0;
  int depth_ = 0;  // objects and arrays open around the position

  [[noreturn]] void fail(const std::string& msg) const;
  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }
  void skip_ws();
  bool accept(std::string_view word);
  bool consume(char c);
  void literal(std::string_view word);
  void open(char bracket);
  uint32_t hex4();
  uint32_t unicode_escape();
  void utf8_sequence(std::string& out);
  std::string string();
  size_t digits();
  void number(Value& v);
};

}  // namespace diffuserve::json
