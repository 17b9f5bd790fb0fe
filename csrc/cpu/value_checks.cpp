#include "value_checks.h"

#include <ATen/ATen.h>

#include <algorithm>

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

}  // namespace nexuskv
