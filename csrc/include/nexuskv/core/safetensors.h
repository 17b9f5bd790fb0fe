// Reading a safetensors file (the container of nexuskv's recipes): torch-free,
// host only.
//
// The format (huggingface/safetensors): 8 bytes, the header's length N as a
// little-endian uint64; N bytes of JSON, an object whose members are tensors,
// {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, and
// optionally "__metadata__", an object of strings; then the data, each
// tensor's bytes at [begin, end) of it, little-endian, row-major.
//
// Everything is checked before any byte is handed out, so that a damaged or
// foreign file is an error naming what is wrong, never a read out of bounds:
// the file's length against the header's, the JSON (strictly: json.h), each
// entry's dtype (element_size() knows it), shape (integers >= 0) and offsets
// (inside the data, end - begin = elements x element size, no overflow), and
// that the entries index the data whole, without holes or overlaps.  Errors are
// FormatError.  The file is read whole (recipes are kilobytes; kMaxBytes caps it).
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace nexuskv::core::safetensors {

struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr uint64_t kMaxHeaderBytes = 100000000;    // the safetensors library's own limit
constexpr uint64_t kMaxBytes = uint64_t(1) << 30;  // the most read() loads into memory

struct Entry {
  std::string dtype;  // "F32", "I32", ... (element_size() > 0)
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in File::data
  int64_t numel() const;
};

struct File {
  std::map<std::string, std::string> metadata;  // "__metadata__"
  std::map<std::string, Entry> tensors;
  std::string data;  // the bytes after the header

  // The bytes of tensor `name` checked to be `dtype` with `rank` dimensions;
  // throws FormatError naming what differs (nullptr never returned).
  const Entry& tensor(const std::string& name, const std::string& dtype, size_t rank) const;
};

// Element size of a safetensors dtype name, 0 when it is not one.
int64_t element_size(const std::string& dtype);

// Parses the bytes of a whole file.
File parse(const std::string& bytes);
// Reads and parses the file at `path`, refused when larger than max_bytes.
File read(const std::string& path, uint64_t max_bytes = kMaxBytes);

}  // namespace nexuskv::core::safetensors
