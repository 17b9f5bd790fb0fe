// A calibration recipe read in C++: the file `python -m nexuskv calibrate`
// writes (nexuskv/recipe.py documents it and reads it in Python), for LibTorch
// applications and TorchScript (torch.classes.nexuskv.Recipe(path)).
//
// What a recipe holds: per layer and kv head the channel means of the keys
// (key_center, float32 [layers, kv_heads, head_dim]); with a bit budget
// (format version 2) a bit map, each layer's key and value code bits
// (int32 [layers, 2]), and the settings it was allocated for (the header's
// "bits": group sizes, tail, sinks, meta dtype).  The file is a safetensors
// file whose metadata "nexuskv_recipe" is a JSON header: format
// "nexuskv-recipe", version 1 or 2, the model facts it was measured on.
//
// Loading checks what the Python reader checks, with the same meaning (a bad
// file is a c10::Error naming the path and the reason, never a crash): the
// container (core/safetensors.h), the header, the model facts the cache needs
// (num_hidden_layers, num_key_value_heads, head_dim: integers >= 1),
// key_center's dtype, shape and finiteness, the bit map's shape and bits
// (2, 3, 4, 8), the sensitivity's shape (float32) beside it.  The file may
// not exceed kMaxFileBytes.
//
// Using it: allocated_options(layer, window) is the layer's cache as the map
// was allocated and measured for it, what cache_for(model, recipe=...) builds
// in Python when given nothing else: the map's bits and the header's groups,
// tail (window_residual on a sliding-window layer), sinks (none on a sliding-
// window layer), meta dtype and fitted ranges.  cache_options(layer, base) is
// `base` with the layer's bits alone (every other setting the caller's);
// setting(name) and flag(name) give the header's fields one by one.  check_geometry() refuses
// a model of another shape (layers, kv heads, head_dim: what a C++ program
// knows of its model; Python's Recipe.check_model compares every fact of the
// config).  key_center is for per-token keys (the vLLM
// backend); nexuskv's own cache quantizes keys per channel and needs none.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "nexuskv/cache.h"

namespace nexuskv {

class Recipe : public torch::CustomClassHolder {
 public:
  static constexpr const char* kFormat = "nexuskv-recipe";
  static constexpr int64_t kMinVersion = 1, kMaxVersion = 2;
  // A recipe holds kilobytes to a few megabytes (key means: layers x kv heads x head_dim floats).
  static constexpr uint64_t kMaxFileBytes = uint64_t(256) << 20;

  // Reads and checks the recipe at `path` (TORCH_CHECK: "Recipe <path>: ...").
  explicit Recipe(const std::string& path);

  const std::string& path() const { return path_; }
  int64_t version() const { return version_; }
  int64_t layers() const { return layers_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  std::string model_type() const { return model_type_; }  // "" when the header has none

  // float32 [layers, kv_heads, head_dim] (a copy the caller may keep).
  at::Tensor key_center() const { return key_center_.clone(); }
  bool has_bit_map() const { return bit_map_.has_value(); }
  // int32 [layers, 2]: key bits, value bits per layer; nullopt without a bit map.
  std::optional<at::Tensor> bit_map() const;
  // Layer `layer`'s key / value code bits (the map must exist, 0 <= layer < layers()).
  int64_t key_bits(int64_t layer) const;
  int64_t value_bits(int64_t layer) const;

  // An integer setting of the header's "bits" object (the settings the bit map
  // was allocated for: group_size, value_group_size, residual, sinks, ...);
  // nullopt when it has none of that name.
  std::optional<int64_t> setting(const std::string& name) const;
  // A boolean setting of the header's "bits" object (fit_range, value_fit_range).
  std::optional<bool> flag(const std::string& name) const;
  // The header's bits.meta_dtype ("bfloat16", "float16", "float32"), if any.
  std::optional<at::ScalarType> meta_dtype() const { return meta_dtype_; }

  // Refuses (TORCH_CHECK) a model of another shape, naming each difference.
  void check_geometry(int64_t layers, int64_t kv_heads, int64_t head_dim) const;

  // `base` with layer `layer`'s key and value bits from the bit map.  base must
  // configure the fused NQ storage through its specs (no key/value compressors).
  CacheOptions cache_options(int64_t layer, CacheOptions base = {}) const;
  // Layer `layer`'s cache as the map was allocated for (see the top), `window`
  // its sliding window if it has one.  Keys in groups of bits.group_size tokens,
  // values in groups of bits.value_group_size channels (default: group_size);
  // residual bits.residual (default 128) or, on a sliding-window layer,
  // bits.window_residual (default: residual); sinks bits.sinks (default 0) on
  // full-attention layers; fitted key / value ranges when bits.fit_range /
  // value_fit_range say so (recipes from before fitted ranges: min/max).  A
  // header without bits.group_size (a recipe of key means only) is refused.
  CacheOptions allocated_options(int64_t layer, std::optional<int64_t> window = std::nullopt) const;

 private:
  void check_layer(int64_t layer, const char* who) const;

  std::string path_, model_type_;
  int64_t version_ = 0, layers_ = 0, kv_heads_ = 0, head_dim_ = 0;
  at::Tensor key_center_;
  std::optional<at::Tensor> bit_map_;
  std::map<std::string, int64_t> settings_;
  std::map<std::string, bool> flags_;
  std::optional<at::ScalarType> meta_dtype_;
};

}  // namespace nexuskv
