// engine/cpu/mtp/dspark_drafter.h against the fp32 torch reference (scripts/conformance/
// dspark_reference.py) recorded in tests/fixtures/engine/deepseek_v4_release_mtp: for both
// prompts, the main-kv rows from the recorded trunk taps, and at every draft position p0 the
// draft call (seed = ids[p0], history = the recorded rows of positions p0 - min(window, p0) ..
// p0 - 1): the Markov-biased logits and confidence logits (relative error printed), the drafts
// and the draft length (equal). The taps come from the reference file, so the drafter is tested
// apart from the trunk.
#include "engine/cpu/mtp/dspark_drafter.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine/config/dsv4_config.h"
#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear.h"
#include "gtest/gtest.h"
#include "tests/engine/reference_tensors.h"
#include "tests/engine/relative_error.h"
#include "model/safetensors.h"

namespace exl3::engine {
namespace {

constexpr char kDir[] = "tests/fixtures/engine/deepseek_v4_release_mtp";

using testing::ReferenceFloats;
using testing::ReferenceInts;
using testing::RelativeError;

TEST(DsparkDrafter, MatchesTheReferenceAtEveryDraftPosition) {
  auto cfg = LoadModelConfig(kDir);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_NE(cfg->dsv4, nullptr);
  const Dsv4DsparkConfig& ds = cfg->dsv4->dspark;
  ASSERT_TRUE(ds.enabled());
  auto src = TensorSource::Open(kDir);
  ASSERT_TRUE(src.ok()) << src.status();
  const int H = cfg->hidden_size, V = cfg->vocab_size;
  auto head = Linear::Load(**src, "head", H, V);
  ASSERT_TRUE(head.ok()) << head.status();
  auto embedding = (*src)->Get("model.embed_tokens.weight");
  ASSERT_TRUE(embedding.ok()) << embedding.status();
  auto drafter = DsparkDrafter::Load(*cfg, **src, *embedding, *head);
  ASSERT_TRUE(drafter.ok()) << drafter.status();
  DsparkDrafter& d = **drafter;
  ASSERT_EQ(d.num_blocks(), 1);
  const int D = d.row_width(), B = d.block_size();
  ASSERT_EQ(B, 4);
  ASSERT_EQ(d.tap_width(), 2 * H);
  auto ref_source = TensorSource::Open(std::string(kDir) + "/reference.safetensors");
  ASSERT_TRUE(ref_source.ok()) << ref_source.status();
  const TensorSource& ref = **ref_source;
  CpuCompute compute(2);
  for (int s = 0; s < 2; ++s) {
    const std::string k = std::to_string(s);
    std::vector<int32_t> ids = ReferenceInts(ref, "prompt." + k);
    const std::vector<int32_t> greedy = ReferenceInts(ref, "greedy." + k);
    ids.insert(ids.end(), greedy.begin(), greedy.end());
    const int n = static_cast<int>(ids.size());
    const std::vector<float> taps = ReferenceFloats(ref, "dspark_taps." + k);
    const std::vector<float> want_rows = ReferenceFloats(ref, "dspark_main_kv." + k);
    ASSERT_EQ(taps.size(), static_cast<size_t>(n) * 2 * H);
    ASSERT_EQ(want_rows.size(), static_cast<size_t>(n) * D);
    std::vector<float> rows(static_cast<size_t>(n) * D);
    ASSERT_TRUE(d.MainKvRows(taps.data(), n, 0, {rows.data()}, compute).ok());
    const double row_err = RelativeError(rows.data(), want_rows.data(), rows.size());
    std::printf("prompt %d: main-kv rows of %d positions: rel err %.3g\n", s, n, row_err);
    EXPECT_LT(row_err, 1e-5);
    // One position at a time at a later first position gives the same rows.
    std::vector<float> one(D);
    ASSERT_TRUE(d.MainKvRows(taps.data() + static_cast<size_t>(n - 1) * 2 * H, 1, n - 1, {one.data()}, compute).ok());
    EXPECT_LT(RelativeError(one.data(), &rows[static_cast<size_t>(n - 1) * D], D), 1e-6);

    const std::vector<float> want_logits = ReferenceFloats(ref, "dspark_logits." + k);
    const std::vector<float> want_conf = ReferenceFloats(ref, "dspark_confidence." + k);
    const std::vector<int32_t> want_drafts = ReferenceInts(ref, "dspark_drafts." + k);
    const std::vector<int32_t> want_length = ReferenceInts(ref, "dspark_length." + k);
    ASSERT_EQ(want_logits.size(), static_cast<size_t>(n) * B * V);
    double worst_logits = 0, worst_conf = 0;
    int draft_mismatches = 0, length_mismatches = 0;
    for (int p0 = 0; p0 < n; ++p0) {
      const int hist = std::min(d.window(), p0);
      auto r = d.Draft({&want_rows[static_cast<size_t>(p0 - hist) * D]}, hist, ids[p0], p0, compute);
      ASSERT_TRUE(r.ok()) << r.status();
      const double le = RelativeError(r->logits.data(), &want_logits[static_cast<size_t>(p0) * B * V], r->logits.size());
      const double ce = RelativeError(r->confidence.data(), &want_conf[static_cast<size_t>(p0) * B], B);
      worst_logits = std::max(worst_logits, le);
      worst_conf = std::max(worst_conf, ce);
      for (int j = 0; j < B; ++j) {
        EXPECT_EQ(r->drafts[j], want_drafts[static_cast<size_t>(p0) * B + j]) << "prompt " << s << " p0 " << p0 << " j " << j;
        draft_mismatches += r->drafts[j] != want_drafts[static_cast<size_t>(p0) * B + j];
      }
      EXPECT_EQ(r->length, want_length[p0]) << "prompt " << s << " p0 " << p0;
      length_mismatches += r->length != want_length[p0];
    }
    std::printf("prompt %d: %d draft calls: worst rel err logits %.3g, confidence %.3g; "
                "draft mismatches %d, length mismatches %d\n",
                s, n, worst_logits, worst_conf, draft_mismatches, length_mismatches);
    EXPECT_LT(worst_logits, 1e-5);
    EXPECT_LT(worst_conf, 1e-5);
  }
}

TEST(DsparkDrafter, RefusesAConfigWithoutIt) {
  auto cfg = LoadModelConfig(kDir);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto src = TensorSource::Open(kDir);
  ASSERT_TRUE(src.ok()) << src.status();
  auto head = Linear::Load(**src, "head", cfg->hidden_size, cfg->vocab_size);
  ASSERT_TRUE(head.ok()) << head.status();
  auto embedding = (*src)->Get("model.embed_tokens.weight");
  ASSERT_TRUE(embedding.ok());
  ModelConfig no_drafter = *cfg;
  auto v = std::make_shared<Dsv4Config>(*cfg->dsv4);
  v->dspark.block_size = 0;
  no_drafter.dsv4 = v;
  auto d = DsparkDrafter::Load(no_drafter, **src, *embedding, *head);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(std::string(d.status().message()).find("no DSPARK drafter"), std::string::npos) << d.status();
}

TEST(DsparkDrafter, RefusesANoiseTokenOutsideTheVocabulary) {
  auto cfg = LoadModelConfig(kDir);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto shape = DsparkShape::Of(*cfg);
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->tap_width, cfg->dsv4->dspark.num_taps() * cfg->hidden_size);
  EXPECT_EQ(static_cast<int>(shape->inv_freq.size()), cfg->dsv4->rope_dim / 2);
  ModelConfig bad = *cfg;
  auto v = std::make_shared<Dsv4Config>(*cfg->dsv4);
  v->dspark.noise_token_id = cfg->vocab_size;
  bad.dsv4 = v;
  auto refused = DsparkShape::Of(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.status().message()).find("dspark_noise_token_id"), std::string::npos)
      << refused.status();
}

}  // namespace
}  // namespace exl3::engine
