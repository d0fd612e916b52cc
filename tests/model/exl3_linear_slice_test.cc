// SliceExl3LinearOutputs: a slice of whole 128-column blocks of an EXL3 layer computes exactly
// those columns of the whole layer's output; other slices are refused.
#include "model/exl3_linear_slice.h"

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codebook.h"
#include "kernels/exl3_linear.h"
#include "kernels/fp16.h"

namespace exl3 {
namespace {

constexpr int kIn = 256, kOut = 384;

// One 4-bit mul1 EXL3 layer "x" [kIn -> kOut] with varied tiles, scales and an fp16 bias.
std::string WriteLayer() {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("exl3_linear_slice_test_" + std::to_string(::getpid()) + ".safetensors")).string();
  std::mt19937 rng(3);
  std::vector<uint16_t> trellis(static_cast<size_t>(kIn / 16) * (kOut / 16) * 64), suh(kIn), svh(kOut), bias(kOut);
  for (uint16_t& t : trellis) t = static_cast<uint16_t>(rng());
  for (int i = 0; i < kIn; ++i) suh[i] = FloatToHalfBits(rng() % 2 ? 1.0f : -1.0f);
  for (int i = 0; i < kOut; ++i) svh[i] = FloatToHalfBits(0.01f * (1 + rng() % 9));
  for (int i = 0; i < kOut; ++i) bias[i] = FloatToHalfBits(0.001f * static_cast<float>(rng() % 100));
  const uint32_t mul1 = kMul1Multiplier;
  SafetensorsWriter w;
  w.Add("x.trellis", DType::kI16, {kIn / 16, kOut / 16, 64}, trellis.data(), trellis.size() * 2);
  w.Add("x.suh", DType::kF16, {kIn}, suh.data(), suh.size() * 2);
  w.Add("x.svh", DType::kF16, {kOut}, svh.data(), svh.size() * 2);
  w.Add("x.bias", DType::kF16, {kOut}, bias.data(), bias.size() * 2);
  w.Add("x.mul1", DType::kI32, {}, &mul1, 4);
  EXPECT_TRUE(w.Write(path).ok());
  return path;
}

TEST(SliceExl3LinearOutputs, ComputesTheWholeLayersColumns) {
  const std::string path = WriteLayer();
  auto src = TensorSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.status();
  auto whole = LoadExl3Linear(**src, "x", kIn, kOut);
  ASSERT_TRUE(whole.ok()) << whole.status();
  constexpr int T = 3;
  std::mt19937 rng(11);
  std::vector<float> x(T * kIn), y(T * kOut);
  for (float& v : x) v = std::normal_distribution<float>()(rng);
  LinearForwardReference((*whole)->view, x.data(), T, y.data());
  for (int first : {0, 128, 256}) {
    for (int count : {128, 256}) {
      if (first + count > kOut) continue;
      auto part = SliceExl3LinearOutputs(**whole, first, count);
      ASSERT_TRUE(part.ok()) << part.status();
      std::vector<float> yp(T * count);
      LinearForwardReference((*part)->view, x.data(), T, yp.data());
      for (int t = 0; t < T; ++t)
        for (int o = 0; o < count; ++o)
          ASSERT_EQ(yp[t * count + o], y[t * kOut + first + o]) << "slice " << first << "+" << count << " token "
                                                                << t << " column " << o;
    }
  }
  std::filesystem::remove(path);
}

TEST(SliceExl3LinearOutputs, RefusesPartialBlocks) {
  const std::string path = WriteLayer();
  auto src = TensorSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.status();
  auto whole = LoadExl3Linear(**src, "x", kIn, kOut);
  ASSERT_TRUE(whole.ok()) << whole.status();
  for (auto [first, count] : {std::pair{64, 128}, std::pair{0, 192}, std::pair{256, 256}}) {
    auto part = SliceExl3LinearOutputs(**whole, first, count);
    ASSERT_FALSE(part.ok()) << first << "+" << count;
    EXPECT_NE(part.status().message().find("not a slice of whole 128-column blocks"), std::string::npos)
        << part.status();
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace exl3
