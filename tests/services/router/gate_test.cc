// The gate (services/router/gate.h) and the decoding of a layer request
// (services/router/layer_request.h) on a generated test model: plain structs in and out, no gRPC,
// no processes.
#include "services/router/gate.h"

#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/routing.h"
#include "services/common/wire.h"
#include "services/router/layer_request.h"
#include "tests/services/common/service_test_util.h"
#include "tools/test_model/expert_test_model.h"

namespace exl3::router {
namespace {

constexpr int kLayer = 1;  // layer 0 is dense

class GateTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    testing::ExpertModelSpec spec = testing::ServiceModelSpec();
    spec.experts = 32;  // two blocks of 16 experts: the gate pool splits the work
    ASSERT_TRUE(testing::WriteExpertModel(dir_->path(), spec).ok());
    Exl3ModelOptions o;
    o.experts = std::map<int, std::vector<int>>{};
    o.load_shared_experts = false;
    auto m = Exl3Model::Open(dir_->path(), o);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete dir_;
  }
  const MoeConfig& cfg() const { return model_->config(); }

  std::vector<float> Hidden(int T) {
    std::mt19937 rng(11);
    return testing::RandomHidden(rng, T, cfg().hidden_size);
  }
  GateInput TopK(int T, int k, std::vector<int32_t> ids, std::vector<float> w) {
    GateInput in;
    in.layer = kLayer;
    in.num_tokens = T;
    in.source = RoutingSource::kTopK;
    in.topk_k = k;
    in.topk_ids = std::move(ids);
    in.topk_weights = std::move(w);
    return in;
  }

  static testing::TempDir* dir_;
  static Exl3Model* model_;
};
testing::TempDir* GateTest::dir_ = nullptr;
Exl3Model* GateTest::model_ = nullptr;

TEST_F(GateTest, ComputedLogitsRouteAsTheModelDoesOnOneThreadOrThePool) {
  // 256 tokens x 32 experts x 256 hidden: large enough for the gate pool.
  const int T = 256;
  const std::vector<float> x = Hidden(T);
  std::vector<int32_t> want_ids(T * cfg().top_k);
  std::vector<float> want_w(want_ids.size());
  ASSERT_TRUE(RouteTokens(cfg(), kLayer, model_->RouterWeight(kLayer), model_->CorrectionBias(kLayer),
                          x.data(), T, want_ids.data(), want_w.data())
                  .ok());
  for (int threads : {1, 4}) {
    SCOPED_TRACE(threads);
    Gate gate(*model_, threads);
    GateInput in;
    in.layer = kLayer;
    in.num_tokens = T;
    absl::StatusOr<Routing> r = gate.Route(in, x.data());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->k, cfg().top_k);
    EXPECT_EQ(r->ids, want_ids);
    EXPECT_EQ(r->weights, want_w);  // bit-identical: the pool splits experts, not the sums
  }
}

TEST_F(GateTest, GivenLogitsGoThroughTheRoutingFunction) {
  const int T = 3, E = cfg().num_experts;
  std::vector<float> logits(T * E);
  for (int i = 0; i < T * E; ++i) logits[i] = static_cast<float>((i * 7) % 11) - 5.0f;
  std::vector<int32_t> want_ids(T * cfg().top_k);
  std::vector<float> want_w(want_ids.size());
  ASSERT_TRUE(RouteFromLogits(cfg(), kLayer, logits.data(), model_->CorrectionBias(kLayer), T,
                              want_ids.data(), want_w.data())
                  .ok());
  Gate gate(*model_, 1);
  GateInput in;
  in.layer = kLayer;
  in.num_tokens = T;
  in.source = RoutingSource::kLogits;
  in.logits = logits;
  in.logit_rows = T;
  absl::StatusOr<Routing> r = gate.Route(in, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ids, want_ids);
  EXPECT_EQ(r->weights, want_w);
  in.logit_rows = T - 1;
  EXPECT_EQ(gate.Route(in, nullptr).status().message(), "router_logits has 2 rows, hidden has 3");
}

TEST_F(GateTest, TopKIsCheckedThenUsedAsGiven) {
  Gate gate(*model_, 1);
  absl::StatusOr<Routing> ok = gate.Route(TopK(2, 2, {0, 7, 3, 1}, {0.5f, 0.5f, 1.0f, 0.0f}), nullptr);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->k, 2);
  EXPECT_EQ(ok->ids, (std::vector<int32_t>{0, 7, 3, 1}));
  struct Bad {
    GateInput in;
    std::string message;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<Bad> bad = {
      {TopK(1, 0, {}, {}), "topk.k is 0, not in 1..4 (the model's top_k)"},
      {TopK(1, 5, {0, 1, 2, 3, 4}, {1, 1, 1, 1, 1}), "topk.k is 5, not in 1..4 (the model's top_k)"},
      {TopK(2, 1, {0}, {1}), "topk.ids and topk.weights must have T*k = 2 entries (have 1 and 1)"},
      {TopK(1, 2, {0, 32}, {1, 1}), "topk.ids[0, 1] = 32 is not an expert (0..31)"},
      {TopK(1, 2, {3, 3}, {1, 1}), "topk.ids: expert 3 repeated for token 0"},
      {TopK(1, 2, {3, 4}, {1, inf}), "topk.weights[0, 1] is not finite"},
  };
  for (const Bad& b : bad) {
    absl::StatusOr<Routing> r = gate.Route(b.in, nullptr);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.message;
    EXPECT_EQ(r.status().message(), b.message);
  }
}

TEST_F(GateTest, TokenIdsOfTheWrongLengthAreRefusedOnAnyLayer) {
  Gate gate(*model_, 1);
  const std::vector<float> x = Hidden(2);
  GateInput in;
  in.layer = kLayer;  // not hash-routed
  in.num_tokens = 2;
  in.token_ids = {5};
  EXPECT_EQ(gate.Route(in, x.data()).status().message(), "token_ids has 1 entries, hidden has 2 rows");
  in.token_ids = {5, 6};
  EXPECT_TRUE(gate.Route(in, x.data()).ok());
}

// ---- DecodeLayerRequest ----

pb::MoeLayerRequest Request(int layer, int T, int H) {
  pb::MoeLayerRequest req;
  req.set_id(9);
  req.set_layer(layer);
  std::vector<float> x(static_cast<size_t>(T) * H, 0.25f);
  svc::EncodeTensor(x.data(), {T, H}, pb::DTYPE_FP16, req.mutable_hidden());
  return req;
}

TEST_F(GateTest, DecodesARequest) {
  pb::MoeLayerRequest req = Request(kLayer, 3, cfg().hidden_size);
  req.set_output_dtype(pb::DTYPE_BF16);
  req.set_include_shared_expert(true);
  absl::StatusOr<LayerRequest> r = DecodeLayerRequest(req, cfg(), {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_tokens, 3);
  EXPECT_EQ(r->in_dtype, pb::DTYPE_FP16);
  EXPECT_EQ(r->out_dtype, pb::DTYPE_BF16);
  EXPECT_EQ(r->row_bytes, static_cast<size_t>(cfg().hidden_size) * 2);
  EXPECT_EQ(r->hidden_bytes.size(), 3 * r->row_bytes);
  ASSERT_EQ(r->hidden.size(), static_cast<size_t>(3 * cfg().hidden_size));
  EXPECT_EQ(r->hidden[0], 0.25f);
  EXPECT_TRUE(r->include_shared_expert);
  EXPECT_EQ(r->gate.source, RoutingSource::kGateWeights);
  EXPECT_EQ(r->gate.layer, kLayer);
}

TEST_F(GateTest, TakesTheHiddenBytesAndDecodesFp32OnlyWhenRead) {
  const int H = cfg().hidden_size;
  pb::MoeLayerRequest routed = Request(kLayer, 2, H);
  routed.mutable_topk()->set_k(1);
  routed.mutable_topk()->add_ids(0);
  routed.mutable_topk()->add_ids(1);
  routed.mutable_topk()->add_weights(1.0f);
  routed.mutable_topk()->add_weights(1.0f);
  routed.set_include_shared_expert(true);
  const std::string bytes = routed.hidden().data();
  {
    // The caller's top-k and no local shared expert: nothing reads fp32 hidden states.
    pb::MoeLayerRequest req = routed;
    absl::StatusOr<LayerRequest> r = TakeLayerRequest(req, cfg(), {}, /*local_shared_expert=*/false);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->num_tokens, 2);
    EXPECT_EQ(r->hidden_bytes, bytes);
    EXPECT_TRUE(req.hidden().data().empty());  // taken, not copied
    EXPECT_TRUE(r->hidden.empty());
    EXPECT_EQ(r->gate.source, RoutingSource::kTopK);
  }
  {
    // The local shared expert reads them.
    pb::MoeLayerRequest req = routed;
    absl::StatusOr<LayerRequest> r = TakeLayerRequest(req, cfg(), {}, /*local_shared_expert=*/true);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->hidden.size(), static_cast<size_t>(2 * H));
    EXPECT_EQ(r->hidden[H], 0.25f);
  }
  {
    // The gate computes the logits from them.
    pb::MoeLayerRequest req = Request(kLayer, 2, H);
    absl::StatusOr<LayerRequest> r = TakeLayerRequest(req, cfg(), {}, /*local_shared_expert=*/false);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->hidden.size(), static_cast<size_t>(2 * H));
  }
  // A non-finite value is refused the same way whether or not the fp32 copy is made.
  std::vector<float> x(static_cast<size_t>(2) * H, 0.5f);
  x[H + 3] = std::numeric_limits<float>::infinity();
  pb::MoeLayerRequest bad = routed;
  svc::EncodeTensor(x.data(), {2, H}, pb::DTYPE_FP16, bad.mutable_hidden());
  pb::MoeLayerRequest bad2 = bad;
  const absl::Status taken = TakeLayerRequest(bad, cfg(), {}, false).status();
  EXPECT_EQ(taken.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(taken, DecodeLayerRequest(bad2, cfg(), {}).status());
  EXPECT_EQ(taken.message(), "hidden: non-finite value inf at [1, 3] (NaN/Inf inputs are rejected)");
}

TEST_F(GateTest, RefusesBadRequestsNamingTheProblem) {
  const int H = cfg().hidden_size;
  EXPECT_EQ(DecodeLayerRequest(Request(0, 1, H), cfg(), {}).status().code(),
            absl::StatusCode::kNotFound);  // layer 0 is dense
  pb::MoeLayerRequest two = Request(kLayer, 1, H);
  two.mutable_topk()->set_k(1);
  two.add_token_ids(3);
  EXPECT_EQ(DecodeLayerRequest(two, cfg(), {}).status().message(),
            "give at most one of router_logits, topk and token_ids");
  LayerRequestLimits small;
  small.max_tokens = 2;
  EXPECT_EQ(DecodeLayerRequest(Request(kLayer, 3, H), cfg(), small).status().code(),
            absl::StatusCode::kResourceExhausted);
  small = {};
  small.max_message_bytes = 100;
  EXPECT_EQ(DecodeLayerRequest(Request(kLayer, 3, H), cfg(), small).status().code(),
            absl::StatusCode::kResourceExhausted);
  pb::MoeLayerRequest none;
  none.set_layer(kLayer);
  EXPECT_EQ(DecodeLayerRequest(none, cfg(), {}).status().message(),
            "empty request: no hidden tensor");
}

}  // namespace
}  // namespace exl3::router
