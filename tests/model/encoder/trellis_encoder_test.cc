// Round trips through the decoder for every K and codebook, SIMD vs portable agreement, and a
// coarse quality bound.
#include "model/encoder/trellis_encoder.h"

#include "model/encoder/layer_quantizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codebook.h"
#include "kernels/trellis_tile.h"

namespace exl3 {
namespace {

std::vector<float> GaussianTiles(int num_tiles, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(num_tiles) * kTileElems);
  for (float& v : x) v = nd(rng) * scale;
  return x;
}

class EncoderRoundTrip : public ::testing::TestWithParam<std::tuple<int, int>> {};

// decode(encode(tile)) reproduces exactly the values the encoder chose, and the error is in a
// sane range (the precise quality table is bench/results/encoder.md).
TEST_P(EncoderRoundTrip, DecoderReproducesChosenValues) {
  const int K = std::get<0>(GetParam());
  const Codebook cb = static_cast<Codebook>(std::get<1>(GetParam()));
  const int kTiles = 2;
  const float scale = DefaultGlobalScale(K, cb);
  std::vector<float> x = GaussianTiles(kTiles, scale, 1000 + 10 * K + static_cast<int>(cb));
  std::vector<uint16_t> words(kTiles * 16 * K);
  std::vector<float> chosen(x.size());
  const double err = EncodeTiles(x.data(), kTiles, K, cb, words.data(), chosen.data(), 2);
  const float* table = CodebookTable(cb);
  double check = 0;
  for (int t = 0; t < kTiles; ++t) {
    float decoded[kTileElems];
    DecodeTileFloat(words.data() + t * 16 * K, K, table, decoded);  // row-major
    for (int e = 0; e < kTileElems; ++e) {
      const TilePos p = StreamElementPosition(e);
      ASSERT_EQ(decoded[p.row * 16 + p.col], chosen[t * kTileElems + e]) << "tile " << t << " e " << e;
      const double d = x[t * kTileElems + e] - chosen[t * kTileElems + e];
      check += d * d;
    }
    // The fp16 decoder agrees with the float table.
    uint16_t half[kTileElems];
    DecodeTileHalf(words.data() + t * 16 * K, K, cb, half);
    for (int i = 0; i < kTileElems; ++i) ASSERT_EQ(HalfBitsToFloat(half[i]), decoded[i]);
  }
  EXPECT_NEAR(err, check, 1e-6 * check);
  const double mse = err / (kTiles * kTileElems) / (scale * scale);  // in unit-Gaussian terms
  const double bound = std::pow(4.0, -K);
  EXPECT_LT(mse, (K <= 4 ? 1.6 : 2.2) * bound) << "K=" << K << " cb=" << CodebookName(cb);
  EXPECT_GT(mse, 0.9 * bound);  // nothing beats rate-distortion
}

INSTANTIATE_TEST_SUITE_P(AllKAndCodebooks, EncoderRoundTrip,
                         ::testing::Combine(::testing::Range(1, 9), ::testing::Values(0, 1, 2)));

TEST(TileEncoder, SimdAndPortablePathsAgree) {
  for (int K : {1, 3, 8}) {
    std::vector<float> x = GaussianTiles(1, 1.3f, 77 + K);
    std::vector<uint16_t> a(16 * K), b(16 * K);
    TileEncoder fast(K, Codebook::kMcg);
    TileEncoder slow(K, Codebook::kMcg, TileEncoder::Simd::kPortable);
    const double ea = fast.Encode(x.data(), a.data());
    const double eb = slow.Encode(x.data(), b.data());
    // Same algorithm; fma vs mul+add may break near-ties differently, so compare the error
    // and check that the portable result decodes to its own values.
    EXPECT_NEAR(ea, eb, 1e-3 * ea) << "K=" << K;
    float chosen[kTileElems], decoded[kTileElems];
    TileEncoder slow2(K, Codebook::kMcg, TileEncoder::Simd::kPortable);
    slow2.Encode(x.data(), b.data(), chosen);
    DecodeTileFloat(b.data(), K, CodebookTable(Codebook::kMcg), decoded);
    for (int e = 0; e < kTileElems; ++e) {
      const TilePos p = StreamElementPosition(e);
      ASSERT_EQ(decoded[p.row * 16 + p.col], chosen[e]);
    }
  }
}

// The AVX-512 step does the AVX2 step's operations in the same order: identical bits, every K
// (both broadcast and permute variants) and codebook, including pass 2's constrained start.
TEST(TileEncoder, Avx512AndAvx2GiveIdenticalBits) {
  if (!TileEncoder::SimdAvailable(TileEncoder::Simd::kAvx512) ||
      !TileEncoder::SimdAvailable(TileEncoder::Simd::kAvx2)) {
    // The two paths compared here cannot both run on this CPU; SimdAndPortablePathsAgree still
    // checks the path it has against the portable one.
    GTEST_SKIP() << "this CPU lacks AVX-512 or AVX2, one of the two instruction sets compared";
  }
  for (int K = 1; K <= 8; ++K) {
    for (Codebook cb : {Codebook::k3Inst, Codebook::kMcg, Codebook::kMul1}) {
      std::vector<float> x = GaussianTiles(1, DefaultGlobalScale(K, cb), 500 + 10 * K + static_cast<int>(cb));
      TileEncoder a(K, cb, TileEncoder::Simd::kAvx2), b(K, cb, TileEncoder::Simd::kAvx512);
      ASSERT_EQ(a.simd(), TileEncoder::Simd::kAvx2);
      ASSERT_EQ(b.simd(), TileEncoder::Simd::kAvx512);
      std::vector<uint16_t> wa(16 * K), wb(16 * K);
      float da[kTileElems], db[kTileElems];
      const double ea = a.Encode(x.data(), wa.data(), da);
      const double eb = b.Encode(x.data(), wb.data(), db);
      EXPECT_EQ(wa, wb) << "K=" << K << " cb=" << CodebookName(cb);
      EXPECT_EQ(ea, eb);
      EXPECT_EQ(0, std::memcmp(da, db, sizeof(da)));
    }
  }
}

// EncodeOptimal is the true tail-biting optimum: at K = 8 (256 overlaps) it equals the best of
// all constrained passes.
TEST(TileEncoder, EncodeOptimalIsTheBestOverlapAtK8) {
  std::vector<float> x = GaussianTiles(1, DefaultGlobalScale(8, Codebook::kMcg), 4321);
  TileEncoder enc(8, Codebook::kMcg);
  std::vector<uint16_t> words(16 * 8);
  int passes = 0;
  const double opt = enc.EncodeOptimal(x.data(), words.data(), nullptr, &passes);
  double best = 1e30;
  for (uint32_t r = 0; r < 256; ++r) best = std::min(best, enc.EncodeWithOverlap(x.data(), r, words.data()));
  EXPECT_EQ(opt, best);
  EXPECT_LT(passes, 256);
}

// The two-pass encoder reaches the exact tail-biting optimum (or comes within a hair) at high K,
// where the error is smallest and a wrong overlap guess would show most. Gaussian tiles at the
// default scales, every codebook.
TEST(TileEncoder, ReachesTheTailBitingOptimumAtHighK) {
  for (int K : {6, 7, 8}) {
    for (Codebook cb : {Codebook::k3Inst, Codebook::kMcg, Codebook::kMul1}) {
      std::vector<float> x = GaussianTiles(2, DefaultGlobalScale(K, cb), 99 + 10 * K + static_cast<int>(cb));
      TileEncoder enc(K, cb);
      std::vector<uint16_t> words(16 * K);
      double ours = 0, opt = 0;
      for (int t = 0; t < 2; ++t) {
        ours += enc.Encode(x.data() + t * kTileElems, words.data());
        opt += enc.EncodeOptimal(x.data() + t * kTileElems, words.data());
      }
      EXPECT_GE(ours, opt * (1 - 1e-5));
      EXPECT_LE(ours, opt * 1.001) << "K=" << K << " " << CodebookName(cb) << ": ours " << ours
                                   << " optimum " << opt;
    }
  }
}

TEST(TileEncoder, PackedStatesReadBack) {
  // Any consistent state sequence packs into words whose TileState reads it back.
  std::mt19937 rng(5);
  for (int K = 1; K <= 8; ++K) {
    std::vector<uint32_t> bits(kTileElems * K);
    for (auto& b : bits) b = rng() & 1;
    uint32_t states[kTileElems];
    const int total = kTileElems * K;
    for (int e = 0; e < kTileElems; ++e) {
      uint32_t s = 0;
      for (int i = 0; i < 16; ++i) s = (s << 1) | bits[((e + 1) * K - 16 + i + total) % total];
      states[e] = s;
    }
    std::vector<uint16_t> words(16 * K);
    PackTileStates(states, K, words.data());
    for (int e = 0; e < kTileElems; ++e) ASSERT_EQ(TileState(words.data(), K, e), states[e]);
  }
}

TEST(TileEncoder, GatherScatterAreInverse) {
  std::vector<float> m(32 * 48);
  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<float>(i) * 0.5f + 1;
  std::vector<float> back(m.size(), 0.0f);
  float tile[kTileElems];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) {
      GatherTileStream(m.data(), 48, i, j, tile);
      ScatterTileStream(tile, back.data(), 48, i, j);
    }
  EXPECT_EQ(m, back);
}

}  // namespace
}  // namespace exl3
