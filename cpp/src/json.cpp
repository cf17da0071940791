// A strict RFC 8259 parser, plus the NaN / Infinity / -Infinity literals that Python's
// json.dump writes. Every read is bounds-checked, so any input either parses or throws.
#include "json.h"

#include <charconv>
#include <limits>
#include <system_error>

#include "diffuserve/errors.h"

namespace diffuserve::json {

const Value* Value::find(const std::string& key) const {
  if (kind != Kind::Object) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &it->second;
}

namespace {

// Deep enough for any real config; shallow enough that recursion cannot exhaust the stack.
constexpr int kMaxDepth = 256;

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xc0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += char(0xe0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  } else {
    out += char(0xf0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3f));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  }
}

// from_chars leaves the value unset when it overflows or underflows; Python gives ±inf or
// ±0 there. Which one follows from the decimal exponent of the leading significant digit.
double out_of_range_value(std::string_view num) {
  bool negative = !num.empty() && num[0] == '-';
  size_t i = negative ? 1 : 0;
  // Position of the first nonzero digit relative to the decimal point.
  int64_t magnitude = 0;
  bool seen_nonzero = false;
  bool in_fraction = false;
  for (; i < num.size() && num[i] != 'e' && num[i] != 'E'; ++i) {
    if (num[i] == '.') {
      in_fraction = true;
    } else if (!seen_nonzero && num[i] == '0') {
      if (in_fraction) --magnitude;
    } else {
      seen_nonzero = true;
      if (!in_fraction) ++magnitude;
    }
  }
  int64_t exponent = 0;
  if (i < num.size()) {
    ++i;
    bool exp_negative = num[i] == '-';
    if (num[i] == '+' || num[i] == '-') ++i;
    for (; i < num.size(); ++i) {
      // Saturate: any exponent this large already decides the answer.
      if (exponent < (int64_t(1) << 40)) exponent = exponent * 10 + (num[i] - '0');
    }
    if (exp_negative) exponent = -exponent;
  }
  double r = magnitude + exponent > 0 ? std::numeric_limits<double>::infinity() : 0.0;
  return negative ? -r : r;
}

}  // namespace

Value parse(std::string_view text, const std::string& what) {
  Reader reader(text, what);
  Value v = reader.value();
  reader.end();
  return v;
}

Kind Reader::next() {
  skip_ws();
  if (at_end()) fail("unexpected end of input");
  switch (text_[pos_]) {
    case '{': return Kind::Object;
    case '[': return Kind::Array;
    case '"': return Kind::String;
    case 't': case 'f': return Kind::Bool;
    case 'n': return Kind::Null;
    default: return Kind::Number;
  }
}

Value Reader::value() {
  Value v;
  switch (v.kind = next()) {
    case Kind::Object:
      object([&](std::string key) {
        Value member = value();
        v.object.insert_or_assign(std::move(key), std::move(member));  // duplicate keys: last wins
      });
      break;
    case Kind::Array:
      array([&] { v.array.push_back(value()); });
      break;
    case Kind::String:
      v.string = string();
      break;
    case Kind::Bool:
      v.boolean = peek() == 't';
      literal(v.boolean ? "true" : "false");
      break;
    case Kind::Null:
      literal("null");
      break;
    case Kind::Number:
      number(v);
      break;
  }
  return v;
}

void Reader::skip() {
  switch (next()) {
    case Kind::Object: object([&](std::string) { skip(); }); break;
    case Kind::Array: array([&] { skip(); }); break;
    default: value(); break;  // a scalar, no larger than its text
  }
}

// Past the opening bracket of an object or array, one level deeper.
void Reader::open(char bracket) {
  if (next() != (bracket == '{' ? Kind::Object : Kind::Array))
    fail(bracket == '{' ? "expected an object" : "expected an array");
  if (++depth_ > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
  ++pos_;
  skip_ws();
}

void Reader::object(const std::function<void(std::string key)>& member) {
  open('{');
  if (!consume('}')) {
    while (true) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      std::string key = string();
      skip_ws();
      if (!consume(':')) fail("expected ':'");
      member(std::move(key));
      skip_ws();
      if (consume('}')) break;
      if (!consume(',')) fail("expected ',' or '}'");
    }
  }
  --depth_;
}

void Reader::array(const std::function<void()>& element) {
  open('[');
  if (!consume(']')) {
    while (true) {
      element();
      skip_ws();
      if (consume(']')) break;
      if (!consume(',')) fail("expected ',' or ']'");
    }
  }
  --depth_;
}

void Reader::end() {
  skip_ws();
  if (pos_ != text_.size()) fail("unexpected trailing characters");
}

void Reader::fail(const std::string& msg) const {
  throw FormatError(what_ + ": invalid JSON at byte " + std::to_string(pos_) + ": " + msg);
}

void Reader::skip_ws() {
  while (!at_end()) {
    char c = text_[pos_];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    ++pos_;
  }
}

// Consumes `word` if the text continues with it.
bool Reader::accept(std::string_view word) {
  if (text_.substr(pos_, word.size()) != word) return false;
  pos_ += word.size();
  return true;
}

bool Reader::consume(char c) {
  if (peek() != c) return false;
  ++pos_;
  return true;
}

void Reader::literal(std::string_view word) {
  if (!accept(word)) fail("invalid literal");
}

uint32_t Reader::hex4() {
  if (text_.size() - pos_ < 4) fail("truncated \\u escape");
  uint32_t cp = 0;
  for (int i = 0; i < 4; ++i) {
    char c = text_[pos_];
    uint32_t d;
    if (is_digit(c)) d = uint32_t(c - '0');
    else if (c >= 'a' && c <= 'f') d = uint32_t(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') d = uint32_t(c - 'A' + 10);
    else fail("invalid hex digit in \\u escape");
    cp = cp * 16 + d;
    ++pos_;
  }
  return cp;
}

// After the 'u' of a \u escape: one code point, pairing surrogates.
uint32_t Reader::unicode_escape() {
  uint32_t cp = hex4();
  if (cp >= 0xdc00 && cp <= 0xdfff) fail("unpaired low surrogate in \\u escape");
  if (cp >= 0xd800 && cp <= 0xdbff) {
    if (!accept("\\u")) fail("high surrogate not followed by a \\u low surrogate");
    uint32_t lo = hex4();
    if (lo < 0xdc00 || lo > 0xdfff) fail("high surrogate not followed by a low surrogate");
    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
  }
  return cp;
}

// Copies one UTF-8 sequence, rejecting overlong forms, surrogates and values past U+10FFFF
// (RFC 8259 requires the text to be UTF-8).
void Reader::utf8_sequence(std::string& out) {
  auto lead = uint8_t(text_[pos_]);
  size_t len;
  uint32_t cp;
  uint32_t min;  // smallest code point this length may encode
  if (lead >= 0xc2 && lead <= 0xdf) {
    len = 2;
    cp = lead & 0x1fu;
    min = 0x80;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    len = 3;
    cp = lead & 0x0fu;
    min = 0x800;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    len = 4;
    cp = lead & 0x07u;
    min = 0x10000;
  } else {
    fail("invalid UTF-8");
  }
  if (text_.size() - pos_ < len) fail("truncated UTF-8 sequence");
  for (size_t i = 1; i < len; ++i) {
    auto b = uint8_t(text_[pos_ + i]);
    if ((b & 0xc0) != 0x80) fail("invalid UTF-8");
    cp = (cp << 6) | (b & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) fail("invalid UTF-8");
  out.append(text_.substr(pos_, len));
  pos_ += len;
}

std::string Reader::string() {
  ++pos_;  // opening quote
  std::string out;
  while (true) {
    if (at_end()) fail("unterminated string");
    char c = text_[pos_];
    if (c == '"') {
      ++pos_;
      return out;
    }
    if (uint8_t(c) < 0x20) fail("unescaped control character in string");
    if (uint8_t(c) >= 0x80) {
      utf8_sequence(out);
      continue;
    }
    ++pos_;
    if (c != '\\') {
      out += c;
      continue;
    }
    if (at_end()) fail("unterminated string");
    char e = text_[pos_++];
    switch (e) {
      case '"': out += '"'; break;
      case '\\': out += '\\'; break;
      case '/': out += '/'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'u': append_utf8(out, unicode_escape()); break;
      default: --pos_; fail("invalid escape in string");
    }
  }
}

// Consumes a run of digits; returns how many.
size_t Reader::digits() {
  size_t start = pos_;
  while (is_digit(peek())) ++pos_;
  return pos_ - start;
}

void Reader::number(Value& v) {
  v.kind = Kind::Number;
  size_t start = pos_;
  bool negative = consume('-');
  if (accept("Infinity")) {
    v.number = negative ? -std::numeric_limits<double>::infinity()
                        : std::numeric_limits<double>::infinity();
    return;
  }
  if (!negative && accept("NaN")) {
    v.number = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  if (!consume('0') && digits() == 0) {
    fail(negative ? "expected a digit after '-'" : "expected a value");
  }
  bool integral = true;
  if (consume('.')) {
    integral = false;
    if (digits() == 0) fail("expected a digit after '.'");
  }
  if (consume('e') || consume('E')) {
    integral = false;
    if (!consume('+')) consume('-');
    if (digits() == 0) fail("expected a digit in the exponent");
  }
  const char* first = text_.data() + start;
  const char* last = text_.data() + pos_;

  if (integral) {
    auto [ptr, ec] = std::from_chars(first, last, v.integer);
    v.is_integer = ec == std::errc() && ptr == last;
    if (!v.is_integer) v.integer = 0;
  }
  auto [ptr, ec] = std::from_chars(first, last, v.number);
  if (ec == std::errc::result_out_of_range) {
    v.number = out_of_range_value(std::string_view(first, size_t(last - first)));
  } else if (ec != std::errc() || ptr != last) {
    fail("invalid number");  // cannot happen for text matching the grammar above
  }
}


}  // namespace diffuserve::json
