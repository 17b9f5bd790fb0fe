// The nexuskv operator surface: every schema, in one block.  Kernels register
// beside their code (csrc/cpu, csrc/cuda) with TORCH_LIBRARY_IMPL; the
// inference-only guard lives in ops/inference_only.cpp.  The nexuskv_meta
// library repeats the operator schemas for the meta kernels that the Python
// fake kernels run (csrc/aten/meta_kernels.cpp).
#include <torch/custom_class.h>
#include <torch/library.h>

#include "nexuskv/cache.h"
#include "nexuskv/recipe.h"

namespace {

// Every operator schema.  nexuskv's carry `tags` (pt2_compliant: the fake
// kernels of nexuskv/ops.py let torch.compile trace them); nexuskv_meta's are
// the same schemas for the meta kernels.
void define_operators(torch::Library& m, const std::vector<at::Tag>& tags) {
  // NQ block quantization; the compressed format is documented in
  // csrc/include/nexuskv/core/nq_format.h.  axis = -2: groups of group_size
  // tokens per channel (keys); axis = -1: groups of group_size channels per
  // token (values).  fit_range: least-squares fitted ranges instead of
  // min/max (nq_format.h, "Fitted ranges"; the same format for readers).
  // Allocates its outputs.
  m.def(
      "nq_compress(Tensor x, int bits, int group_size, int axis, int num_outliers=0, "
      "ScalarType? meta_dtype=None, bool fit_range=False) -> "
      "(Tensor codes, Tensor scale, Tensor zero, Tensor outlier_idx, Tensor outlier_val)",
      tags);
  // Inverse of nq_compress: x_hat [..., tokens, head_dim] in out_dtype
  // (default: outlier_val's dtype, i.e. the dtype that was compressed).  The
  // format parameters must be those of the compression: a mismatch is an
  // error where it changes the buffers' sizes, undetectable where it does not
  // (nexuskv.ops.nq_decompress lists the cases).
  m.def(
      "nq_decompress(Tensor codes, Tensor scale, Tensor zero, Tensor outlier_idx, Tensor outlier_val, "
      "int bits, int group_size, int axis, int head_dim, ScalarType? out_dtype=None) -> Tensor",
      tags);

  // DGQ: per-channel quantization over token groups chosen from the data
  // (segments of whole granules, at most max_len tokens, default the smallest
  // multiple of granule >= 2*group_size;
  // S = ceil(tokens / group_size) per row).  Returns the NQ buffers plus
  // segment_starts [..., S] (int32).  Allocates its outputs.
  m.def(
      "dgq_compress(Tensor x, int bits, int group_size, int granule=16, int? max_len=None, int num_outliers=0, "
      "ScalarType? meta_dtype=None, bool fit_range=False) -> "
      "(Tensor codes, Tensor scale, Tensor zero, Tensor outlier_idx, Tensor outlier_val, Tensor segment_starts)",
      tags);
  m.def(
      "dgq_decompress(Tensor codes, Tensor scale, Tensor zero, Tensor outlier_idx, Tensor outlier_val, "
      "Tensor segment_starts, int bits, int group_size, int head_dim, ScalarType? out_dtype=None) -> Tensor",
      tags);
  // Fused attention straight over the compressed cache:
  //   out = softmax(q . K^T * scale + causal) . V        [batch, q_heads, q_len, head_dim]
  // k_cache / v_cache: [codes, scale, zero, outlier_idx, outlier_val] (NQ) or
  // the same + segment_starts (DGQ), each [batch, kv_heads, ...];
  // k_format / v_format: [bits, group_size, axis].  Keys of sequence b are its
  // compressed_lens[b] compressed tokens, then tail_lens[b] tokens of the full
  // precision k_tail/v_tail [batch, kv_heads, tail_tokens, head_dim]; the q_len
  // queries are the last q_len positions (causal among themselves).  With
  // rotation_signs the cache holds hadamard_rotate(K), hadamard_rotate(V) and the
  // output is in the original basis.  scale defaults to head_dim^-0.5.
  // Optional sinks: sink_lens[b] full-precision tokens of k_sink/v_sink
  // [batch, kv_heads, sink_tokens, head_dim] come first, so that the positions
  // of sequence b are sinks, compressed, tail (the tail and sinks are stored in
  // the original basis even when rotated).  window: sliding window, the query
  // at position p sees keys (p - window, p] (positions count sinks too).
  // softcap: scores become softcap * tanh(score / softcap) (Gemma 2).
  // Allocates its output.
  m.def(
      "dgq_fused_attention(Tensor q, Tensor[] k_cache, Tensor[] v_cache, int[] k_format, int[] v_format, "
      "Tensor compressed_lens, Tensor? k_tail=None, Tensor? v_tail=None, Tensor? tail_lens=None, "
      "Tensor? rotation_signs=None, float? scale=None, Tensor? k_sink=None, Tensor? v_sink=None, "
      "Tensor? sink_lens=None, int? window=None, float? softcap=None) -> Tensor",
      tags);
  // Randomized Hadamard rotation of the last dim (a power of two):
  // y = H (signs * x) / sqrt(n); inverse=True undoes it.  Allocates its output.
  m.def("hadamard_rotate(Tensor x, Tensor signs, bool inverse=False) -> Tensor", tags);
  // The append of a fixed-capacity compressed cache whose whole state is
  // tensors (nexuskv.static_cache.StaticKVCache: a decode step is this and
  // dgq_fused_attention, which torch.compile(fullgraph=True) and torch.export
  // trace): k / v [batch, kv_heads, n, head_dim] go to the full-precision tail
  // k_tail / v_tail [batch, kv_heads, tail_capacity, head_dim]; once it holds
  // residual + chunk tokens or more, its oldest whole chunks are compressed
  // into k_store / v_store (the NQ tensors of dgq_fused_attention's k_cache /
  // v_cache, or DGQ for keys, of a fixed capacity) at the compressed length.
  // lengths int64 [2, batch]: compressed, tail (dgq_fused_attention's
  // compressed_lens and tail_lens).  Mutates its first five arguments.
  m.def(
      "static_kv_append_(Tensor(a!)[] k_store, Tensor(b!)[] v_store, Tensor(c!) k_tail, Tensor(d!) v_tail, "
      "Tensor(e!) lengths, Tensor k, Tensor v, int[] k_format, int[] v_format, int residual) -> ()",
      tags);
  // Paged KV (a serving engine's block pool; the format:
  // csrc/include/nexuskv/core/paged_format.h).  pages: uint8 [num_blocks,
  // kv_heads, block_size, slot_bytes] of one layer, slot_bytes from
  // paged_slot_bytes.  The write quantizes key / value [num_tokens, kv_heads,
  // head_dim] per token (groups of group_size channels, scales in their dtype)
  // into slot_mapping[t] = block * block_size + offset (-1: skip); with
  // rotation_signs it stores hadamard_rotate(x, signs); key_fit_range /
  // value_fit_range: fitted ranges as nq_compress's (the same slots for
  // readers); exact_window: the pages' format (W, paged_format.h; their rings
  // are written by paged_exact_write_, not here).  Mutates pages.
  m.def(
      "paged_kv_write_(Tensor(a!) pages, Tensor key, Tensor value, Tensor slot_mapping, int key_bits, "
      "int value_bits, int group_size, int num_outliers=0, Tensor? rotation_signs=None, bool key_fit_range=False, "
      "bool value_fit_range=False, int exact_window=0) -> ()",
      tags);
  // The exact window's rings (pages of exact_window W > 0): the rows of key /
  // value [num_tokens, kv_heads, head_dim] as given (not rotated), each in
  // the ring of its slot_mapping[t] (-1: skip), in token order.  Call it after
  // paged_attention over the same tokens (that attention reads their rows
  // from its own key / value, and older ones from the rings).  Mutates pages.
  m.def(
      "paged_exact_write_(Tensor(a!) pages, Tensor key, Tensor value, Tensor slot_mapping, int key_bits, "
      "int value_bits, int group_size, int num_outliers, int exact_window) -> ()",
      tags);
  // Fused attention over the pages of ragged requests (vLLM's varlen batch):
  //   out = softmax(softcap(q . K^T * scale) + causal / window mask) . V   [num_tokens, q_heads, head_dim]
  // Request r's queries are q rows [query_start_loc[r], query_start_loc[r+1]),
  // the last positions of its seq_lens[r] tokens (written before the call),
  // causal among themselves; its token t lives in block block_table[r, t /
  // block_size].  GQA by q_heads / kv_heads; window: the query at position p
  // sees keys (p - window, p]; softcap as in dgq_fused_attention; q's dtype is
  // the dtype the keys and values were written in.  Rows of q past
  // query_start_loc[-1] give zeros.  exact_window W > 0: the query at
  // position p reads keys and values (p - W, p] exact, from key / value
  // [num_tokens, kv_heads, head_dim] (the queries' own tokens, as written by
  // paged_kv_write_ before the call) and from the pages' rings (older ones).
  // Allocates its output.
  m.def(
      "paged_attention(Tensor q, Tensor pages, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "
      "int key_bits, int value_bits, int group_size, int num_outliers=0, Tensor? rotation_signs=None, "
      "float? scale=None, int? window=None, float? softcap=None, int exact_window=0, Tensor? key=None, "
      "Tensor? value=None) -> Tensor",
      tags);
}

}  // namespace

TORCH_LIBRARY(nexuskv, m) {
  define_operators(m, {at::Tag::pt2_compliant_tag});
  // Bytes per (token, kv head) slot of a paged pool (paged_format.h): the last
  // dimension of paged_kv_write_'s pages, what a serving engine sizes its
  // blocks by.  No tensor argument: one kernel for every backend.
  // (Its kernel: csrc/aten/paged_args.cpp.)
  m.def(
      "paged_slot_bytes(int head_dim, int key_bits, int value_bits, int group_size, int num_outliers, "
      "ScalarType dtype, int exact_window=0, int block_size=0) -> int");

  // The compressed KV cache of one attention layer (policy and methods:
  // nexuskv/cache.h), for Python and TorchScript as
  // torch.classes.nexuskv.KVCache; build it with the Python factory
  // nexuskv.cache.make_cache(**keywords).  The constructor's arguments are the
  // fields of nexuskv::CacheOptions in a fixed order (the first 12 without
  // defaults: the order of older releases, kept so that their positional
  // calls still work).  external_chunk > 0: external storage in chunks of
  // that many tokens (the quantization arguments are then unused).
  // meta_dtype: dtype of the scales/zeros (default: the input dtype).
  // window: sliding window (tokens a query sees, itself included).
  // key_fit_range / value_fit_range: least-squares fitted ranges (nq_format.h).
  m.class_<nexuskv::KVCache>("KVCache")
      .def(torch::init([](int64_t key_bits, int64_t key_group_size, int64_t key_axis, int64_t key_outliers,
                          bool key_dynamic, int64_t value_bits, int64_t value_group_size, int64_t value_axis,
                          int64_t value_outliers, int64_t residual, bool rotate, int64_t seed, int64_t sinks,
                          int64_t external_chunk, std::optional<at::ScalarType> meta_dtype,
                          std::optional<int64_t> window, bool key_fit_range, bool value_fit_range) {
             nexuskv::CacheOptions o;
             o.keys.bits = key_bits, o.keys.group_size = key_group_size, o.keys.axis = key_axis;
             o.keys.num_outliers = key_outliers, o.keys.dynamic = key_dynamic;
             o.values.bits = value_bits, o.values.group_size = value_group_size, o.values.axis = value_axis;
             o.values.num_outliers = value_outliers;
             o.keys.meta_dtype = o.values.meta_dtype = meta_dtype;
             o.keys.fit_range = key_fit_range, o.values.fit_range = value_fit_range;
             o.residual = residual, o.rotate = rotate, o.seed = seed, o.sinks = sinks;
             o.external_chunk = external_chunk, o.window = window;
             return c10::make_intrusive<nexuskv::KVCache>(std::move(o));
           }),
           "",
           {torch::arg("key_bits"), torch::arg("key_group_size"), torch::arg("key_axis"), torch::arg("key_outliers"),
            torch::arg("key_dynamic"), torch::arg("value_bits"), torch::arg("value_group_size"),
            torch::arg("value_axis"), torch::arg("value_outliers"), torch::arg("residual"), torch::arg("rotate"),
            torch::arg("seed"), torch::arg("sinks") = 0, torch::arg("external_chunk") = 0,
            torch::arg("meta_dtype") = torch::arg::none(), torch::arg("window") = torch::arg::none(),
            torch::arg("key_fit_range") = false, torch::arg("value_fit_range") = false})
      .def("append", &nexuskv::KVCache::append, "",
           {torch::arg("k"), torch::arg("v"), torch::arg("valid") = torch::arg::none(), torch::arg("hold") = false})
      .def("settle", &nexuskv::KVCache::settle)
      .def("compression_points", &nexuskv::KVCache::compression_points, "", {torch::arg("n")})
      .def("append_and_attend", &nexuskv::KVCache::append_and_attend, "",
           {torch::arg("k"), torch::arg("v"), torch::arg("q"), torch::arg("scale") = torch::arg::none(),
            torch::arg("softcap") = torch::arg::none()})
      .def("attend", &nexuskv::KVCache::attend, "",
           {torch::arg("q"), torch::arg("scale") = torch::arg::none(), torch::arg("softcap") = torch::arg::none()})
      .def("dense", &nexuskv::KVCache::dense, "", {torch::arg("dtype") = torch::arg::none()})
      .def("take_due_chunks", &nexuskv::KVCache::take_due_chunks)
      .def("dense_with", &nexuskv::KVCache::dense_with, "",
           {torch::arg("k_compressed"), torch::arg("v_compressed"), torch::arg("dtype") = torch::arg::none()})
      .def("crop", &nexuskv::KVCache::crop, "", {torch::arg("length")})
      .def("crop_with", &nexuskv::KVCache::crop_with, "",
           {torch::arg("length"), torch::arg("k_compressed"), torch::arg("v_compressed")})
      .def("reorder", &nexuskv::KVCache::reorder, "", {torch::arg("beam_idx")})
      .def("to", [](const c10::intrusive_ptr<nexuskv::KVCache>& self,
                    const std::string& device) { self->to(c10::Device(device)); })
      .def("clone", &nexuskv::KVCache::clone)
      .def("reset", &nexuskv::KVCache::reset)
      .def("state_dict", &nexuskv::KVCache::state_dict)
      .def_static(
          "from_state_dict",
          [](const c10::Dict<std::string, at::Tensor>& state) { return nexuskv::KVCache::from_state_dict(state); })
      .def("lengths", &nexuskv::KVCache::lengths)
      .def("compressed_lengths", &nexuskv::KVCache::compressed_lengths)
      .def("evicted_lengths", &nexuskv::KVCache::evicted_lengths)
      .def("max_length", &nexuskv::KVCache::max_length)
      .def("nbytes", &nexuskv::KVCache::nbytes)
      .def("used_nbytes", &nexuskv::KVCache::used_nbytes)
      .def("compressed_nbytes", &nexuskv::KVCache::compressed_nbytes)
      .def("chunk", &nexuskv::KVCache::chunk)
      .def("sinks", &nexuskv::KVCache::sinks)
      .def("window", &nexuskv::KVCache::window)
      .def("is_external", &nexuskv::KVCache::is_external)
      // pickle, torch.save and copy.deepcopy carry the state dict.
      .def_pickle([](const c10::intrusive_ptr<nexuskv::KVCache>& self) { return self->state_dict(); },
                  [](c10::Dict<std::string, at::Tensor> state) { return nexuskv::KVCache::from_state_dict(state); });
  // A calibration recipe (nexuskv/recipe.h), for TorchScript and Python as
  // torch.classes.nexuskv.Recipe(path): each layer's key / value bits to build
  // its KVCache with, the settings they were allocated for, the key means.
  m.class_<nexuskv::Recipe>("Recipe")
      .def(torch::init<std::string>(), "", {torch::arg("path")})
      .def("path", [](const c10::intrusive_ptr<nexuskv::Recipe>& self) { return self->path(); })
      .def("version", &nexuskv::Recipe::version)
      .def("layers", &nexuskv::Recipe::layers)
      .def("kv_heads", &nexuskv::Recipe::kv_heads)
      .def("head_dim", &nexuskv::Recipe::head_dim)
      .def("model_type", &nexuskv::Recipe::model_type)
      .def("key_center", &nexuskv::Recipe::key_center)
      .def("has_bit_map", &nexuskv::Recipe::has_bit_map)
      .def("bit_map", &nexuskv::Recipe::bit_map)
      .def("key_bits", &nexuskv::Recipe::key_bits, "", {torch::arg("layer")})
      .def("value_bits", &nexuskv::Recipe::value_bits, "", {torch::arg("layer")})
      .def("setting", &nexuskv::Recipe::setting, "", {torch::arg("name")})
      .def("flag", &nexuskv::Recipe::flag, "", {torch::arg("name")})
      .def("meta_dtype", &nexuskv::Recipe::meta_dtype)
      .def("check_geometry", &nexuskv::Recipe::check_geometry, "",
           {torch::arg("layers"), torch::arg("kv_heads"), torch::arg("head_dim")});
}

// The meta kernels of the operators above, run by the fake kernels of
// nexuskv/ops.py on meta copies of their inputs (csrc/aten/meta_kernels.cpp).
TORCH_LIBRARY(nexuskv_meta, m) { define_operators(m, {}); }
