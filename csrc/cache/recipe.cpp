// Reading a calibration recipe in C++ (nexuskv/recipe.h): the container by
// core/safetensors.h, the header by core/json.h, the checks of
// nexuskv/recipe.py's Recipe.
#include "nexuskv/recipe.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <vector>

#include "nexuskv/core/json.h"
#include "nexuskv/core/safetensors.h"

namespace nexuskv {
namespace {

namespace json = core::json;
namespace st = core::safetensors;

constexpr int64_t kBitChoices[] = {2, 3, 4, 8};  // recipe.py BIT_CHOICES: the cache's code widths

// A tensor of the file as an owned at::Tensor (the file's bytes are copied).
at::Tensor to_tensor(const st::File& f, const st::Entry& e, at::ScalarType dtype) {
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(dtype));
  if (e.end > e.begin) std::memcpy(t.data_ptr(), f.data.data() + e.begin, size_t(e.end - e.begin));
  return t;
}

std::optional<at::ScalarType> scalar_type(const std::string& name) {
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  if (name == "float32") return at::kFloat;
  return std::nullopt;
}

}  // namespace

Recipe::Recipe(const std::string& path) : path_(path) {
  const std::string who = "Recipe " + path + ": ";
  std::error_code error;  // (the overload without one throws std::filesystem_error, e.g. on EACCES)
  const bool regular = std::filesystem::is_regular_file(path, error);
  TORCH_CHECK(regular, who,
              error && error != std::errc::no_such_file_or_directory
                  ? "cannot read it (" + error.message() + ")"
                  : std::string("no such file (make one with python -m nexuskv calibrate)"));
  st::File file;
  try {
    file = st::read(path, kMaxFileBytes);
  } catch (const st::FormatError& e) {
    TORCH_CHECK(false, who, e.what());
  }
  const auto meta = file.metadata.find("nexuskv_recipe");
  TORCH_CHECK(meta != file.metadata.end(), who, "no nexuskv_recipe header (not written by nexuskv calibrate)");
  json::Value header;
  try {
    header = json::parse(meta->second);
  } catch (const json::ParseError& e) {
    TORCH_CHECK(false, who, "the nexuskv_recipe header is not JSON (", e.what(), ")");
  }
  TORCH_CHECK(header.kind == json::Value::Kind::Object, who, "the nexuskv_recipe header must be a JSON object, got ",
              header.kind_name());
  const json::Value *format = header.find("format"), *version = header.find("version");
  const bool known_format = format && format->kind == json::Value::Kind::String && format->string == kFormat;
  const bool known_version =
      version && version->is_integer && version->integer >= kMinVersion && version->integer <= kMaxVersion;
  auto shown = [](const json::Value* v) {
    if (!v) return std::string("(none)");
    if (v->kind == json::Value::Kind::String) return "'" + v->string + "'";
    return v->is_integer ? std::to_string(v->integer) : std::string(v->kind_name());
  };
  TORCH_CHECK(known_format && known_version, who, "format ", shown(format), " version ", shown(version),
              "; this nexuskv reads '", kFormat, "' versions ", kMinVersion, " to ", kMaxVersion);
  version_ = version->integer;

  if (const json::Value* source = header.find("source"))
    TORCH_CHECK(source->kind == json::Value::Kind::Object, who, "the header's source must be an object, got ",
                source->kind_name());
  // The model facts the cache depends on (the others are the Python reader's to compare).
  const json::Value* model = header.find("model");
  TORCH_CHECK(model && model->kind == json::Value::Kind::Object, who, "the header's model facts must be an object");
  auto fact = [&](const char* name) {
    const json::Value* v = model->find(name);
    TORCH_CHECK(v && v->is_integer && v->integer >= 1, who, "the header's model facts need ", name,
                " as an integer >= 1, got ",
                !v              ? "none"
                : v->is_integer ? std::to_string(v->integer)
                                : v->kind_name());
    return v->integer;
  };
  layers_ = fact("num_hidden_layers"), kv_heads_ = fact("num_key_value_heads"), head_dim_ = fact("head_dim");
  if (const json::Value* type = model->find("model_type"); type && type->kind == json::Value::Kind::String)
    model_type_ = type->string;

  try {
    TORCH_CHECK(file.tensors.count("key_center"), who, "no key_center tensor");
    const st::Entry& center = file.tensor("key_center", "F32", 3);
    TORCH_CHECK(center.shape == std::vector<int64_t>({layers_, kv_heads_, head_dim_}), who,
                "key_center must be float32 [", layers_, ", ", kv_heads_, ", ", head_dim_,
                "] (layers, kv heads, head_dim), got ", c10::IntArrayRef(center.shape));
    key_center_ = to_tensor(file, center, at::kFloat);
    TORCH_CHECK(key_center_.isfinite().all().item<bool>(), who, "key_center holds NaN or Inf");
    if (file.tensors.count("bit_map")) {
      const st::Entry& map = file.tensor("bit_map", "I32", 2);
      TORCH_CHECK(map.shape == std::vector<int64_t>({layers_, 2}), who, "bit_map must be int32 [", layers_,
                  ", 2] (layers; key bits, value bits), got ", c10::IntArrayRef(map.shape));
      at::Tensor m = to_tensor(file, map, at::kInt);
      const int32_t* bits = m.data_ptr<int32_t>();
      for (int64_t i = 0; i < m.numel(); ++i)
        TORCH_CHECK(std::find(std::begin(kBitChoices), std::end(kBitChoices), bits[i]) != std::end(kBitChoices), who,
                    "bit_map holds ", bits[i], " (layer ", i / 2, "); code bits must be among [2, 3, 4, 8]");
      bit_map_ = m;
    }
    if (file.tensors.count("sensitivity")) {
      const st::Entry& s = file.tensor("sensitivity", "F32", 3);
      TORCH_CHECK(bit_map_ && s.shape[0] == layers_ && s.shape[1] == 2, who,
                  "sensitivity must be [layers, 2, choices] beside a bit_map");
    }
  } catch (const st::FormatError& e) {
    TORCH_CHECK(false, who, e.what());
  }

  if (const json::Value* bits = header.find("bits")) {
    TORCH_CHECK(bits->kind == json::Value::Kind::Object, who, "the header's bits must be an object, got ",
                bits->kind_name());
    for (const auto& [name, v] : bits->object) {
      if (v.is_integer) settings_.emplace(name, v.integer);
      if (v.kind == json::Value::Kind::Bool) flags_.emplace(name, v.boolean);
    }
    if (const json::Value* meta_dtype = bits->find("meta_dtype")) {
      const auto dtype = meta_dtype->kind == json::Value::Kind::String ? scalar_type(meta_dtype->string) : std::nullopt;
      TORCH_CHECK(dtype, who, "bits.meta_dtype must be one of ['bfloat16', 'float16', 'float32']");
      meta_dtype_ = dtype;
    }
  }
}

std::optional<at::Tensor> Recipe::bit_map() const {
  if (!bit_map_) return std::nullopt;
  return bit_map_->clone();
}

void Recipe::check_layer(int64_t layer, const char* who) const {
  TORCH_CHECK(bit_map_, "Recipe ", path_, ": ", who,
              " needs a bit map, and this recipe has none (python -m nexuskv calibrate --bits-budget B makes one)");
  TORCH_CHECK(layer >= 0 && layer < layers_, "Recipe ", path_, ": ", who, ": layer must be in [0, ", layers_, "), got ",
              layer);
}

int64_t Recipe::key_bits(int64_t layer) const {
  check_layer(layer, "key_bits");
  return bit_map_->data_ptr<int32_t>()[2 * layer];
}

int64_t Recipe::value_bits(int64_t layer) const {
  check_layer(layer, "value_bits");
  return bit_map_->data_ptr<int32_t>()[2 * layer + 1];
}

std::optional<int64_t> Recipe::setting(const std::string& name) const {
  const auto it = settings_.find(name);
  if (it == settings_.end()) return std::nullopt;
  return it->second;
}

std::optional<bool> Recipe::flag(const std::string& name) const {
  const auto it = flags_.find(name);
  if (it == flags_.end()) return std::nullopt;
  return it->second;
}

void Recipe::check_geometry(int64_t layers, int64_t kv_heads, int64_t head_dim) const {
  std::string diff;
  auto compare = [&](const char* name, int64_t got, int64_t recipe) {
    if (got != recipe)
      diff += (diff.empty() ? "" : ", ") + std::string(name) + " " + std::to_string(got) +
              " (recipe: " + std::to_string(recipe) + ")";
  };
  compare("layers", layers, layers_), compare("kv_heads", kv_heads, kv_heads_),
      compare("head_dim", head_dim, head_dim_);
  TORCH_CHECK(diff.empty(), "Recipe ", path_, " was measured on another model: ", diff,
              "; calibrate on this model (python -m nexuskv calibrate --model ...)");
}

CacheOptions Recipe::cache_options(int64_t layer, CacheOptions base) const {
  check_layer(layer, "cache_options");
  TORCH_CHECK(!base.key_compressor && !base.value_compressor, "Recipe ", path_,
              ": cache_options sets the bits of the fused NQ storage (CacheOptions::keys / values); base must not "
              "carry key or value compressors");
  base.keys.bits = key_bits(layer);
  base.values.bits = value_bits(layer);
  return base;
}

CacheOptions Recipe::allocated_options(int64_t layer, std::optional<int64_t> window) const {
  check_layer(layer, "allocated_options");
  const auto field = [&](const char* name, std::optional<int64_t> fallback, int64_t least) {
    const std::optional<int64_t> v = setting(name) ? setting(name) : fallback;
    TORCH_CHECK(v && *v >= least, "Recipe ", path_, ": allocated_options needs the header's bits.", name,
                " (an integer >= ", least, "), ", v ? "got " + std::to_string(*v) : std::string("it has none"),
                "; calibrate with --bits-budget writes it");
    return *v;
  };
  CacheOptions o;
  o.keys.group_size = field("group_size", std::nullopt, 1);
  o.values.group_size = field("value_group_size", o.keys.group_size, 1);
  const int64_t residual = field("residual", 128, 0);
  o.residual = window ? field("window_residual", residual, 0) : residual;
  o.sinks = window ? 0 : field("sinks", 0, 0);
  o.window = window;
  o.keys.meta_dtype = o.values.meta_dtype = meta_dtype_;
  o.keys.fit_range = flag("fit_range").value_or(false);
  o.values.fit_range = flag("value_fit_range").value_or(false);
  return cache_options(layer, o);
}

}  // namespace nexuskv
