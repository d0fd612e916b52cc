// Decode-sized dense linears on the GPU (engine/cuda/dense_gemv_kernels.h, and CudaLinear's dense
// path through it) against a double reference on fresh random inputs: 1 to 8 rows, input widths
// that take the float4 path (4096, 128) and the scalar one (127; an x one float off 16-byte
// alignment), several linears sharing x in one launch (GLM-5.3-Flash's low-rank f_a / g_a / b
// shapes), with and without bias, the input split over a cluster (DenseGemvPlan) at its edges (odd
// widths, slices that end mid-warp, outputs that end mid-tile, jobs of their own x), and
// CudaLinear at 9 rows (cuBLAS) for the hand-over. Lines "dense gemv ..." give every comparison
// as ‖out − ref‖ / ‖ref‖. Skipped where no GPU is visible (ctest label gpu).
#include <cublas_v2.h>

#include <cstdio>
#include <random>
#include <vector>

#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/dense_gemv_kernels.h"
#include "gtest/gtest.h"
#include "tests/engine/cuda/gpu_test_support.h"

namespace exl3::engine::cuda {
namespace {

std::vector<float> Reference(const std::vector<float>& w, const std::vector<float>* bias, const float* x, int T,
                             int in, int out) {
  std::vector<float> y(static_cast<size_t>(T) * out);
  for (int t = 0; t < T; ++t) {
    for (int o = 0; o < out; ++o) {
      double acc = bias != nullptr ? (*bias)[o] : 0.0;
      for (int i = 0; i < in; ++i) acc += static_cast<double>(w[static_cast<size_t>(o) * in + i]) * x[t * in + i];
      y[static_cast<size_t>(t) * out + o] = static_cast<float>(acc);
    }
  }
  return y;
}

TEST(DenseGemvTest, SharedLaunchMatchesTheReference) {
  REQUIRE_GPU();
  std::mt19937 rng(23);
  for (const int in : {4096, 128, 127}) {
    for (const int x_offset : {0, 1}) {
      for (const int T : {1, 3, 8}) {
        const std::vector<int> outs = {128, 128, 64};
        const std::vector<float> x = Random(static_cast<size_t>(T) * in + x_offset, rng);
        DeviceArray<float> d_x = ToDevice(x);
        std::vector<std::vector<float>> w, b;
        std::vector<DeviceArray<float>> d_w, d_b, d_y;
        std::vector<DenseGemvJob> jobs;
        for (size_t j = 0; j < outs.size(); ++j) {
          w.push_back(Random(static_cast<size_t>(outs[j]) * in, rng, 0.05f));
          b.push_back(Random(outs[j], rng));
          d_w.push_back(ToDevice(w[j]));
          d_b.push_back(ToDevice(b[j]));
          d_y.emplace_back();
          ASSERT_TRUE(d_y.back().Reserve(static_cast<size_t>(T) * outs[j]).ok());
        }
        for (size_t j = 0; j < outs.size(); ++j)  // the middle one without bias
          jobs.push_back({d_w[j].get(), j == 1 ? nullptr : d_b[j].get(), d_y[j].get(), outs[j]});
        ASSERT_TRUE(DenseGemv(jobs.data(), static_cast<int>(jobs.size()), d_x.get() + x_offset, T, in, nullptr).ok());
        for (size_t j = 0; j < outs.size(); ++j) {
          const std::vector<float> want = Reference(w[j], j == 1 ? nullptr : &b[j], x.data() + x_offset, T, in, outs[j]);
          const double rel = RelativeError(ToHost(d_y[j], want.size()), want);
          std::printf("dense gemv in %d (x offset %d) rows %d linear %zu of %zu: rel %.2e\n", in, x_offset, T, j,
                      outs.size(), rel);
          EXPECT_LT(rel, 1e-5) << "in " << in << " rows " << T << " linear " << j;
        }
      }
    }
  }
  DenseGemvJob job;
  EXPECT_FALSE(DenseGemv(&job, 1, nullptr, kDenseGemvMaxRows + 1, 16, nullptr).ok()) << "too many rows";
  EXPECT_FALSE(DenseGemv(&job, 0, nullptr, 1, 16, nullptr).ok()) << "no linear";
}

// The split input at its edges: widths whose slices end mid-warp or mid-batch (odd, scalar path;
// a multiple of 4 that is not of 512), outputs that end mid-tile (1, 13, 130 features over jobs),
// every row count, jobs each with an x of its own next to one on the shared x, a launch large
// enough to need no split (4096 outputs), and narrow rows four outputs a warp (128 and 64 inputs
// on float4s, 20 floats; KDA's f_b and g_b in one launch). Each case names DenseGemvPlan's layout.
TEST(DenseGemvTest, SplitInputMatchesTheReferenceAtTileEdges) {
  REQUIRE_GPU();
  std::mt19937 rng(47);
  struct Case {
    int in;
    std::vector<int> outs;
    bool own_x;  // the second and later jobs read an x of their own
  };
  const std::vector<Case> cases = {
      {4097, {13}, false},          {4097, {128, 130, 1}, false}, {4096, {32}, false},
      {4096, {128, 128, 64}, true}, {1540, {288, 5}, false},      {16384, {24}, false},
      {640, {7, 9, 11, 13}, true},  {128, {8192}, false},         {4096, {4096}, false},
      {33, {40, 3}, true},          {128, {8192, 8192}, true},    {64, {130}, false},
      {20, {45, 7}, true},
  };
  for (const Case& c : cases) {
    for (int T = 1; T <= kDenseGemvMaxRows; ++T) {
      if (c.outs[0] >= 4096 && T != 1 && T != kDenseGemvMaxRows) continue;  // the big ones at the ends only
      const int count = static_cast<int>(c.outs.size());
      std::vector<std::vector<float>> xs, w, b;
      std::vector<DeviceArray<float>> d_x, d_w, d_b, d_y;
      std::vector<DenseGemvJob> jobs;
      int total = 0;
      for (int j = 0; j < count; ++j) {
        if (j == 0 || c.own_x) {
          xs.push_back(Random(static_cast<size_t>(T) * c.in, rng));
          d_x.push_back(ToDevice(xs.back()));
        }
        w.push_back(Random(static_cast<size_t>(c.outs[j]) * c.in, rng, 0.05f));
        b.push_back(Random(c.outs[j], rng));
        d_w.push_back(ToDevice(w[j]));
        d_b.push_back(ToDevice(b[j]));
        d_y.emplace_back();
        ASSERT_TRUE(d_y.back().Reserve(static_cast<size_t>(T) * c.outs[j]).ok());
        total += c.outs[j];
      }
      for (int j = 0; j < count; ++j) {
        DenseGemvJob job{d_w[j].get(), j % 2 == 1 ? nullptr : d_b[j].get(), d_y[j].get(), c.outs[j]};
        if (c.own_x && j > 0) job.x = d_x[j].get();
        jobs.push_back(job);
      }
      ASSERT_TRUE(DenseGemv(jobs.data(), count, d_x[0].get(), T, c.in, nullptr).ok());
      const DenseGemvShape plan = DenseGemvPlan(total, c.in, c.in % 4 == 0);
      for (int j = 0; j < count; ++j) {
        const std::vector<float>& x = xs[c.own_x ? j : 0];
        const std::vector<float> want = Reference(w[j], j % 2 == 1 ? nullptr : &b[j], x.data(), T, c.in, c.outs[j]);
        const double rel = RelativeError(ToHost(d_y[j], want.size()), want);
        std::printf("dense gemv in %d rows %d linear %d of %d (out %d, %s x; %d blocks, %d splits, %d outputs a warp): "
                    "rel %.2e\n",
                    c.in, T, j, count, c.outs[j], c.own_x && j > 0 ? "own" : "shared", plan.blocks, plan.splits,
                    plan.outputs_per_warp, rel);
        EXPECT_LT(rel, 1e-5) << "in " << c.in << " rows " << T << " linear " << j;
      }
    }
  }
  // GLM-5.3-Flash's decode shapes: 4096 inputs to a few hundred outputs split (low-rank, router,
  // indexer), KDA's two 128 → 8192 four outputs a warp, a wide head neither.
  EXPECT_EQ(DenseGemvPlan(320, 4096, true).splits, 8);
  EXPECT_EQ(DenseGemvPlan(288, 4096, true).splits, 8);
  EXPECT_EQ(DenseGemvPlan(32, 4096, true).splits, 8);
  EXPECT_EQ(DenseGemvPlan(16384, 128, true).splits, 1);
  EXPECT_EQ(DenseGemvPlan(16384, 128, true).outputs_per_warp, 4);
  EXPECT_EQ(DenseGemvPlan(16384, 128, true).blocks, 512);
  EXPECT_EQ(DenseGemvPlan(154880, 4096, true).splits, 1);
  EXPECT_EQ(DenseGemvPlan(154880, 4096, true).outputs_per_warp, 1);
}

// The same launch twice gives the same bits (the split's sums are added in a fixed order).
TEST(DenseGemvTest, SplitInputIsDeterministic) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  const int in = 4096, T = 3;
  const std::vector<int> outs = {128, 128, 64};
  const std::vector<float> x = Random(static_cast<size_t>(T) * in, rng);
  DeviceArray<float> d_x = ToDevice(x);
  std::vector<DeviceArray<float>> d_w, d_y[2];
  std::vector<DenseGemvJob> jobs[2];
  for (size_t j = 0; j < outs.size(); ++j) d_w.push_back(ToDevice(Random(static_cast<size_t>(outs[j]) * in, rng, 0.05f)));
  for (int run = 0; run < 2; ++run) {
    for (size_t j = 0; j < outs.size(); ++j) {
      d_y[run].emplace_back();
      ASSERT_TRUE(d_y[run].back().Reserve(static_cast<size_t>(T) * outs[j]).ok());
      jobs[run].push_back({d_w[j].get(), nullptr, d_y[run].back().get(), outs[j]});
    }
    ASSERT_TRUE(DenseGemv(jobs[run].data(), static_cast<int>(outs.size()), d_x.get(), T, in, nullptr).ok());
  }
  for (size_t j = 0; j < outs.size(); ++j) {
    const size_t n = static_cast<size_t>(T) * outs[j];
    EXPECT_EQ(ToHost(d_y[0][j], n), ToHost(d_y[1][j], n)) << "linear " << j;
  }
}

// CudaLinear's dense layers: DenseGemv up to 8 rows, cuBLAS from 9, alone and through ForwardShared
// (the router's 4096 → 288 shape; the low-rank ones).
TEST(DenseGemvTest, CudaLinearDenseRowsMatchTheReference) {
  REQUIRE_GPU();
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  const CudaLinearContext ctx{handle, nullptr, nullptr};
  std::mt19937 rng(31);
  const int in = 4096;
  for (const int T : {1, 8, 9}) {
    const std::vector<int> outs = {288, 128, 64};
    std::vector<std::vector<float>> w;
    std::vector<CudaLinear> layers;
    for (int out : outs) {
      w.push_back(Random(static_cast<size_t>(out) * in, rng, 0.05f));
      auto l = CudaLinear::UploadDense(w.back().data(), in, out);
      ASSERT_TRUE(l.ok()) << l.status();
      layers.push_back(std::move(*l));
    }
    const std::vector<float> x = Random(static_cast<size_t>(T) * in, rng);
    DeviceArray<float> d_x = ToDevice(x);
    std::vector<DeviceArray<float>> alone(outs.size()), shared(outs.size());
    const CudaLinear* ptrs[3];
    float* ys[3];
    for (size_t j = 0; j < outs.size(); ++j) {
      ASSERT_TRUE(alone[j].Reserve(static_cast<size_t>(T) * outs[j]).ok());
      ASSERT_TRUE(shared[j].Reserve(static_cast<size_t>(T) * outs[j]).ok());
      ASSERT_TRUE(layers[j].Forward(d_x.get(), T, alone[j].get(), ctx).ok());
      ptrs[j] = &layers[j];
      ys[j] = shared[j].get();
    }
    ASSERT_TRUE(CudaLinear::ForwardShared(ptrs, 3, d_x.get(), T, ys, ctx).ok());
    for (size_t j = 0; j < outs.size(); ++j) {
      const std::vector<float> want = Reference(w[j], nullptr, x.data(), T, in, outs[j]);
      const double rel_alone = RelativeError(ToHost(alone[j], want.size()), want);
      const double rel_shared = RelativeError(ToHost(shared[j], want.size()), want);
      std::printf("dense gemv CudaLinear rows %d out %d: alone rel %.2e, shared rel %.2e\n", T, outs[j], rel_alone,
                  rel_shared);
      EXPECT_LT(rel_alone, 1e-5);
      EXPECT_LT(rel_shared, 1e-5);
    }
  }
  cublasDestroy(handle);
}

// CudaLinear::ForwardEach: KDA's f_b / g_b shape (128 → 8192, each from its own low-rank input)
// in one launch up to 8 rows, one by one (cuBLAS) from 9.
TEST(DenseGemvTest, CudaLinearForwardEachMatchesTheReference) {
  REQUIRE_GPU();
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  const CudaLinearContext ctx{handle, nullptr, nullptr};
  std::mt19937 rng(37);
  const int in = 128, out = 8192;
  for (const int T : {1, 5, 8, 9}) {
    std::vector<std::vector<float>> w, x;
    std::vector<CudaLinear> layers;
    std::vector<DeviceArray<float>> d_x, d_y(2);
    for (int j = 0; j < 2; ++j) {
      w.push_back(Random(static_cast<size_t>(out) * in, rng, 0.05f));
      auto l = CudaLinear::UploadDense(w.back().data(), in, out);
      ASSERT_TRUE(l.ok()) << l.status();
      layers.push_back(std::move(*l));
      x.push_back(Random(static_cast<size_t>(T) * in, rng));
      d_x.push_back(ToDevice(x.back()));
      ASSERT_TRUE(d_y[j].Reserve(static_cast<size_t>(T) * out).ok());
    }
    const CudaLinear* ptrs[2] = {&layers[0], &layers[1]};
    const float* xs[2] = {d_x[0].get(), d_x[1].get()};
    float* ys[2] = {d_y[0].get(), d_y[1].get()};
    ASSERT_TRUE(CudaLinear::ForwardEach(ptrs, xs, 2, T, ys, ctx).ok());
    for (int j = 0; j < 2; ++j) {
      const std::vector<float> want = Reference(w[j], nullptr, x[j].data(), T, in, out);
      const double rel = RelativeError(ToHost(d_y[j], want.size()), want);
      std::printf("dense gemv CudaLinear::ForwardEach rows %d linear %d: rel %.2e\n", T, j, rel);
      EXPECT_LT(rel, 1e-5);
    }
  }
  cublasDestroy(handle);
}

}  // namespace
}  // namespace exl3::engine::cuda
