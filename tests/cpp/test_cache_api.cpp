// LibTorch test of the C++ cache API: KVCompressor (NQ, DGQ, a user's own
// class) and KVCache configured by compressors, as C++ inference code uses them.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <string>

#include <unistd.h>

#include "catch_compat.h"
#include "nexuskv/cache.h"
#include "nexuskv/compressor.h"
#include "nexuskv/recipe.h"

namespace {

using nexuskv::CompressedTensor;
using nexuskv::KVCache;
using nexuskv::KVCompressor;
using nexuskv::QuantSpec;

QuantSpec spec(int64_t bits, int64_t group, int64_t axis, bool dynamic = false) {
  QuantSpec s;
  s.bits = bits, s.group_size = group, s.axis = axis, s.dynamic = dynamic;
  return s;
}

// A user's compressor: float16 copies (2 bytes an element, nothing else).
class HalfCompressor final : public KVCompressor {
 public:
  CompressedTensor compress(const at::Tensor& x) const override {
    return {{x.to(at::kHalf)}, x.sizes().vec(), x.scalar_type()};
  }
  at::Tensor decompress(const CompressedTensor& c, std::optional<at::ScalarType> dtype) const override {
    return c.parts.at(0).to(dtype.value_or(c.dtype));
  }
  std::string describe() const override { return "fp16"; }
};

// float64 causal attention of the last Lq positions over K, V [H, L, D] (one sequence).
at::Tensor attention_f64(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V, double scale) {
  const int64_t Hq = q.size(0), Lq = q.size(1), L = K.size(1);
  const at::Tensor Kd = K.to(at::kDouble).repeat_interleave(Hq / K.size(0), 0);
  const at::Tensor Vd = V.to(at::kDouble).repeat_interleave(Hq / V.size(0), 0);
  at::Tensor s = at::matmul(q.to(at::kDouble), Kd.transpose(-1, -2)) * scale;
  const at::Tensor mask = at::arange(L).unsqueeze(0) > at::arange(L - Lq, L).unsqueeze(1);
  s.masked_fill_(mask, -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(s, -1), Vd);
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b).norm().item<double>() / b.norm().item<double>();
}

}  // namespace

TEST_CASE("NQ and DGQ compressors report their exact bytes and effective bits") {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  const at::Tensor x = torch::randn({2, 128, 64}, at::kHalf);
  const nexuskv::NQCompressor keys(spec(4, 32, -2)), values(spec(4, 32, -1));
  for (const KVCompressor* c : {static_cast<const KVCompressor*>(&keys), static_cast<const KVCompressor*>(&values)}) {
    const CompressedTensor ct = c->compress(x);
    // 4-bit codes + an fp16 scale and zero per 32 elements = 5 bits; fp16 / 5 bits = 3.2x.
    REQUIRE(ct.nbytes() == 2 * 128 * 64 / 2 + 2 * 2 * (2 * 128 * 64 / 32));
    REQUIRE(std::fabs(ct.effective_bits() - 5.0) < 1e-12);
    REQUIRE(std::fabs(ct.bytes_ratio() - 3.2) < 1e-12);
    const at::Tensor xh = c->decompress(ct);
    REQUIRE(xh.scalar_type() == at::kHalf);
    REQUIRE((xh.to(at::kFloat) - x.to(at::kFloat)).abs().max().item<double>() < 0.6);
    REQUIRE(c->fused_spec().has_value());
  }
  const auto dgq = nexuskv::make_compressor(spec(4, 32, -2, true));
  const CompressedTensor ct = dgq->compress(x);
  REQUIRE(ct.parts.size() == 6);  // + segment_starts, counted in the bytes
  REQUIRE(ct.nbytes() == 2 * 128 * 64 / 2 + 2 * 2 * (2 * 128 * 64 / 32) + 4 * 2 * 4);
  REQUIRE(dgq->describe().rfind("DGQ4", 0) == 0);
}

TEST_CASE("a KVCache configured by NQ compressors is the fused cache") {
  torch::manual_seed(1);
  torch::NoGradGuard no_grad;
  nexuskv::CacheOptions by_compressors, by_specs;
  by_compressors.key_compressor = std::make_shared<nexuskv::NQCompressor>(spec(4, 32, -2));
  by_compressors.value_compressor = std::make_shared<nexuskv::NQCompressor>(spec(4, 32, -1));
  by_specs.keys = spec(4, 32, -2), by_specs.values = spec(4, 32, -1);
  for (auto* o : {&by_compressors, &by_specs}) o->residual = 16, o->sinks = 4;
  KVCache a(by_compressors), b(by_specs);
  const at::Tensor k = torch::randn({2, 2, 90, 64}), v = torch::randn({2, 2, 90, 64}), q = torch::randn({2, 4, 2, 64});
  a.append(k, v, std::nullopt), b.append(k, v, std::nullopt);
  REQUIRE(at::equal(a.attend(q, std::nullopt), b.attend(q, std::nullopt)));
  REQUIRE(a.nbytes() == b.nbytes());
}

TEST_CASE("a user's own C++ compressor works through the cache") {
  torch::manual_seed(2);
  torch::NoGradGuard no_grad;
  const int64_t B = 2, H = 2, D = 64, residual = 8, sinks = 3;
  auto half = std::make_shared<HalfCompressor>();
  nexuskv::CacheOptions options;
  options.key_compressor = options.value_compressor = half;
  options.residual = residual, options.sinks = sinks;
  KVCache cache(options);
  REQUIRE(cache.chunk() == 1);
  const at::Tensor k = torch::randn({B, H, 40, D}), v = torch::randn({B, H, 40, D});
  at::Tensor valid = torch::ones({B, 40}, at::kBool);
  valid.select(0, 1).slice(0, 0, 10).fill_(false);  // left padding of sequence 1
  cache.append(k, v, valid);
  REQUIRE(cache.lengths().equal(torch::tensor({40, 30}, at::kLong)));
  REQUIRE(cache.compressed_lengths().equal(torch::tensor({29, 19}, at::kLong)));
  auto [kd, vd, lens] = cache.dense(at::kFloat);
  // Sinks and tail exact, compressed tokens the fp16 copies.
  REQUIRE(at::equal(kd.select(0, 0).slice(1, 0, 3), k.select(0, 0).slice(1, 0, 3)));
  REQUIRE(at::equal(kd.select(0, 0).slice(1, 3, 32), k.select(0, 0).slice(1, 3, 32).to(at::kHalf).to(at::kFloat)));
  REQUIRE(at::equal(vd.select(0, 1).slice(1, 22, 30), v.select(0, 1).slice(1, 32, 40)));
  // Attention over the decompressed cache, against float64.
  const at::Tensor q = torch::randn({B, 4, 3, D});
  const at::Tensor out = cache.attend(q, std::nullopt);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = lens[b].item<int64_t>();
    const at::Tensor ref =
        attention_f64(q.select(0, b), kd.select(0, b).slice(1, 0, L), vd.select(0, b).slice(1, 0, L), 1.0 / 8);
    REQUIRE(rel(out.select(0, b), ref) < 1e-5);
  }
  // Bytes: the fp16 chunks plus the sinks and tail buffers, all exact.
  const int64_t chunk_bytes = 2 * (29 + 19) * H * D * 2;
  const int64_t full = 2 * B * H * D * 4;  // one token of K and V per sequence, float32
  // The sink buffer holds the sinks; the tail buffer grows in steps of at least 16 tokens up to
  // residual + chunk tokens (chunk 1 here).
  REQUIRE(cache.nbytes() == chunk_bytes + full * sinks + full * (residual + cache.chunk()));
  REQUIRE(cache.used_nbytes() == chunk_bytes + 2 * (3 + 3 + 8 + 8) * H * D * 4);
  cache.reorder(torch::tensor({1, 1}, at::kLong));
  REQUIRE(cache.lengths().equal(torch::tensor({30, 30}, at::kLong)));
}

TEST_CASE("chunk storage with a sliding window, crop, and save/load through torch::pickle_save") {
  torch::manual_seed(3);
  torch::NoGradGuard no_grad;
  const int64_t W = 12, D = 64;
  auto half = std::make_shared<HalfCompressor>();
  nexuskv::CacheOptions options;
  options.key_compressor = options.value_compressor = half;
  options.residual = 4, options.window = W;
  KVCache cache(options);
  cache.append(torch::randn({1, 2, 40, D}), torch::randn({1, 2, 40, D}), std::nullopt);
  for (int step = 0; step < 10; ++step) {
    cache.append(torch::randn({1, 2, 1, D}), torch::randn({1, 2, 1, D}), std::nullopt);
    const at::Tensor q = torch::randn({1, 4, 1, D});
    auto [kd, vd, lens] = cache.dense(at::kFloat);
    // Windowed float64 reference over the cached keys: only the last W are visible.
    const int64_t L = lens[0].item<int64_t>();
    REQUIRE(L >= W);
    const at::Tensor ref =
        attention_f64(q.select(0, 0), kd.select(0, 0).slice(1, L - W, L), vd.select(0, 0).slice(1, L - W, L), 1.0 / 8);
    REQUIRE(rel(cache.attend(q).select(0, 0), ref) < 1e-5);
  }
  // 50 positions: before the last append 49, so positions < 38 are dead (chunk 1).
  REQUIRE(cache.evicted_lengths().equal(torch::tensor({38}, at::kLong)));
  REQUIRE(cache.lengths().equal(torch::tensor({12}, at::kLong)));

  // Save, load with the compressors, continue alike.
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(cache.state_dict()));
  const auto state = c10::impl::toTypedDict<std::string, at::Tensor>(torch::pickle_load(bytes).toGenericDict());
  REQUIRE_THROWS_WITH(KVCache::from_state_dict(state), Catch::Contains("chunk storage needs its compressors"));
  const auto loaded = KVCache::from_state_dict(state, half, half);
  const at::Tensor k = torch::randn({1, 2, 3, D}), v = torch::randn({1, 2, 3, D}), q = torch::randn({1, 4, 3, D});
  cache.append(k, v, std::nullopt), loaded->append(k, v, std::nullopt);
  REQUIRE(at::equal(cache.attend(q), loaded->attend(q)));
  REQUIRE(cache.nbytes() == loaded->nbytes());

  // Crop inside the compressed part: the cut object's survivors come back to the tail.
  auto [k0, v0, l0] = cache.dense(at::kFloat);
  const int64_t evicted = cache.evicted_lengths()[0].item<int64_t>();
  REQUIRE(evicted == 39);  // 50 positions before the 3 new: < 39 dead
  cache.crop(50);          // 53 positions -> 50
  auto [k1, v1, l1] = cache.dense(at::kFloat);
  REQUIRE(l1.equal(torch::tensor({50 - evicted}, at::kLong)));
  REQUIRE(at::equal(k1, k0.slice(2, 0, 50 - evicted)));
  REQUIRE(at::equal(v1, v0.slice(2, 0, 50 - evicted)));
  REQUIRE_THROWS_WITH(cache.crop(48), Catch::Contains("would need positions the window already dropped"));
}

TEST_CASE("CacheOptions are checked by the constructor") {
  nexuskv::CacheOptions o;
  o.keys.group_size = 0;
  REQUIRE_THROWS_WITH(KVCache(o), Catch::Contains("KVCache: key_group_size must be in [1, 256], got 0"));
  o = {};
  o.residual = int64_t(1) << 40;
  REQUIRE_THROWS_WITH(KVCache(o), Catch::Contains("residual must be in [0, 2147483647]"));
  o = {};
  o.key_compressor = std::make_shared<HalfCompressor>();
  REQUIRE_THROWS_WITH(KVCache(o), Catch::Contains("give both key_compressor and value_compressor"));
}

namespace {
// A user's compressor that fails on the n-th call (a bad chunk, an allocator error...).
class FailingCompressor final : public KVCompressor {
 public:
  explicit FailingCompressor(int fail_at) : fail_at_(fail_at) {}
  CompressedTensor compress(const at::Tensor& x) const override {
    TORCH_CHECK(++calls_ != fail_at_, "FailingCompressor: call ", calls_, " fails");
    return {{x.to(at::kHalf)}, x.sizes().vec(), x.scalar_type()};
  }
  at::Tensor decompress(const CompressedTensor& c, std::optional<at::ScalarType> dtype) const override {
    return c.parts.at(0).to(dtype.value_or(c.dtype));
  }
  int64_t token_multiple() const override { return multiple_; }
  std::string describe() const override { return "failing"; }
  int64_t multiple_ = 4;

 private:
  int fail_at_;
  mutable int calls_ = 0;
};
}  // namespace

TEST_CASE("an append that fails part-way through a batch leaves the cache as it was") {
  torch::manual_seed(4);
  torch::NoGradGuard no_grad;
  // Keys of sequence 0, values of 0, keys of 1 (the second key call: fails); with a
  // per-sequence loop that writes as it goes, sequence 0 would be applied alone.
  nexuskv::CacheOptions options;
  options.key_compressor = std::make_shared<FailingCompressor>(2);
  options.value_compressor = std::make_shared<FailingCompressor>(99);
  options.residual = 2;
  KVCache cache(options);
  cache.append(torch::randn({2, 2, 5, 32}), torch::randn({2, 2, 5, 32}), std::nullopt);  // all in the tail
  const auto before = cache.state_dict();
  REQUIRE_THROWS_WITH(cache.append(torch::randn({2, 2, 8, 32}), torch::randn({2, 2, 8, 32}), std::nullopt),
                      Catch::Contains("call 2 fails"));
  const auto after = cache.state_dict();
  REQUIRE(before.size() == after.size());
  for (const auto& item : before) REQUIRE(at::equal(item.value(), after.at(item.key())));
  REQUIRE(cache.lengths().equal(torch::tensor({5, 5}, at::kLong)));
  cache.append(torch::randn({2, 2, 8, 32}), torch::randn({2, 2, 8, 32}), std::nullopt);  // calls 3, 4: fine
  REQUIRE(cache.lengths().equal(torch::tensor({13, 13}, at::kLong)));
  REQUIRE(cache.compressed_lengths().equal(torch::tensor({8, 8}, at::kLong)));
}

TEST_CASE("a chunk (lcm of the token groups) too large for int32 positions is a clear error") {
  auto a = std::make_shared<FailingCompressor>(0), b = std::make_shared<FailingCompressor>(0);
  a->multiple_ = (int64_t(1) << 31) - 1, b->multiple_ = (int64_t(1) << 31) - 2;
  nexuskv::CacheOptions o;
  o.key_compressor = a, o.value_compressor = b;
  REQUIRE_THROWS_WITH(KVCache(o), Catch::Contains("exceeds 2147483647 tokens"));
  b->multiple_ = int64_t(1) << 62;
  REQUIRE_THROWS_WITH(KVCache(o), Catch::Contains("token_multiple() must be in [1, 2147483647]"));
}

namespace {

// A recipe file as `python -m nexuskv calibrate` writes one (nexuskv/recipe.h):
// 2 layers, 1 kv head, head_dim 16, bit map {{4, 2}, {8, 3}}.
std::string write_recipe(const std::string& name, const std::string& recipe_json) {
  // (The process id in the name: parallel ctest runs do not share the file.)
  const std::string path =
      (std::filesystem::temp_directory_path() / (std::to_string(::getpid()) + "_" + name)).string();
  std::string data(2 * 16 * 4 + 4 * 4, '\0');
  for (int i = 0; i < 32; ++i) {
    const float x = 0.25f * float(i - 7);
    std::memcpy(data.data() + 4 * i, &x, 4);
  }
  const int32_t bits[4] = {4, 2, 8, 3};
  std::memcpy(data.data() + 128, bits, sizeof(bits));
  std::string escaped;
  for (char c : recipe_json) escaped += c == '"' ? std::string("\\\"") : std::string(1, c);
  const std::string header =
      "{\"__metadata__\": {\"nexuskv_recipe\": \"" + escaped +
      "\"}, \"key_center\": {\"dtype\": \"F32\", \"shape\": [2, 1, 16], \"data_offsets\": [0, 128]},"
      " \"bit_map\": {\"dtype\": \"I32\", \"shape\": [2, 2], \"data_offsets\": [128, 144]}}";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char((uint64_t(header.size()) >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary) << bytes << header << data;
  return path;
}

constexpr const char* kRecipeJson =
    R"({"format": "nexuskv-recipe", "version": 2, "model": {"model_type": "llama", "num_hidden_layers": 2,)"
    R"( "num_key_value_heads": 1, "head_dim": 16}, "bits": {"group_size": 32, "residual": 16, "sinks": 2,)"
    R"( "meta_dtype": "bfloat16", "budget": 3.5}})";

}  // namespace

TEST_CASE("a recipe configures each layer's cache from C++") {
  const std::string path = write_recipe("nexuskv_test_recipe.safetensors", kRecipeJson);
  const auto recipe = c10::make_intrusive<nexuskv::Recipe>(path);
  CHECK(recipe->layers() == 2);
  CHECK(recipe->model_type() == "llama");
  CHECK(recipe->key_center().sizes() == at::IntArrayRef({2, 1, 16}));
  CHECK(recipe->key_center()[1][0][15].item<float>() == 0.25f * 24);
  CHECK(recipe->setting("group_size") == 32);
  CHECK(recipe->setting("budget") == std::nullopt);  // not an integer
  CHECK(recipe->meta_dtype() == at::kBFloat16);
  recipe->check_geometry(2, 1, 16);
  CHECK_THROWS_WITH(recipe->check_geometry(2, 2, 16), Catch::Contains("kv_heads 2 (recipe: 1)"));

  nexuskv::CacheOptions base;
  base.keys.group_size = *recipe->setting("group_size");
  base.values.group_size = 16;
  base.keys.meta_dtype = base.values.meta_dtype = recipe->meta_dtype();
  base.residual = *recipe->setting("residual"), base.sinks = *recipe->setting("sinks");
  std::vector<int64_t> compressed_bytes;
  for (int64_t layer = 0; layer < recipe->layers(); ++layer) {
    const nexuskv::CacheOptions o = recipe->cache_options(layer, base);
    CHECK(o.keys.bits == recipe->key_bits(layer));
    CHECK(o.values.bits == recipe->value_bits(layer));
    CHECK(o.keys.group_size == 32);  // the rest is base's
    CHECK(o.values.group_size == 16);
    CHECK(o.sinks == 2);
    auto cache = c10::make_intrusive<KVCache>(o);
    const at::Tensor k = at::randn({1, 1, 82, 16}), v = at::randn({1, 1, 82, 16});
    cache->append(k, v, std::nullopt);
    REQUIRE(cache->compressed_lengths().item<int64_t>() == 64);
    // The same cache configured by hand holds the same bytes and the same K/V.
    nexuskv::CacheOptions by_hand = base;
    by_hand.keys.bits = layer == 0 ? 4 : 8, by_hand.values.bits = layer == 0 ? 2 : 3;
    auto reference = c10::make_intrusive<KVCache>(by_hand);
    reference->append(k, v, std::nullopt);
    CHECK(cache->compressed_nbytes() == reference->compressed_nbytes());
    CHECK(std::get<0>(cache->dense(std::nullopt)).equal(std::get<0>(reference->dense(std::nullopt))));
    CHECK(std::get<1>(cache->dense(std::nullopt)).equal(std::get<1>(reference->dense(std::nullopt))));
    compressed_bytes.push_back(cache->compressed_nbytes());
  }
  CHECK(compressed_bytes[1] > compressed_bytes[0]);  // 8 + 3 bits against 4 + 2

  base.key_compressor = std::make_shared<nexuskv::NQCompressor>(base.keys);
  base.value_compressor = std::make_shared<nexuskv::NQCompressor>(base.values);
  CHECK_THROWS_WITH(recipe->cache_options(0, base), Catch::Contains("must not carry key or value compressors"));
  CHECK_THROWS_WITH(recipe->cache_options(2, {}), Catch::Contains("layer must be in [0, 2), got 2"));
  std::filesystem::remove(path);

  // The options the map was allocated for: the header's groups, tails, sinks and fits (Python's
  // cache_for(model, recipe=...) given nothing else).
  const std::string fitted = write_recipe(
      "nexuskv_test_recipe_fit.safetensors",
      R"({"format": "nexuskv-recipe", "version": 2, "model": {"model_type": "gemma3", "num_hidden_layers": 2,)"
      R"( "num_key_value_heads": 1, "head_dim": 16}, "bits": {"group_size": 32, "value_group_size": 16,)"
      R"( "residual": 24, "window_residual": 8, "sinks": 2, "fit_range": true, "value_fit_range": false}})");
  const nexuskv::Recipe r(fitted);
  CHECK(r.flag("fit_range") == true);
  CHECK(r.flag("value_fit_range") == false);
  CHECK(r.flag("residual") == std::nullopt);  // an integer, not a flag
  for (int64_t layer = 0; layer < 2; ++layer) {
    const nexuskv::CacheOptions full = r.allocated_options(layer);
    CHECK(full.keys.bits == r.key_bits(layer));
    CHECK(full.values.bits == r.value_bits(layer));
    CHECK(full.keys.group_size == 32);
    CHECK(full.values.group_size == 16);
    CHECK(full.residual == 24);
    CHECK(full.sinks == 2);
    CHECK(!full.window);
    CHECK(full.keys.fit_range);
    CHECK(!full.values.fit_range);
    CHECK(!full.keys.meta_dtype);  // the header names none: the input dtype
    const nexuskv::CacheOptions sliding = r.allocated_options(layer, 512);
    CHECK(sliding.residual == 8);  // window_residual
    CHECK(sliding.sinks == 0);
    CHECK(sliding.window == 512);
    auto cache = c10::make_intrusive<KVCache>(sliding);  // a valid cache
    cache->append(at::randn({1, 1, 40, 16}), at::randn({1, 1, 40, 16}), std::nullopt);
    CHECK(cache->compressed_lengths().item<int64_t>() == 32);
  }
  // Defaults: value groups as the keys', a 128-token tail (the sliding layers' too), no sinks, min/max.
  const nexuskv::CacheOptions d = recipe->allocated_options(0);
  CHECK(d.values.group_size == 32);
  CHECK(d.residual == 16);
  CHECK(d.sinks == 2);
  CHECK(!d.keys.fit_range);
  CHECK(d.keys.meta_dtype == at::kBFloat16);
  CHECK(recipe->allocated_options(1, 64).residual == 16);
  std::filesystem::remove(fitted);
  const std::string bare = write_recipe(
      "nexuskv_test_recipe_bare.safetensors",
      R"({"format": "nexuskv-recipe", "version": 2, "model": {"model_type": "llama", "num_hidden_layers": 2,)"
      R"( "num_key_value_heads": 1, "head_dim": 16}, "bits": {"sinks": 2}})");
  CHECK_THROWS_WITH(nexuskv::Recipe(bare).allocated_options(0),
                    Catch::Contains("allocated_options needs the header's bits.group_size"));
  std::filesystem::remove(bare);

  // What is not a recipe says why, naming the file.
  const std::string other =
      write_recipe("nexuskv_test_recipe_v9.safetensors", R"({"format": "nexuskv-recipe", "version": 9, "model": {}})");
  CHECK_THROWS_WITH(nexuskv::Recipe(other), Catch::Contains("Recipe " + other + ": format 'nexuskv-recipe' version 9"));
  std::filesystem::remove(other);
  CHECK_THROWS_WITH(nexuskv::Recipe("/nonexistent.safetensors"), Catch::Contains("no such file"));
}

TEST_CASE("a held append attends over its own tokens exact, and settle() leaves what a plain append leaves") {
  torch::manual_seed(5);
  torch::NoGradGuard no_grad;
  const int64_t D = 64;
  nexuskv::CacheOptions options;  // 4-bit keys per channel (groups of 64 tokens), values per token
  options.residual = 60, options.sinks = 4;
  KVCache plain(options), held(options);
  // A prefill, chunks that cross group boundaries, decode steps, a chunk smaller than the tail.
  for (const int64_t n : {300, 64, 130, 1, 1, 5, 64}) {
    const at::Tensor k = torch::randn({2, 2, n, D}), v = torch::randn({2, 2, n, D}), q = torch::randn({2, 4, n, D});
    plain.append(k, v, std::nullopt);
    held.append(k, v, std::nullopt, /*hold=*/true);
    // Held: every new token is in the tail as given, none compressed by this append.
    auto [kd, vd, lens] = held.dense(at::kFloat);
    REQUIRE(at::equal(kd.slice(2, kd.size(2) - n), k));
    REQUIRE(at::equal(vd.slice(2, vd.size(2) - n), v));
    // Its attention: float64 attention over the held cache's tokens (older ones as stored).
    for (int64_t b = 0; b < 2; ++b)
      REQUIRE(rel(held.attend(q).select(0, b), attention_f64(q.select(0, b), kd.select(0, b), vd.select(0, b),
                                                              1.0 / 8)) < 1e-5);
    if (n >= 64) REQUIRE(!at::equal(held.attend(q), plain.attend(q)));  // plain compressed some new tokens
    held.settle();
    auto [kp, vp, lp] = plain.dense(at::kFloat);
    auto [kh, vh, lh] = held.dense(at::kFloat);
    REQUIRE(at::equal(kh, kp));
    REQUIRE(at::equal(vh, vp));
    REQUIRE(held.compressed_lengths().equal(plain.compressed_lengths()));
    REQUIRE(held.nbytes() == plain.nbytes());  // the tail shrank back
  }
  held.settle();  // nothing held: a no-op
  REQUIRE(held.nbytes() == plain.nbytes());
  KVCache fresh(options);
  fresh.settle();  // a new cache: nothing to do
  REQUIRE(fresh.lengths().numel() == 0);
}

TEST_CASE("settle() with a sliding window evicts what no later query sees") {
  torch::manual_seed(6);
  torch::NoGradGuard no_grad;
  const int64_t D = 64, W = 100;
  nexuskv::CacheOptions options;
  options.residual = 0, options.window = W;
  KVCache plain(options), held(options);
  for (int step = 0; step < 6; ++step) {
    const at::Tensor k = torch::randn({1, 2, 64, D}), v = torch::randn({1, 2, 64, D}), q = torch::randn({1, 4, 1, D});
    plain.append(k, v, std::nullopt);
    held.append(k, v, std::nullopt, true);
    held.settle();
    // The next query sees the same W keys in both (settle evicted only dead chunks).
    const at::Tensor k1 = torch::randn({1, 2, 1, D}), v1 = torch::randn({1, 2, 1, D});
    const auto a = plain.clone(), b = held.clone();  // the loop goes on without the probe token
    a->append(k1, v1, std::nullopt), b->append(k1, v1, std::nullopt);
    // (the same tokens; the kernel's tiles may start elsewhere in the buffers)
    REQUIRE(rel(b->attend(q), a->attend(q).to(at::kDouble)) < 1e-6);
    REQUIRE(held.nbytes() <= plain.nbytes());
  }
  REQUIRE(held.evicted_lengths()[0].item<int64_t>() > plain.evicted_lengths()[0].item<int64_t>());
}

TEST_CASE("a chunk cut at compression_points() into held pieces is attended as token-by-token decoding") {
  torch::manual_seed(7);
  torch::NoGradGuard no_grad;
  const int64_t D = 64, n = 150;
  for (const auto& [residual, sinks] : {std::pair<int64_t, int64_t>{60, 4}, {0, 0}, {16, 0}}) {
    nexuskv::CacheOptions options;
    options.residual = residual, options.sinks = sinks;
    options.keys.bits = options.values.bits = 2;  // coarse: exact and compressed tokens differ a lot
    KVCache decoded(options), pieces(options), whole(options), once(options);
    const at::Tensor k0 = torch::randn({1, 2, 100, D}), v0 = torch::randn({1, 2, 100, D});
    for (KVCache* c : {&decoded, &pieces, &whole, &once}) c->append(k0, v0, std::nullopt);
    const at::Tensor k = torch::randn({1, 2, n, D}), v = torch::randn({1, 2, n, D}), q = torch::randn({1, 4, n, D});
    std::vector<at::Tensor> by_token;
    for (int64_t i = 0; i < n; ++i) {
      decoded.append(k.slice(2, i, i + 1), v.slice(2, i, i + 1), std::nullopt);
      by_token.push_back(decoded.attend(q.slice(2, i, i + 1)));
    }
    const at::Tensor ref = at::cat(by_token, 2).to(at::kDouble);
    std::vector<int64_t> cuts = pieces.compression_points(n);
    REQUIRE(!cuts.empty());
    for (size_t j = 1; j < cuts.size(); ++j) REQUIRE(cuts[j] - cuts[j - 1] == pieces.chunk());  // one per chunk
    cuts.insert(cuts.begin(), 0), cuts.push_back(n);
    std::vector<at::Tensor> by_piece;
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      const int64_t a = cuts[j], b = cuts[j + 1];
      pieces.append(k.slice(2, a, b), v.slice(2, a, b), std::nullopt, true);
      by_piece.push_back(pieces.attend(q.slice(2, a, b)));
    }
    pieces.settle();
    REQUIRE(rel(at::cat(by_piece, 2), ref) < 1e-5);
    REQUIRE(at::equal(once.append_and_attend(k, v, q), at::cat(by_piece, 2)));  // the same, in one call
    // The chunk held whole sees groups exact that decoding had compressed by then.
    whole.append(k, v, std::nullopt, true);
    REQUIRE(rel(whole.attend(q), ref) > 1e-3);
    whole.settle();
    // Afterwards the three hold the same tokens alike.
    auto [kd, vd, ld] = decoded.dense(at::kFloat);
    for (KVCache* c : {&pieces, &whole, &once}) {
      auto [kc, vc, lc] = c->dense(at::kFloat);
      REQUIRE(at::equal(kc, kd));
      REQUIRE(at::equal(vc, vd));
    }
  }
}

TEST_CASE("append_and_attend stores nothing of a chunk it rejects") {
  torch::manual_seed(8);
  torch::NoGradGuard no_grad;
  const int64_t D = 64, n = 150;
  nexuskv::CacheOptions options;
  options.residual = 16;
  KVCache cache(options);
  cache.append(torch::randn({1, 2, 100, D}), torch::randn({1, 2, 100, D}), std::nullopt);
  const int64_t bytes = cache.nbytes();
  REQUIRE(cache.compression_points(n).size() >= 2);  // several pieces
  at::Tensor k = torch::randn({1, 2, n, D}), v = torch::randn({1, 2, n, D});
  const at::Tensor q = torch::randn({1, 4, n, D});
  k[0][1][n - 3][5] = std::numeric_limits<float>::quiet_NaN();  // in the last piece
  REQUIRE_THROWS_WITH(cache.append_and_attend(k, v, q), Catch::Contains("k holds NaN"));
  REQUIRE_THROWS_WITH(cache.append_and_attend(v, v, q.slice(2, 1)), Catch::Contains("append_and_attend needs q"));
  REQUIRE_THROWS_WITH(cache.append_and_attend(v, v, q.to(at::kInt)), Catch::Contains("q must be"));
  REQUIRE(cache.lengths().equal(torch::tensor({100}, at::kLong)));
  REQUIRE(cache.nbytes() == bytes);
}
