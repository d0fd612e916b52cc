#include <random>
// Routing functions against hand-computed cases for every family: softmax (+norm, Mixtral),
// sigmoid + bias (groups, the -inf mask, scaling), sqrt-softplus, hash routing, ties, bad input.
#include "model/routing.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace exl3 {
namespace {

MoeConfig Softmax(int E, int k, bool norm, MoeFamily f = MoeFamily::kQwen3Moe) {
  MoeConfig c;
  c.architecture = "test";
  c.family = f;
  c.hidden_size = 4;
  c.num_hidden_layers = 2;
  c.moe_layers = {true, true};
  c.num_experts = E;
  c.top_k = k;
  c.moe_intermediate_size = 128;
  c.scoring = ScoringFunc::kSoftmax;
  c.norm_topk_prob = norm;
  return c;
}

MoeConfig Sigmoid(int E, int k, float scale, int groups = 1, int keep = 1) {
  MoeConfig c = Softmax(E, k, true, MoeFamily::kGlm);
  c.scoring = ScoringFunc::kSigmoid;
  c.has_correction_bias = true;
  c.routed_scaling_factor = scale;
  c.n_group = groups;
  c.topk_group = keep;
  return c;
}

struct Out {
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Out Route(const MoeConfig& c, const std::vector<float>& logits, const std::vector<float>* bias = nullptr) {
  const int T = static_cast<int>(logits.size()) / c.num_experts;
  Out o{std::vector<int32_t>(T * c.top_k), std::vector<float>(T * c.top_k)};
  absl::Status s = RouteFromLogits(c, 0, logits.data(), bias ? bias->data() : nullptr, T,
                                   o.ids.data(), o.w.data());
  EXPECT_TRUE(s.ok()) << s;
  return o;
}

TEST(RoutingTest, SoftmaxTopK) {
  // p = softmax([1, 2, 3, 0]) = [0.087144, 0.236883, 0.643914, 0.032059]
  Out o = Route(Softmax(4, 2, false), {1, 2, 3, 0});
  EXPECT_EQ(o.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(o.w[0], 0.6439142598879724, 1e-6);
  EXPECT_NEAR(o.w[1], 0.23688281808991013, 1e-6);
  o = Route(Softmax(4, 2, true), {1, 2, 3, 0});
  EXPECT_NEAR(o.w[0], 0.7310585786300049, 1e-6);
  EXPECT_NEAR(o.w[1], 0.2689414213699951, 1e-6);
}

TEST(RoutingTest, MixtralAlwaysRenormalises) {
  MoeConfig c = Softmax(4, 2, false, MoeFamily::kMixtral);
  c.norm_topk_prob = true;  // what ParseMoeConfig sets for Mixtral whatever the file says
  Out o = Route(c, {1, 2, 3, 0});
  EXPECT_NEAR(o.w[0] + o.w[1], 1.0, 1e-6);
  EXPECT_NEAR(o.w[0], 0.7310585786300049, 1e-6);
}

TEST(RoutingTest, TiesGoToTheLowerIndex) {
  Out o = Route(Softmax(6, 3, true), {0.5, 1, 1, 0.5, 1, 1});
  EXPECT_EQ(o.ids, (std::vector<int32_t>{1, 2, 4}));
  for (float w : o.w) EXPECT_NEAR(w, 1.0 / 3, 1e-6);
  o = Route(Sigmoid(4, 2, 1.0f), {0, 0, 0, 0});
  EXPECT_EQ(o.ids, (std::vector<int32_t>{0, 1}));
}

TEST(RoutingTest, SigmoidWithBiasChoosesByBiasedWeighsByUnbiased) {
  // s = sigmoid([0, 1, -1, 2]) = [0.5, 0.731059, 0.268941, 0.880797];
  // s + bias = [1.0, 0.731059, 1.268941, 0.880797] -> experts 2, 0;
  // weights = [0.268941, 0.5] / 0.768941 * 2.5 = [0.874389, 1.625611].
  const std::vector<float> bias = {0.5f, 0.0f, 1.0f, 0.0f};
  Out o = Route(Sigmoid(4, 2, 2.5f), {0, 1, -1, 2}, &bias);
  EXPECT_EQ(o.ids, (std::vector<int32_t>{2, 0}));
  EXPECT_NEAR(o.w[0], 0.8743885226355472, 1e-5);
  EXPECT_NEAR(o.w[1], 1.6256114773644528, 1e-5);
  // Without norm_topk_prob: the raw scores times the scale.
  MoeConfig c = Sigmoid(4, 2, 2.5f);
  c.norm_topk_prob = false;
  o = Route(c, {0, 1, -1, 2}, &bias);
  EXPECT_NEAR(o.w[0], 0.2689414213699951 * 2.5, 1e-5);
  EXPECT_NEAR(o.w[1], 0.5 * 2.5, 1e-5);
}

TEST(RoutingTest, GroupsKeepTheBestGroupsByTopTwoSum) {
  // 8 experts, 4 groups of 2, keep 2 groups, top-2. Scores chosen on the logit scale so that the
  // best single expert (7) sits in a group whose top-2 sum is poor.
  // logits:             g0: [1, 1]   g1: [-3, 2]  g2: [0.5, 0.5]  g3: [-4, 3]
  const std::vector<float> logits = {1, 1, -3, 2, 0.5, 0.5, -4, 3};
  auto sig = [](double x) { return 1 / (1 + std::exp(-x)); };
  // group sums: g0 = 1.4621, g1 = 0.9283, g2 = 1.2449, g3 = 0.9706 -> keep g0, g2.
  Out o = Route(Sigmoid(8, 2, 1.0f, 4, 2), logits);
  EXPECT_EQ(o.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(o.w[0], 0.5, 1e-6);
  // With one group kept per... all groups kept, expert 7 and 3 win.
  o = Route(Sigmoid(8, 2, 1.0f, 4, 4), logits);
  EXPECT_EQ(o.ids, (std::vector<int32_t>{7, 3}));
  EXPECT_NEAR(o.w[0], sig(3) / (sig(3) + sig(2)), 1e-6);
}

TEST(RoutingTest, MaskedGroupsAreNeverChosen) {
  // All biased scores negative (bias -2): transformers 5.x masks the dropped groups' experts with
  // -inf, so the top-k still comes from the kept groups (4.x's 0.0 mask chose experts 2 and 3).
  const std::vector<float> logits = {1, 1, -3, 2, 0.5, 0.5, -4, 3};
  const std::vector<float> bias(8, -2.0f);
  Out o = Route(Sigmoid(8, 2, 1.0f, 4, 2), logits, &bias);
  // Kept groups g0, g2 (same order as without bias); experts 0 and 1 lead them.
  EXPECT_EQ(o.ids, (std::vector<int32_t>{0, 1}));
  // top-k larger than one kept group: the rest comes from the other kept group.
  MoeConfig c = Sigmoid(8, 3, 1.0f, 4, 2);
  o = Route(c, logits, &bias);
  EXPECT_EQ(o.ids, (std::vector<int32_t>{0, 1, 4}));
}

TEST(RoutingTest, SqrtSoftplus) {
  MoeConfig c = Sigmoid(4, 2, 1.5f);
  c.family = MoeFamily::kDeepseekV4;
  c.scoring = ScoringFunc::kSqrtSoftplus;
  // s = sqrt(softplus([0, 1, 2, -1])) = [0.832555, 1.145976, 1.458399, 0.559698]
  Out o = Route(c, {0, 1, 2, -1});
  EXPECT_EQ(o.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(o.w[0], 0.8399705605183985, 1e-5);
  EXPECT_NEAR(o.w[1], 0.6600294394816016, 1e-5);
  // Large logits take the softplus threshold branch: s = sqrt(x).
  o = Route(c, {30, 25, 0, 0});
  EXPECT_NEAR(o.w[0], std::sqrt(30.0) / (std::sqrt(30.0) + std::sqrt(25.0)) * 1.5, 1e-5);
}

TEST(RoutingTest, HashRoutedLayers) {
  MoeConfig c = Sigmoid(4, 2, 1.5f);
  c.family = MoeFamily::kDeepseekV4;
  c.scoring = ScoringFunc::kSqrtSoftplus;
  c.hash_routed_layers = {true, false};
  const std::vector<float> logits = {0, 1, 2, -1};
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  absl::Status s = RouteFromLogits(c, 0, logits.data(), nullptr, 1, ids.data(), w.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("token ids"), std::string::npos);
  // tid2eid for a vocabulary of 3: token 2 -> experts {3, 0}.
  const std::vector<int32_t> table = {0, 1, 1, 2, 3, 0};
  const std::vector<int64_t> tok = {2};
  ASSERT_TRUE(RouteHashed(c, 0, logits.data(), table.data(), 3, tok.data(), 1, ids.data(), w.data()).ok());
  EXPECT_EQ(ids, (std::vector<int32_t>{3, 0}));
  const double s3 = 0.5596978537731075, s0 = 0.8325546111576977;
  EXPECT_NEAR(w[0], s3 / (s3 + s0) * 1.5, 1e-5);
  EXPECT_NEAR(w[1], s0 / (s3 + s0) * 1.5, 1e-5);
  const std::vector<int64_t> bad_tok = {3};
  EXPECT_FALSE(RouteHashed(c, 0, logits.data(), table.data(), 3, bad_tok.data(), 1, ids.data(), w.data()).ok());
  // Layer 1 is not hash-routed: routes from logits.
  EXPECT_TRUE(RouteFromLogits(c, 1, logits.data(), nullptr, 1, ids.data(), w.data()).ok());
  EXPECT_FALSE(RouteHashed(c, 1, logits.data(), table.data(), 3, tok.data(), 1, ids.data(), w.data()).ok());
}

TEST(RoutingTest, RouteTokensComputesLogitsInFp32) {
  MoeConfig c = Softmax(4, 2, true);
  // x [2, 4], router weight [4, 4] = identity -> logits = x.
  const std::vector<float> w = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1};
  const std::vector<float> x = {1, 2, 3, 0, 0, 0, -1, 5};
  std::vector<int32_t> ids(4);
  std::vector<float> wt(4);
  ASSERT_TRUE(RouteTokens(c, 0, w.data(), nullptr, x.data(), 2, ids.data(), wt.data()).ok());
  EXPECT_EQ(ids, (std::vector<int32_t>{2, 1, 3, 0}));
  EXPECT_NEAR(wt[0], 0.7310585786300049, 1e-6);
}

TEST(RoutingTest, RejectsBadInput) {
  MoeConfig c = Softmax(4, 2, true);
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  const std::vector<float> nan_logits = {0, std::numeric_limits<float>::quiet_NaN(), 0, 0};
  EXPECT_FALSE(RouteFromLogits(c, 0, nan_logits.data(), nullptr, 1, ids.data(), w.data()).ok());
  const std::vector<float> inf_x = {0, std::numeric_limits<float>::infinity(), 0, 0};
  std::vector<float> rw(16, 0.1f);
  EXPECT_FALSE(RouteTokens(c, 0, rw.data(), nullptr, inf_x.data(), 1, ids.data(), w.data()).ok());
  const std::vector<float> ok = {0, 1, 2, 3};
  EXPECT_FALSE(RouteFromLogits(c, 5, ok.data(), nullptr, 1, ids.data(), w.data()).ok());  // not MoE
}

}  // namespace
}  // namespace exl3

namespace exl3 {
namespace {

// The gate's dot products (SIMD where the CPU has it) equal, bit for bit, the documented order:
// eight double lanes (lane j takes elements i + j), then ((0+1)+(2+3))+((4+5)+(6+7)); hidden sizes
// with and without a tail.
TEST(RouterLogits, BitIdenticalToTheDocumentedDoubleOrder) {
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int hidden : {8, 128, 200, 4096}) {
    const int T = 3, E = 5;
    std::vector<float> x(T * hidden), w(E * hidden), got(T * E);
    for (float& v : x) v = nd(rng);
    for (float& v : w) v = nd(rng);
    ComputeRouterLogits(w.data(), x.data(), T, E, hidden, got.data());
    for (int t = 0; t < T; ++t) {
      for (int e = 0; e < E; ++e) {
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int i = 0;
        for (; i + 8 <= hidden; i += 8) {
          for (int j = 0; j < 8; ++j) acc[j] += double(x[t * hidden + i + j]) * w[e * hidden + i + j];
        }
        for (; i < hidden; ++i) acc[0] += double(x[t * hidden + i]) * w[e * hidden + i];
        const float ref = static_cast<float>(((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                                             ((acc[4] + acc[5]) + (acc[6] + acc[7])));
        EXPECT_EQ(got[t * E + e], ref) << "hidden " << hidden << " t " << t << " e " << e;
      }
    }
  }
}

}  // namespace
}  // namespace exl3
