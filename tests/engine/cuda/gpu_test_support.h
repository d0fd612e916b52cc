// What the GPU engine's tests share (tests/engine/cuda/*_test.cc): skipping where no GPU is
// visible, relative errors, random inputs and host <-> device copies of test data.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_array.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/engine/relative_error.h"

#define REQUIRE_GPU()                                                     \
  do {                                                                    \
    if (exl3::cuda::DeviceCount() == 0) GTEST_SKIP() << "no GPU visible"; \
  } while (0)

namespace exl3::engine::cuda {

using testing::RelativeError;

inline std::vector<float> Random(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Greedy runs of the same prompts (testing::RunGreedy's rows, [sequence][step][vocab]) on the GPU
// and the CPU model: every row's greedy token the same (a fatal failure names the first that is
// not) and the worst row's relative error in *worst.
inline void CompareGreedyRows(const std::vector<std::vector<std::vector<float>>>& gpu,
                              const std::vector<std::vector<std::vector<float>>>& cpu, double* worst) {
  *worst = 0;
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t s = 0; s < gpu.size(); ++s) {
    ASSERT_EQ(gpu[s].size(), cpu[s].size());
    for (size_t r = 0; r < gpu[s].size(); ++r) {
      const std::vector<float>& g = gpu[s][r];
      const std::vector<float>& c = cpu[s][r];
      *worst = std::max(*worst, RelativeError(g, c));
      ASSERT_EQ(std::max_element(g.begin(), g.end()) - g.begin(), std::max_element(c.begin(), c.end()) - c.begin())
          << "sequence " << s << " step " << r;
    }
  }
}

template <typename T>
DeviceArray<T> ToDevice(const std::vector<T>& v) {
  DeviceArray<T> d;
  EXPECT_TRUE(d.Upload(v).ok());
  return d;
}

// After the device's work so far.
template <typename T>
std::vector<T> ToHost(const T* d, size_t n) {
  std::vector<T> v(n);
  EXPECT_TRUE(exl3::cuda::Synchronize().ok());
  EXPECT_TRUE(exl3::cuda::CopyToHost(v.data(), d, n * sizeof(T)).ok());
  return v;
}
template <typename T>
std::vector<T> ToHost(const DeviceArray<T>& d, size_t n) {
  return ToHost(d.get(), n);
}

// IEEE binary16 bits to float (references read the values the kernels read from the fp16 cache).
inline float HalfToFloat(KvHalf h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float v;
  if (exponent == 0) {
    v = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    v = mantissa != 0 ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  }
  return (h & 0x8000) != 0 ? -v : v;
}

}  // namespace exl3::engine::cuda
