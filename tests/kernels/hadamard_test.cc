// The SIMD Hadamard kernels and the linear layer's transforms built on them give the scalar
// results bit for bit, on every instruction set this CPU has.
#include "kernels/hadamard.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/exl3_linear.h"
#include "kernels/fp16.h"
#include "tests/kernels/random_layer.h"

namespace exl3 {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Random floats over a wide range of magnitudes (both signs, zeros, subnormals now and then) and,
// with `specials`, infinities.
std::vector<float> WideRandom(size_t n, uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> m(1.0f, 2.0f);
  std::uniform_int_distribution<int> e(-40, 40);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = std::ldexp(m(rng), e(rng)) * (rng() & 1 ? -1.0f : 1.0f);
    const uint32_t r = rng() % 64;
    if (r == 0) x = 0.0f;
    if (r == 1) x = -0.0f;
    if (r == 2) x = std::ldexp(m(rng), -140);  // subnormal
    if (specials && r == 3) x = rng() & 1 ? INFINITY : -INFINITY;
  }
  return v;
}

std::vector<HadamardIsa> SimdIsas() {
  std::vector<HadamardIsa> out;
  for (HadamardIsa isa : {HadamardIsa::kAvx2, HadamardIsa::kAvx512}) {
    if (HadamardIsaSupported(isa)) out.push_back(isa);
  }
  return out;
}

const char* Name(HadamardIsa isa) {
  return isa == HadamardIsa::kAvx512 ? "avx512" : isa == HadamardIsa::kAvx2 ? "avx2" : "scalar";
}

TEST(HadamardTest, ScaleConstant) {
  volatile float n = 128.0f;
  EXPECT_EQ(Bits(kHadamard128Scale), Bits(1.0f / std::sqrt(n)));
}

TEST(HadamardTest, SimdKernelsBitIdenticalToScalar) {
  const HadamardKernels& ref = HadamardKernelsFor(HadamardIsa::kScalar);
  std::printf("instruction sets checked:");
  for (HadamardIsa isa : SimdIsas()) std::printf(" %s", Name(isa));
  std::printf(" (best: %s)\n", Name(BestHadamardIsa()));
  for (HadamardIsa isa : SimdIsas()) {
    SCOPED_TRACE(Name(isa));
    const HadamardKernels& k = HadamardKernelsFor(isa);
    for (uint32_t round = 0; round < 200; ++round) {
      const bool specials = round % 4 == 3;
      const auto x = WideRandom(128, 1000 + round, specials);
      const auto scale = WideRandom(128, 5000 + round, false);
      const auto bias = WideRandom(128, 9000 + round, specials);
      std::vector<float> a = x, b = x;
      ref.hadamard128(a.data());
      k.hadamard128(b.data());
      for (int i = 0; i < 128; ++i) ASSERT_EQ(Bits(a[i]), Bits(b[i])) << "hadamard128 round " << round << " i " << i;
      std::vector<float> sa(128), sb(128, -1.0f);
      ref.scale_hadamard128(x.data(), scale.data(), sa.data());
      k.scale_hadamard128(x.data(), scale.data(), sb.data());
      for (int i = 0; i < 128; ++i) ASSERT_EQ(Bits(sa[i]), Bits(sb[i])) << "scale_hadamard128 round " << round << " i " << i;
      for (const float* bp : {static_cast<const float*>(nullptr), bias.data()}) {
        a = x;
        b = x;
        ref.hadamard128_scale_bias(a.data(), scale.data(), bp);
        k.hadamard128_scale_bias(b.data(), scale.data(), bp);
        for (int i = 0; i < 128; ++i) {
          ASSERT_EQ(Bits(a[i]), Bits(b[i])) << "hadamard128_scale_bias round " << round << " i " << i
                                            << " bias " << (bp != nullptr);
        }
      }
    }
  }
}

TEST(HadamardTest, HalfToFloatExactForEveryHalf) {
  std::vector<uint16_t> h(65536);
  for (int i = 0; i < 65536; ++i) h[i] = static_cast<uint16_t>(i);
  for (HadamardIsa isa : SimdIsas()) {
    SCOPED_TRACE(Name(isa));
    std::vector<float> out(h.size());
    HadamardKernelsFor(isa).half_to_float(h.data(), out.data(), h.size());
    for (int i = 0; i < 65536; ++i) {
      const float want = HalfBitsToFloat(h[i]);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(out[i])) << i;  // a signalling NaN comes back quieted
      } else {
        ASSERT_EQ(Bits(out[i]), Bits(want)) << i;
      }
    }
  }
}

// The transforms as they were written before the SIMD kernels (per element HalfBitsToFloat),
// kept here as the statement of what they compute.
void InputTransformPlain(const Exl3LinearView& w, const float* x, int T, float* out) {
  const int k = w.in_features;
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < k; ++i) out[t * k + i] = x[t * k + i] * HalfBitsToFloat(w.suh[i]);
    for (int b = 0; b < k; b += 128) HadamardKernelsFor(HadamardIsa::kScalar).hadamard128(out + t * k + b);
  }
}

void OutputTransformPlain(const Exl3LinearView& w, float* y, int T) {
  const int n = w.out_features;
  for (int t = 0; t < T; ++t) {
    float* row = y + t * n;
    for (int b = 0; b < n; b += 128) HadamardKernelsFor(HadamardIsa::kScalar).hadamard128(row + b);
    for (int c = 0; c < n; ++c) {
      row[c] *= HalfBitsToFloat(w.svh[c]);
      if (w.bias != nullptr) row[c] += HalfBitsToFloat(w.bias[c]);
    }
  }
}

TEST(HadamardTest, LinearTransformsBitIdenticalToPlainCode) {
  for (bool with_bias : {false, true}) {
    testing::RandomLinear lin(384, 256, 2, Codebook::kMcg, with_bias ? 3 : 4, with_bias);
    const int T = 5;
    const auto x = WideRandom(static_cast<size_t>(T) * 384, 77, false);
    std::vector<float> a(x.size()), b(x.size(), -1.0f);
    InputTransformPlain(lin.view, x.data(), T, a.data());
    ApplyInputTransform(lin.view, x.data(), T, b.data());
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(Bits(a[i]), Bits(b[i])) << "input " << i;
    const auto y = WideRandom(static_cast<size_t>(T) * 256, 78, false);
    a = y;
    b = y;
    OutputTransformPlain(lin.view, a.data(), T);
    ApplyOutputTransform(lin.view, b.data(), T);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(Bits(a[i]), Bits(b[i])) << "output " << i << " bias " << with_bias;
  }
}

}  // namespace
}  // namespace exl3
