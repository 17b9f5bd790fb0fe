// The strict JSON reader of nexuskv/core/json.h: recursive descent over the
// text, depth bounded.
#include "nexuskv/core/json.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>
#include <unordered_set>

namespace nexuskv::core::json {
namespace {

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  Value document() {
    skip_space();
    Value v = value(0);
    skip_space();
    if (pos_ != s_.size()) fail("the end of the text after the value");
    return v;
  }

 private:
  std::string_view s_;
  size_t pos_ = 0;
  int64_t values_ = 0;

  [[noreturn]] void fail(const std::string& expected) const {
    std::string got = pos_ < s_.size() ? "'" + printable(s_[pos_]) + "'" : "the end of the text";
    throw ParseError("JSON: expected " + expected + " at byte " + std::to_string(pos_) + ", got " + got);
  }
  static std::string printable(char c) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) return std::string(1, c);
    static const char* hex = "0123456789abcdef";
    return std::string("\\x") + hex[u >> 4] + hex[u & 15];
  }

  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool take(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) return ++pos_, true;
    return false;
  }
  void expect_word(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) {
      std::string quoted(1, '\'');  // (built up: GCC 12 warns falsely on "'" + std::string)
      quoted.append(word).push_back('\'');
      fail(quoted);
    }
    pos_ += word.size();
  }

  Value value(int depth) {
    if (depth >= kMaxDepth) fail("at most " + std::to_string(kMaxDepth) + " levels of nesting");
    if (++values_ > kMaxValues) fail("at most " + std::to_string(kMaxValues) + " values in the text");
    Value v;
    if (pos_ >= s_.size()) fail("a value");
    switch (s_[pos_]) {
      case '{': object(v, depth); break;
      case '[': array(v, depth); break;
      case '"': v.kind = Value::Kind::String, v.string = string(); break;
      case 't': expect_word("true"), v.kind = Value::Kind::Bool, v.boolean = true; break;
      case 'f': expect_word("false"), v.kind = Value::Kind::Bool; break;
      case 'n': expect_word("null"); break;
      // Python's json writes these for float('nan') and +-inf (recipe headers can hold them).
      case 'N': expect_word("NaN"), v.kind = Value::Kind::Number, v.number = std::nan(""); break;
      case 'I': expect_word("Infinity"), v.kind = Value::Kind::Number, v.number = HUGE_VAL; break;
      default:
        if (s_.substr(pos_, 9) == "-Infinity") {
          pos_ += 9, v.kind = Value::Kind::Number, v.number = -HUGE_VAL;
          break;
        }
        number(v);
        break;
    }
    return v;
  }

  void object(Value& v, int depth) {
    v.kind = Value::Kind::Object;
    ++pos_;  // '{'
    skip_space();
    if (take('}')) return;
    std::unordered_set<std::string> seen;  // (find() per key would be quadratic in the members)
    for (;;) {
      skip_space();
      if (pos_ >= s_.size() || s_[pos_] != '"') fail("a string (an object key)");
      const size_t at = pos_;
      std::string key = string();
      if (!seen.insert(key).second) {
        pos_ = at;
        fail("a key not seen before in this object (\"" + key + "\" is repeated)");
      }
      skip_space();
      if (!take(':')) fail("':'");
      skip_space();
      v.object.emplace_back(std::move(key), value(depth + 1));
      skip_space();
      if (take('}')) return;
      if (!take(',')) fail("',' or '}'");
    }
  }

  void array(Value& v, int depth) {
    v.kind = Value::Kind::Array;
    ++pos_;  // '['
    skip_space();
    if (take(']')) return;
    for (;;) {
      skip_space();
      v.array.push_back(value(depth + 1));
      skip_space();
      if (take(']')) return;
      if (!take(',')) fail("',' or ']'");
    }
  }

  unsigned hex4() {
    unsigned u = 0;
    for (int i = 0; i < 4; ++i, ++pos_) {
      if (pos_ >= s_.size()) fail("four hex digits after \\u");
      const char c = s_[pos_];
      const int d = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
      if (d < 0) fail("four hex digits after \\u");
      u = u * 16 + unsigned(d);
    }
    return u;
  }
  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xc0 | (cp >> 6)), out += char(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += char(0xe0 | (cp >> 12)), out += char(0x80 | ((cp >> 6) & 0x3f)), out += char(0x80 | (cp & 0x3f));
    } else {
      out += char(0xf0 | (cp >> 18)), out += char(0x80 | ((cp >> 12) & 0x3f));
      out += char(0x80 | ((cp >> 6) & 0x3f)), out += char(0x80 | (cp & 0x3f));
    }
  }

  // One multi-byte UTF-8 sequence, checked (RFC 3629: no overlong forms, no
  // surrogates, nothing above U+10FFFF) and copied.
  void utf8_sequence(std::string& out) {
    const auto byte = [&](size_t i) { return pos_ + i < s_.size() ? static_cast<unsigned char>(s_[pos_ + i]) : 0u; };
    const unsigned lead = byte(0);
    const int n = lead >= 0xc2 && lead <= 0xdf   ? 2
                  : lead >= 0xe0 && lead <= 0xef ? 3
                  : lead >= 0xf0 && lead <= 0xf4 ? 4
                                                 : 0;
    if (n == 0) fail("valid UTF-8 in a string");
    unsigned cp = lead & (0xff >> (n + 1));
    for (int i = 1; i < n; ++i) {
      if ((byte(size_t(i)) & 0xc0) != 0x80) fail("valid UTF-8 in a string");
      cp = cp << 6 | (byte(size_t(i)) & 0x3f);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) || (cp >= 0xd800 && cp < 0xe000))
      fail("valid UTF-8 in a string");
    out.append(s_.substr(pos_, size_t(n)));
    pos_ += size_t(n);
  }

  std::string string() {
    ++pos_;  // '"'
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail("'\"' (the end of the string)");
      const char c = s_[pos_];
      if (c == '"') return ++pos_, out;
      if (static_cast<unsigned char>(c) < 0x20) fail("no raw control character in a string");
      if (static_cast<unsigned char>(c) >= 0x80) {
        utf8_sequence(out);
        continue;
      }
      if (c != '\\') {
        out += c, ++pos_;
        continue;
      }
      ++pos_;
      if (pos_ >= s_.size()) fail("an escape after '\\'");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          // A high surrogate followed by a low one is one code point; a surrogate alone
          // (Python's json writes one for each undecodable byte of a path, \udcXX) is kept
          // as its three-byte form, as Python's "surrogatepass" would.
          if (cp >= 0xd800 && cp < 0xdc00 && s_.substr(pos_, 2) == "\\u") {
            const size_t before = pos_;
            pos_ += 2;
            const unsigned lo = hex4();
            if (lo >= 0xdc00 && lo < 0xe000)
              cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            else
              pos_ = before;  // not a pair: the next escape stands alone
          }
          append_utf8(out, cp);
          break;
        }
        default: --pos_, fail("one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u");
      }
    }
  }

  void number(Value& v) {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    take('-');
    if (take('0')) {
      if (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') fail("no leading zero in a number");
    } else if (digits() == 0) {
      fail("a value");
    }
    bool integral = true;
    if (take('.')) {
      integral = false;
      if (digits() == 0) fail("a digit after '.'");
    }
    if (take('e') || take('E')) {
      integral = false;
      if (!take('+')) take('-');
      if (digits() == 0) fail("a digit in the exponent");
    }
    const std::string text(s_.substr(start, pos_ - start));
    v.kind = Value::Kind::Number;
    v.number = std::strtod(text.c_str(), nullptr);  // ERANGE: +-inf or 0, kept as a double only
    if (integral) {
      errno = 0;
      const long long i = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == 0) v.is_integer = true, v.integer = i;
    }
  }
};

}  // namespace

const Value* Value::find(std::string_view key) const {
  if (kind != Kind::Object) return nullptr;
  for (const auto& [k, v] : object)
    if (k == key) return &v;
  return nullptr;
}

const char* Value::kind_name() const {
  switch (kind) {
    case Kind::Null: return "null";
    case Kind::Bool: return "a boolean";
    case Kind::Number: return is_integer ? "an integer" : "a number";
    case Kind::String: return "a string";
    case Kind::Array: return "an array";
    case Kind::Object: return "an object";
  }
  return "a value";
}

Value parse(std::string_view text) { return Parser(text).document(); }

}  // namespace nexuskv::core::json
