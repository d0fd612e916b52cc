// LoadExl3Linear on layers exllamav3 writes but this project does not run: half-integer bit
// rates and layers zero-padded to multiples of 128 are refused with messages naming them.
#include "model/exl3_linear_loader.h"

#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codebook.h"

namespace exl3 {
namespace {

// One EXL3 layer "x" with a trellis of `shape`, ±1 scales and the mul1 flag, in its own file.
std::string WriteLayer(const std::string& name, std::vector<int64_t> shape) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("exl3_linear_loader_test_" + std::to_string(::getpid()) + "_" + name +
                             ".safetensors")).string();
  size_t words = 1;
  for (int64_t d : shape) words *= static_cast<size_t>(d);
  std::vector<uint16_t> trellis(words, 0x1234);
  const int k = static_cast<int>(shape[0] * 16), n = static_cast<int>(shape[1] * 16);
  std::vector<uint16_t> suh(k, 0x3c00), svh(n, 0x3c00);  // fp16 1.0
  const uint32_t mul1 = kMul1Multiplier;
  SafetensorsWriter w;
  w.Add("x.trellis", DType::kI16, shape, trellis.data(), words * 2);
  w.Add("x.suh", DType::kF16, {k}, suh.data(), suh.size() * 2);
  w.Add("x.svh", DType::kF16, {n}, svh.data(), svh.size() * 2);
  w.Add("x.mul1", DType::kI32, {}, &mul1, 4);
  EXPECT_TRUE(w.Write(path).ok());
  return path;
}

TEST(LoadExl3Linear, ReadsAWholeBitRate) {
  const std::string path = WriteLayer("k4", {16, 8, 64});
  auto src = TensorSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.status();
  auto lin = LoadExl3Linear(**src, "x", 256, 128);
  ASSERT_TRUE(lin.ok()) << lin.status();
  EXPECT_EQ((*lin)->view.bits, 4);
  EXPECT_EQ((*lin)->view.codebook, Codebook::kMul1);
  std::filesystem::remove(path);
}

TEST(LoadExl3Linear, RefusesHalfIntegerRatesByName) {
  for (int words : {24, 40, 56}) {  // 1.5, 2.5, 3.5 bits: 16 * K + 8 words per tile
    const std::string path = WriteLayer("half" + std::to_string(words), {16, 8, words});
    auto src = TensorSource::Open(path);
    ASSERT_TRUE(src.ok()) << src.status();
    auto lin = LoadExl3Linear(**src, "x", 256, 128);
    ASSERT_FALSE(lin.ok());
    const std::string want = "tensor 'x.trellis' has shape [16, 8, " + std::to_string(words) +
                             "]: a half-integer bit rate (K = " + std::to_string(words / 16) +
                             ".5, exllamav3's mul1 1.5/2.5/3.5-bit rates), which is not supported";
    EXPECT_EQ(lin.status().message(), want);
    std::filesystem::remove(path);
  }
}

TEST(LoadExl3Linear, RefusesLayersPaddedTo128ByName) {
  // exllamav3 stores a 256 -> 160 layer (DeepSeek's kv_a_proj_with_mqa shape in the engine
  // fixtures) as 256 x 256, its last 96 columns zero.
  const std::string path = WriteLayer("padded", {16, 16, 64});
  auto src = TensorSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.status();
  auto lin = LoadExl3Linear(**src, "x", 256, 160);
  ASSERT_FALSE(lin.ok());
  EXPECT_NE(lin.status().message().find("the config's 256x160 layer zero-padded to multiples of "
                                        "128, as exllamav3 stores it; this loader takes unpadded "
                                        "EXL3 layers only (LoadPaddedExl3Linear reads padded ones)"),
            std::string::npos) << lin.status();
  // Any other shape mismatch keeps its own message.
  auto other = LoadExl3Linear(**src, "x", 256, 384);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("but the config needs 256x384"), std::string::npos)
      << other.status();
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace exl3
