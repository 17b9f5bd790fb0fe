#include "value_checks.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace nexuskv {

void check_rotation_sign_values(const char* op, const at::Tensor& signs) {
  TORCH_INTERNAL_ASSERT(signs.scalar_type() == at::kFloat && signs.is_contiguous() && signs.device().is_cpu());
  const float* s = signs.data_ptr<float>();
  for (int64_t i = 0; i < signs.numel(); ++i)
    TORCH_CHECK(s[i] == 1.f || s[i] == -1.f, op, ": rotation signs must all be +1 or -1, got ", s[i], " at ", i);
}

void check_segment_starts(const char* op, const char* what, const core::NQDims& d, const int32_t* starts,
                          const std::function<int64_t(int64_t)>& valid_tokens) {
  const std::string o = what && *what ? std::string(what) + ": " : std::string();
  const int64_t S = d.meta_a();
  const int32_t* s = starts;
  for (int64_t r = 0; r < d.rows; ++r, s += S) {
    TORCH_CHECK(s[0] == 0, op, ": ", o, "segment_starts of row ", r, " must begin at token 0, got ", s[0]);
    const int64_t valid = valid_tokens ? valid_tokens(r) : d.tokens;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t end = i + 1 < S ? s[i + 1] : d.tokens;
      TORCH_CHECK(s[i] <= end && end <= d.tokens, op, ": ", o, "segment_starts of row ", r,
                  " must be non-decreasing within [0, ", d.tokens, "]; segment ", i, " is [", s[i], ", ", end, ")");
      // outlier_idx holds positions inside a segment in one byte: every segment
      // that holds valid tokens spans at most kMaxGroupSize of them.  The slots
      // past a cache's tokens hold its compressed length, so the last one runs
      // unused to the capacity, however far that is.
      const int64_t used_end = std::min(end, valid);
      TORCH_CHECK(s[i] >= valid || used_end - s[i] <= core::kMaxGroupSize, op, ": ", o, "segment_starts of row ", r,
                  ": segment ", i, " is [", s[i], ", ", end, "), longer than the ", core::kMaxGroupSize,
                  " tokens a segment may hold");
    }
  }
}

void check_lengths_within(const char* op, const char* name, const core::SeqLengths& lens, int64_t batch, int64_t limit,
                          const char* limit_what) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t v = lens.at(b);
    TORCH_CHECK(v >= 0 && v <= limit, op, ": ", name, "[", b, "] = ", v, " is outside [0, ", limit, "] (", limit_what,
                ")");
  }
}

void check_paged_slots(const char* op, const int64_t* slots, int64_t n, int64_t num_slots) {
  std::vector<int64_t> used;
  used.reserve(size_t(n));
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, op, ": slot_mapping[", t, "] is ", slots[t],
                ", outside the pool's slots [0, num_blocks * block_size) = [0, ", num_slots, ") (-1: skip the token)");
    if (slots[t] >= 0) used.push_back(slots[t]);
  }
  // Two tokens of one call racing for one slot would leave a mix of both.
  std::sort(used.begin(), used.end());
  const auto dup = std::adjacent_find(used.begin(), used.end());
  TORCH_CHECK(dup == used.end(), op, ": slot_mapping holds slot ", dup == used.end() ? 0 : *dup,
              " twice; each slot can take one token per call");
}

void check_paged_write_status(const char* op, at::ScalarType dtype, bool non_finite, bool overflow) {
  TORCH_CHECK(!non_finite, op, ": key or value holds NaN or Inf (in a token with a slot); the slots of such tokens ",
              "now hold garbage: write them again with finite values before attending over them");
  TORCH_CHECK(!overflow, op, ": a group of key or value spans more than ", dtype,
              " can hold as a scale (finite values beyond +-1.7e38 in float32, or beyond +-65504 in float16); the ",
              "slots of such tokens now hold garbage");
}

void check_paged_requests(const char* op, const PagedAttentionShapes& s, const int32_t* qsl, const int32_t* seq_lens,
                          const int32_t* table) {
  const int64_t P = s.pool.layout.block_size;
  TORCH_CHECK(qsl[0] == 0, op, ": query_start_loc[0] must be 0, got ", qsl[0]);
  for (int64_t r = 0; r < s.num_reqs; ++r) {
    const int64_t q_len = int64_t(qsl[r + 1]) - qsl[r];
    TORCH_CHECK(q_len >= 0 && qsl[r + 1] <= s.num_tokens, op, ": query_start_loc must be non-decreasing and at most ",
                "q's tokens (", s.num_tokens, "), got query_start_loc[", r, "] = ", qsl[r], ", [", r + 1,
                "] = ", qsl[r + 1]);
    const int64_t len = seq_lens[r];
    TORCH_CHECK(len >= q_len && len <= s.max_blocks * P, op, ": seq_lens[", r, "] = ", len, " must be at least ",
                "the request's queries (", q_len, ") and at most block_table's blocks times block_size (", s.max_blocks,
                " x ", P, ")");
    if (q_len == 0) continue;
    int64_t first = 0;
    if (s.window > 0 && len - q_len - s.window + 1 > 0) first = len - q_len - s.window + 1;
    for (int64_t b = first / P; b < (len + P - 1) / P; ++b) {
      const int32_t id = table[r * s.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < s.pool.num_blocks, op, ": block_table[", r, ", ", b, "] = ", id,
                  " is not a block of pages (", s.pool.num_blocks, " blocks), and request ", r, " reads it");
    }
  }
}

void check_paged_outliers(const char* op, bool corrupt) {
  TORCH_CHECK(!corrupt, op, ": pages hold an outlier position outside its group: they were not written by ",
              "paged_kv_write_ with this format (key_bits, value_bits, group_size, num_outliers, dtype)");
}

}  // namespace nexuskv
