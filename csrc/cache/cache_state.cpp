// Save and load of a KVCache as a flat dict of plain tensors, so that
// torch.save / torch.load(weights_only=True) (Python), torch::pickle_save
// (C++) and the TorchBind pickle (def_pickle) all carry it.  A restored cache
// holds the same bytes and continues bit-exactly as the original.
//
// Format version 1 (every entry a tensor; ints are 0-D int64; a dtype is an
// empty tensor of that dtype):
//   nexuskv.version            1
//   config.storage             0 fused, 1 chunk (C++ compressors), 2 external
//   config.{key,value}_{bits,group_size,axis,outliers,dynamic,granule}
//   config.{key,value}_meta_dtype   (absent: the input dtype)
//   config.{key,value}_fit_range    1 (absent: min/max ranges, as before it existed)
//   config.{residual,sinks,rotate,seed,external_chunk}
//   config.window              (absent: no window)
//   config.{key,value}_compressor   uint8 text of describe() (chunk storage)
// After the first append also:
//   shape                      int64 [3]: batch, kv_heads, head_dim
//   dtype                      empty tensor of the K/V dtype, on the cache's device
//   lengths.{sinks,evicted,compressed,tail}   int64 [batch]
//   keys.{codes,scale,zero,outlier_idx,outlier_val[,segment_starts]}  and values.*:
//                              the fused buffers (layout: cache_impl.h), capacity included
//   tail.k, tail.v             [batch, kv_heads, tail capacity, head_dim]
//   sinks.k, sinks.v           [batch, kv_heads, sink capacity, head_dim] (sinks > 0)
//   due.seq, due.offset        int64 [m]; due.k.<j>, due.v.<j> [kv_heads, n, head_dim] (external)
//   chunks.{keys,values}.<b>.<j>.<p>     part p of compressed object j of sequence b,
//   chunks.{keys,values}.<b>.<j>.shape   int64, chunks.{keys,values}.<b>.<j>.dtype (chunk storage)
// Rotation signs are not stored: they are drawn again from the seed.
#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <utility>

#include "cache_impl.h"

namespace nexuskv {
namespace {

constexpr const char* kCls = "KVCache.from_state_dict";
constexpr int64_t kVersion = 1;
const char* const kPartNames[] = {"codes", "scale", "zero", "outlier_idx", "outlier_val", "segment_starts"};

using State = c10::Dict<std::string, at::Tensor>;

at::Tensor int_entry(int64_t v) { return at::scalar_tensor(v, at::TensorOptions().dtype(at::kLong)); }
at::Tensor dtype_entry(at::ScalarType t, const at::Device& d = at::kCPU) {
  return at::empty({0}, at::TensorOptions().dtype(t).device(d));
}
at::Tensor text_entry(const std::string& s) {
  return at::tensor(at::ArrayRef<uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()),
                    at::TensorOptions().dtype(at::kByte));
}

const at::Tensor& entry(const State& st, const std::string& key) {
  const auto it = st.find(key);
  TORCH_CHECK(it != st.end(), kCls, ": the state has no entry '", key, "' (not a nexuskv KVCache state dict?)");
  return it->value();
}
bool has(const State& st, const std::string& key) { return st.find(key) != st.end(); }

at::Tensor host(const at::Tensor& t) { return to_host(t); }  // load time only

int64_t int_of(const State& st, const std::string& key) {
  const at::Tensor& t = entry(st, key);
  TORCH_CHECK(t.numel() == 1 && at::isIntegralType(t.scalar_type(), /*includeBool=*/true), kCls, ": entry '", key,
              "' must be one integer, got ", t.scalar_type(), " ", t.sizes());
  return host(t.to(at::kLong)).data_ptr<int64_t>()[0];
}

std::vector<int64_t> ints_of(const State& st, const std::string& key, int64_t n) {
  const at::Tensor& t = entry(st, key);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && at::isIntegralType(t.scalar_type(), false), kCls, ": entry '", key,
              "' must be an integer tensor of shape [", n, "], got ", t.scalar_type(), " ", t.sizes());
  const at::Tensor h = host(t.to(at::kLong));
  return std::vector<int64_t>(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + n);
}

at::ScalarType dtype_of(const State& st, const std::string& key) { return entry(st, key).scalar_type(); }

void put_spec(State& st, const char* name, const QuantSpec& s) {
  const std::string p = std::string("config.") + name + "_";
  st.insert(p + "bits", int_entry(s.bits));
  st.insert(p + "group_size", int_entry(s.group_size));
  st.insert(p + "axis", int_entry(s.axis));
  st.insert(p + "outliers", int_entry(s.num_outliers));
  st.insert(p + "dynamic", int_entry(s.dynamic));
  st.insert(p + "granule", int_entry(s.granule));
  if (s.meta_dtype) st.insert(p + "meta_dtype", dtype_entry(*s.meta_dtype));
  if (s.fit_range) st.insert(p + "fit_range", int_entry(1));  // absent (older states): min/max
}

QuantSpec spec_of(const State& st, const char* name) {
  const std::string p = std::string("config.") + name + "_";
  QuantSpec s;
  s.bits = int_of(st, p + "bits"), s.group_size = int_of(st, p + "group_size"), s.axis = int_of(st, p + "axis");
  s.num_outliers = int_of(st, p + "outliers"), s.dynamic = int_of(st, p + "dynamic") != 0;
  s.granule = int_of(st, p + "granule");
  if (has(st, p + "meta_dtype")) s.meta_dtype = dtype_of(st, p + "meta_dtype");
  s.fit_range = has(st, p + "fit_range") && int_of(st, p + "fit_range") != 0;
  return s;
}

std::string text_of(const State& st, const std::string& key) {
  const at::Tensor t = host(entry(st, key));
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 1, kCls, ": entry '", key, "' must be uint8 text");
  return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), size_t(t.numel()));
}

// The stored tensor `key`, checked to have exactly this shape, dtype and device.
at::Tensor tensor_of(const State& st, const std::string& key, at::IntArrayRef sizes, at::ScalarType dtype,
                     const at::Device& device) {
  const at::Tensor& t = entry(st, key);
  TORCH_CHECK(t.sizes() == sizes && t.scalar_type() == dtype && t.device() == device, kCls, ": entry '", key,
              "' must be ", dtype, " ", sizes, " on ", device, ", got ", t.scalar_type(), " ", t.sizes(), " on ",
              t.device());
  // The cache writes its buffers in place: never alias the caller's tensors.  Detached:
  // a cache is inference-only (an entry that requires grad would poison every attend()).
  return t.detach().clone();
}

// The DGQ invariant of a stored buffer (what append and crop maintain,
// cache_impl.h), per row [b, h] with c = lengths.compressed[b]: starts from 0,
// non-decreasing, at most c; each a whole granule from its chunk's start (every
// compression starts on a chunk); every segment that holds compressed tokens
// spans at most the spec's longest segment of them; the slots from ceil(c / G)
// on hold c.  Checked here so that a forged state fails now, with the entry
// named, not at a later attend() or inside a decoder's outlier check.
void check_stored_segments(const std::string& name, const QuantSpec& spec, const at::Tensor& stored,
                           const std::vector<int64_t>& compressed, int64_t chunk) {
  const at::Tensor s = stored.to(at::kLong).contiguous();  // [B, H, A]
  const int64_t B = s.size(0), H = s.size(1), A = s.size(2), G = spec.group_size, longest = spec.dgq_max_len();
  const int64_t* p = s.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = compressed[size_t(b)], used = (c + G - 1) / G;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t* row = p + (b * H + h) * A;
      const auto where = [&](int64_t i) { return "[" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                                                 std::to_string(i) + "] = " + std::to_string(row[i]); };
      TORCH_CHECK(A == 0 || row[0] == 0, kCls, ": ", name, where(0), ": the first segment must start at token 0");
      for (int64_t i = 0; i < A; ++i) {
        const int64_t end = i + 1 < used ? row[i + 1] : c;
        TORCH_CHECK(row[i] <= c && (i + 1 >= A || row[i] <= row[i + 1]), kCls, ": ", name, where(i),
                    ": segment starts must be non-decreasing within [0, ", c, "] (lengths.compressed[", b, "])");
        TORCH_CHECK(i < used || row[i] == c, kCls, ": ", name, where(i), ": the slots past the compressed tokens "
                    "must hold lengths.compressed[", b, "] = ", c);
        // (Compressions start on chunks; when a chunk is not whole granules a
        // segment's granule count from its compression's start is not known.)
        TORCH_CHECK(chunk % spec.granule != 0 || row[i] % spec.granule == 0, kCls, ": ", name, where(i),
                    ": a segment starts on a whole granule of ", spec.granule, " tokens");
        TORCH_CHECK(i >= used || row[i] >= c || end - row[i] <= longest, kCls, ": ", name, where(i),
                    ": the segment runs to ", end, ", longer than the ", longest, " tokens a segment of group_size ",
                    G, " may hold");
      }
    }
  }
}

}  // namespace

c10::Dict<std::string, at::Tensor> KVCache::Impl::state_dict() const {
  State st;
  st.insert("nexuskv.version", int_entry(kVersion));
  st.insert("config.storage", int_entry(int64_t(mode)));
  // Fused storage: the specs it stores (also when NQ / DGQ compressors gave them).
  put_spec(st, "key", mode == StorageMode::kFused ? keys : options.keys);
  put_spec(st, "value", mode == StorageMode::kFused ? values : options.values);
  st.insert("config.residual", int_entry(options.residual));
  st.insert("config.sinks", int_entry(options.sinks));
  st.insert("config.rotate", int_entry(options.rotate));
  st.insert("config.seed", int_entry(options.seed));
  st.insert("config.external_chunk", int_entry(options.external_chunk));
  if (options.window) st.insert("config.window", int_entry(*options.window));
  if (mode == StorageMode::kChunks) {
    st.insert("config.key_compressor", text_entry(k_comp->describe()));
    st.insert("config.value_compressor", text_entry(v_comp->describe()));
  }
  if (!started()) return st;
  st.insert("shape", host_lengths({batch, heads, head_dim}));
  st.insert("dtype", dtype_entry(x_options.dtype().toScalarType(), x_options.device()));
  st.insert("lengths.sinks", host_lengths(sink_len));
  st.insert("lengths.evicted", host_lengths(evicted_len));
  st.insert("lengths.compressed", host_lengths(compressed_len));
  st.insert("lengths.tail", host_lengths(tail_len));
  for (size_t i = 0; i < k_fused.size(); ++i) {
    st.insert(std::string("keys.") + kPartNames[i], k_fused[i].clone());
  }
  for (size_t i = 0; i < v_fused.size(); ++i) {
    st.insert(std::string("values.") + kPartNames[i], v_fused[i].clone());
  }
  st.insert("tail.k", k_tail.clone());
  st.insert("tail.v", v_tail.clone());
  if (k_sink.defined()) st.insert("sinks.k", k_sink.clone()), st.insert("sinks.v", v_sink.clone());
  if (mode == StorageMode::kExternal) {
    std::vector<int64_t> seq, offset;
    for (size_t j = 0; j < due.size(); ++j) {
      seq.push_back(due[j].seq), offset.push_back(due[j].offset);
      st.insert("due.k." + std::to_string(j), due[j].k.clone());
      st.insert("due.v." + std::to_string(j), due[j].v.clone());
    }
    st.insert("due.seq", host_lengths(seq));
    st.insert("due.offset", host_lengths(offset));
  }
  for (const auto& [name, chunks] : {std::pair("keys", &k_chunks), std::pair("values", &v_chunks)})
    for (size_t b = 0; b < chunks->size(); ++b)
      for (size_t j = 0; j < (*chunks)[b].size(); ++j) {
        const CompressedTensor& c = (*chunks)[b][j];
        const std::string p = std::string("chunks.") + name + "." + std::to_string(b) + "." + std::to_string(j) + ".";
        for (size_t q = 0; q < c.parts.size(); ++q) st.insert(p + std::to_string(q), c.parts[q].clone());
        st.insert(p + "shape", host_lengths(c.shape));
        st.insert(p + "dtype", dtype_entry(c.dtype));
      }
  return st;
}

CacheOptions options_from_state(const c10::Dict<std::string, at::Tensor>& st) {
  const int64_t version = int_of(st, "nexuskv.version");
  TORCH_CHECK(version == kVersion, kCls, ": entry 'nexuskv.version' is ", version, ": state format version ", version,
              " is not supported (this nexuskv reads version ", kVersion, ")");
  CacheOptions o;
  o.keys = spec_of(st, "key"), o.values = spec_of(st, "value");
  o.residual = int_of(st, "config.residual"), o.sinks = int_of(st, "config.sinks");
  o.rotate = int_of(st, "config.rotate") != 0, o.seed = int_of(st, "config.seed");
  o.external_chunk = int_of(st, "config.external_chunk");
  if (has(st, "config.window")) o.window = int_of(st, "config.window");
  // The constructor checks these again, but here the message names the entry.
  check_quant_spec(o.keys, kCls, "config.key_");
  check_quant_spec(o.values, kCls, "config.value_");
  return o;
}

void KVCache::Impl::load_state(const c10::Dict<std::string, at::Tensor>& st) {
  const int64_t storage = int_of(st, "config.storage");
  TORCH_CHECK(storage == int64_t(mode), kCls, ": the state holds storage kind ", storage, " but the cache built "
              "from it has ", int64_t(mode), " (0 fused, 1 chunk, 2 external); chunk storage needs its compressors");
  if (mode == StorageMode::kChunks)
    for (const auto& [key, comp] : {std::pair("config.key_compressor", k_comp.get()),
                                    std::pair("config.value_compressor", v_comp.get())})
      TORCH_CHECK(text_of(st, key) == comp->describe(), kCls, ": the state was saved with compressor '",
                  text_of(st, key), "' but '", comp->describe(), "' was given");
  if (!has(st, "shape")) {  // saved before any append: then it holds no tokens
    for (const auto& item : st) {
      const std::string& key = item.key();
      TORCH_CHECK(key.rfind("config.", 0) == 0 || key == "nexuskv.version", kCls, ": the state has entry '", key,
                  "' but no 'shape' (a cache that holds tokens saves its shape; the state is incomplete)");
    }
    return;
  }
  const std::vector<int64_t> shape = ints_of(st, "shape", 3);
  const int64_t B = shape[0], H = shape[1], D = shape[2];
  TORCH_CHECK(B > 0 && H > 0 && D > 0, kCls, ": shape must be positive, got ", at::IntArrayRef(shape));
  const at::Tensor& carrier = entry(st, "dtype");
  const at::ScalarType x = carrier.scalar_type();
  const at::Device device = carrier.device();
  TORCH_CHECK(x == at::kFloat || x == at::kHalf || x == at::kBFloat16, kCls,
              ": dtype must be float32, float16 or bfloat16, got ", x);
  TORCH_CHECK(!options.rotate || (D & (D - 1)) == 0, kCls, ": rotate needs head_dim a power of two, got ", D);
  const at::TensorOptions xo = at::TensorOptions().dtype(x).device(device);
  const auto sl = ints_of(st, "lengths.sinks", B), el = ints_of(st, "lengths.evicted", B);
  const auto cl = ints_of(st, "lengths.compressed", B), tl = ints_of(st, "lengths.tail", B);

  const auto fp = [&](const std::string& key) {
    const at::Tensor& t = entry(st, key);
    TORCH_CHECK(t.dim() == 4, kCls, ": entry '", key, "' must have 4 dims, got ", t.sizes());
    return tensor_of(st, key, {B, H, t.size(2), D}, x, device);
  };
  const at::Tensor kt = fp("tail.k"), vt = fp("tail.v");
  TORCH_CHECK(vt.size(2) == kt.size(2), kCls, ": tail.k and tail.v must hold one capacity");
  at::Tensor ks, vs;
  if (options.sinks > 0) {
    ks = fp("sinks.k"), vs = fp("sinks.v");
    TORCH_CHECK(vs.size(2) == ks.size(2) && ks.size(2) <= options.sinks, kCls,
                ": sinks.k and sinks.v must hold one capacity of at most sinks=", options.sinks);
  }
  StoreParts kf, vf;
  int64_t capacity = 0;
  if (mode == StorageMode::kFused) {
    const at::Tensor& codes = entry(st, "keys.codes");
    TORCH_CHECK(codes.dim() == 4, kCls, ": keys.codes must have 4 dims, got ", codes.sizes());
    capacity = codes.size(2);
    TORCH_CHECK(capacity >= 1 && capacity <= CacheOptions::kMaxTokens && capacity % chunk == 0, kCls,
                ": entry 'keys.codes' holds a compressed capacity of ", capacity,
                " tokens; it must be a positive multiple of the chunk (", chunk, ")");
    for (const auto& [name, spec, out] :
         {std::tuple("keys.", &keys, &kf), std::tuple("values.", &values, &vf)}) {
      const StoreParts want = allocate_store(*spec, B, H, capacity, D, at::TensorOptions().dtype(x).device(at::kMeta));
      for (size_t i = 0; i < want.size(); ++i)
        out->push_back(tensor_of(st, name + std::string(kPartNames[i]), want[i].sizes(), want[i].scalar_type(), device));
    }
  }
  const int64_t W = options.window.value_or(0);
  for (int64_t b = 0; b < B; ++b) {
    const size_t i = size_t(b);
    for (const auto& [name, v] : {std::pair("sinks", sl[i]), std::pair("evicted", el[i]),
                                  std::pair("compressed", cl[i]), std::pair("tail", tl[i])})
      TORCH_CHECK(v >= 0 && v <= CacheOptions::kMaxPositions, kCls, ": lengths.", name, "[", b, "] = ", v,
                  " is outside [0, ", CacheOptions::kMaxPositions, "]");
    TORCH_CHECK(sl[i] <= (ks.defined() ? ks.size(2) : 0), kCls, ": lengths.sinks[", b, "] = ", sl[i],
                " exceeds the sink buffers (sinks.k holds ", ks.defined() ? ks.size(2) : 0, " tokens)");
    TORCH_CHECK(tl[i] <= kt.size(2), kCls, ": lengths.tail[", b, "] = ", tl[i], " exceeds the tail buffers (tail.k "
                "holds ", kt.size(2), " tokens)");
    TORCH_CHECK(sl[i] == options.sinks || el[i] + cl[i] + tl[i] == 0, kCls, ": lengths.sinks[", b, "] = ", sl[i],
                " is below sinks=", options.sinks, " but the sequence has tokens after its sinks");
    TORCH_CHECK(el[i] == 0 || options.window, kCls, ": lengths.evicted[", b, "] = ", el[i],
                " but the state has no config.window (only a sliding window evicts)");
    TORCH_CHECK(el[i] % chunk == 0 && (mode == StorageMode::kChunks || cl[i] % chunk == 0), kCls,
                ": lengths.evicted[", b, "] = ", el[i], " and lengths.compressed[", b, "] = ", cl[i],
                " must be whole chunks of ", chunk, " tokens");
    TORCH_CHECK(mode != StorageMode::kFused || cl[i] <= capacity, kCls, ": lengths.compressed[", b, "] = ", cl[i],
                " exceeds the compressed buffers (keys.codes holds ", capacity, " tokens)");
    // What the window evicted is what no query from the next position on sees
    // (crop's rule): a window widened after the fact would need evicted tokens.
    const int64_t positions = sl[i] + el[i] + cl[i] + tl[i];
    TORCH_CHECK(positions <= CacheOptions::kMaxPositions, kCls, ": sequence ", b, " spans ", positions,
                " positions (lengths.*), more than ", CacheOptions::kMaxPositions);
    TORCH_CHECK(el[i] == 0 || el[i] <= positions - W + 1, kCls, ": lengths.evicted[", b, "] = ", el[i],
                " but with config.window = ", W, " the next query (position ", positions, ") sees positions from ",
                positions - W + 1, " on: the window is wider than the one that evicted them");
  }
  if (mode == StorageMode::kFused)
    for (const auto& [name, spec, parts] : {std::tuple("keys", &keys, &kf), std::tuple("values", &values, &vf)}) {
      const std::string entry_name = std::string(name) + ".segment_starts";
      TORCH_CHECK(has(st, entry_name) == spec->dynamic, kCls, ": the state ", spec->dynamic ? "lacks" : "has",
                  " entry '", entry_name, "' but config.", name == std::string("keys") ? "key" : "value",
                  "_dynamic = ", int(spec->dynamic), " (segment starts belong to dynamic (DGQ) groups only)");
      if (spec->dynamic) check_stored_segments(entry_name, *spec, host((*parts)[5]), cl, chunk);
    }
  std::vector<DueChunk> d;
  if (mode == StorageMode::kExternal) {
    const int64_t m = entry(st, "due.seq").numel();
    TORCH_CHECK(entry(st, "due.offset").numel() == m, kCls, ": due.seq and due.offset must list one entry per due "
                "chunk, got ", m, " and ", entry(st, "due.offset").numel());
    TORCH_CHECK(!has(st, "due.k." + std::to_string(m)), kCls, ": the state has entry 'due.k.", m, "' but due.seq "
                "lists ", m, " due chunks");
    const auto seq = ints_of(st, "due.seq", m), offset = ints_of(st, "due.offset", m);
    for (int64_t j = 0; j < m; ++j) {
      const int64_t b = seq[size_t(j)], at_token = offset[size_t(j)];
      TORCH_CHECK(b >= 0 && b < B, kCls, ": due.seq[", j, "] = ", b, " is outside [0, ", B, ")");
      const std::string key = "due.k." + std::to_string(j);
      const at::Tensor& t = entry(st, key);
      TORCH_CHECK(t.dim() == 3, kCls, ": entry '", key, "' must have 3 dims [", H, ", tokens, ", D, "], got ",
                  t.sizes());
      // A due chunk is whole chunks of compressed positions that the sequence holds.
      const int64_t n = t.size(1), held = el[size_t(b)] + cl[size_t(b)];
      TORCH_CHECK(n > 0 && n % chunk == 0, kCls, ": entry '", key, "' must hold a positive whole number of chunks of ",
                  chunk, " tokens, got ", n);
      TORCH_CHECK(at_token >= 0 && at_token % chunk == 0 && at_token <= held - n, kCls, ": due.offset[", j, "] = ",
                  at_token, " must be a whole chunk in [0, ", held - n, "] (sequence ", b, " holds ", held,
                  " evicted and compressed positions, the chunk ", n, ")");
      d.push_back({b, at_token, tensor_of(st, key, {H, n, D}, x, device),
                   tensor_of(st, "due.v." + std::to_string(j), {H, n, D}, x, device)});
    }
  }
  std::vector<std::vector<CompressedTensor>> kc, vc;
  if (mode == StorageMode::kChunks) {
    for (const auto& [name, out] : {std::pair("keys", &kc), std::pair("values", &vc)}) {
      out->assign(size_t(B), {});
      for (int64_t b = 0; b < B; ++b) {
        int64_t tokens = 0;
        for (int64_t j = 0;; ++j) {
          const std::string p = std::string("chunks.") + name + "." + std::to_string(b) + "." + std::to_string(j) + ".";
          if (!has(st, p + "shape")) break;
          CompressedTensor c;
          const at::Tensor& sh = entry(st, p + "shape");
          c.shape = ints_of(st, p + "shape", sh.numel());
          c.dtype = dtype_of(st, p + "dtype");
          TORCH_CHECK(c.shape.size() == 3 && c.shape[0] == H && c.shape[2] == D, kCls, ": ", p,
                      "shape must be [", H, ", tokens, ", D, "]");
          for (int64_t q = 0; has(st, p + std::to_string(q)); ++q)
            c.parts.push_back(entry(st, p + std::to_string(q)).detach().clone());
          tokens += c.shape[1];
          (*out)[size_t(b)].push_back(std::move(c));
        }
        TORCH_CHECK(tokens == cl[size_t(b)], kCls, ": the compressed ", name, " objects of sequence ", b, " hold ",
                    tokens, " tokens, but lengths.compressed says ", cl[size_t(b)]);
      }
    }
  }
  // Everything checked: take it.
  batch = B, heads = H, head_dim = D, x_options = xo;
  sink_len = sl, evicted_len = el, compressed_len = cl, tail_len = tl;
  k_fused = std::move(kf), v_fused = std::move(vf);
  k_tail = kt, v_tail = vt, k_sink = ks, v_sink = vs;
  due = std::move(d), k_chunks = std::move(kc), v_chunks = std::move(vc);
  signs = options.rotate ? rotation_signs_for(D, device) : at::Tensor();
  lengths_changed();
  check_loaded_values();
}

// A loaded cache must hold what an append could have stored (nexuskv/cache.h:
// finite K/V), or a later compression of its tail, a crop into its compressed
// part or every attend() would fail or turn NaN: the full-precision rows and
// due chunks are checked, and the compressed parts are decoded once (which also
// checks their outlier positions).  On failure the half-built cache is dropped
// by from_state_dict.
void KVCache::Impl::check_loaded_values() const {
  const auto finite = [](const at::Tensor& t) { return !t.defined() || host_flag(at::isfinite(t).all()); };
  for (const auto& [name, t] : {std::pair("tail.k", &k_tail), std::pair("tail.v", &v_tail),
                                std::pair("sinks.k", &k_sink), std::pair("sinks.v", &v_sink)})
    TORCH_CHECK(finite(*t), kCls, ": entry '", name, "' holds NaN or Inf; a cache only holds finite K/V");
  for (const DueChunk& d : due)
    TORCH_CHECK(finite(d.k) && finite(d.v), kCls, ": a due chunk (due.k/due.v) holds NaN or Inf");
  if (mode == StorageMode::kExternal) return;
  if (mode == StorageMode::kFused) {
    // Per entry, so that the message names the one at fault: the metadata
    // that the compressed tokens use must be finite, and each part must
    // decode (which checks its outlier positions; its segment starts were
    // checked by load_state).
    for (const auto& [name, parts, spec, is_keys] : {std::tuple("keys", &k_fused, &keys, true),
                                                     std::tuple("values", &v_fused, &values, false)})
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t c = compressed_len[size_t(b)], rows = meta_rows(*spec, c);
        if (c == 0) continue;
        for (const auto& [i, part] : {std::pair(1, "scale"), std::pair(2, "zero"), std::pair(4, "outlier_val")})
          TORCH_CHECK(finite((*parts)[size_t(i)].select(0, b).slice(1, 0, rows)), kCls, ": entry '", name, ".", part,
                      "' holds NaN or Inf in the groups of sequence ", b, "; a cache only holds finite K/V");
        at::Tensor decoded;
        try {
          decoded = compressed_tokens(is_keys, b, b + 1, 0, c, at::kFloat);
        } catch (const c10::Error& e) {
          TORCH_CHECK(false, kCls, ": entry '", name, ".outlier_idx' does not decode", spec->dynamic ? " under '" : "",
                      spec->dynamic ? name : "", spec->dynamic ? ".segment_starts'" : "", " (sequence ", b, "): ",
                      e.what_without_backtrace());
        }
        TORCH_CHECK(finite(decoded), kCls, ": entries '", name, ".scale' and '", name, ".zero' of sequence ", b,
                    " decode to values beyond float32; a cache only holds finite K/V");
      }
    return;
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> kv;
  try {
    kv = assemble(at::kFloat, nullptr, nullptr);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, kCls, ": the stored compressed K/V do not decode: ", e.what_without_backtrace());
  }
  TORCH_CHECK(finite(std::get<0>(kv)) && finite(std::get<1>(kv)), kCls,
              ": the stored compressed K/V decode to NaN or Inf (keys.* / values.* scale, zero or outlier_val are "
              "not finite); a cache only holds finite K/V");
}

}  // namespace nexuskv
