// The fast CPU backend against the reference linear and MoE at several K, codebooks and shapes.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "gtest/gtest.h"
#include "kernels/cpu/inner_product.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/trellis_tile.h"
#include "tests/kernels/random_layer.h"

namespace exl3 {
namespace {

using testing::RandomExpert;
using testing::RandomLinear;
using testing::RandomVector;
using testing::RelErr;

struct Shape {
  int k, n, T;
};

// Param: the highest inner loop allowed (the test runs the best one the CPU has up to it).
class CpuLinearTest : public ::testing::TestWithParam<cpu::Isa> {
 protected:
  void SetUp() override { prev_ = cpu::SetMaxIsa(GetParam()); }
  void TearDown() override { cpu::SetMaxIsa(prev_); }
  cpu::Isa prev_ = cpu::Isa::kAvx512Vbmi;
};

TEST_P(CpuLinearTest, MatchesReferenceAllBitWidthsAndCodebooks) {
  cpu::CpuBackend backend(3);
  std::printf("isa: %s\n", std::string(cpu::ActiveIsa()).c_str());
  const Shape shapes[] = {{128, 128, 1}, {256, 384, 3}, {384, 256, 1}, {128, 512, 5}};
  double worst = 0;
  uint32_t seed = 1;
  for (const Shape& s : shapes) {
    for (int K = 1; K <= 8; ++K) {
      for (int cb = 0; cb < 3; ++cb) {
        SCOPED_TRACE(::testing::Message() << s.k << "x" << s.n << " T=" << s.T << " K=" << K << " cb=" << cb);
        RandomLinear lin(s.k, s.n, K, static_cast<Codebook>(cb), seed++, /*with_bias=*/(K % 2) == 0);
        const auto x = RandomVector(static_cast<size_t>(s.T) * s.k, seed++);
        std::vector<float> ref(static_cast<size_t>(s.T) * s.n), out(ref.size(), -7.0f);
        LinearForwardReference(lin.view, x.data(), s.T, ref.data());
        ASSERT_TRUE(backend.Linear(lin.view, x.data(), s.T, out.data()).ok());
        const double e = RelErr(out.data(), ref.data(), ref.size());
        EXPECT_LT(e, 1e-5);
        worst = std::max(worst, e);
      }
    }
  }
  std::printf("worst rel err vs LinearForwardReference: %.3g\n", worst);
}

TEST_P(CpuLinearTest, LargerTokenCount) {
  cpu::CpuBackend backend(2);
  RandomLinear lin(512, 256, 4, Codebook::kMcg, 99);
  const int T = 33;
  const auto x = RandomVector(static_cast<size_t>(T) * 512, 7);
  std::vector<float> ref(static_cast<size_t>(T) * 256), out(ref.size());
  LinearForwardReference(lin.view, x.data(), T, ref.data());
  ASSERT_TRUE(backend.Linear(lin.view, x.data(), T, out.data()).ok());
  EXPECT_LT(RelErr(out.data(), ref.data(), ref.size()), 1e-5);
}

// Token blocks (32 tokens) and the one-token path sum in the same order: a token's output is the
// same to the bit whether it is computed alone or in a batch that spans several blocks.
TEST_P(CpuLinearTest, BatchedTokensEqualOneAtATime) {
  cpu::CpuBackend backend(2);
  const int T = 70, k = 128, n = 256;
  uint32_t seed = 500;
  for (int K = 1; K <= 8; ++K) {
    for (int cb = 0; cb < 3; ++cb) {
      SCOPED_TRACE(::testing::Message() << "K=" << K << " cb=" << cb);
      RandomLinear lin(k, n, K, static_cast<Codebook>(cb), seed++);
      const auto x = RandomVector(static_cast<size_t>(T) * k, seed++);
      std::vector<float> batched(static_cast<size_t>(T) * n), one(n);
      ASSERT_TRUE(backend.Linear(lin.view, x.data(), T, batched.data()).ok());
      for (int t : {0, 31, 32, 69}) {
        ASSERT_TRUE(backend.Linear(lin.view, x.data() + static_cast<size_t>(t) * k, 1, one.data()).ok());
        for (int j = 0; j < n; ++j) ASSERT_EQ(batched[static_cast<size_t>(t) * n + j], one[j]) << "t=" << t << " j=" << j;
      }
    }
  }
}

TEST_P(CpuLinearTest, MoeMatchesReference) {
  cpu::CpuBackend backend(4);
  const int H = 256, I = 128, E = 6, T = 5;
  std::vector<std::unique_ptr<RandomExpert>> experts;
  for (int e = 0; e < E; ++e) experts.push_back(std::make_unique<RandomExpert>(H, I, 10 + e, 1 + e % 4));
  RandomExpert shared(H, 2 * I, 77, 3);
  MoeLayerView layer;
  layer.hidden_size = H;
  layer.intermediate_size = I;
  layer.swiglu_limit = 0.7f;  // small enough that the clamp bites on these inputs
  layer.shared_swiglu_limit = 0.7f;
  for (auto& e : experts) layer.experts.push_back(&e->mlp);
  layer.experts[3] = nullptr;  // not held
  layer.shared = &shared.mlp;
  layer.shared_intermediate_size = 2 * I;
  const auto x = RandomVector(static_cast<size_t>(T) * H, 5, 2.0f);
  // Ragged per-token lists, a duplicate expert, an empty token.
  const std::vector<int32_t> offsets = {0, 2, 3, 3, 6, 7};
  const std::vector<int32_t> ids = {0, 5, 2, 1, 1, 4, 0};
  const std::vector<float> w = {0.5f, 0.25f, 1.0f, 0.3f, 0.2f, -0.4f, 2.0f};
  MoeAssignments a{T, ids.data(), w.data(), offsets.data(), 0};
  for (bool with_shared : {false, true}) {
    std::vector<float> ref(static_cast<size_t>(T) * H), out(ref.size(), 3.0f);
    ASSERT_TRUE(MoeForwardReference(layer, x.data(), a, with_shared, ref.data()).ok());
    ASSERT_TRUE(backend.Moe(layer, x.data(), a, with_shared, out.data()).ok());
    EXPECT_LT(RelErr(out.data(), ref.data(), ref.size()), 1e-5);
    for (int h = 0; h < H; ++h) {
      if (!with_shared) {
        EXPECT_EQ(out[2 * H + h], 0.0f);  // token 2 has no pairs
      }
    }
  }
  // Errors: expert not held, out of range, non-finite weight.
  std::vector<float> y(static_cast<size_t>(T) * H);
  std::vector<int32_t> bad = ids;
  bad[1] = 3;
  EXPECT_EQ(backend.Moe(layer, x.data(), {T, bad.data(), w.data(), offsets.data(), 0}, true, y.data()).code(),
            absl::StatusCode::kNotFound);
  bad[1] = 6;
  EXPECT_EQ(backend.Moe(layer, x.data(), {T, bad.data(), w.data(), offsets.data(), 0}, true, y.data()).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> badw = w;
  badw[4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(backend.Moe(layer, x.data(), {T, ids.data(), badw.data(), offsets.data(), 0}, true, y.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Isa, CpuLinearTest,
                         ::testing::Values(cpu::Isa::kScalar, cpu::Isa::kAvx2, cpu::Isa::kAvx512,
                                           cpu::Isa::kAvx512Vbmi),
                         [](const auto& info) {
                           return info.param == cpu::Isa::kScalar ? "scalar"
                                  : info.param == cpu::Isa::kAvx2 ? "upto_avx2"
                                  : info.param == cpu::Isa::kAvx512 ? "upto_avx512"
                                                                    : "upto_avx512vbmi";
                         });

// Every 16-bit state of every codebook decodes to the scalar decoder's value, to the bit, in
// every inner loop this CPU has: a K = 8 layer whose 512 tiles hold every state (tile (a, h) has
// stream bytes a, 128h, a, 128h + 1, ..., so its states are (a, x) and (x, a) for x in
// [128h, 128h + 128)), multiplied by the identity (x' row t one-hot at t), gives W_inner exactly.
TEST(CpuBackendTest, EveryStateDecodesBitExactInEveryInnerLoop) {
  const int k = 128, n = 1024, K = 8;
  std::vector<uint16_t> trellis(static_cast<size_t>(k / 16) * (n / 16) * 16 * K);
  for (int tile = 0; tile < 512; ++tile) {
    const int a = tile / 2, h = tile % 2;
    uint8_t b[256];
    for (int i = 0; i < 128; ++i) {
      b[2 * i] = static_cast<uint8_t>(a);
      b[2 * i + 1] = static_cast<uint8_t>(128 * h + i);
    }
    // Stream byte m is byte 3 - m % 4 of u32 word m / 4; u32[j] = u16[2j] | u16[2j + 1] << 16.
    uint16_t* w = trellis.data() + static_cast<size_t>(tile) * 16 * K;
    for (int j = 0; j < 64; ++j) {
      w[2 * j + 1] = static_cast<uint16_t>(b[4 * j] << 8 | b[4 * j + 1]);
      w[2 * j] = static_cast<uint16_t>(b[4 * j + 2] << 8 | b[4 * j + 3]);
    }
  }
  std::vector<bool> seen(65536, false);
  for (int tile = 0; tile < 512; ++tile) {
    for (int e = 0; e < kTileElems; ++e) seen[TileState(trellis.data() + static_cast<size_t>(tile) * 16 * K, K, e)] = true;
  }
  ASSERT_EQ(std::count(seen.begin(), seen.end(), true), 65536);
  const std::vector<uint16_t> ones(1024, 0x3c00);
  std::vector<float> xt(static_cast<size_t>(k) * k, 0.0f);
  for (int t = 0; t < k; ++t) xt[static_cast<size_t>(t) * k + t] = 1.0f;
  std::vector<float> xp(cpu::Avx2PreparedFloats(k, k));
  const bool avx2 = cpu::Avx2Supported();
  if (avx2) cpu::Avx2PrepareX(xt.data(), k, k, xp.data());
  for (int cb = 0; cb < 3; ++cb) {
    Exl3LinearView v;
    v.in_features = k;
    v.out_features = n;
    v.bits = K;
    v.codebook = static_cast<Codebook>(cb);
    v.trellis = trellis.data();
    v.suh = ones.data();
    v.svh = ones.data();
    std::vector<uint16_t> inner(static_cast<size_t>(k) * n);
    DequantizeInner(v, inner.data());
    struct Loop {
      const char* name;
      bool ok;
      void (*fn)(const Exl3LinearView&, const float*, int, int, int, float*);
      bool prepared;
    };
    const Loop loops[] = {{"scalar", true, cpu::InnerProductScalar, false},
                          {"avx2", avx2, cpu::InnerProductAvx2, true},
                          {"avx512", cpu::Avx512Supported(), cpu::InnerProductAvx512, true},
                          {"avx512vbmi", cpu::Avx512VbmiSupported(), cpu::InnerProductAvx512Vbmi, true}};
    for (const Loop& l : loops) {
      if (!l.ok) continue;
      SCOPED_TRACE(::testing::Message() << l.name << " cb=" << cb);
      std::vector<float> y(static_cast<size_t>(k) * n, -1.0f);
      l.fn(v, l.prepared ? xp.data() : xt.data(), k, 0, n / 16, y.data());
      for (size_t i = 0; i < y.size(); ++i) {
        const float want = HalfBitsToFloat(inner[i]);
        uint32_t a, b;
        std::memcpy(&a, &y[i], 4);
        std::memcpy(&b, &want, 4);
        ASSERT_EQ(a, b) << "row " << i / n << " col " << i % n;
      }
      // One token at a time (the one-token loop) gives the same rows.
      std::vector<float> one(n);
      for (int t : {0, 77}) {
        std::vector<float> x1(xt.begin() + static_cast<size_t>(t) * k, xt.begin() + static_cast<size_t>(t + 1) * k);
        std::vector<float> xp1(cpu::Avx2PreparedFloats(1, k));
        if (l.prepared) cpu::Avx2PrepareX(x1.data(), 1, k, xp1.data());
        l.fn(v, l.prepared ? xp1.data() : x1.data(), 1, 0, n / 16, one.data());
        for (int c = 0; c < n; ++c) ASSERT_EQ(one[c], y[static_cast<size_t>(t) * n + c]) << "t=" << t << " c=" << c;
      }
    }
  }
}

TEST(CpuBackendTest, ConcurrentCallersGetTheirOwnResults) {
  cpu::CpuBackend backend(2);
  RandomLinear a(256, 256, 2, Codebook::kMcg, 5), b(256, 384, 3, Codebook::kMul1, 6);
  const auto xa = RandomVector(2 * 256, 1), xb = RandomVector(3 * 256, 2);
  std::vector<float> ra(2 * 256), rb(3 * 384);
  LinearForwardReference(a.view, xa.data(), 2, ra.data());
  LinearForwardReference(b.view, xb.data(), 3, rb.data());
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      for (int r = 0; r < 10; ++r) {
        const bool use_a = (i + r) % 2 == 0;
        std::vector<float> y(use_a ? ra.size() : rb.size());
        absl::Status s = use_a ? backend.Linear(a.view, xa.data(), 2, y.data())
                               : backend.Linear(b.view, xb.data(), 3, y.data());
        const auto& ref = use_a ? ra : rb;
        if (!s.ok() || RelErr(y.data(), ref.data(), ref.size()) > 1e-5) ++bad;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(CpuBackendTest, RejectsBadLayers) {
  cpu::CpuBackend backend(1);
  RandomLinear a(256, 256, 2, Codebook::kMcg, 5);
  Exl3LinearView v = a.view;
  v.bits = 9;
  std::vector<float> x(256), y(256);
  EXPECT_FALSE(backend.Linear(v, x.data(), 1, y.data()).ok());
  v = a.view;
  v.in_features = 200;
  EXPECT_FALSE(backend.Linear(v, x.data(), 1, y.data()).ok());
  EXPECT_TRUE(backend.Linear(a.view, x.data(), 0, y.data()).ok());
}

TEST(ThreadPoolTest, RunsEveryItemOnce) {
  cpu::ThreadPool pool(4);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> hits(97);
    pool.ParallelFor(97, [&](int i, int t) {
      ASSERT_LT(t, pool.size());
      hits[i]++;
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

}  // namespace
}  // namespace exl3
