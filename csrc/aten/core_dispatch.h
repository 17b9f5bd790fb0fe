// Maps ATen float dtypes onto the torch-free core's storage types.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "nexuskv/core/half.h"

namespace nexuskv {

// Calls f(T{}) with T the core type of t: float, core::half_t or core::bf16_t.
// The core types are bit-compatible with c10::Half / c10::BFloat16, so a
// tensor's data pointer can be reinterpreted as T*.
template <typename F>
void dispatch_core_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(core::half_t{}); break;
    case at::kBFloat16: f(core::bf16_t{}); break;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", t);
  }
}

template <typename T>
T* core_ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace nexuskv
