// Test support: one hyper-connection of a fixture (engine/cpu/residual/hyper_connections.h) on the GPU
// (engine/cuda/hyper_connection_kernels.h) against the CPU class, on random streams: the collapse
// (block input, post and comb mix, and the block's normed input against RMS-normalising the CPU's
// block input with a random weight), the expand from the CPU's mix, and the collapse that expands
// first (HyperCollapse with an expand, in place on the arrays the residual stream passes: the
// expand's mix and block output are the arrays it writes) against the CPU's Expand then Collapse,
// and those two collapses with their mix on a side stream, eagerly and from a captured CUDA graph,
// against themselves on one stream (CheckForkedMix).
// Prints lines starting with `label` giving ‖gpu − cpu‖ / ‖cpu‖ and checks the bounds the
// families share.
#pragma once

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cuda/decode_graphs.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/cpu/residual/hyper_connections.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
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

// Two collapses as the residual stream runs a layer's (the second expands block_out [T, hidden]
// into the streams [T, N, hidden] first, with the first's mix, then collapses them in place) on
// one stream, then with their mix on a HyperMixStream's side stream eagerly, then replayed from a
// CUDA graph captured on a stream of its own (DecodeGraphs::Capture; the side stream a fork and a
// join of the graph): every output the same bits each way.
inline void CheckForkedMix(const HyperConnectionArgs& a, const std::vector<float>& streams,
                           const std::vector<float>& block_out, int T) {
  const size_t N = static_cast<size_t>(a.streams), H = static_cast<size_t>(a.hidden);
  const size_t rows = static_cast<size_t>(T);
  DeviceArray<float> d_streams, d_out, d_input, d_post, d_comb, d_normed, d_norm;
  DeviceArray<double> scratch;
  ASSERT_TRUE(d_input.Reserve(rows * H).ok());
  ASSERT_TRUE(d_normed.Reserve(rows * H).ok());
  ASSERT_TRUE(d_post.Reserve(rows * N).ok());
  ASSERT_TRUE(d_comb.Reserve(rows * N * N).ok());
  ASSERT_TRUE(scratch.Reserve(HyperCollapseScratchDoubles(a, T)).ok());
  ASSERT_TRUE(d_norm.Upload(std::vector<float>(H, 1.0f)).ok());
  // Inputs as given, outputs NaN (so a launch that wrote nothing shows).
  const std::vector<float> nan_rows(rows * H, NAN), nan_post(rows * N, NAN), nan_comb(rows * N * N, NAN);
  auto reset = [&] {
    ASSERT_TRUE(d_streams.Upload(streams).ok());
    ASSERT_TRUE(d_out.Upload(block_out).ok());
    ASSERT_TRUE(d_input.Upload(nan_rows).ok());
    ASSERT_TRUE(d_normed.Upload(nan_rows).ok());
    ASSERT_TRUE(d_post.Upload(nan_post).ok());
    ASSERT_TRUE(d_comb.Upload(nan_comb).ok());
    ASSERT_TRUE(exl3::cuda::Synchronize().ok());
  };
  auto layer = [&](StreamHandle stream, HyperMixStream* mix) -> absl::Status {
    HyperCollapseOutput first;
    first.block_input = d_input.get();
    first.post = d_post.get();
    first.comb = d_comb.get();
    first.norm_weight = d_norm.get();
    first.norm_eps = a.norm_eps;
    first.normed = d_normed.get();
    EXL3_RETURN_IF_ERROR(HyperCollapse(a, nullptr, d_streams.get(), T, first, scratch.get(), stream, mix));
    HyperExpandInput ex;
    ex.post = d_post.get();
    ex.comb = d_comb.get();
    ex.block_output = d_out.get();
    HyperCollapseOutput second = first;
    second.block_input = d_out.get();
    EXL3_RETURN_IF_ERROR(HyperCollapse(a, &ex, d_streams.get(), T, second, scratch.get(), stream, mix));
    return mix != nullptr ? mix->Join(stream) : absl::OkStatus();
  };
  struct Outputs {
    std::vector<float> streams, input, out, post, comb, normed;
    bool operator==(const Outputs& o) const {
      return streams == o.streams && input == o.input && out == o.out && post == o.post && comb == o.comb &&
             normed == o.normed;
    }
  };
  auto outputs = [&](StreamHandle stream) {
    EXPECT_TRUE(exl3::cuda::Synchronize(stream).ok());
    return Outputs{ToHost(d_streams, rows * N * H), ToHost(d_input, rows * H), ToHost(d_out, rows * H),
                   ToHost(d_post, rows * N),        ToHost(d_comb, rows * N * N), ToHost(d_normed, rows * H)};
  };
  reset();
  ASSERT_TRUE(layer(nullptr, nullptr).ok());
  const Outputs want = outputs(nullptr);
  for (const float v : want.comb) ASSERT_FALSE(std::isnan(v)) << "the one-stream collapse wrote no comb";

  auto stream = exl3::cuda::StreamCreate();
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto mix = HyperMixStream::Create();
  ASSERT_TRUE(mix.ok()) << mix.status();
  reset();
  ASSERT_TRUE(layer(*stream, mix->get()).ok());
  const bool eager_same = outputs(*stream) == want;
  EXPECT_TRUE(eager_same) << "the collapses with their mix on a side stream differ";

  DecodeGraphs graphs(/*enabled=*/true, /*verify_steps=*/false);
  DecodeGraph& g = graphs.Get(1, 1, 0, 0);
  ASSERT_TRUE(graphs.Capture(g, *stream, [&] { return layer(*stream, mix->get()); }).ok());
  ASSERT_TRUE(graphs.enabled() && g.exec != nullptr) << "the forked collapses did not capture";
  bool graph_same = true;
  for (int replay = 0; replay < 2; ++replay) {
    reset();
    ASSERT_TRUE(graphs.Replay(g, *stream).ok());
    graph_same = graph_same && outputs(*stream) == want;
  }
  EXPECT_TRUE(graph_same) << "the collapses replayed from a graph differ";
  std::printf("hyper-connection mix on a side stream, %d streams x %d, T %d: eager %s, graph %s\n", a.streams,
              a.hidden, T, eager_same ? "same bits" : "DIFFERENT", graph_same ? "same bits" : "DIFFERENT");
  graphs.Drop();
  exl3::cuda::StreamDestroy(*stream);
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
  ASSERT_TRUE(HyperCollapse(a, nullptr, d_streams.get(), T, out, scratch.get(), nullptr, nullptr).ok());
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
  ASSERT_TRUE(HyperCollapse(a, nullptr, d_streams.get(), T, out, scratch.get(), nullptr, nullptr).ok());
  EXPECT_EQ(ToHost(d_input, input.size()), got_input) << "collapse not deterministic";
  EXPECT_EQ(ToHost(d_normed, input.size()), got_normed) << "collapse norm not deterministic";

  // Expand from the CPU's mix (the collapse's differences left out).
  const std::vector<float> block_out = Random(input.size(), rng);
  std::vector<float> expanded = streams;
  hc->Expand(mix, block_out.data(), T, expanded.data(), compute);
  DeviceArray<float> cpu_post = ToDevice(mix.post), cpu_comb = ToDevice(mix.comb), d_out = ToDevice(block_out);
  ASSERT_TRUE(HyperExpand(cpu_post.get(), cpu_comb.get(), d_out.get(), T, N, H, d_streams.get(), nullptr).ok());
  const double rel_expand = RelativeError(ToHost(d_streams, streams.size()), expanded);
  std::printf("%s hyper-connection %-36s %d x %d T %4d collapse rel %.2e (post %.2e, comb %.2e, normed %.2e, "
              "norm vs own input %.2e), expand rel %.2e\n",
              label, prefix.c_str(), N, H, T, rel_in, rel_post, rel_comb, rel_normed, rel_norm_own, rel_expand);
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
  ASSERT_TRUE(HyperCollapse(a, &ex, s2.get(), T, out, scratch.get(), nullptr, nullptr).ok());
  const double rel_streams2 = RelativeError(ToHost(s2, streams.size()), expanded);
  const double rel_in2 = RelativeError(ToHost(io2, input2.size()), input2);
  const double rel_post2 = RelativeError(ToHost(post2, mix2.post.size()), mix2.post);
  const double rel_comb2 = RelativeError(ToHost(comb2, mix2.comb.size()), mix2.comb);
  const double rel_normed2 = RelativeError(ToHost(d_normed, input2.size()), normed2);
  std::printf("%s hyper-connection %-36s %d x %d T %4d expand+collapse: streams rel %.2e, collapse rel %.2e (post "
              "%.2e, comb %.2e, normed %.2e)\n",
              label, prefix.c_str(), N, H, T, rel_streams2, rel_in2, rel_post2, rel_comb2, rel_normed2);
  EXPECT_LT(rel_streams2, 1e-6);
  EXPECT_LT(rel_in2, 1e-5);
  EXPECT_LT(rel_post2, 1e-5);
  EXPECT_LT(rel_comb2, 1e-5);
  EXPECT_LT(rel_normed2, 1e-5);

  CheckForkedMix(a, streams, block_out, T);
}

}  // namespace exl3::engine::cuda::testing
