// RoPE against transformers 5.24's own frequencies (modeling_rope_utils' ROPE_INIT_FUNCTIONS,
// printed for these configurations: head_dim 64, max_position_embeddings 4096), and the
// rotation's layouts against their definitions.
#include "engine/config/read_model_config.h"
#include "engine/cpu/rope.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/config/model_config.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 2e-7 * std::fabs(want[i]) + 1e-12) << "frequency " << i;
}

absl::StatusOr<ModelConfig> Config(const std::string& rope_parameters) {
  const std::string json = R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 512,
    "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 4096, "vocab_size": 128, "rope_parameters": )" +
                           rope_parameters + "}";
  return ParseModelConfig(json, "test config.json");
}

TEST(Rope, LinearAsTransformers) {
  auto cfg = Config(R"({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ExpectClose(RopeInverseFrequencies(cfg->rope, 4096, 4096),
              {0.25f, 0.18747355f, 0.140585333f, 0.105424128f, 0.079056941f, 0.0592843406f,
               0.0444569848f, 0.0333380364f, 0.0250000004f, 0.0187473539f, 0.0140585322f,
               0.0105424123f, 0.00790569466f, 0.00592843397f, 0.00444569858f, 0.00333380373f,
               0.00249999994f, 0.00187473558f, 0.00140585331f, 0.00105424121f, 0.000790569466f,
               0.000592843455f, 0.000444569858f, 0.000333380362f, 0.000250000012f,
               0.000187473546f, 0.000140585325f, 0.000105424122f, 7.90569466e-05f,
               5.92843462e-05f, 4.44569851e-05f, 3.33380376e-05f});
}

TEST(Rope, DynamicAsTransformersPastTheContext) {
  auto cfg = Config(R"({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  // Within max_position_embeddings: the default frequencies.
  EXPECT_EQ(RopeInverseFrequencies(cfg->rope, 4096, 100)[1],
            RopeInverseFrequencies(cfg->rope, 4096, 4096)[1]);
  ExpectClose(RopeInverseFrequencies(cfg->rope, 4096, 8192),
              {1.f, 0.71195507f, 0.506879985f, 0.360875785f, 0.256927341f, 0.182920724f,
               0.130231336f, 0.0927188545f, 0.0660116598f, 0.0469973311f, 0.0334599912f,
               0.0238220077f, 0.0169601999f, 0.0120748999f, 0.0085967863f, 0.00612052577f,
               0.00435753912f, 0.00310237193f, 0.00220874953f, 0.00157253037f, 0.00111957092f,
               0.000797084183f, 0.000567488139f, 0.000404026068f, 0.000287648378f,
               0.000204792726f, 0.000145803206f, 0.000103805338f, 7.39047391e-05f,
               5.26168515e-05f, 3.74608317e-05f, 2.66704283e-05f});
}

TEST(Rope, YarnAsTransformers) {
  auto cfg = Config(R"({"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                        "original_max_position_embeddings": 512, "beta_fast": 32,
                        "beta_slow": 1})");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_NEAR(cfg->rope.attention_factor, 1.2079441541679836, 1e-12);
  ExpectClose(RopeInverseFrequencies(cfg->rope, 4096, 4096),
              {1.f, 0.713111103f, 0.508527458f, 0.336194307f, 0.220887616f, 0.144070789f,
               0.0931495577f, 0.0595880151f, 0.0376166441f, 0.023347551f, 0.0141696986f,
               0.00833627023f, 0.00468369294f, 0.00244076364f, 0.00109928579f, 0.000783912954f,
               0.000559017004f, 0.000398641219f, 0.000284275477f, 0.000202719995f,
               0.000144561869f, 0.000103088671f, 7.35136782e-05f, 5.24234165e-05f,
               3.73837211e-05f, 2.66587449e-05f, 1.90106457e-05f, 1.35567025e-05f,
               9.66743482e-06f, 6.89395529e-06f, 4.91615583e-06f, 3.50576511e-06f});
}

TEST(Rope, PartialRotaryFromTheOlderTopLevelField) {
  auto cfg = Config(R"(null, "rope_theta": 10000.0, "partial_rotary_factor": 0.5)");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->rope.rotary_dim, 32);
  ExpectClose(RopeInverseFrequencies(cfg->rope, 4096, 4096),
              {1.f, 0.562341332f, 0.316227764f, 0.177827939f, 0.100000001f, 0.0562341288f,
               0.0316227786f, 0.0177827943f, 0.00999999978f, 0.00562341325f, 0.00316227786f,
               0.00177827943f, 0.00100000005f, 0.000562341302f, 0.000316227786f,
               0.00017782794f});
}

TEST(Rope, LayoutsRotatePairsAndPassTheRest) {
  RopeConfig c;
  c.rotary_dim = 4;
  c.theta = 10000.0;
  const float angle0 = 3.0f, angle1 = 3.0f * 0.01f;  // position 3, inv_freq 1 and 0.01
  for (RopeLayout layout : {RopeLayout::kHalfSplit, RopeLayout::kInterleaved}) {
    c.layout = layout;
    Rope rope(c, 4096);
    std::vector<float> x = {1, 2, 3, 4, 5, 6};
    rope.Apply(x.data(), 1, 6, /*position=*/3, /*seq_len=*/4);
    // Pairs (0, 2), (1, 3) half-split; (0, 1), (2, 3) interleaved, written de-interleaved.
    const float a0 = 1, b0 = layout == RopeLayout::kHalfSplit ? 3 : 2;
    const float a1 = layout == RopeLayout::kHalfSplit ? 2 : 3, b1 = 4;
    EXPECT_NEAR(x[0], a0 * std::cos(angle0) - b0 * std::sin(angle0), 1e-5);
    EXPECT_NEAR(x[1], a1 * std::cos(angle1) - b1 * std::sin(angle1), 1e-5);
    EXPECT_NEAR(x[2], b0 * std::cos(angle0) + a0 * std::sin(angle0), 1e-5);
    EXPECT_NEAR(x[3], b1 * std::cos(angle1) + a1 * std::sin(angle1), 1e-5);
    EXPECT_EQ(x[4], 5);
    EXPECT_EQ(x[5], 6);
  }
}

// The older place of the scaling: `rope_scaling` with `type` instead of `rope_type`.
TEST(Rope, OlderRopeScalingWithTypeIsRead) {
  const std::string json = R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 512,
    "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 4096, "vocab_size": 128, "rope_theta": 10000.0,
    "rope_scaling": {"type": "linear", "factor": 4.0}})";
  auto cfg = ParseModelConfig(json, "test config.json");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->rope.type, RopeType::kLinear);
  EXPECT_EQ(RopeInverseFrequencies(cfg->rope, 4096, 4096)[0], 0.25f);
}

// Rope types the engine does not implement stop the model at start, naming the type and the
// ones it has.
TEST(Rope, UnknownRopeTypesAreRefusedNamingThem) {
  for (const char* type : {"llama3", "longrope", "su"}) {
    auto cfg = Config(std::string(R"({"rope_type": ")") + type +
                      R"(", "rope_theta": 10000.0, "factor": 8.0})");
    ASSERT_FALSE(cfg.ok()) << type;
    EXPECT_EQ(cfg.status().code(), absl::StatusCode::kUnimplemented) << cfg.status();
    EXPECT_NE(cfg.status().message().find(std::string("'") + type + "'"), std::string::npos)
        << cfg.status();
    EXPECT_NE(cfg.status().message().find("default, linear, dynamic, yarn"), std::string::npos)
        << cfg.status();
  }
  // A scaled type without its factor is refused too.
  auto cfg = Config(R"({"rope_type": "linear", "rope_theta": 10000.0})");
  ASSERT_FALSE(cfg.ok());
  EXPECT_NE(cfg.status().message().find("factor"), std::string::npos) << cfg.status();
}

// Each family's layout as transformers rotates it: GQA families rotate half-split pairs
// (rotate_half); DeepSeek-V3 interleaved pairs unless its config sets rope_interleave false.
TEST(Rope, EachFamilyRotatesInItsLayout) {
  auto load = [](const std::string& fixture, bool* ok) {
    std::ifstream f("tests/fixtures/engine/" + fixture + "/config.json");
    std::stringstream ss;
    ss << f.rdbuf();
    *ok = static_cast<bool>(f);
    return nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  };
  for (const char* fixture : {"glm4_moe_all", "qwen3_moe_all", "mixtral_all"}) {
    bool ok = false;
    const nlohmann::json j = load(fixture, &ok);
    ASSERT_TRUE(ok && j.is_object()) << fixture;
    auto cfg = ParseModelConfig(j.dump(), fixture);
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    EXPECT_EQ(cfg->rope.layout, RopeLayout::kHalfSplit) << fixture;
  }
  bool ok = false;
  nlohmann::json j = load("deepseek_v3_all", &ok);
  ASSERT_TRUE(ok && j.is_object());
  auto interleaved = ParseModelConfig(j.dump(), "deepseek_v3_all");
  ASSERT_TRUE(interleaved.ok()) << interleaved.status();
  EXPECT_EQ(interleaved->rope.layout, RopeLayout::kInterleaved);
  EXPECT_EQ(interleaved->rope.type, RopeType::kYarn);
  j.erase("rope_interleave");  // transformers' default for DeepSeek-V3: interleaved
  auto by_default = ParseModelConfig(j.dump(), "deepseek_v3_all");
  ASSERT_TRUE(by_default.ok()) << by_default.status();
  EXPECT_EQ(by_default->rope.layout, RopeLayout::kInterleaved);
  j["rope_interleave"] = false;
  auto half_split = ParseModelConfig(j.dump(), "deepseek_v3_all");
  ASSERT_TRUE(half_split.ok()) << half_split.status();
  EXPECT_EQ(half_split->rope.layout, RopeLayout::kHalfSplit);
}

}  // namespace
}  // namespace exl3::engine
