// The fp32 reference MoE against a dense float64 computation from DequantizeDense weights.
#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/moe_cpu.h"
#include "tests/kernels/random_layer.h"

namespace exl3 {
namespace {

using testing::RandomExpert;
using testing::RandomVector;
using testing::RelErr;

std::vector<double> Dense(const Exl3LinearView& w) {
  std::vector<float> f(static_cast<size_t>(w.in_features) * w.out_features);
  DequantizeDense(w, f.data());
  return std::vector<double>(f.begin(), f.end());
}

// y = x · W in float64 (W [k, n] row-major).
std::vector<double> MatVec(const std::vector<double>& x, const std::vector<double>& W, int k, int n,
                           const Exl3LinearView& w) {
  std::vector<double> y(n, 0.0);
  for (int i = 0; i < k; ++i) {
    for (int j = 0; j < n; ++j) y[j] += x[i] * W[static_cast<size_t>(i) * n + j];
  }
  if (w.bias) {
    for (int j = 0; j < n; ++j) y[j] += HalfBitsToFloat(w.bias[j]);
  }
  return y;
}

std::vector<double> MlpF64(const ExpertMlp& m, const std::vector<double>& x, double limit) {
  const int H = m.gate.in_features, I = m.gate.out_features;
  std::vector<double> g = MatVec(x, Dense(m.gate), H, I, m.gate);
  std::vector<double> u = MatVec(x, Dense(m.up), H, I, m.up);
  for (int i = 0; i < I; ++i) {
    double gv = g[i], uv = u[i];
    if (limit > 0) {
      gv = std::min(gv, limit);
      uv = std::max(-limit, std::min(uv, limit));
    }
    g[i] = gv / (1 + std::exp(-gv)) * uv;
  }
  return MatVec(g, Dense(m.down), I, H, m.down);
}

TEST(MoeReferenceTest, MatchesDenseFloat64) {
  const int H = 256, I = 128, E = 4, T = 3, k = 2;
  std::vector<std::unique_ptr<RandomExpert>> experts;
  for (int e = 0; e < E; ++e) {
    experts.push_back(std::make_unique<RandomExpert>(H, I, 100 + e, 1 + 2 * e));
  }
  RandomExpert shared(H, 256, 555, 4, Codebook::k3Inst);
  const auto gate_vec = RandomVector(H, 9, 0.05f);
  for (float limit : {0.0f, 0.8f}) {
    for (bool gated : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "limit " << limit << " gated " << gated);
      MoeLayerView layer;
      layer.hidden_size = H;
      layer.intermediate_size = I;
      layer.swiglu_limit = limit;
      layer.shared_swiglu_limit = limit;
      for (auto& e : experts) layer.experts.push_back(&e->mlp);
      layer.shared = &shared.mlp;
      layer.shared_intermediate_size = 256;
      if (gated) layer.shared_gate = gate_vec.data();
      const auto x = RandomVector(static_cast<size_t>(T) * H, 21, 3.0f);
      const std::vector<int32_t> ids = {0, 3, 2, 1, 3, 3};
      const std::vector<float> w = {0.7f, 0.3f, 1.5f, -0.5f, 0.25f, 0.25f};
      std::vector<float> y(static_cast<size_t>(T) * H);
      ASSERT_TRUE(MoeForwardReference(layer, x.data(), MoeAssignments::Fixed(T, k, ids.data(), w.data()),
                                      true, y.data()).ok());
      std::vector<float> ref(y.size());
      for (int t = 0; t < T; ++t) {
        std::vector<double> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
        std::vector<double> acc(H, 0.0);
        for (int j = 0; j < k; ++j) {
          const auto o = MlpF64(*layer.experts[ids[t * k + j]], xt, limit);
          for (int h = 0; h < H; ++h) acc[h] += w[t * k + j] * o[h];
        }
        const auto so = MlpF64(shared.mlp, xt, limit);
        double sw = 1.0;
        if (gated) {
          double d = 0;
          for (int h = 0; h < H; ++h) d += xt[h] * gate_vec[h];
          sw = 1 / (1 + std::exp(-d));
        }
        for (int h = 0; h < H; ++h) ref[t * H + h] = static_cast<float>(acc[h] + sw * so[h]);
      }
      const double err = RelErr(y.data(), ref.data(), y.size());
      EXPECT_LT(err, 1e-5);
      std::printf("rel err vs float64 dense: %.3g\n", err);
    }
  }
}

TEST(MoeReferenceTest, ClampMatters) {
  // With a tiny limit the result differs from the unclamped one (the clamp is applied).
  const int H = 128, I = 128;
  RandomExpert e(H, I, 3, 2);
  const auto x = RandomVector(H, 4, 5.0f);
  std::vector<float> a(H), b(H);
  ExpertMlpForwardReference(e.mlp, 0.0f, x.data(), 1, a.data());
  ExpertMlpForwardReference(e.mlp, 0.1f, x.data(), 1, b.data());
  EXPECT_GT(RelErr(b.data(), a.data(), H), 1e-2);
}

TEST(MoeReferenceTest, Errors) {
  const int H = 128, I = 128;
  RandomExpert e0(H, I, 1, 2);
  MoeLayerView layer;
  layer.hidden_size = H;
  layer.intermediate_size = I;
  layer.experts = {&e0.mlp, nullptr};
  const auto x = RandomVector(H, 4);
  std::vector<float> y(H, 42.0f);
  int32_t id = 1;
  float w = 1.0f;
  EXPECT_EQ(MoeForwardReference(layer, x.data(), MoeAssignments::Fixed(1, 1, &id, &w), false, y.data()).code(),
            absl::StatusCode::kNotFound);
  id = 2;
  EXPECT_EQ(MoeForwardReference(layer, x.data(), MoeAssignments::Fixed(1, 1, &id, &w), false, y.data()).code(),
            absl::StatusCode::kInvalidArgument);
  id = -1;
  EXPECT_FALSE(MoeForwardReference(layer, x.data(), MoeAssignments::Fixed(1, 1, &id, &w), false, y.data()).ok());
  id = 0;
  w = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(MoeForwardReference(layer, x.data(), MoeAssignments::Fixed(1, 1, &id, &w), false, y.data()).ok());
  EXPECT_EQ(y[0], 42.0f);  // untouched on error
  // An expert of the wrong shape is refused.
  RandomExpert wrong(H, 256, 2, 2);
  layer.experts[1] = &wrong.mlp;
  w = 1.0f;
  EXPECT_FALSE(MoeForwardReference(layer, x.data(), MoeAssignments::Fixed(1, 1, &id, &w), false, y.data()).ok());
}

}  // namespace
}  // namespace exl3
