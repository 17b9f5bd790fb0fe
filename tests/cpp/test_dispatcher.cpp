// LibTorch test: the registered operators called from C++ through the public
// header and through the dispatcher by name, as a C++ application would.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <string>

#include "catch_compat.h"
#include "nexuskv/ops.h"

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

TEST_CASE("nq_compress / nq_decompress through the public header") {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16})
    for (int64_t axis : {-2, -1}) {
      const at::Tensor x = torch::randn({2, 3, 100, 64}).to(dtype);
      auto [codes, scale, zero, idx, val] = nexuskv::nq_compress(x, 4, 32, axis, 1);
      REQUIRE(codes.sizes() == at::IntArrayRef({2, 3, 100, 32}));
      REQUIRE(scale.scalar_type() == dtype);
      const at::Tensor xh = nexuskv::nq_decompress(codes, scale, zero, idx, val, 4, 32, axis, 64);
      REQUIRE(xh.sizes() == x.sizes());
      REQUIRE(xh.scalar_type() == dtype);
      // Per-element bound: half of the largest scale, plus output rounding.
      const double bound = scale.to(at::kFloat).max().item<double>() / 2 * 1.01 + 0.02;
      REQUIRE((xh.to(at::kFloat) - x.to(at::kFloat)).abs().max().item<double>() <= bound);
    }
}

TEST_CASE("operators are reachable by name through the dispatcher") {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("nexuskv::nq_compress", "");
  REQUIRE(op.schema().returns().size() == 5);
  // every argument of the schema, defaults included (the boxed convention): fit_range last
  torch::jit::Stack stack{torch::randn({4, 16}), int64_t(8), int64_t(16), int64_t(-1), int64_t(0), c10::IValue(), true};
  op.callBoxed(&stack);
  REQUIRE(stack.size() == 5);
  REQUIRE(stack[0].toTensor().sizes() == at::IntArrayRef({4, 16}));
}

TEST_CASE("bad input is a c10::Error naming the argument") {
  const at::Tensor x = torch::randn({8, 64});
  REQUIRE(error_of([&] { nexuskv::nq_compress(x, 5, 32, -2); }).find("bits must be one of 2, 3, 4, 8, got 5") !=
          std::string::npos);
  REQUIRE(error_of([&] { nexuskv::nq_compress(x, 4, 0, -2); }).find("group_size") != std::string::npos);
  REQUIRE(error_of([&] { nexuskv::nq_compress(x.to(at::kLong), 4, 32, -2); }).find("float32, float16 or bfloat16") !=
          std::string::npos);
  const at::Tensor g = torch::randn({8, 64}, torch::requires_grad());
  REQUIRE(error_of([&] { nexuskv::nq_compress(g, 4, 32, -2); }).find("inference-only") != std::string::npos);
  {
    torch::NoGradGuard no_grad;
    REQUIRE_NOTHROW(nexuskv::nq_compress(g, 4, 32, -2));
  }
}

TEST_CASE("int arguments are range-checked on their int64 value") {
  const at::Tensor x = torch::randn({8, 64});
  // A narrowing to int first would read 2^32 + 4 as 4.
  REQUIRE(error_of([&] {
            nexuskv::nq_compress(x, (int64_t(1) << 32) + 4, 32, -2);
          }).find("bits must be one of 2, 3, 4, 8, got 4294967300") != std::string::npos);
}

TEST_CASE("the meta kernels run the kernels' checks (nexuskv_meta)") {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("nexuskv_meta::nq_compress", "");
  torch::jit::Stack ok{
      torch::empty({4, 100, 64}, torch::kMeta), int64_t(4), int64_t(32), int64_t(-2), int64_t(1), c10::IValue(), false};
  op.callBoxed(&ok);
  REQUIRE(ok.size() == 5);
  REQUIRE(ok[0].toTensor().is_meta());
  REQUIRE(ok[0].toTensor().sizes() == at::IntArrayRef({4, 100, 32}));  // the real kernel's sizes
  REQUIRE(ok[1].toTensor().sizes() == at::IntArrayRef({4, 4, 64}));
  torch::jit::Stack empty{
      torch::empty({4, 0, 64}, torch::kMeta), int64_t(4), int64_t(32), int64_t(-2), int64_t(0), c10::IValue(), false};
  REQUIRE(error_of([&] { op.callBoxed(&empty); }).find("nq_compress: x must not be empty") != std::string::npos);
}
