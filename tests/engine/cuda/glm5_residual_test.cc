// GLM-5.3-Flash's residual stream and dense MLP on the GPU against the CPU engine's functions
// (engine/cuda/hyper_residual.h, engine/cuda/dense_mlp.h): its hyper-connections (the kernels
// DeepSeek-V4 shares, with the glm5_next fixture's weights under model.language_model. and its
// hc_* fields), the head's mean of the streams (HyperMeanCollapse against HyperHead::Mean) and
// the dense MLP's clamped SwiGLU (ClampedSiluMul against kernels/moe_cpu.h's SwiGlu with the
// fixture's limit). Each prints a "glm5 ..." line. Skipped where no GPU is visible (ctest label
// gpu).
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/config/glm5next_config.h"
#include "engine/cpu/residual/hyper_connections.h"
#include "engine/config/model_config.h"
#include "gtest/gtest.h"
#include "kernels/moe_cpu.h"
#include "model/moe_config.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"
#include "tests/engine/cuda/hyper_connection_check.h"

namespace exl3::engine::cuda {
namespace {

constexpr const char* kFixture = "tests/fixtures/engine/glm5_next_experts";

HyperConnectionShape Glm5Shape(const ModelConfig& cfg) {
  const Glm5NextConfig& g = *cfg.glm5next;
  return {cfg.hidden_size, g.hc_mult, g.hc_sinkhorn_iters, g.hc_eps, cfg.rms_norm_eps};
}

TEST(Glm5KernelsTest, HyperConnectionsMatchTheCpu) {
  REQUIRE_GPU();
  auto cfg = LoadModelConfig(kFixture);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_NE(cfg->glm5next, nullptr);
  auto src = TensorSource::Open(kFixture);
  ASSERT_TRUE(src.ok()) << src.status();
  const HyperConnectionShape shape = Glm5Shape(*cfg);
  std::mt19937 rng(11);
  for (const std::string& prefix : {LayerPrefix(cfg->moe, 0) + "hc_attn_", LayerPrefix(cfg->moe, 2) + "hc_ffn_"})
    testing::CheckHyperConnectionAgainstCpu(**src, prefix, shape, /*T=*/29, rng, "glm5");
}

// At the released models' width (4096, 4 streams: the decode step's shape, 1 to 8 tokens; the
// prefill's, whose sums take MixSumsTiledKernel from 16 tokens on: 16, 64, 65 (one past a tile of
// 64 tokens) and 1024) and at widths whose last slice of the collapse's sums is partly empty (300,
// 3 streams; tiled at 64 and 100 tokens, with a partly empty last pass of 16 positions), that take
// its scalar path (301: not a multiple of 4, 5 streams, the most whose Sinkhorn runs a lane an
// element; more streams than the tiled kernel's 4 at 64 tokens) and its shared-memory Sinkhorn (8
// and 16 streams), and 1 and 2 streams tiled, with random weights.
TEST(Glm5KernelsTest, HyperConnectionsAtWideHiddenSizesMatchTheCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  struct Case {
    HyperConnectionShape shape;
    std::vector<int> tokens;
  };
  const std::vector<Case> cases = {{{4096, 4, 20, 1e-6f, 1e-5f}, {1, 2, 3, 7, 8, 16, 64, 65, 1024}},
                                   {{300, 3, 20, 1e-6f, 1e-5f}, {3, 64, 100}},
                                   {{301, 5, 20, 1e-6f, 1e-5f}, {1, 7, 64}},
                                   {{512, 2, 20, 1e-6f, 1e-5f}, {40}},
                                   {{128, 1, 20, 1e-6f, 1e-5f}, {17}},
                                   {{256, 8, 20, 1e-6f, 1e-5f}, {2}},
                                   {{64, 16, 7, 1e-6f, 1e-5f}, {3}}};
  for (const Case& c : cases) {
    const HyperConnectionShape& shape = c.shape;
    const int N = shape.streams, mixes = (2 + N) * N;
    const std::vector<float> fn = Random(static_cast<size_t>(mixes) * N * shape.hidden, rng, 0.02f);
    const std::vector<float> base = Random(mixes, rng), scale = Random(3, rng, 0.5f);
    SafetensorsWriter w;
    w.AddF32("hc_fn", {mixes, static_cast<int64_t>(N) * shape.hidden}, fn.data());
    w.AddF32("hc_base", {mixes}, base.data());
    w.AddF32("hc_scale", {3}, scale.data());
    const std::string path = ::testing::TempDir() + "hyper_connection_" + std::to_string(shape.hidden) + "_" +
                             std::to_string(N) + ".safetensors";
    ASSERT_TRUE(w.Write(path).ok());
    auto src = TensorSource::Open(path);
    ASSERT_TRUE(src.ok()) << src.status();
    for (const int T : c.tokens) testing::CheckHyperConnectionAgainstCpu(**src, "hc_", shape, T, rng, "glm5");
  }
}

// The head: the mean of each logit row's streams (rows out of order, one repeated), against
// HyperHead::Mean's Collapse.
TEST(Glm5KernelsTest, MeanHeadMatchesTheCpu) {
  REQUIRE_GPU();
  auto cfg = LoadModelConfig(kFixture);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_NE(cfg->glm5next, nullptr);
  for (const HyperConnectionShape shape : {Glm5Shape(*cfg), HyperConnectionShape{4096, 4, 20, 1e-6f, 1e-5f},
                                           HyperConnectionShape{300, 3, 20, 1e-6f, 1e-5f}}) {
    const int H = shape.hidden, N = shape.streams, T = 23;
    std::mt19937 rng(5 + H);
    const std::vector<float> streams = Random(static_cast<size_t>(T) * N * H, rng, 3.0f);
    const std::vector<int> rows = {0, 22, 7, 7, 13};
    const HyperHead head = HyperHead::Mean(shape);
    ASSERT_EQ(head.kind(), HyperHeadKind::kMean);
    std::vector<float> want(rows.size() * H);
    head.Collapse(streams.data(), rows, want.data());
    const std::vector<int32_t> rows32(rows.begin(), rows.end());
    DeviceArray<float> d_streams = ToDevice(streams), d_out;
    DeviceArray<int32_t> d_rows = ToDevice(rows32);
    ASSERT_TRUE(d_out.Reserve(want.size()).ok());
    ASSERT_TRUE(HyperMeanCollapse(N, H, d_streams.get(), d_rows.get(), static_cast<int>(rows.size()), d_out.get(),
                                  nullptr).ok());
    const std::vector<float> got = ToHost(d_out, want.size());
    const double rel = RelativeError(got, want);
    std::printf("glm5 mean head %d streams x %d: rel %.2e\n", N, H, rel);
    // The same fp32 additions in the same order, then the same division.
    EXPECT_EQ(got, want);
  }
  EXPECT_FALSE(HyperMeanCollapse(17, 64, nullptr, nullptr, 1, nullptr, nullptr).ok()) << "more streams than the GPU's";
}

// The dense MLP's activation with the fixture's limit (10: Glm5NextTextConfig's default), on values
// of which a good part lies beyond it, against the CPU's SwiGlu.
TEST(Glm5KernelsTest, ClampedSwiGluMatchesTheCpu) {
  REQUIRE_GPU();
  auto cfg = LoadModelConfig(kFixture);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const float limit = cfg->dense_swiglu_limit;
  ASSERT_GT(limit, 0.0f) << "the fixture's dense MLP is clamped";
  std::mt19937 rng(21);
  const size_t n = 3 * 4096 + 17;
  const std::vector<float> gate = Random(n, rng, 12.0f), up = Random(n, rng, 12.0f);
  int clamped = 0;
  for (size_t i = 0; i < n; ++i) clamped += gate[i] > limit || std::fabs(up[i]) > limit;
  std::vector<float> want = gate;
  SwiGlu(want.data(), up.data(), n, limit);
  DeviceArray<float> d_gate = ToDevice(gate), d_up = ToDevice(up);
  ASSERT_TRUE(ClampedSiluMul(d_gate.get(), d_up.get(), static_cast<int64_t>(n), limit, nullptr).ok());
  const double rel = RelativeError(ToHost(d_gate, n), want);
  std::printf("glm5 clamped swiglu limit %.1f: %zu values (%d beyond the limit) rel %.2e\n", limit, n, clamped, rel);
  EXPECT_GT(clamped, static_cast<int>(n / 10));
  EXPECT_LT(rel, 1e-6);
  // The unclamped kernel differs there (the clamp is what the test sees).
  DeviceArray<float> d_plain = ToDevice(gate);
  ASSERT_TRUE(SiluMul(d_plain.get(), d_up.get(), static_cast<int64_t>(n), nullptr).ok());
  EXPECT_GT(RelativeError(ToHost(d_plain, n), want), 1e-2);
  for (const float bad : {0.0f, -1.0f, NAN, INFINITY})
    EXPECT_FALSE(ClampedSiluMul(d_gate.get(), d_up.get(), static_cast<int64_t>(n), bad, nullptr).ok()) << bad;
}

}  // namespace
}  // namespace exl3::engine::cuda
