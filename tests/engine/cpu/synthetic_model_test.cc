// Synthetic whole models (exl3-tool make-test-model --synthetic --whole-model): every family's
// layout at a chosen attention shape loads in the CPU model and decodes finite logits, with the
// linears EXL3 where both dimensions are multiples of 128 (DeepSeek-V4 and Qwen3-Next included:
// their compressors, indexer, hyper-connections, DeltaNet and hash table as stored; GLM-5.3-Flash
// with its KDA and indexed layers, hyper-connections and text model under model.language_model.;
// Qwen4-Exp with its DeltaNet + PLE and QSA layers, gated hyper-connections and MTP head).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include "base/status_macros.h"
#include "engine/cpu/cpu_model.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"
#include "tools/test_model/test_model.h"
#include "tests/engine/mixed_expert_model.h"
#include "tests/engine/model_harness.h"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;

class SyntheticWholeModelTest : public ::testing::TestWithParam<std::string> {};

// A 2-layer model of `arch` whose linears are EXL3 (both dimensions multiples of 128).
TestModelSpec WholeModelSpec(const std::string& arch) {
  TestModelSpec spec;
  spec.arch = arch;
  spec.layers = 2;
  spec.hidden = 256;
  spec.experts = 4;
  spec.top_k = 2;
  spec.heads = 4;  // GQA: q 256, k/v 128; MLA below: every projection a multiple of 128
  spec.q_lora_rank = 128;
  spec.kv_lora_rank = 64;
  spec.qk_rope_head_dim = 64;
  spec.qk_nope_head_dim = 64;
  spec.v_head_dim = 64;
  spec.index_heads = 2;      // GLM-MoE-DSA: wq_b 256 x 128, wk 128 x 256 (EXL3)
  spec.index_head_dim = 128;
  spec.index_topk = 3;       // 9 positions below: the later ones attend sparsely
  spec.vocab = 256;
  if (spec.arch == "deepseek_v4") {  // [sliding, CSA, HCA]: 2 heads of 128, all EXL3
    spec.layers = 3;
    spec.heads = 2;
    spec.head_dim = 128;
    spec.sliding_window = 4;
    spec.hca_compress_rate = 4;
    spec.index_topk = 1;  // the later positions see more compressed entries than that
  }
  if (spec.arch == "glm5_next") {  // [KDA 2 x 64, indexed]: NoPE MLA, pools of 2, top 4
    spec.qk_rope_head_dim = 0;
    spec.index_kpool = 2;
    spec.index_topk = 4;
    spec.linear_heads = 2;
    spec.linear_head_dim = 64;
  }
  if (spec.arch == "qwen4_exp") {  // [DeltaNet + PLE, QSA]: blocks of 2, a budget of 4 positions
    spec.index_kpool = 2;
    spec.index_topk = 4;
    spec.heads_per_ngram = 2;  // 4 n-gram heads of rows of 160 (exllamav3's width)
    spec.ple_embed_dim = 640;
    spec.ngram_vocab_size_base = 300;
  }
  return spec;
}

SyntheticOptions WholeModelOptions() {
  SyntheticOptions so;
  so.whole_model = true;
  so.bits = 3;
  so.progress = false;
  return so;
}

// The CPU model's logits for a 5-token prompt and 4 greedy tokens (chunks of 3) from `dir`.
absl::StatusOr<std::vector<std::vector<float>>> GreedyLogits(const fs::path& dir) {
  CpuModelOptions o;
  o.num_threads = 2;
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CpuModel> model, CpuModel::Open(dir.string(), o));
  EXL3_ASSIGN_OR_RETURN(auto rows, testing::RunGreedy(*model, {{1, 2, 3, 4, 5}}, 4, /*chunk=*/3));
  return rows[0];
}

// Writes `arch`'s whole synthetic model in transformers' config layout and in the release layout
// (spec.release_layout), runs `check` on each directory and its config.json, and returns both
// models' greedy logits (empty where writing or decoding failed: the failure is recorded).
using LayoutCheck = std::function<void(bool release, const fs::path& dir, const nlohmann::json& config)>;
std::vector<std::vector<std::vector<float>>> LogitsOfBothLayouts(const std::string& arch, const LayoutCheck& check) {
  std::vector<std::vector<std::vector<float>>> logits;
  for (bool release : {false, true}) {
    TestModelSpec spec = WholeModelSpec(arch);
    spec.release_layout = release;
    const fs::path dir = fs::temp_directory_path() / ("exl3_" + arch + (release ? "_release" : "_transformers"));
    fs::remove_all(dir);
    const absl::Status written = WriteSyntheticExl3Model(spec, WholeModelOptions(), dir.string());
    EXPECT_TRUE(written.ok()) << written;
    if (!written.ok()) return {};
    std::ifstream in(dir / "config.json");
    check(release, dir, nlohmann::json::parse(in));
    auto rows = GreedyLogits(dir);
    EXPECT_TRUE(rows.ok()) << rows.status();
    if (!rows.ok()) return {};
    logits.push_back(*std::move(rows));
    fs::remove_all(dir);
  }
  return logits;
}

TEST_P(SyntheticWholeModelTest, LoadsAndDecodes) {
  const TestModelSpec spec = WholeModelSpec(GetParam());
  const SyntheticOptions so = WholeModelOptions();
  const fs::path dir = fs::temp_directory_path() / ("exl3_synthetic_whole_" + spec.arch);
  fs::remove_all(dir);
  ASSERT_TRUE(WriteSyntheticExl3Model(spec, so, dir.string()).ok());
  auto src = TensorSource::Open(dir.string());
  ASSERT_TRUE(src.ok()) << src.status();
  if (spec.arch == "deepseek_v4") {
    EXPECT_TRUE((*src)->Has("head.trellis"));
    EXPECT_TRUE((*src)->Has("model.layers.0.attn.wkv.trellis"));
    EXPECT_TRUE((*src)->Has("model.layers.0.attn.wo_a.slice.0.trellis"));  // a layer per output group
    EXPECT_TRUE((*src)->Has("model.layers.1.attn.indexer.compressor.wgate.trellis"));
    EXPECT_TRUE((*src)->Has("model.layers.2.attn.compressor.ape"));
    EXPECT_TRUE((*src)->Has("model.layers.0.ffn.gate.tid2eid"));
    EXPECT_TRUE((*src)->Has("model.hc_head.hc_fn"));
  } else if (spec.arch == "qwen3_next") {
    EXPECT_TRUE((*src)->Has("lm_head.trellis"));
    EXPECT_TRUE((*src)->Has("model.layers.0.linear_attn.in_proj_qkvz.trellis"));
    EXPECT_TRUE((*src)->Has("model.layers.0.linear_attn.A_log"));
    EXPECT_TRUE((*src)->Has("model.layers.1.self_attn.q_proj.trellis"));
    EXPECT_TRUE((*src)->Has("model.layers.1.mlp.shared_expert_gate.weight"));
  } else if (spec.arch == "glm5_next") {
    const std::string p = "model.language_model.layers.";
    EXPECT_TRUE((*src)->Has("lm_head.trellis"));
    EXPECT_TRUE((*src)->Has("model.language_model.embed_tokens.weight"));
    // KDA's q/k/v and convolutions as the converter and exllamav3 write them: fused.
    EXPECT_TRUE((*src)->Has(p + "0.self_attn.qkv_proj.trellis"));
    EXPECT_FALSE((*src)->Has(p + "0.self_attn.q_proj.trellis"));
    EXPECT_TRUE((*src)->Has(p + "0.self_attn.f_b_proj.weight"));  // KDA's gates stay bf16
    EXPECT_TRUE((*src)->Has(p + "0.self_attn.conv1d.weight"));
    EXPECT_TRUE((*src)->Has(p + "1.self_attn.kv_b_proj.weight"));  // MLA's kv_b_proj stays bf16
    EXPECT_TRUE((*src)->Has(p + "0.hc_attn_fn"));
    EXPECT_TRUE((*src)->Has(p + "0.mlp.gate_proj.trellis"));
    EXPECT_TRUE((*src)->Has(p + "1.self_attn.q_b_proj.trellis"));
    EXPECT_TRUE((*src)->Has(p + "1.self_attn.indexer.wq_b.trellis"));
    EXPECT_TRUE((*src)->Has(p + "1.self_attn.indexer.index_kpool_compress_ape"));
    EXPECT_TRUE((*src)->Has(p + "1.mlp.experts.3.down_proj.trellis"));
    EXPECT_TRUE((*src)->Has(p + "1.hc_ffn_scale"));
  } else if (spec.arch == "qwen4_exp") {
    const std::string p = "model.language_model.layers.";
    EXPECT_TRUE((*src)->Has("lm_head.trellis"));
    EXPECT_TRUE((*src)->Has(p + "0.linear_attn.in_proj_qkv.trellis"));
    EXPECT_TRUE((*src)->Has(p + "0.linear_attn.in_proj_a.weight"));  // kept as stored
    EXPECT_TRUE((*src)->Has(p + "0.ple.ple_embedding.ngram_embedding.shard_0.weight"));
    EXPECT_TRUE((*src)->Has(p + "0.ple.ple_embedding.layer_multipliers"));
    EXPECT_TRUE((*src)->Has(p + "0.ple.key_proj.weight"));
    EXPECT_TRUE((*src)->Has(p + "1.attn_hyper_connection.block_inject_weight.weight"));
    EXPECT_TRUE((*src)->Has(p + "1.self_attn.indexer.index_qk_proj.trellis"));  // [384, 256]
    EXPECT_TRUE((*src)->Has(p + "1.mlp.experts.3.down_proj.trellis"));
    EXPECT_TRUE((*src)->Has("model.language_model.hyper_connection_mixer.input_mix_weight_up.weight"));
    EXPECT_FALSE((*src)->Has("model.language_model.norm.weight"));  // no final norm
    EXPECT_FALSE((*src)->Has(p + "0.input_layernorm.weight"));
  } else {
    EXPECT_TRUE((*src)->Has("lm_head.trellis"));
    EXPECT_TRUE((*src)->Has("model.layers.0.self_attn.o_proj.trellis"));
  }
  if (spec.arch == "glm_moe_dsa") {
    EXPECT_TRUE((*src)->Has("model.layers.1.self_attn.indexer.wq_b.trellis"));
    EXPECT_TRUE((*src)->Has("model.layers.1.self_attn.indexer.wk.weight"));  // kept bf16, as exllamav3 keeps it
    EXPECT_TRUE((*src)->Has("model.layers.1.self_attn.kv_b_proj.weight"));
    EXPECT_TRUE((*src)->Has("model.layers.1.self_attn.indexer.weights_proj.weight"));
  }

  auto rows = GreedyLogits(dir);
  ASSERT_TRUE(rows.ok()) << rows.status();
  for (const std::vector<float>& row : *rows)
    for (float v : row) ASSERT_TRUE(std::isfinite(v));
  fs::remove_all(dir);
}

// Routed experts that differ in K and codebook (SyntheticOptions' per-expert cycles): the CPU
// model decodes them (engine_cuda_model_test compares the GPU against it on such a model).
TEST(SyntheticModelTest, RoutedExpertsOfMixedBitWidthsDecode) {
  const TestModelSpec spec = testing::MixedExpertModelSpec();
  const fs::path dir = fs::temp_directory_path() / "exl3_synthetic_mixed_expert_bits";
  ASSERT_TRUE(testing::WriteMixedExpertModel(dir).ok());
  auto src = TensorSource::Open(dir.string());
  ASSERT_TRUE(src.ok()) << src.status();
  // Expert 1: K 3 (trellis [16, 8, 48]), 3INST (no flag); expert 2: K 4, MCG.
  auto e1 = (*src)->Get("model.layers.1.mlp.experts.1.gate_proj.trellis");
  ASSERT_TRUE(e1.ok()) << e1.status();
  EXPECT_EQ(e1->info->shape, (std::vector<int64_t>{16, 8, 48}));
  EXPECT_FALSE((*src)->Has("model.layers.1.mlp.experts.1.gate_proj.mcg"));
  EXPECT_TRUE((*src)->Has("model.layers.1.mlp.experts.2.down_proj.mcg"));
  CpuModelOptions o;
  o.num_threads = 2;
  auto model = CpuModel::Open(dir.string(), o);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<std::vector<int32_t>> prompts = {std::vector<int32_t>(40), std::vector<int32_t>(30)};
  for (size_t p = 0; p < prompts.size(); ++p)
    for (size_t i = 0; i < prompts[p].size(); ++i) prompts[p][i] = static_cast<int32_t>((p * 97 + i * 31) % 256);
  auto rows = testing::RunGreedy(**model, prompts, 3, /*chunk=*/40);
  ASSERT_TRUE(rows.ok()) << rows.status();
  for (const auto& seq : *rows)
    for (const std::vector<float>& row : seq)
      for (float v : row) ASSERT_TRUE(std::isfinite(v));
  fs::remove_all(dir);
}

// --release-layout (exllamav3 reads GLM-5.3-Flash's release config only): the same tensors, the
// config in the release layout with processor_config.json beside it, and the engine decodes the
// same logits from it, bit for bit. Both layouts declare the vision tower (vision_config, the image
// tokens) as transformers' Glm5NextConfig writes it; the engine reads text_config alone.
TEST(SyntheticModelTest, Glm5NextReleaseLayoutDecodesTheSameLogits) {
  const auto logits = LogitsOfBothLayouts("glm5_next", [](bool release, const fs::path& dir,
                                                          const nlohmann::json& config) {
    const nlohmann::json& text = config["text_config"];
    EXPECT_EQ(config["vision_config"]["model_type"], "glm5_next_vision");
    EXPECT_EQ(config["vision_config"]["out_hidden_size"], text["hidden_size"]);
    EXPECT_TRUE(config.contains("image_start_token_id") && config.contains("image_end_token_id"));
    EXPECT_EQ(text["layer_types"][1], release ? "deepseek_sparse_attention" : "indexed_attention");
    EXPECT_EQ(text.contains("linear_attn_config"), release);
    EXPECT_EQ(text.contains("linear_num_heads"), !release);
    if (release) {
      EXPECT_EQ(text["linear_attn_config"]["head_dim"], 64);
    }
    EXPECT_EQ(fs::exists(dir / "processor_config.json"), release);
  });
  ASSERT_EQ(logits.size(), 2u);
  EXPECT_EQ(logits[0], logits[1]);
}

// Qwen4-Exp's release layout (its QSA layers full_attention in layer_types, the only name exllamav3
// reads): the same tensors and the same logits; the n-gram table holds exactly the rows the
// engine's hashing needs in split_ngram_parts pieces, with the hashing constants it checks.
TEST(SyntheticModelTest, Qwen4ExpReleaseLayoutDecodesTheSameLogits) {
  const auto logits = LogitsOfBothLayouts("qwen4_exp", [](bool release, const fs::path& dir,
                                                          const nlohmann::json& config) {
    const nlohmann::json& text = config["text_config"];
    EXPECT_EQ(config["architectures"][0], "Qwen4ExpForConditionalGeneration");
    EXPECT_EQ(config["vision_config"]["out_hidden_size"], text["hidden_size"]);
    EXPECT_EQ(text["layer_types"][0], "linear_attention");
    EXPECT_EQ(text["layer_types"][1], release ? "full_attention" : "indexed_attention");
    EXPECT_EQ(text["ple_layer_ids"], nlohmann::json::array({1}));
    EXPECT_FALSE(fs::exists(dir / "preprocessor_config.json"));  // text only, for exllamav3 too
    auto src = TensorSource::Open(dir.string());
    ASSERT_TRUE(src.ok()) << src.status();
    const int parts = text["split_ngram_parts"];
    int64_t rows = 0;
    for (int i = 0; i < parts; ++i) {
      auto piece = (*src)->Get("model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_" +
                               std::to_string(i) + ".weight");
      ASSERT_TRUE(piece.ok()) << piece.status();
      EXPECT_EQ(piece->info->shape[1], 160);
      rows += piece->info->shape[0];
    }
    EXPECT_EQ(rows % 128, 0);
    EXPECT_GE(rows, 4 * 300);
    auto sizes = (*src)->Get("model.language_model.layers.0.ple.ple_embedding.ngram_heads_vocab_sizes");
    ASSERT_TRUE(sizes.ok()) << sizes.status();
    EXPECT_EQ(sizes->as<int64_t>()[0], 307);  // the first prime >= ngram_vocab_size_base 300
  });
  ASSERT_EQ(logits.size(), 2u);
  EXPECT_EQ(logits[0], logits[1]);
}

// Qwen4-Exp's MTP head (--mtp): mtp.* in a shard of its own, which the engine's head loads and
// drafts with.
TEST(SyntheticModelTest, Qwen4ExpMtpHeadLoads) {
  TestModelSpec spec = WholeModelSpec("qwen4_exp");
  spec.mtp = true;
  const fs::path dir = fs::temp_directory_path() / "exl3_qwen4_mtp";
  fs::remove_all(dir);
  ASSERT_TRUE(WriteSyntheticExl3Model(spec, WholeModelOptions(), dir.string()).ok());
  auto src = TensorSource::Open(dir.string());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_TRUE((*src)->Has("mtp.fc_hidden.trellis"));
  EXPECT_TRUE((*src)->Has("mtp.layers.0.self_attn.indexer.index_qk_proj.trellis"));
  EXPECT_TRUE((*src)->Has("mtp.hyper_connection_mixer.hc_norm.weight"));
  EXPECT_FALSE((*src)->Has("mtp.layers.0.ple.key_proj.weight"));
  CpuModelOptions o;
  o.num_threads = 2;
  auto model = CpuModel::Open(dir.string(), o);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE((*model)->EnableMtpDrafting().ok());
  fs::remove_all(dir);
}

TEST(SyntheticModelTest, ReleaseLayoutIsGlm5NextsAndQwen4ExpsOnly) {
  TestModelSpec spec = WholeModelSpec("qwen3_next");
  spec.release_layout = true;
  const absl::Status st = WriteSyntheticExl3Model(spec, WholeModelOptions(), "/nonexistent/never");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("--release-layout"), std::string::npos) << st;
}

// `spec` is refused as INVALID_ARGUMENT naming `says`, before anything is written to `dir`.
void ExpectRefused(const TestModelSpec& spec, const std::string& says, const fs::path& dir) {
  SyntheticOptions so;
  so.progress = false;
  const absl::Status st = WriteSyntheticExl3Model(spec, so, dir.string());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find(says), std::string::npos) << st;
  EXPECT_FALSE(fs::exists(dir));
}

// GLM-5.3-Flash shapes transformers or the engine cannot have are refused before anything is
// written: rope in its NoPE attention, index_topk not a multiple of index_kpool, Qwen3-Next's
// full_attention layer kind, KV heads differing from heads.
TEST(SyntheticModelTest, Glm5NextRefusesShapesItCannotHave) {
  const fs::path dir = fs::temp_directory_path() / "exl3_synthetic_glm5_refused";
  fs::remove_all(dir);
  auto refused = [&](const TestModelSpec& spec, const std::string& says) { ExpectRefused(spec, says, dir); };
  TestModelSpec spec;
  spec.arch = "glm5_next";
  TestModelSpec rope = spec;
  rope.qk_rope_head_dim = 16;
  refused(rope, "no rope");
  TestModelSpec pools = spec;
  pools.index_kpool = 3;
  refused(pools, "--index-kpool");
  TestModelSpec kinds = spec;
  kinds.layer_types = {"linear_attention", "full_attention", "linear_attention"};
  refused(kinds, "indexed_attention");
  TestModelSpec kv = spec;
  kv.kv_heads = 2;
  refused(kv, "KV heads");
}

// Qwen4-Exp shapes transformers, the engine or (with the release layout) exllamav3 cannot have are
// refused before anything is written: a PLE on a QSA layer, ple_embed_dim not a multiple of the
// n-gram heads, a dense layer, rotary dimensions wider than the index head, n-gram rows other than
// exllamav3's 160, and a table that split_ngram_parts pieces of ceil(rows / parts) cannot cover.
TEST(SyntheticModelTest, Qwen4ExpRefusesShapesItCannotHave) {
  const fs::path dir = fs::temp_directory_path() / "exl3_synthetic_qwen4_refused";
  fs::remove_all(dir);
  auto refused = [&](const TestModelSpec& spec, const std::string& says) { ExpectRefused(spec, says, dir); };
  const TestModelSpec spec = WholeModelSpec("qwen4_exp");  // [linear_attention, indexed_attention]
  TestModelSpec ple = spec;
  ple.ple_layer_ids = {2};
  refused(ple, "--ple-layer-ids holds 2");
  TestModelSpec embed = spec;
  embed.ple_embed_dim = 642;
  refused(embed, "--ple-embed-dim 642");
  TestModelSpec dense = spec;
  dense.dense_layers = 1;
  refused(dense, "every layer MoE");
  TestModelSpec rope = spec;
  rope.index_head_dim = 8;
  refused(rope, "a quarter of each head");
  TestModelSpec rows = spec;
  rows.release_layout = true;
  rows.ple_embed_dim = 256;
  refused(rows, "rows of 160");
  TestModelSpec parts = spec;
  parts.split_ngram_parts = 1000;
  refused(parts, "--split-ngram-parts 1000");
}

INSTANTIATE_TEST_SUITE_P(Families, SyntheticWholeModelTest,
                         ::testing::Values("glm4_moe", "deepseek_v3", "qwen3_moe", "mixtral",
                                           "glm_moe_dsa", "deepseek_v4", "qwen3_next", "glm5_next",
                                           "qwen4_exp"));

}  // namespace
}  // namespace exl3::engine
