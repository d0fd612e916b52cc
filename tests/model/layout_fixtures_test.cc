// The checkpoint layouts transformers writes (tests/fixtures/layouts/<family>: config.json,
// tensors.json with every tensor's name, dtype and shape, and expected.json with the facts read
// off the transformers model itself; all written by scripts/conformance/moe_conformance.py)
// against this repository's readers: model/moe_config.h finds the family, the expert count,
// top-k, each layer's kind (dense / moe / hash_moe) and the shared expert, every tensor name it
// produces exists with the shape the config implies, and every tensor of a MoE layer's MLP is one
// the reader knows (none is silently ignored). For the families the engine runs,
// engine/config/model_config.h parses the same config.json and the attention weights it reads exist.
// No torch needed.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/config/read_model_config.h"
#include "engine/config/dsv4_config.h"
#include "engine/config/model_config.h"
#include "gtest/gtest.h"
#include "model/config/read_moe_config.h"
#include "model/moe_config.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
constexpr char kLayouts[] = "tests/fixtures/layouts";  // tests run in the source directory

std::vector<std::string> LayoutNames() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(kLayouts, ec)) {
    if (e.is_directory() && fs::exists(e.path() / "tensors.json")) {
      names.push_back(e.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in, nullptr, /*allow_exceptions=*/false);
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(LayoutFixtures, EveryFamilyIsPresent) {
  const std::vector<std::string> names = LayoutNames();
  for (const char* f : {"mixtral", "qwen3_moe", "glm4_moe", "deepseek_v3", "glm_moe_dsa",
                        "qwen3_next", "deepseek_v4", "glm5_next", "qwen4_exp"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), f), names.end()) << f;
  }
  // Every architecture model/moe_config.h supports has a layout.
  std::set<std::string> archs;
  for (const std::string& n : names) {
    archs.insert(ReadJson(std::string(kLayouts) + "/" + n + "/expected.json")["architecture"]);
  }
  for (const std::string& a : SupportedArchitectures()) EXPECT_TRUE(archs.count(a)) << a;
}

class LayoutFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = std::string(kLayouts) + "/" + GetParam();
    expected_ = ReadJson(dir_ + "/expected.json");
    ASSERT_TRUE(expected_.is_object()) << dir_;
    const json t = ReadJson(dir_ + "/tensors.json");
    ASSERT_TRUE(t.is_object()) << dir_;
    for (const auto& [name, v] : t.items()) {
      tensors_[name] = {v["dtype"].get<std::string>(), v["shape"].get<std::vector<int64_t>>()};
    }
    absl::StatusOr<MoeConfig> c = LoadMoeConfig(dir_);
    ASSERT_TRUE(c.ok()) << c.status();
    cfg_ = *c;
  }

  // The tensor exists with this shape (and, when given, one of these dtypes).
  void ExpectTensor(const std::string& name, const std::vector<int64_t>& shape,
                    const std::set<std::string>& dtypes = {}) {
    auto it = tensors_.find(name);
    ASSERT_NE(it, tensors_.end()) << GetParam() << ": no tensor " << name;
    EXPECT_EQ(it->second.shape, shape) << name;
    if (!dtypes.empty()) {
      EXPECT_TRUE(dtypes.count(it->second.dtype)) << name << " " << it->second.dtype;
    }
    claimed_.insert(name);
  }

  struct Tensor {
    std::string dtype;
    std::vector<int64_t> shape;
  };
  std::string dir_;
  json expected_;
  std::map<std::string, Tensor> tensors_;
  std::set<std::string> claimed_;
  MoeConfig cfg_;
};

TEST_P(LayoutFixture, ConfigFacts) {
  EXPECT_EQ(cfg_.architecture, expected_["architecture"].get<std::string>());
  EXPECT_EQ(MoeFamilyName(cfg_.family), expected_["family"].get<std::string>());
  EXPECT_EQ(cfg_.hidden_size, expected_["hidden_size"].get<int>());
  EXPECT_EQ(cfg_.num_experts, expected_["num_experts"].get<int>());
  EXPECT_EQ(cfg_.top_k, expected_["top_k"].get<int>());
  EXPECT_EQ(cfg_.moe_intermediate_size, expected_["moe_intermediate_size"].get<int>());
  EXPECT_EQ(cfg_.shared_intermediate_size, expected_["shared_intermediate_size"].get<int>());
  EXPECT_EQ(cfg_.shared_expert_gated, expected_["shared_expert_gated"].get<bool>());
  const std::vector<std::string> kinds = expected_["layer_kinds"].get<std::vector<std::string>>();
  ASSERT_EQ(cfg_.num_hidden_layers, static_cast<int>(kinds.size()));
  for (int L = 0; L < cfg_.num_hidden_layers; ++L) {
    EXPECT_EQ(MlpKindName(cfg_.LayerKind(L)), kinds[L]) << GetParam() << " layer " << L;
  }
}

TEST_P(LayoutFixture, EveryMoeTensorNameResolves) {
  const int H = cfg_.hidden_size, I = cfg_.moe_intermediate_size, E = cfg_.num_experts;
  for (int L = 0; L < cfg_.num_hidden_layers; ++L) {
    if (!cfg_.IsMoeLayer(L)) {
      // A dense layer has no experts and no router.
      EXPECT_FALSE(tensors_.count(RoutedExpertPrefix(cfg_, L, 0, Projection::kGate) + ".weight")) << L;
      EXPECT_FALSE(tensors_.count(RouterWeightKey(cfg_, L))) << L;
      continue;
    }
    for (int e = 0; e < E; ++e) {
      ExpectTensor(RoutedExpertPrefix(cfg_, L, e, Projection::kGate) + ".weight", {I, H});
      ExpectTensor(RoutedExpertPrefix(cfg_, L, e, Projection::kUp) + ".weight", {I, H});
      ExpectTensor(RoutedExpertPrefix(cfg_, L, e, Projection::kDown) + ".weight", {H, I});
    }
    ExpectTensor(RouterWeightKey(cfg_, L), {E, H});
    const std::string bias = CorrectionBiasKey(cfg_, L);
    if (!bias.empty()) ExpectTensor(bias, {E});
    const std::string hash = HashTableKey(cfg_, L);
    EXPECT_EQ(hash.empty(), !cfg_.IsHashRoutedLayer(L));
    if (!hash.empty()) {
      ExpectTensor(hash, {expected_["vocab_size"].get<int64_t>(), cfg_.top_k}, {"I64", "I32"});
    }
    if (cfg_.has_shared_expert()) {
      const int S = cfg_.shared_intermediate_size;
      ExpectTensor(SharedExpertPrefix(cfg_, L, Projection::kGate) + ".weight", {S, H});
      ExpectTensor(SharedExpertPrefix(cfg_, L, Projection::kUp) + ".weight", {S, H});
      ExpectTensor(SharedExpertPrefix(cfg_, L, Projection::kDown) + ".weight", {H, S});
    }
    const std::string sgate = SharedExpertGateKey(cfg_, L);
    if (!sgate.empty()) ExpectTensor(sgate, {1, H});
    // Completeness: nothing under the layer's MoE block the reader does not know about.
    for (const char* block : {"mlp.", "ffn.", "block_sparse_moe."}) {
      const std::string prefix = LayerPrefix(cfg_, L) + block;
      for (const auto& [name, t] : tensors_) {
        if (absl::StartsWith(name, prefix)) {
          EXPECT_TRUE(claimed_.count(name)) << GetParam() << ": " << name << " is not read";
        }
      }
    }
  }
  const json cfg_json = ReadJson(dir_ + "/config.json");
  if (!cfg_json.value("tie_word_embeddings", false)) {
    ExpectTensor(HeadWeightKey(cfg_), {expected_["vocab_size"].get<int64_t>(), H});
  }
}

INSTANTIATE_TEST_SUITE_P(Families, LayoutFixture, ::testing::ValuesIn(LayoutNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// The families the engine runs (engine/config/model_config.h): their config.json as transformers writes
// it parses, and the attention weights the engine reads exist with the shapes it derives.
class EngineLayoutFixture : public LayoutFixture {};

TEST_P(EngineLayoutFixture, EngineConfigAndAttentionNames) {
  const json j = ReadJson(dir_ + "/config.json");
  absl::StatusOr<engine::ModelConfig> m =
      engine::ParseModelConfig(ReadText(dir_ + "/config.json"), dir_ + "/config.json");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->vocab_size, j["vocab_size"].get<int>());
  EXPECT_EQ(m->num_heads, j["num_attention_heads"].get<int>());
  EXPECT_EQ(m->num_layers, j["num_hidden_layers"].get<int>());
  for (int L = 0; L < m->num_layers; ++L) EXPECT_EQ(m->IsMoeLayer(L), cfg_.IsMoeLayer(L));
  if (cfg_.family == MoeFamily::kDeepseekV3 || cfg_.architecture == "GlmMoeDsaForCausalLM") {
    EXPECT_EQ(m->attention, cfg_.family == MoeFamily::kDeepseekV3 ? engine::AttentionKind::kMla
                                                                  : engine::AttentionKind::kDsa);
    EXPECT_EQ(m->kv_lora_rank, j["kv_lora_rank"].get<int>());
    // The MLA projections the engine reads, with the shapes the config implies.
    const int heads = m->num_heads, qk = m->qk_nope_head_dim + m->qk_rope_head_dim;
    for (int L = 0; L < m->num_layers; ++L) {
      const std::string a = absl::StrCat("model.layers.", L, ".self_attn.");
      ExpectTensor(a + "q_a_proj.weight", {m->q_lora_rank, m->hidden_size});
      ExpectTensor(a + "q_b_proj.weight", {heads * qk, m->q_lora_rank});
      ExpectTensor(a + "kv_a_proj_with_mqa.weight", {m->kv_lora_rank + m->qk_rope_head_dim, m->hidden_size});
      ExpectTensor(a + "kv_b_proj.weight",
                   {heads * (m->qk_nope_head_dim + m->v_head_dim), m->kv_lora_rank});
      ExpectTensor(a + "o_proj.weight", {m->hidden_size, heads * m->v_head_dim});
      if (m->HasOwnIndexer(L)) {
        // DSA's lightning indexer: queries from the q latent, one key head, per-head weights.
        const engine::IndexerConfig& ix = m->indexer;
        ExpectTensor(a + "indexer.wq_b.weight", {ix.num_heads * ix.head_dim, m->q_lora_rank});
        ExpectTensor(a + "indexer.wk.weight", {ix.head_dim, m->hidden_size});
        ExpectTensor(a + "indexer.k_norm.weight", {ix.head_dim});
        ExpectTensor(a + "indexer.k_norm.bias", {ix.head_dim});
        ExpectTensor(a + "indexer.weights_proj.weight", {ix.num_heads, m->hidden_size});
      }
    }
  } else if (cfg_.family == MoeFamily::kDeepseekV4) {
    // Shared-KV attention, compressors, indexer and hyper-connections under the original names.
    EXPECT_EQ(m->attention, engine::AttentionKind::kDsv4);
    const engine::Dsv4Config& v = *m->dsv4;
    const int H = m->hidden_size, NH = m->num_heads, D = v.head_dim, N = v.hc_mult;
    const int GR = v.o_groups * v.o_lora_rank;
    EXPECT_EQ(v.rope_dim, j["qk_rope_head_dim"].get<int>());
    ExpectTensor("model.hc_head.hc_fn", {N, N * H});
    ExpectTensor("model.hc_head.hc_base", {N});
    ExpectTensor("model.hc_head.hc_scale", {1});
    for (int L = 0; L < m->num_layers; ++L) {
      const std::string l = absl::StrCat("model.layers.", L, ".");
      ExpectTensor(l + "attn_norm.weight", {H});
      ExpectTensor(l + "ffn_norm.weight", {H});
      for (const char* hc : {"hc_attn_", "hc_ffn_"}) {
        ExpectTensor(l + hc + "fn", {(2 + N) * N, N * H});
        ExpectTensor(l + hc + "base", {(2 + N) * N});
        ExpectTensor(l + hc + "scale", {3});
      }
      const std::string a = l + "attn.";
      ExpectTensor(a + "wq_a.weight", {v.q_lora_rank, H});
      ExpectTensor(a + "q_norm.weight", {v.q_lora_rank});
      ExpectTensor(a + "wq_b.weight", {NH * D, v.q_lora_rank});
      ExpectTensor(a + "wkv.weight", {D, H});
      ExpectTensor(a + "norm.weight", {D});
      ExpectTensor(a + "wo_a.weight", {GR, NH * D / v.o_groups});
      ExpectTensor(a + "wo_b.weight", {H, GR});
      ExpectTensor(a + "attn_sink", {NH});
      const engine::Dsv4LayerType type = v.layer_types[L];
      if (type != engine::Dsv4LayerType::kSlidingWindow) {
        const int rate = v.CompressRate(L);
        const int width = (type == engine::Dsv4LayerType::kCompressedSparse ? 2 : 1) * D;
        ExpectTensor(a + "compressor.wkv.weight", {width, H});
        ExpectTensor(a + "compressor.wgate.weight", {width, H});
        ExpectTensor(a + "compressor.ape", {rate, width});
        ExpectTensor(a + "compressor.norm.weight", {D});
      }
      if (type == engine::Dsv4LayerType::kCompressedSparse) {
        const int DI = v.index_head_dim;
        ExpectTensor(a + "indexer.wq_b.weight", {v.index_heads * DI, v.q_lora_rank});
        ExpectTensor(a + "indexer.weights_proj.weight", {v.index_heads, H});
        ExpectTensor(a + "indexer.compressor.wkv.weight", {2 * DI, H});
        ExpectTensor(a + "indexer.compressor.wgate.weight", {2 * DI, H});
        ExpectTensor(a + "indexer.compressor.ape", {v.CompressRate(L), 2 * DI});
        ExpectTensor(a + "indexer.compressor.norm.weight", {DI});
      }
      for (const auto& [name, t] : tensors_) {
        if (absl::StartsWith(name, a)) {
          EXPECT_TRUE(claimed_.count(name)) << name << " is not read";
        }
      }
    }
  } else {
    EXPECT_EQ(m->attention, engine::AttentionKind::kGqa);
    const int q = m->num_heads * m->head_dim, kv = m->num_kv_heads * m->head_dim;
    for (int L = 0; L < m->num_layers; ++L) {
      const std::string a = absl::StrCat("model.layers.", L, ".self_attn.");
      ExpectTensor(a + "q_proj.weight", {q, m->hidden_size});
      ExpectTensor(a + "k_proj.weight", {kv, m->hidden_size});
      ExpectTensor(a + "v_proj.weight", {kv, m->hidden_size});
      ExpectTensor(a + "o_proj.weight", {m->hidden_size, q});
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EngineFamilies, EngineLayoutFixture,
                         ::testing::Values("mixtral", "qwen3_moe", "glm4_moe", "deepseek_v3",
                                           "glm_moe_dsa", "deepseek_v4"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace exl3
