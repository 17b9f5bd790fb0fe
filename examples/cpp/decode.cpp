// A LibTorch application that runs a TorchScript decoder-attention module
// (saved from Python) over a nexuskv compressed cache, and checks each step
// against the outputs Python computed.
//
//   nexuskv_decode <module.pt> <data.pt>
//
// data.pt is a scripted module whose attributes hold the inputs and the
// expected outputs: prefill_k, prefill_v [B, H, n0, D], then per decode step
// q [steps, B, Hq, 1, D], k, v [steps, B, H, 1, D] and expected [steps, B, Hq, 1, D].
#include <torch/script.h>

#include <iostream>
#include <memory>

#include "nexuskv/cache.h"
#include "nexuskv/compressor.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " <module.pt> <data.pt>\n";
    return 2;
  }
  torch::NoGradGuard no_grad;
  torch::jit::Module decoder = torch::jit::load(argv[1]);
  torch::jit::Module data = torch::jit::load(argv[2]);
  const at::Tensor q = data.attr("q").toTensor(), k = data.attr("k").toTensor(), v = data.attr("v").toTensor();
  const at::Tensor expected = data.attr("expected").toTensor();

  // The same cache Python used: 4-bit keys per channel and values per token in
  // groups of 32, 16 full-precision tokens, DGQ off, no rotation.  Configured by
  // KVCompressor objects (nexuskv/compressor.h): NQ is stored in place and read
  // by the fused kernel; a class of one's own would go through its decompress().
  nexuskv::CacheOptions options;
  options.keys.bits = 4, options.keys.group_size = 32;      // axis -2 (per channel) by default
  options.values.bits = 4, options.values.group_size = 32;  // axis -1 (per token) by default
  options.key_compressor = std::make_shared<nexuskv::NQCompressor>(options.keys);
  options.value_compressor = std::make_shared<nexuskv::NQCompressor>(options.values);
  options.residual = 16;
  auto cache = c10::make_intrusive<nexuskv::KVCache>(options);
  cache->append(data.attr("prefill_k").toTensor(), data.attr("prefill_v").toTensor(), std::nullopt);

  double worst = 0;
  for (int64_t step = 0; step < q.size(0); ++step) {
    const at::Tensor out = decoder.forward({q[step], k[step], v[step], cache}).toTensor();
    worst = std::max(worst, (out - expected[step]).abs().max().item<double>());
  }
  std::cout << "steps " << q.size(0) << ", cached tokens " << cache->max_length() << ", cache bytes "
            << cache->nbytes() << ", max |C++ - Python| " << worst << "\n";
  if (worst > 1e-5) {
    std::cerr << "mismatch against the outputs saved from Python\n";
    return 1;
  }
  std::cout << "OK\n";
  return 0;
}
