// A strict JSON reader (RFC 8259) for the headers of the files nexuskv reads
// in C++: a safetensors file's header and the recipe JSON inside its metadata
// (safetensors.h, nexuskv/recipe.h).  Torch-free, host only, not a kernel.
//
// Why our own: LibTorch ships no JSON library in its public headers, and these
// headers are small and written by nexuskv (or safetensors) itself; what must
// not happen is a crash, a hang or a silent misreading on a damaged file.  So
// the reader is strict: one value, whitespace around it only; no trailing
// commas, comments or leading zeros; strings must be valid UTF-8 and valid
// escapes (\uXXXX with paired surrogates becomes UTF-8) without raw control
// characters; duplicate object keys are refused; nesting deeper than kMaxDepth
// and more than kMaxValues values are refused (no stack overflow, bounded
// memory, work linear in the text).  What Python's json module writes by
// default is read too: NaN, Infinity, -Infinity, and a lone surrogate escape
// (kept in its three-byte form).  Errors are ParseError (a std::runtime_error)
// naming the byte offset and what was expected there.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace nexuskv::core::json {

struct ParseError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr int kMaxDepth = 64;
constexpr int64_t kMaxValues = int64_t(1) << 20;

struct Value {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  double number = 0;        // every number
  bool is_integer = false;  // written without fraction or exponent, and within int64
  int64_t integer = 0;      // its exact value then
  std::string string;       // UTF-8
  std::vector<Value> array;
  std::vector<std::pair<std::string, Value>> object;  // in file order, keys unique

  // The member `key` of an object, nullptr when absent (or not an object).
  const Value* find(std::string_view key) const;
  // What the kind is called in messages ("an object", "a string", ...).
  const char* kind_name() const;
};

// Parses one JSON text; throws ParseError.
Value parse(std::string_view text);

}  // namespace nexuskv::core::json
