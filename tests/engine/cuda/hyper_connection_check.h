// Test support: one hyper-connection of a fixture (engine/cpu/residual/hyper_connections.h) on the GPU
// (engine/cuda/hyper_connection_kernels.h) against the CPU class, on random streams: the collapse
// (block input, post and comb mix) and the expand from the CPU's mix. Prints one line starting with
// `label` and checks the bounds the families share.
#pragma once

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/cpu_compute.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/cpu/residual/hyper_connections.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda::testing {

inline void CheckHyperConnectionAgainstCpu(const TensorSource& src, const std::string& prefix,
                                           const HyperConnectionShape& shape, int T, std::mt19937& rng,
                                           const char* label) {
  SCOPED_TRACE(prefix);
  const int H = shape.hidden, N = shape.streams;
  CpuCompute compute(2);
  auto hc = HyperConnection::Load(src, prefix, shape);
  ASSERT_TRUE(hc.ok()) << hc.status();
  const std::vector<float> streams = Random(static_cast<size_t>(T) * N * H, rng);
  std::vector<float> input(static_cast<size_t>(T) * H);
  HyperConnectionMix mix;
  hc->Collapse(streams.data(), T, input.data(), &mix, compute);

  DeviceArray<float> fn = ToDevice(hc->fn()), base = ToDevice(hc->base()), d_streams = ToDevice(streams);
  DeviceArray<float> d_input, d_post, d_comb;
  ASSERT_TRUE(d_input.Reserve(input.size()).ok());
  ASSERT_TRUE(d_post.Reserve(mix.post.size()).ok());
  ASSERT_TRUE(d_comb.Reserve(mix.comb.size()).ok());
  HyperConnectionArgs a;
  a.fn = fn.get();
  a.base = base.get();
  for (int i = 0; i < 3; ++i) a.scale[i] = hc->scale()[i];
  a.streams = N;
  a.hidden = H;
  a.sinkhorn_iters = shape.sinkhorn_iters;
  a.eps = shape.eps;
  a.norm_eps = shape.norm_eps;
  DeviceArray<double> scratch;
  ASSERT_TRUE(scratch.Reserve(HyperCollapseScratchDoubles(a, T)).ok());
  ASSERT_TRUE(
      HyperCollapse(a, d_streams.get(), T, d_input.get(), d_post.get(), d_comb.get(), scratch.get(), nullptr).ok());
  const double rel_in = RelativeError(ToHost(d_input, input.size()), input);
  const double rel_post = RelativeError(ToHost(d_post, mix.post.size()), mix.post);
  const double rel_comb = RelativeError(ToHost(d_comb, mix.comb.size()), mix.comb);

  // Expand from the CPU's mix (the collapse's differences left out).
  const std::vector<float> block_out = Random(input.size(), rng);
  std::vector<float> expanded = streams;
  hc->Expand(mix, block_out.data(), T, expanded.data(), compute);
  DeviceArray<float> cpu_post = ToDevice(mix.post), cpu_comb = ToDevice(mix.comb), d_out = ToDevice(block_out);
  ASSERT_TRUE(HyperExpand(cpu_post.get(), cpu_comb.get(), d_out.get(), T, N, H, d_streams.get(), nullptr).ok());
  const double rel_expand = RelativeError(ToHost(d_streams, streams.size()), expanded);
  std::printf("%s hyper-connection %-42s collapse rel %.2e (post %.2e, comb %.2e), expand rel %.2e\n", label,
              prefix.c_str(), rel_in, rel_post, rel_comb, rel_expand);
  EXPECT_LT(rel_in, 1e-5);
  EXPECT_LT(rel_post, 1e-5);
  EXPECT_LT(rel_comb, 1e-5);
  EXPECT_LT(rel_expand, 1e-6);
}

}  // namespace exl3::engine::cuda::testing
