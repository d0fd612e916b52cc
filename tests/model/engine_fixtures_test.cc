// The attention-engine fixtures (tests/fixtures/engine, written by
// scripts/conformance/engine_fixtures.py) against this repository's own code: every fixture opens
// as an EXL3 model, its reference tensors match reference.json, the greedy tokens are the argmax of
// the teacher-forced logits with the recorded gap, and every MoE layer computed by model/routing.h
// and the CPU backend on the recorded input reproduces transformers' output within 1e-5 relative;
// the DSPARK drafter fixture's drafts, lengths and confidences are consistent with its logits.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/moe_cpu.h"
#include "model/config/read_moe_config.h"
#include "model/exl3_model.h"
#include "model/moe_config.h"
#include "model/routing.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

namespace fs = std::filesystem;
constexpr char kFixtures[] = "tests/fixtures/engine";  // tests run in the source directory

// The fixtures whose reference.json has `key`: every fixture has "tensors"; whole-model references
// ("logits", "moe_layers") are absent from the MTP fixtures, which tests/engine/cpu/mtp/mtp_head_test.cc checks.
std::vector<std::string> FixtureNames(const char* key = "tensors") {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(kFixtures, ec)) {
    if (!e.is_directory() || !fs::exists(e.path() / "reference.json")) continue;
    std::ifstream in(e.path() / "reference.json");
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains(key)) names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(EngineFixtures, AllFamiliesAndVariantsArePresent) {
  const std::vector<std::string> names = FixtureNames();
  for (const char* family :
       {"glm4_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm_moe_dsa", "deepseek_v4",
        "qwen3_next", "glm5_next", "qwen4_exp"}) {
    for (const char* variant : {"experts", "all"}) {
      const std::string n = std::string(family) + "_" + variant;
      EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
    }
  }
  // The families in their release checkpoints' settings and config.json layout, `all` only
  // (scripts/conformance/engine_fixtures.py release_family; the reverse check's fixtures).
  for (const char* family : {"glm4_moe", "mixtral", "qwen3_moe", "qwen3_next", "deepseek_v3",
                             "glm_moe_dsa", "glm5_next", "deepseek_v4", "qwen4_exp"}) {
    const std::string n = std::string(family) + "_release_all";
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  }
}

class EngineFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = std::string(kFixtures) + "/" + GetParam();
    std::ifstream in(dir_ + "/reference.json");
    ref_json_ = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(ref_json_.is_object()) << dir_;
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
        SafetensorsFile::Open(dir_ + "/reference.safetensors");
    ASSERT_TRUE(f.ok()) << f.status();
    ref_ = std::move(*f);
  }

  // A reference tensor as floats (int32 tensors converted), with its shape.
  std::vector<float> Get(const std::string& name, std::vector<int64_t>* shape = nullptr) const {
    absl::StatusOr<TensorView> t = ref_->Get(name);
    EXPECT_TRUE(t.ok()) << name << ": " << t.status();
    if (!t.ok()) return {};
    if (shape) *shape = t->info->shape;
    if (t->info->dtype == DType::kI32) {
      const int32_t* p = t->as<int32_t>();
      return std::vector<float>(p, p + t->info->num_elements());
    }
    absl::StatusOr<std::vector<float>> v = ToFloat32(*t);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : std::vector<float>{};
  }

  std::string dir_;
  nlohmann::json ref_json_;
  std::unique_ptr<SafetensorsFile> ref_;
};

TEST_P(EngineFixture, TensorsMatchReferenceJson) {
  const nlohmann::json& tensors = ref_json_["tensors"];
  ASSERT_TRUE(tensors.is_object());
  EXPECT_EQ(tensors.size(), ref_->tensors().size());
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    absl::StatusOr<TensorView> t = ref_->Get(it.key());
    ASSERT_TRUE(t.ok()) << it.key();
    EXPECT_EQ(t->info->shape, it.value()["shape"].get<std::vector<int64_t>>()) << it.key();
    const std::string dtype = it.value()["dtype"].get<std::string>();
    EXPECT_EQ(t->info->dtype, dtype == "int32" ? DType::kI32 : DType::kF32) << it.key();
  }
}

// The fixtures that carry a whole model's reference: greedy tokens, logits, MoE layers' in and out.
class ModelReferenceFixture : public EngineFixture {};

TEST_P(ModelReferenceFixture, GreedyTokensAreTheArgmaxOfTheLogits) {
  const int prompts = static_cast<int>(ref_json_["prompts"].size());
  ASSERT_EQ(prompts, 4);
  for (int i = 0; i < prompts; ++i) {
    const std::string s = std::to_string(i);
    std::vector<int64_t> shape;
    const std::vector<float> prompt = Get("prompt." + s);
    const std::vector<float> greedy = Get("greedy." + s);
    const std::vector<float> logits = Get("logits." + s, &shape);
    ASSERT_EQ(shape.size(), 2u);
    ASSERT_EQ(static_cast<size_t>(shape[0]), prompt.size() + greedy.size());
    const int vocab = static_cast<int>(shape[1]);
    for (size_t j = 0; j < greedy.size(); ++j) {
      const float* row = logits.data() + (prompt.size() - 1 + j) * vocab;
      const int best = static_cast<int>(std::max_element(row, row + vocab) - row);
      EXPECT_EQ(best, static_cast<int>(greedy[j])) << GetParam() << " prompt " << i << " step " << j;
      std::vector<float> sorted(row, row + vocab);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      EXPECT_GE(sorted[0] - sorted[1], ref_json_["prompts"][i]["min_top1_top2_gap"].get<double>() * 0.999);
    }
  }
}

TEST_P(ModelReferenceFixture, MoeLayersMatchTransformers) {
  absl::StatusOr<MoeConfig> cfg = LoadMoeConfig(dir_);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_TRUE(RequireExl3(*cfg).ok());
  const std::vector<int> layers = ref_json_["moe_layers"].get<std::vector<int>>();
  ASSERT_EQ(layers, cfg->MoeLayers());
  absl::StatusOr<std::unique_ptr<Exl3Model>> model = Exl3Model::Open(dir_);  // every expert
  ASSERT_TRUE(model.ok()) << model.status();
  const MoeConfig& c = (*model)->config();
  cpu::CpuBackend cpu(1);
  for (int L : layers) {
    std::vector<int64_t> shape;
    const std::vector<float> x = Get("moe_in." + std::to_string(L), &shape);
    const std::vector<float> want = Get("moe_out." + std::to_string(L));
    ASSERT_EQ(shape.size(), 2u);
    ASSERT_EQ(shape[1], c.hidden_size);
    const int T = static_cast<int>(shape[0]);
    std::vector<int32_t> ids(static_cast<size_t>(T) * c.top_k);
    std::vector<float> weights(ids.size());
    if (c.IsHashRoutedLayer(L)) {
      // DeepSeek-V4's hash_moe layers: experts by the moe prompt's token ids.
      const std::string m = std::to_string(ref_json_["moe_prompt"].get<int>());
      std::vector<int64_t> tokens;
      for (float v : Get("prompt." + m)) tokens.push_back(static_cast<int64_t>(v));
      for (float v : Get("greedy." + m)) tokens.push_back(static_cast<int64_t>(v));
      ASSERT_EQ(tokens.size(), static_cast<size_t>(T));
      int64_t vocab = 0;
      const int32_t* table = (*model)->HashTable(L, &vocab);
      ASSERT_NE(table, nullptr);
      std::vector<float> logits(static_cast<size_t>(T) * c.num_experts);
      ComputeRouterLogits((*model)->RouterWeight(L), x.data(), T, c.num_experts, c.hidden_size,
                          logits.data());
      ASSERT_TRUE(RouteHashed(c, L, logits.data(), table, vocab, tokens.data(), T, ids.data(),
                              weights.data())
                      .ok());
    } else {
      ASSERT_TRUE(RouteTokens(c, L, (*model)->RouterWeight(L), (*model)->CorrectionBias(L), x.data(),
                              T, ids.data(), weights.data())
                      .ok());
    }
    absl::StatusOr<MoeLayerView> view = (*model)->LayerView(L);
    ASSERT_TRUE(view.ok()) << view.status();
    std::vector<float> y(x.size());
    ASSERT_TRUE(cpu.Moe(*view, x.data(), MoeAssignments::Fixed(T, c.top_k, ids.data(), weights.data()),
                        /*include_shared=*/true, y.data())
                    .ok());
    double num = 0, den = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      num += (static_cast<double>(y[i]) - want[i]) * (static_cast<double>(y[i]) - want[i]);
      den += static_cast<double>(want[i]) * want[i];
    }
    const double rel = std::sqrt(num / den);
    EXPECT_LT(rel, 1e-5) << GetParam() << " layer " << L;
    std::printf("%s layer %d: |y - transformers| / |transformers| = %.3e\n", GetParam().c_str(), L, rel);
  }
}

// DeepSeek-V4's DSPARK drafter fixture (deepseek_v4_release_mtp; docs/dspark.md): per prompt and
// position p0, the drafts are the argmax of the recorded (Markov-biased) logits with at least the
// recorded gap, the length is the prefix of confidence logits >= 0 (sigmoid >= 0.5), every
// confidence logit at least min_abs_confidence from 0, and the taps / main-kv rows one per position.
class DsparkReferenceFixture : public EngineFixture {};

TEST_P(DsparkReferenceFixture, DraftsAndLengthsFollowTheLogitsAndConfidence) {
  nlohmann::json config;
  {
    std::ifstream in(dir_ + "/config.json");
    config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
  const int B = config["dspark_block_size"].get<int>();
  const int hidden = config["hidden_size"].get<int>();
  const int taps = static_cast<int>(config["dspark_target_layer_ids"].size());
  const double min_conf = ref_json_["min_abs_confidence"].get<double>();
  const nlohmann::json& prompts = ref_json_["prompts"];
  ASSERT_FALSE(prompts.empty());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string s = std::to_string(i);
    const size_t n = Get("prompt." + s).size() + Get("greedy." + s).size();
    std::vector<int64_t> shape;
    const std::vector<float> logits = Get("dspark_logits." + s, &shape);
    ASSERT_EQ(shape.size(), 3u);
    ASSERT_EQ(static_cast<size_t>(shape[0]), n);
    ASSERT_EQ(shape[1], B);
    const int64_t vocab = shape[2];
    const std::vector<float> drafts = Get("dspark_drafts." + s);
    const std::vector<float> conf = Get("dspark_confidence." + s);
    const std::vector<float> length = Get("dspark_length." + s);
    ASSERT_EQ(drafts.size(), n * B);
    ASSERT_EQ(conf.size(), n * B);
    ASSERT_EQ(length.size(), n);
    Get("dspark_taps." + s, &shape);
    EXPECT_EQ(shape, (std::vector<int64_t>{static_cast<int64_t>(n), taps * hidden}));
    Get("dspark_main_kv." + s, &shape);
    ASSERT_EQ(shape.size(), 3u);
    EXPECT_EQ(shape[1], static_cast<int64_t>(n));
    EXPECT_EQ(shape[2], config["head_dim"].get<int64_t>());
    const double min_gap = prompts[i]["min_draft_gap_over_logit_std"].get<double>();
    for (size_t p = 0; p < n; ++p) {
      int len = 0;
      bool open = true;
      for (int j = 0; j < B; ++j) {
        const float* row = logits.data() + (p * B + j) * vocab;
        const int best = static_cast<int>(std::max_element(row, row + vocab) - row);
        EXPECT_EQ(best, static_cast<int>(drafts[p * B + j])) << GetParam() << " prompt " << i << " p0 " << p << " j " << j;
        std::vector<float> sorted(row, row + vocab);
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
        double mean = 0, var = 0;
        for (int64_t v = 0; v < vocab; ++v) mean += row[v];
        mean /= vocab;
        for (int64_t v = 0; v < vocab; ++v) var += (row[v] - mean) * (row[v] - mean);
        EXPECT_GE((sorted[0] - sorted[1]) / std::sqrt(var / (vocab - 1)), min_gap * 0.999);
        const float c = conf[p * B + j];
        EXPECT_GE(std::fabs(c), min_conf * 0.999);
        open = open && c >= 0;
        len += open ? 1 : 0;
      }
      EXPECT_EQ(len, static_cast<int>(length[p])) << GetParam() << " prompt " << i << " p0 " << p;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DsparkReferenceFixture, ::testing::ValuesIn(FixtureNames("dspark")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
INSTANTIATE_TEST_SUITE_P(Fixtures, EngineFixture, ::testing::ValuesIn(FixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });
INSTANTIATE_TEST_SUITE_P(Fixtures, ModelReferenceFixture, ::testing::ValuesIn(FixtureNames("moe_layers")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace exl3
