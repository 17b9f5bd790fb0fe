// The safetensors reader of nexuskv/core/safetensors.h.
#include "nexuskv/core/safetensors.h"

#include <algorithm>
#include <bit>
#include <fstream>
#include <limits>

#include "nexuskv/core/json.h"

namespace nexuskv::core::safetensors {
namespace {

// The tensor data is little-endian; so are the hosts nexuskv builds for.
static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

[[noreturn]] void fail(const std::string& what) { throw FormatError(what); }

uint64_t as_offset(const json::Value& v, const std::string& where) {
  if (!v.is_integer || v.integer < 0) fail(where + " must be an integer >= 0, got " + v.kind_name());
  return uint64_t(v.integer);
}

Entry entry(const std::string& name, const json::Value& v, uint64_t data_bytes) {
  const std::string where = "tensor \"" + name + "\"";
  if (v.kind != json::Value::Kind::Object) fail(where + " must be an object, got " + v.kind_name());
  for (const auto& [key, _] : v.object)
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      fail(where + " has an unknown member \"" + key + "\"");
  const json::Value *dtype = v.find("dtype"), *shape = v.find("shape"), *offsets = v.find("data_offsets");
  if (!dtype || !shape || !offsets) fail(where + " must have dtype, shape and data_offsets");
  Entry e;
  if (dtype->kind != json::Value::Kind::String || element_size(dtype->string) == 0)
    fail(where + ": dtype must be a safetensors dtype name (F32, I32, ...), got " +
         (dtype->kind == json::Value::Kind::String ? "\"" + dtype->string + "\"" : dtype->kind_name()));
  e.dtype = dtype->string;
  if (shape->kind != json::Value::Kind::Array) fail(where + ": shape must be an array, got " + shape->kind_name());
  // Elements x element size must fit the file, so no product may pass kMaxBytes.
  uint64_t bytes = uint64_t(element_size(e.dtype));
  for (const json::Value& d : shape->array) {
    const uint64_t n = as_offset(d, where + ": every dimension");
    e.shape.push_back(int64_t(n));
    bytes = n == 0 ? 0 : bytes > kMaxBytes / n ? kMaxBytes + 1 : bytes * n;
  }
  if (offsets->kind != json::Value::Kind::Array || offsets->array.size() != 2)
    fail(where + ": data_offsets must be an array [begin, end]");
  e.begin = as_offset(offsets->array[0], where + ": data_offsets[0]");
  e.end = as_offset(offsets->array[1], where + ": data_offsets[1]");
  if (e.begin > e.end || e.end > data_bytes)
    fail(where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
         "] are not a range within the " + std::to_string(data_bytes) + " bytes of data");
  if (e.end - e.begin != bytes)
    fail(where + ": data_offsets hold " + std::to_string(e.end - e.begin) + " bytes, its dtype and shape " +
         (bytes > kMaxBytes ? "more than the file" : std::to_string(bytes)));
  return e;
}

}  // namespace

int64_t Entry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape)
    if (d == 0) return 0;          // (the other dimensions may then be anything: no product of them)
  for (int64_t d : shape) n *= d;  // <= the bytes checked at parse
  return n;
}

int64_t element_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

const Entry& File::tensor(const std::string& name, const std::string& dtype, size_t rank) const {
  const auto it = tensors.find(name);
  if (it == tensors.end()) fail("no tensor \"" + name + "\"");
  const Entry& e = it->second;
  if (e.dtype != dtype || e.shape.size() != rank)
    fail("tensor \"" + name + "\" must be " + dtype + " with " + std::to_string(rank) + " dimensions, got " + e.dtype +
         " with " + std::to_string(e.shape.size()));
  return e;
}

File parse(const std::string& bytes) {
  if (bytes.size() < 8)
    fail("not a safetensors file: " + std::to_string(bytes.size()) + " bytes, less than its 8-byte length field");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(bytes[size_t(i)]);
  if (n > kMaxHeaderBytes || n > bytes.size() - 8)
    fail("not a safetensors file: its header claims " + std::to_string(n) + " bytes, the file has " +
         std::to_string(bytes.size() - 8) + " after the length field");
  json::Value header;
  try {
    header = json::parse(std::string_view(bytes).substr(8, size_t(n)));
  } catch (const json::ParseError& e) {
    fail(std::string("not a safetensors file: its header is not JSON (") + e.what() + ")");
  }
  if (header.kind != json::Value::Kind::Object)
    fail(std::string("the header must be a JSON object, got ") + header.kind_name());
  File f;
  f.data = bytes.substr(8 + size_t(n));
  for (const auto& [name, v] : header.object) {
    if (name != "__metadata__") {
      f.tensors.emplace(name, entry(name, v, f.data.size()));
      continue;
    }
    if (v.kind != json::Value::Kind::Object) fail(std::string("__metadata__ must be an object, got ") + v.kind_name());
    for (const auto& [key, s] : v.object) {
      if (s.kind != json::Value::Kind::String)
        fail("__metadata__ \"" + key + "\" must be a string, got " + s.kind_name());
      f.metadata.emplace(key, s.string);
    }
  }
  // The data must be indexed whole and without holes or overlaps (the format's rule, which
  // the safetensors library enforces too): the ranges, in order, tile [0, size).
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, e] : f.tensors) ranges.emplace_back(e.begin, e.end);
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin != covered)
      fail("the tensors' data_offsets leave a hole or overlap at byte " + std::to_string(std::min(begin, covered)) +
           " of the data");
    covered = end;
  }
  if (covered != f.data.size())
    fail("the tensors' data_offsets cover " + std::to_string(covered) + " of the " + std::to_string(f.data.size()) +
         " bytes of data");
  return f;
}

File read(const std::string& path, uint64_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open the file");
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) fail("cannot read the file's size (not a regular file?)");
  if (uint64_t(size) > max_bytes)
    fail("the file has " + std::to_string(size) + " bytes, more than the " + std::to_string(max_bytes) +
         " this reader loads");
  std::string bytes(size_t(size), '\0');
  in.seekg(0);
  if (!in.read(bytes.data(), size)) fail("cannot read the file");
  return parse(bytes);
}

}  // namespace nexuskv::core::safetensors
