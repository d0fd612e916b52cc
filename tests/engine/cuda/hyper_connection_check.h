// Test support: one hyper-connection of a fixture (engine/cpu/residual/hyper_connections.h) on the GPU
// (engine/cuda/hyper_connection_kernels.h) against the CPU class, on random streams: the collapse
// (block input, post and comb mix, and the block's normed input against RMS-normalising the CPU's
// block input with a random weight), the expand from the CPU's mix, and the collapse that expands
// first (HyperCollapse with an expand, in place on the arrays the residual stream passes: the
// expand's mix and block output are the arrays it writes) against the CPU's Expand then Collapse.
// Prints lines starting with `label` giving ‖gpu − cpu‖ / ‖cpu‖ and checks the bounds the
// families share.
#pragma once

#include <cmath>
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

// RmsNorm's arithmetic (engine/cuda/engine_kernels.h) on the host: y = w · (x · inv), inv from a
// double sum of squares.
inline std::vector<float> RmsNormRows(const std::vector<float>& x, const std::vector<float>& w, int T, int H,
                                      float eps) {
  std::vector<float> y(x.size());
  for (int t = 0; t < T; ++t) {
    const float* xr = x.data() + static_cast<size_t>(t) * H;
    double ss = 0.0;
    for (int d = 0; d < H; ++d) ss += static_cast<double>(xr[d]) * xr[d];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / H + eps));
    for (int d = 0; d < H; ++d) y[static_cast<size_t>(t) * H + d] = w[d] * (xr[d] * inv);
  }
  return y;
}

inline void CheckHyperConnectionAgainstCpu(const TensorSource& src, const std::string& prefix,
                                           const HyperConnectionShape& shape, int T, std::mt19937& rng,
                                           const char* label) {
  SCOPED_TRACE(prefix + " T=" + std::to_string(T));
  const int H = shape.hidden, N = shape.streams;
  CpuCompute compute(2);
  auto hc = HyperConnection::Load(src, prefix, shape);
  ASSERT_TRUE(hc.ok()) << hc.status();
  const std::vector<float> streams = Random(static_cast<size_t>(T) * N * H, rng);
  const std::vector<float> norm_weight = Random(H, rng, 0.5f);
  std::vector<float> input(static_cast<size_t>(T) * H);
  HyperConnectionMix mix;
  hc->Collapse(streams.data(), T, input.data(), &mix, compute);
  const std::vector<float> normed = RmsNormRows(input, norm_weight, T, H, shape.norm_eps);

  DeviceArray<float> fn = ToDevice(hc->fn()), base = ToDevice(hc->base()), d_streams = ToDevice(streams);
  DeviceArray<float> d_norm = ToDevice(norm_weight);
  DeviceArray<float> d_input, d_post, d_comb, d_normed;
  ASSERT_TRUE(d_input.Reserve(input.size()).ok());
  ASSERT_TRUE(d_post.Reserve(mix.post.size()).ok());
  ASSERT_TRUE(d_comb.Reserve(mix.comb.size()).ok());
  ASSERT_TRUE(d_normed.Reserve(input.size()).ok());
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
  HyperCollapseOutput out;
  out.block_input = d_input.get();
  out.post = d_post.get();
  out.comb = d_comb.get();
  out.norm_weight = d_norm.get();
  out.norm_eps = shape.norm_eps;
  out.normed = d_normed.get();
  ASSERT_TRUE(HyperCollapse(a, nullptr, d_streams.get(), T, out, scratch.get(), nullptr).ok());
  const std::vector<float> got_input = ToHost(d_input, input.size());
  const double rel_in = RelativeError(got_input, input);
  const double rel_post = RelativeError(ToHost(d_post, mix.post.size()), mix.post);
  const double rel_comb = RelativeError(ToHost(d_comb, mix.comb.size()), mix.comb);
  const std::vector<float> got_normed = ToHost(d_normed, input.size());
  const double rel_normed = RelativeError(got_normed, normed);
  // The norm from the pairs' sums against RmsNorm's on the GPU's own block input: the same to a
  // float rounding or two.
  const double rel_norm_own = RelativeError(got_normed, RmsNormRows(got_input, norm_weight, T, H, shape.norm_eps));
  // Twice, the same bits (every sum in a fixed order).
  ASSERT_TRUE(HyperCollapse(a, nullptr, d_streams.get(), T, out, scratch.get(), nullptr).ok());
  EXPECT_EQ(ToHost(d_input, input.size()), got_input) << "collapse not deterministic";
  EXPECT_EQ(ToHost(d_normed, input.size()), got_normed) << "collapse norm not deterministic";

  // Expand from the CPU's mix (the collapse's differences left out).
  const std::vector<float> block_out = Random(input.size(), rng);
  std::vector<float> expanded = streams;
  hc->Expand(mix, block_out.data(), T, expanded.data(), compute);
  DeviceArray<float> cpu_post = ToDevice(mix.post), cpu_comb = ToDevice(mix.comb), d_out = ToDevice(block_out);
  ASSERT_TRUE(HyperExpand(cpu_post.get(), cpu_comb.get(), d_out.get(), T, N, H, d_streams.get(), nullptr).ok());
  const double rel_expand = RelativeError(ToHost(d_streams, streams.size()), expanded);
  std::printf("%s hyper-connection %-36s T %3d collapse rel %.2e (post %.2e, comb %.2e, normed %.2e, "
              "norm vs own input %.2e), expand rel %.2e\n",
              label, prefix.c_str(), T, rel_in, rel_post, rel_comb, rel_normed, rel_norm_own, rel_expand);
  EXPECT_LT(rel_in, 1e-5);
  EXPECT_LT(rel_post, 1e-5);
  EXPECT_LT(rel_comb, 1e-5);
  EXPECT_LT(rel_normed, 1e-5);
  EXPECT_LT(rel_norm_own, 1e-6);
  EXPECT_LT(rel_expand, 1e-6);

  // The collapse that expands first, as the residual stream's MLP input runs it: the CPU's mix and
  // the block output in the arrays the collapse writes (post, comb, block input), the streams as
  // before the expand above.
  std::vector<float> input2(input.size());
  HyperConnectionMix mix2;
  hc->Collapse(expanded.data(), T, input2.data(), &mix2, compute);
  const std::vector<float> normed2 = RmsNormRows(input2, norm_weight, T, H, shape.norm_eps);
  DeviceArray<float> s2 = ToDevice(streams), post2 = ToDevice(mix.post), comb2 = ToDevice(mix.comb),
                     io2 = ToDevice(block_out);
  HyperExpandInput ex;
  ex.post = post2.get();
  ex.comb = comb2.get();
  ex.block_output = io2.get();
  out.block_input = io2.get();
  out.post = post2.get();
  out.comb = comb2.get();
  ASSERT_TRUE(HyperCollapse(a, &ex, s2.get(), T, out, scratch.get(), nullptr).ok());
  const double rel_streams2 = RelativeError(ToHost(s2, streams.size()), expanded);
  const double rel_in2 = RelativeError(ToHost(io2, input2.size()), input2);
  const double rel_post2 = RelativeError(ToHost(post2, mix2.post.size()), mix2.post);
  const double rel_comb2 = RelativeError(ToHost(comb2, mix2.comb.size()), mix2.comb);
  const double rel_normed2 = RelativeError(ToHost(d_normed, input2.size()), normed2);
  std::printf("%s hyper-connection %-36s T %3d expand+collapse: streams rel %.2e, collapse rel %.2e (post %.2e, "
              "comb %.2e, normed %.2e)\n",
              label, prefix.c_str(), T, rel_streams2, rel_in2, rel_post2, rel_comb2, rel_normed2);
  EXPECT_LT(rel_streams2, 1e-6);
  EXPECT_LT(rel_in2, 1e-5);
  EXPECT_LT(rel_post2, 1e-5);
  EXPECT_LT(rel_comb2, 1e-5);
  EXPECT_LT(rel_normed2, 1e-5);
}

}  // namespace exl3::engine::cuda::testing
