#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "kernels/codebook.h"
#include "kernels/fp16.h"
#include "kernels/hadamard.h"
#include "kernels/trellis_tile.h"

namespace exl3 {
namespace {

TEST(Fp16, RoundTripsEveryFiniteHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if (((h >> 10) & 0x1f) == 0x1f) continue;
    EXPECT_EQ(FloatToHalfBits(HalfBitsToFloat(static_cast<uint16_t>(h))), h);
  }
}

TEST(Fp16, RoundsToNearestEven) {
  EXPECT_EQ(FloatToHalfBits(1.0f + 1.0f / 2048), 0x3c00);            // tie -> even (down)
  EXPECT_EQ(FloatToHalfBits(1.0f + 3.0f / 2048), 0x3c02);            // tie -> even (up)
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00);                      // overflow -> inf
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -25)), 0x0000);         // tie at smallest subnormal
  EXPECT_EQ(FloatToHalfBits(std::ldexp(3.0f, -26)), 0x0001);
}

TEST(Codebook, RmsMatchesTheFormat) {
  for (Codebook cb : {Codebook::k3Inst, Codebook::kMcg, Codebook::kMul1}) {
    const float* t = CodebookTable(cb);
    double ss = 0;
    for (int s = 0; s < 65536; ++s) ss += double(t[s]) * t[s];
    const double rms = std::sqrt(ss / 65536);
    EXPECT_NEAR(rms, cb == Codebook::kMul1 ? 1.0 : 1.24, 0.06) << CodebookName(cb);
  }
}

TEST(TrellisTile, PermutationIsABijection) {
  std::vector<int> seen(256, 0);
  for (int e = 0; e < 256; ++e) {
    TilePos p = StreamElementPosition(e);
    ASSERT_GE(p.row, 0); ASSERT_LT(p.row, 16); ASSERT_GE(p.col, 0); ASSERT_LT(p.col, 16);
    ++seen[p.row * 16 + p.col];
  }
  for (int v : seen) EXPECT_EQ(v, 1);
}

TEST(TrellisTile, StatesWrapAroundTheStream) {
  // K = 2: element 0 reads bits 498..511 then 0..1.
  std::vector<uint16_t> words(32, 0);
  words[30] = 0x0000; words[31] = 0x0001;  // u32[15] = 0x00010000: stream bit 495 set
  EXPECT_EQ(TileState(words.data(), 2, 0), 0u);
  words[31] = 0x0000; words[30] = 0x0001;  // u32[15] low bit: stream bit 511
  EXPECT_EQ(TileState(words.data(), 2, 0), 1u << 2);
}

TEST(Hadamard, IsOrthonormalAndSelfInverse) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> v(256), orig;
  for (auto& x : v) x = nd(rng);
  orig = v;
  HadamardBlocks(v.data(), v.size());
  double n0 = 0, n1 = 0;
  for (size_t i = 0; i < v.size(); ++i) { n0 += orig[i] * orig[i]; n1 += v[i] * v[i]; }
  EXPECT_NEAR(n0, n1, 1e-3 * n0);
  HadamardBlocks(v.data(), v.size());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(v[i], orig[i], 1e-5);
}

}  // namespace
}  // namespace exl3
