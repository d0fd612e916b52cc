// Decode-sized dense linears on the GPU (engine/cuda/dense_gemv_kernels.h, and CudaLinear's dense
// path through it) against a double reference on fresh random inputs: 1 to 8 rows, input widths
// that take the float4 path (4096, 128) and the scalar one (127; an x one float off 16-byte
// alignment), several linears sharing x in one launch (GLM-5.3-Flash's low-rank f_a / g_a / b
// shapes), with and without bias, and CudaLinear at 9 rows (cuBLAS) for the hand-over. Lines
// "dense gemv ..." give every comparison. Skipped where no GPU is visible (ctest label gpu).
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

}  // namespace
}  // namespace exl3::engine::cuda
