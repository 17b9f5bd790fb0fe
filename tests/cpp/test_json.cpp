// The strict JSON reader and the safetensors container reader of the core
// (nexuskv/core/json.h, safetensors.h), without torch: what they accept, and
// that every damaged input is an error naming where, never a crash.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "nexuskv/core/json.h"
#include "nexuskv/core/safetensors.h"

using namespace nexuskv::core;

namespace {

// Whether parse(text) throws a ParseError whose message holds `part`.
bool json_error(const std::string& text, const std::string& part) {
  try {
    json::parse(text);
  } catch (const json::ParseError& e) {
    return std::string(e.what()).find(part) != std::string::npos;
  }
  return false;
}

// A safetensors file: the length field, the header, the data.
std::string container(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out + header + data;
}

bool format_error(const std::string& bytes, const std::string& part) {
  try {
    safetensors::parse(bytes);
  } catch (const safetensors::FormatError& e) {
    return std::string(e.what()).find(part) != std::string::npos;
  }
  return false;
}

}  // namespace

TEST_CASE("json: the values of a recipe header", "[json]") {
  const json::Value v = json::parse(
      R"( {"format": "nexuskv-recipe", "version": 2, "model": {"head_dim": 64, "x": -0.5e1},
          "list": [true, false, null, [], {}], "s": "a\"b\\c\/d\n\u00e9\ud83d\ude00"} )");
  REQUIRE(v.kind == json::Value::Kind::Object);
  REQUIRE(v.object.size() == 5);
  CHECK(v.find("format")->string == "nexuskv-recipe");
  CHECK(v.find("version")->is_integer);
  CHECK(v.find("version")->integer == 2);
  CHECK(v.find("model")->find("head_dim")->integer == 64);
  const json::Value* x = v.find("model")->find("x");
  CHECK_FALSE(x->is_integer);
  CHECK(x->number == -5.0);
  const auto& list = v.find("list")->array;
  REQUIRE(list.size() == 5);
  CHECK((list[0].kind == json::Value::Kind::Bool && list[0].boolean));
  CHECK((list[1].kind == json::Value::Kind::Bool && !list[1].boolean));
  CHECK(list[2].kind == json::Value::Kind::Null);
  CHECK((list[3].kind == json::Value::Kind::Array && list[3].array.empty()));
  CHECK((list[4].kind == json::Value::Kind::Object && list[4].object.empty()));
  // UTF-8 of U+00E9 and of the surrogate pair U+1F600.
  CHECK(v.find("s")->string == "a\"b\\c/d\n\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(v.find("absent") == nullptr);
  CHECK(list[0].find("anything") == nullptr);  // not an object
  // Integers: exact within int64; beyond it a double only.
  CHECK(json::parse("9007199254740993").integer == 9007199254740993LL);
  CHECK(json::parse("-9223372036854775808").is_integer);
  CHECK_FALSE(json::parse("9223372036854775808").is_integer);
  CHECK_FALSE(json::parse("1.0").is_integer);
  CHECK(json::parse("0").integer == 0);
}

TEST_CASE("json: every malformed text is an error naming the byte", "[json]") {
  CHECK(json_error("", "at byte 0"));
  CHECK(json_error("{\"a\": 1,}", "a string (an object key) at byte 8"));
  CHECK(json_error("[1, 2,]", "a value at byte 6"));
  CHECK(json_error("{\"a\": 1} x", "the end of the text"));
  CHECK(json_error("{\"a\": 1, \"a\": 2}", "\"a\" is repeated"));
  CHECK(json_error("01", "leading zero"));
  CHECK(json_error("1.", "a digit after '.'"));
  CHECK(json_error("1e", "a digit in the exponent"));
  CHECK(json_error("-", "a value"));
  CHECK(json_error("nan", "'null'"));
  CHECK(json_error("Infinit", "'Infinity'"));
  CHECK(json_error("tru", "'true'"));
  CHECK(json_error("\"abc", "the end of the string"));
  CHECK(json_error("\"a\tb\"", "no raw control character"));
  CHECK(json_error("\"\\x\"", "one of"));
  CHECK(json_error("\"\\u12g4\"", "four hex digits"));
  // Python's json: NaN and the infinities, and a lone surrogate (kept as its three bytes).
  const json::Value py = json::parse("[NaN, Infinity, -Infinity, \"\\udcff\\ud83d\\u0041\"]");
  CHECK(std::isnan(py.array[0].number));
  CHECK((std::isinf(py.array[1].number) && py.array[1].number > 0));
  CHECK((std::isinf(py.array[2].number) && py.array[2].number < 0 && !py.array[2].is_integer));
  CHECK(py.array[3].string ==
        "\xed\xb3\xbf\xed\xa0\xbd"
        "A");
  CHECK(json_error("{\"a\" 1}", "':'"));
  CHECK(json_error("[1 2]", "',' or ']'"));
  CHECK(json_error(std::string("[1,\0]", 5), "\\x00"));
  // Strings are UTF-8: every malformed sequence is refused, every valid one kept.
  CHECK(json::parse("\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"").string == "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
  for (const char* bad : {"\"\xff\"", "\"\xc3\"", "\"\xc0\xaf\"", "\"\xe0\x80\xaf\"", "\"\xed\xa0\x80\"",
                          "\"\xf4\x90\x80\x80\"", "\"\x80\""})
    CHECK(json_error(bad, "valid UTF-8 in a string"));
  // Nesting is bounded: no recursion deeper than kMaxDepth.
  CHECK_NOTHROW(json::parse(std::string(json::kMaxDepth, '[') + std::string(json::kMaxDepth, ']')));
  CHECK(json_error(std::string(100000, '['), "levels of nesting"));
  // Bounded work: many values are refused, many keys cost linear time.
  std::string many = "[";
  for (int64_t i = 0; i <= json::kMaxValues; ++i) many += "0,";
  many += "0]";
  CHECK(json_error(many, "values in the text"));
  std::string keys = "{";
  for (int i = 0; i < 200000; ++i) keys += "\"k" + std::to_string(i) + "\": 0,";
  keys += "\"k7\": 1}";
  CHECK(json_error(keys, "\"k7\" is repeated"));
}

TEST_CASE("safetensors: a file's tensors, metadata and bytes", "[json]") {
  std::string data(8 + 6, '\0');
  const float f[2] = {1.5f, -2.f};
  std::memcpy(data.data(), f, 8);
  const std::string header =
      R"({"__metadata__": {"k": "{\"v\": 1}"}, "a": {"dtype": "F32", "shape": [2],)"
      R"( "data_offsets": [0, 8]}, "b": {"dtype": "U8", "shape": [2, 3], "data_offsets": [8, 14]},)"
      R"( "e": {"dtype": "I32", "shape": [0, 4], "data_offsets": [14, 14]}})";
  const safetensors::File file = safetensors::parse(container(header, data));
  CHECK(file.metadata.at("k") == "{\"v\": 1}");
  REQUIRE(file.tensors.size() == 3);
  const safetensors::Entry& a = file.tensor("a", "F32", 1);
  CHECK(a.numel() == 2);
  float back[2];
  std::memcpy(back, file.data.data() + a.begin, 8);
  CHECK((back[0] == 1.5f && back[1] == -2.f));
  CHECK(file.tensor("b", "U8", 2).numel() == 6);
  CHECK(file.tensor("e", "I32", 2).numel() == 0);
  CHECK_THROWS_AS(file.tensor("a", "I32", 1), safetensors::FormatError);
  CHECK_THROWS_AS(file.tensor("a", "F32", 2), safetensors::FormatError);
  CHECK_THROWS_AS(file.tensor("z", "F32", 1), safetensors::FormatError);
}

TEST_CASE("safetensors: damaged and foreign files are errors", "[json]") {
  const std::string entry = R"("t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})";
  const std::string data(8, '\0');
  CHECK(format_error("", "less than its 8-byte length field"));
  CHECK(format_error(std::string(8, '\xff'), "its header claims"));
  CHECK(format_error(container("{" + entry + "}", data).substr(0, 30), "its header claims"));
  CHECK(format_error(container("{" + entry, data), "not JSON"));
  CHECK(format_error(container("[]", ""), "must be a JSON object"));
  CHECK(format_error(container("{" + entry + "}", data.substr(0, 4)), "not a range within the 4 bytes"));
  CHECK(format_error(container(R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", data),
                     "hold 8 bytes, its dtype and shape 12"));
  CHECK(format_error(
      container(R"({"t": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", data),
      "more than the file"));
  CHECK(format_error(container(R"({"t": {"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}})", data),
                     "dtype must be a safetensors dtype name"));
  CHECK(format_error(container(R"({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", data),
                     "every dimension must be an integer >= 0"));
  CHECK(
      format_error(container(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", data), "not a range"));
  CHECK(format_error(container(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", data),
                     "data_offsets must be an array [begin, end]"));
  CHECK(format_error(container(R"({"t": {"dtype": "F32", "shape": [2]}})", data), "must have dtype, shape"));
  CHECK(format_error(container(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}})", data),
                     "unknown member \"x\""));
  CHECK(format_error(container(R"({"__metadata__": {"k": 1}})", ""), "__metadata__ \"k\" must be a string"));
  CHECK(format_error(container(R"({"__metadata__": []})", ""), "__metadata__ must be an object"));
  // The data is indexed whole, without holes or overlaps.
  const std::string two = R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [)";
  CHECK(format_error(
      container(two + R"(0, 2]}, "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}})", std::string(5, '\0')),
      "leave a hole or overlap at byte 2"));
  CHECK(format_error(
      container(two + R"(0, 2]}, "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}})", std::string(3, '\0')),
      "leave a hole or overlap at byte 1"));
  CHECK(format_error(container(two + R"(0, 2]}})", std::string(3, '\0')), "cover 2 of the 3 bytes"));
  CHECK_THROWS_AS(safetensors::read("/nonexistent/recipe.safetensors"), safetensors::FormatError);
}
