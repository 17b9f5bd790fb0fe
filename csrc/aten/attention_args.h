// Argument validation for dgq_fused_attention, shared by every backend: turns
// the operator's tensors into a core::AttentionProblem after checking them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "nexuskv/core/attention.h"

namespace nexuskv {

struct AttentionInputs {
  core::AttentionProblem problem;
  std::vector<at::Tensor> keep_alive;  // converted tensors the problem points into
};

AttentionInputs attention_inputs(const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache,
                                 at::IntArrayRef k_format, at::IntArrayRef v_format,
                                 const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail,
                                 const std::optional<at::Tensor>& v_tail, const std::optional<at::Tensor>& tail_lens,
                                 const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                 const std::optional<at::Tensor>& k_sink, const std::optional<at::Tensor>& v_sink,
                                 const std::optional<at::Tensor>& sink_lens, std::optional<int64_t> window,
                                 std::optional<double> softcap);

// Checks signs for a randomized Hadamard rotation of rows of length n.
void check_rotation_signs(const char* op, const at::Tensor& signs, int64_t n);

}  // namespace nexuskv
