// LoadPaddedExl3Linear: a layer exllamav3 stored zero-padded to multiples of 128 is read as the
// block of its real rows and columns of the dequantized stored layer; IsPaddedExl3Linear tells
// that shape from every other.
#include "model/exl3_padded_linear.h"

#include <filesystem>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codebook.h"
#include "kernels/exl3_linear.h"
#include "kernels/fp16.h"
#include "model/exl3_linear_loader.h"

namespace exl3 {
namespace {

// One EXL3 layer "x" stored k x n (4 bits, mul1), varied trellis words, signs and scales, an fp16
// bias [n], in its own file.
std::string WriteLayer(const std::string& name, int k, int n) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("exl3_padded_linear_test_" + std::to_string(::getpid()) + "_" + name +
                             ".safetensors")).string();
  const std::vector<int64_t> shape = {k / 16, n / 16, 64};
  std::vector<uint16_t> trellis(static_cast<size_t>(k / 16) * (n / 16) * 64);
  for (size_t i = 0; i < trellis.size(); ++i) trellis[i] = static_cast<uint16_t>(i * 2654435761u >> 7);
  std::vector<uint16_t> suh(k), svh(n), bias(n);
  for (int i = 0; i < k; ++i) suh[i] = FloatToHalfBits(i % 3 ? 1.0f : -1.0f);
  for (int i = 0; i < n; ++i) svh[i] = FloatToHalfBits(0.01f * (1 + i % 5));
  for (int i = 0; i < n; ++i) bias[i] = FloatToHalfBits(0.25f * i);
  const uint32_t mul1 = kMul1Multiplier;
  SafetensorsWriter w;
  w.Add("x.trellis", DType::kI16, shape, trellis.data(), trellis.size() * 2);
  w.Add("x.suh", DType::kF16, {k}, suh.data(), suh.size() * 2);
  w.Add("x.svh", DType::kF16, {n}, svh.data(), svh.size() * 2);
  w.Add("x.bias", DType::kF16, {n}, bias.data(), bias.size() * 2);
  w.Add("x.mul1", DType::kI32, {}, &mul1, 4);
  EXPECT_TRUE(w.Write(path).ok());
  return path;
}

TEST(Exl3PaddedLinear, PaddedWidth) {
  EXPECT_EQ(Exl3PaddedWidth(160), 256);
  EXPECT_EQ(Exl3PaddedWidth(288), 384);
  EXPECT_EQ(Exl3PaddedWidth(256), 256);
  EXPECT_EQ(Exl3PaddedWidth(1), 128);
}

TEST(Exl3PaddedLinear, TellsThePaddedShape) {
  // Stored 256 x 256: DeepSeek-V3's kv_a_proj_with_mqa of the fixtures (256 -> 160).
  const std::string path = WriteLayer("shape", 256, 256);
  auto src = TensorSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_TRUE(*IsPaddedExl3Linear(**src, "x", 256, 160));   // output padded
  EXPECT_TRUE(*IsPaddedExl3Linear(**src, "x", 200, 256));   // input padded
  EXPECT_TRUE(*IsPaddedExl3Linear(**src, "x", 129, 129));   // both
  EXPECT_FALSE(*IsPaddedExl3Linear(**src, "x", 256, 256));  // the stored shape itself
  EXPECT_FALSE(*IsPaddedExl3Linear(**src, "x", 256, 384));  // wider than stored
  EXPECT_FALSE(*IsPaddedExl3Linear(**src, "x", 256, 64));   // would be stored 128 wide
  EXPECT_FALSE(IsPaddedExl3Linear(**src, "y", 256, 160).ok());  // no layer
  std::filesystem::remove(path);
}

TEST(Exl3PaddedLinear, ReadsTheRealBlockOfTheStoredLayer) {
  const std::string path = WriteLayer("block", 256, 256);
  auto src = TensorSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.status();
  auto stored = LoadExl3Linear(**src, "x", 256, 256);
  ASSERT_TRUE(stored.ok()) << stored.status();
  std::vector<float> whole(256 * 256);  // [in, out]
  DequantizeDense((*stored)->view, whole.data());
  const int in = 200, out = 160;
  auto w = LoadPaddedExl3Linear(**src, "x", in, out);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_EQ(w->weight_out_in.size(), static_cast<size_t>(out) * in);
  for (int o = 0; o < out; ++o)
    for (int i = 0; i < in; ++i)
      ASSERT_EQ(w->weight_out_in[static_cast<size_t>(o) * in + i], whole[static_cast<size_t>(i) * 256 + o])
          << "row " << o << " column " << i;
  ASSERT_EQ(w->bias.size(), static_cast<size_t>(out));
  for (int o = 0; o < out; ++o) EXPECT_EQ(w->bias[o], 0.25f * o);
  std::filesystem::remove(path);
}

TEST(Exl3PaddedLinear, RefusesALayerThatIsNotPadded) {
  const std::string path = WriteLayer("unpadded", 256, 256);
  auto src = TensorSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.status();
  auto w = LoadPaddedExl3Linear(**src, "x", 256, 256);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().message(), "x: not the 256x256 layer stored padded to 256x256");
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace exl3
