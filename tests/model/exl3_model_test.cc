// Exl3Model on model directories written by the test: all experts or a share, the layer view, the
// fingerprint, bytes, and the validation errors (missing tensor, wrong shape, config mismatch).
#include "model/exl3_model.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/config/config_file.h"
#include "model/routing.h"
#include "tests/kernels/random_layer.h"
#include "tests/model/exllamav3_dir_writer.h"
#include "tools/test_model/expert_test_model.h"

namespace exl3 {
namespace {

using testing::ExpertModelSpec;

std::string TempDir(const std::string& name) {
  const std::string d = (std::filesystem::temp_directory_path() /
                         ("exl3_model_test_" + std::to_string(::getpid()) + "_" + name)).string();
  std::filesystem::remove_all(d);
  return d;
}

std::string Write(const std::string& name, const ExpertModelSpec& spec,
                  const nlohmann::json* cfg = nullptr) {
  const std::string dir = TempDir(name);
  absl::Status s = testing::WriteExpertModel(dir, spec, cfg);
  EXPECT_TRUE(s.ok()) << s;
  return dir;
}

TEST(Exl3ModelTest, OpensEveryExpertAndRunsTheLayer) {
  ExpertModelSpec spec;
  spec.swiglu_limit = 3.0f;
  const std::string dir = Write("all", spec);
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  const MoeConfig& c = (*m)->config();
  EXPECT_EQ(c.MoeLayers(), (std::vector<int>{1, 2}));
  EXPECT_EQ((*m)->HeldExperts(1).size(), 8u);
  EXPECT_EQ((*m)->HeldExperts(0).size(), 0u);
  ASSERT_NE((*m)->SharedExpert(2), nullptr);
  ASSERT_NE((*m)->RouterWeight(1), nullptr);
  ASSERT_NE((*m)->CorrectionBias(1), nullptr);
  EXPECT_EQ((*m)->Expert(1, 1)->gate.bits, 3);
  EXPECT_EQ((*m)->Expert(1, 1)->gate.codebook, Codebook::kMcg);
  EXPECT_EQ((*m)->Expert(1, 1)->up.codebook, Codebook::k3Inst);
  EXPECT_EQ((*m)->Expert(1, 1)->down.codebook, Codebook::kMul1);
  EXPECT_EQ((*m)->Expert(1, 0)->gate.bits, 2);
  // Bytes: trellis + suh + svh (+ flag) of three projections.
  const uint64_t gate = 256 / 16 * 128 / 16 * 16 * 2 * 2 + 2 * (256 + 128) + 4;  // K=2 mcg
  const uint64_t up = 256 / 16 * 128 / 16 * 16 * 3 * 2 + 2 * (256 + 128);       // K=3 3inst
  const uint64_t down = 128 / 16 * 256 / 16 * 16 * 2 * 2 + 2 * (256 + 128) + 4;  // K=2 mul1
  EXPECT_EQ((*m)->ExpertBytes(1, 0), gate + up + down);
  EXPECT_GT((*m)->LayerBytes(1), 8 * (gate + up + down));
  EXPECT_EQ((*m)->TotalBytes(), (*m)->LayerBytes(1) + (*m)->LayerBytes(2));
  EXPECT_EQ((*m)->fingerprint().size(), 32u);

  absl::StatusOr<MoeLayerView> view = (*m)->LayerView(2);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->num_experts(), 8);
  EXPECT_FLOAT_EQ(view->swiglu_limit, 3.0f);
  EXPECT_FALSE((*m)->LayerView(0).ok());

  // Route and run layer 2 through the reference and the CPU backend.
  const int T = 4;
  const auto x = testing::RandomVector(static_cast<size_t>(T) * 256, 3);
  std::vector<int32_t> ids(T * 2);
  std::vector<float> w(T * 2);
  ASSERT_TRUE(RouteTokens(c, 2, (*m)->RouterWeight(2), (*m)->CorrectionBias(2), x.data(), T,
                          ids.data(), w.data()).ok());
  for (int t = 0; t < T; ++t) EXPECT_NEAR(w[2 * t] + w[2 * t + 1], 2.5, 1e-5);
  std::vector<float> ref(T * 256), out(T * 256);
  const MoeAssignments a = MoeAssignments::Fixed(T, 2, ids.data(), w.data());
  ASSERT_TRUE(MoeForwardReference(*view, x.data(), a, true, ref.data()).ok());
  cpu::CpuBackend cpu(2);
  ASSERT_TRUE(cpu.Moe(*view, x.data(), a, true, out.data()).ok());
  EXPECT_LT(testing::RelErr(out.data(), ref.data(), ref.size()), 1e-5);
  std::filesystem::remove_all(dir);
}

TEST(Exl3ModelTest, OtherFamiliesKeyNaming) {
  ExpertModelSpec spec;
  const nlohmann::json qwen = testing::Qwen3NextConfig(spec);
  const std::string qdir = Write("qwen3next", spec, &qwen);
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(qdir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->config().family, MoeFamily::kQwen3Next);
  EXPECT_TRUE((*m)->Linear(1, -1, Projection::kGate) != nullptr);
  EXPECT_EQ((*m)->Linear(1, -1, Projection::kGate)->prefix, "model.layers.1.mlp.shared_expert.gate_proj");
  ASSERT_NE((*m)->SharedExpertGate(2), nullptr);
  EXPECT_EQ((*m)->CorrectionBias(2), nullptr);
  absl::StatusOr<MoeLayerView> view = (*m)->LayerView(2);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->shared_gate, (*m)->SharedExpertGate(2));
  // The gate is part of the shared expert: loaded even without routers.
  Exl3ModelOptions no_routers;
  no_routers.load_routers = false;
  m = Exl3Model::Open(qdir, no_routers);
  ASSERT_TRUE(m.ok());
  EXPECT_NE((*m)->SharedExpertGate(2), nullptr);
  EXPECT_EQ((*m)->RouterWeight(2), nullptr);
  std::filesystem::remove_all(qdir);

  const nlohmann::json mix = testing::MixtralConfig(spec);
  const std::string mdir = Write("mixtral", spec, &mix);
  m = Exl3Model::Open(mdir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->config().MoeLayers(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ((*m)->Linear(0, 5, Projection::kUp)->prefix, "model.layers.0.block_sparse_moe.experts.5.w3");
  EXPECT_EQ((*m)->SharedExpert(0), nullptr);
  const auto x = testing::RandomVector(2 * 256, 4);
  std::vector<int32_t> ids(4);
  std::vector<float> w(4);
  ASSERT_TRUE(RouteTokens((*m)->config(), 0, (*m)->RouterWeight(0), nullptr, x.data(), 2, ids.data(),
                          w.data()).ok());
  EXPECT_NEAR(w[0] + w[1], 1.0, 1e-6);  // Mixtral renormalises
  std::filesystem::remove_all(mdir);
}

TEST(Exl3ModelTest, HoldsOnlyItsShare) {
  const std::string dir = Write("share", ExpertModelSpec{});
  Exl3ModelOptions opt;
  opt.experts = std::map<int, std::vector<int>>{{1, {0, 3, 7}}};
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir, opt);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->HeldExperts(1), (std::vector<int>{0, 3, 7}));
  EXPECT_TRUE((*m)->HeldExperts(2).empty());
  EXPECT_TRUE((*m)->HoldsExpert(1, 3));
  EXPECT_FALSE((*m)->HoldsExpert(1, 4));
  absl::StatusOr<MoeLayerView> view = (*m)->LayerView(1);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->experts[4], nullptr);
  EXPECT_NE(view->experts[7], nullptr);
  // A worker's share: only its experts' pairs.
  const auto x = testing::RandomVector(256, 8);
  const int32_t ids[2] = {3, 7};
  const float w[2] = {0.6f, 0.4f};
  std::vector<float> y(256);
  EXPECT_TRUE(MoeForwardReference(*view, x.data(), MoeAssignments::Fixed(1, 2, ids, w), false, y.data()).ok());
  const int32_t not_held[1] = {4};
  EXPECT_EQ(MoeForwardReference(*view, x.data(), MoeAssignments::Fixed(1, 1, not_held, w), false, y.data()).code(),
            absl::StatusCode::kNotFound);

  opt.experts = std::map<int, std::vector<int>>{{0, {1}}};
  EXPECT_FALSE(Exl3Model::Open(dir, opt).ok());  // layer 0 is dense
  opt.experts = std::map<int, std::vector<int>>{{1, {8}}};
  absl::StatusOr<std::unique_ptr<Exl3Model>> bad = Exl3Model::Open(dir, opt);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("expert 8"), std::string::npos) << bad.status();
  std::filesystem::remove_all(dir);
}

TEST(Exl3ModelTest, FingerprintTracksConfigAndShapes) {
  ExpertModelSpec spec;
  const std::string a = Write("fp_a", spec);
  const std::string b = Write("fp_b", spec);
  spec.scale = 1.0f;
  const std::string c = Write("fp_c", spec);
  auto fp = [](const std::string& d) { return (*Exl3Model::Open(d))->fingerprint(); };
  EXPECT_EQ(fp(a), fp(b));  // same config and shapes (random contents differ)
  EXPECT_NE(fp(a), fp(c));
  for (const auto& d : {a, b, c}) std::filesystem::remove_all(d);
}

// A process that read config.json already hands the ConfigFile to Open: the file is not read
// again, and the fingerprint is over the bytes handed (those of the file: the same fingerprint).
TEST(Exl3ModelTest, OpensFromTheConfigFileItIsHanded) {
  ExpertModelSpec spec;
  const std::string dir = Write("handed", spec);
  absl::StatusOr<ConfigFile> file = ConfigFile::Read(dir);
  ASSERT_TRUE(file.ok()) << file.status();
  std::ifstream in(dir + "/config.json", std::ios::binary);
  const std::string on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(file->bytes(), on_disk);

  absl::StatusOr<std::unique_ptr<Exl3Model>> read = Exl3Model::Open(dir);
  absl::StatusOr<std::unique_ptr<Exl3Model>> handed = Exl3Model::Open(dir, *file);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(handed.ok()) << handed.status();
  EXPECT_EQ((*handed)->fingerprint(), (*read)->fingerprint());
  EXPECT_EQ((*handed)->config().num_experts, (*read)->config().num_experts);
  EXPECT_EQ((*handed)->config().MoeLayers(), (*read)->config().MoeLayers());
  EXPECT_EQ((*handed)->HeldExperts(1), (*read)->HeldExperts(1));

  // The same object in other bytes (indented): Open reads the text it is handed, not the file.
  const nlohmann::json parsed = nlohmann::json::parse(on_disk);
  absl::StatusOr<ConfigFile> reformatted = ConfigFile::Parse(parsed.dump(2), file->source());
  ASSERT_TRUE(reformatted.ok()) << reformatted.status();
  absl::StatusOr<std::unique_ptr<Exl3Model>> other = Exl3Model::Open(dir, *reformatted);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE((*other)->fingerprint(), (*read)->fingerprint());

  // A missing directory is named as before, whichever Open.
  absl::StatusOr<std::unique_ptr<Exl3Model>> missing = Exl3Model::Open(dir + "_missing", *file);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("does not exist"), std::string::npos) << missing.status();
  std::filesystem::remove_all(dir);
}

TEST(Exl3ModelTest, FingerprintCoversRecordedWeightDigests) {
  ExpertModelSpec spec;
  spec.weight_digests = true;
  const std::string a = Write("wd_a", spec);
  const std::string a2 = Write("wd_a2", spec);
  spec.seed = 2;  // same config and shapes, other weights
  const std::string b = Write("wd_b", spec);
  auto open = [](const std::string& d, Exl3ModelOptions o = {}) { return Exl3Model::Open(d, o); };
  absl::StatusOr<std::unique_ptr<Exl3Model>> ma = open(a), ma2 = open(a2), mb = open(b);
  ASSERT_TRUE(ma.ok() && ma2.ok() && mb.ok());
  EXPECT_TRUE((*ma)->fingerprint_covers_weights());
  EXPECT_EQ((*ma)->fingerprint(), (*ma2)->fingerprint());
  EXPECT_NE((*ma)->fingerprint(), (*mb)->fingerprint());
  // A share (a worker's) and no share (the router's) agree without reading each other's tensors.
  Exl3ModelOptions share;
  share.experts = std::map<int, std::vector<int>>{{1, {0}}};
  share.load_routers = false;
  EXPECT_EQ((*open(a, share))->fingerprint(), (*ma)->fingerprint());
  // Without weights.digest.json: the shape-only fingerprint of before.
  std::filesystem::remove(a2 + "/" + kWeightDigestFile);
  absl::StatusOr<std::unique_ptr<Exl3Model>> legacy = open(a2);
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  EXPECT_FALSE((*legacy)->fingerprint_covers_weights());
  EXPECT_NE((*legacy)->fingerprint(), (*ma)->fingerprint());
  // Another directory's digests: refused, the file named.
  std::filesystem::copy_file(b + "/" + kWeightDigestFile, a2 + "/" + kWeightDigestFile);
  {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(a2 + "/" + kWeightDigestFile));
    j["tensors"].erase(j["tensors"].begin());
    std::ofstream(a2 + "/" + kWeightDigestFile) << j.dump();
  }
  absl::StatusOr<std::unique_ptr<Exl3Model>> other = open(a2);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find(kWeightDigestFile), std::string::npos) << other.status();
  for (const auto& d : {a, a2, b}) std::filesystem::remove_all(d);
}

TEST(Exl3ModelTest, ChangedWeightFailsItsDigestCheckWhenRead) {
  ExpertModelSpec spec;
  spec.weight_digests = true;
  const std::string dir = Write("wd_changed", spec);
  // b's digests over a's tensors: every tensor read is refused, naming it and both digests.
  spec.seed = 2;
  const std::string other = Write("wd_other", spec);
  std::filesystem::copy_file(other + "/" + kWeightDigestFile, dir + "/" + kWeightDigestFile,
                             std::filesystem::copy_options::overwrite_existing);
  Exl3ModelOptions share;
  share.experts = std::map<int, std::vector<int>>{{1, {3}}};
  share.load_routers = false;
  share.load_shared_experts = false;
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir, share);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_NE(m.status().message().find("model.layers.1.mlp.experts.3."), std::string::npos)
      << m.status();
  EXPECT_NE(m.status().message().find("content digest"), std::string::npos) << m.status();
  for (const auto& d : {dir, other}) std::filesystem::remove_all(d);
}

TEST(Exl3ModelTest, PackedSignsOpen) {
  ExpertModelSpec spec;
  spec.packed_signs = true;
  const std::string dir = Write("packed", spec);
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  const Exl3Linear* lin = (*m)->Linear(1, 2, Projection::kUp);
  ASSERT_NE(lin, nullptr);
  EXPECT_EQ(lin->owned_suh.size(), 256u);
  EXPECT_EQ(lin->view.suh, lin->owned_suh.data());
  for (uint16_t v : lin->owned_suh) EXPECT_TRUE(v == 0x3c00 || v == 0xbc00);
  std::filesystem::remove_all(dir);
}

TEST(Exl3ModelTest, MissingTensorIsNamed) {
  ExpertModelSpec spec;
  spec.skip = [](const std::string& n) { return n == "model.layers.2.mlp.experts.5.up_proj.svh"; };
  const std::string dir = Write("missing", spec);
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("model.layers.2.mlp.experts.5.up_proj.svh"), std::string::npos)
      << m.status();
  // A share without that expert opens fine.
  Exl3ModelOptions opt;
  opt.experts = std::map<int, std::vector<int>>{{2, {0, 1}}};
  EXPECT_TRUE(Exl3Model::Open(dir, opt).ok());
  std::filesystem::remove_all(dir);

  spec.skip = [](const std::string& n) { return n == "model.layers.1.mlp.gate.e_score_correction_bias"; };
  const std::string dir2 = Write("missing_bias", spec);
  m = Exl3Model::Open(dir2);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("e_score_correction_bias"), std::string::npos) << m.status();
  std::filesystem::remove_all(dir2);
}

TEST(Exl3ModelTest, WrongShapeIsNamed) {
  ExpertModelSpec spec;
  spec.shape_override = [](const std::string& n, std::vector<int64_t>& shape) {
    if (n != "model.layers.1.mlp.experts.2.down_proj.trellis") return false;
    shape[1] = 8;  // out 128 instead of hidden 256
    return true;
  };
  const std::string dir = Write("shape", spec);
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("model.layers.1.mlp.experts.2.down_proj.trellis"), std::string::npos)
      << m.status();
  std::filesystem::remove_all(dir);
}

TEST(Exl3ModelTest, ConfigMismatchAndBadConfig) {
  ExpertModelSpec spec;
  const std::string dir = Write("mismatch", spec);
  // Rewrite config.json claiming a larger intermediate size than the tensors have.
  nlohmann::json cfg = testing::GlmConfig(spec);
  cfg["moe_intermediate_size"] = 256;
  std::ofstream(dir + "/config.json") << cfg.dump();
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("trellis"), std::string::npos) << m.status();
  // More experts than stored.
  cfg = testing::GlmConfig(spec);
  cfg["n_routed_experts"] = 16;
  std::ofstream(dir + "/config.json") << cfg.dump();
  EXPECT_FALSE(Exl3Model::Open(dir).ok());
  // Not EXL3.
  cfg = testing::GlmConfig(spec);
  cfg.erase("quantization_config");
  std::ofstream(dir + "/config.json") << cfg.dump();
  m = Exl3Model::Open(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("exl3"), std::string::npos);
  // Unknown architecture.
  cfg = testing::GlmConfig(spec);
  cfg["architectures"] = {"FooForCausalLM"};
  std::ofstream(dir + "/config.json") << cfg.dump();
  m = Exl3Model::Open(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("FooForCausalLM"), std::string::npos);
  std::filesystem::remove(dir + "/config.json");
  EXPECT_FALSE(Exl3Model::Open(dir).ok());
  EXPECT_FALSE(Exl3Model::Open(dir + "/nope").ok());
  std::filesystem::remove_all(dir);
}

TEST(Exl3ModelTest, WrongCodebookFlagValue) {
  const std::string dir = TempDir("flag");
  std::filesystem::create_directories(dir);
  testing::RandomLinear lin(128, 128, 2, Codebook::kMcg, 1);
  SafetensorsWriter w;
  w.Add("l.trellis", DType::kI16, {8, 8, 32}, lin.trellis.data(), lin.trellis.size() * 2);
  w.Add("l.suh", DType::kF16, {128}, lin.suh.data(), 256);
  w.Add("l.svh", DType::kF16, {128}, lin.svh.data(), 256);
  const uint32_t wrong = 12345;
  w.Add("l.mcg", DType::kI32, {}, &wrong, 4);
  ASSERT_TRUE(w.Write(dir + "/x.safetensors").ok());
  auto src = TensorSource::Open(dir + "/x.safetensors");
  ASSERT_TRUE(src.ok());
  absl::StatusOr<std::unique_ptr<Exl3Linear>> l = LoadExl3Linear(**src, "l");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("l.mcg"), std::string::npos) << l.status();
  EXPECT_FALSE(LoadExl3Linear(**src, "other").ok());
  std::filesystem::remove_all(dir);
}

// ---- Directories as exllamav3's converter writes them (tests/model/exllamav3_dir_writer.h) ----

std::string WriteExllamav3(const std::string& name, const testing::Exllamav3DirSpec& spec) {
  const std::string dir = TempDir("exllamav3_" + name);
  testing::Exllamav3DirWriter w(spec);
  absl::Status s = w.Write(dir);
  EXPECT_TRUE(s.ok()) << s;
  return dir;
}

TEST(Exl3ModelTest, OpensExllamav3Directories) {
  using testing::Exllamav3Family;
  struct Case {
    const char* name;
    Exllamav3Family family;
    const char* codebook;
    int shards;
    Codebook want;
  };
  const Case cases[] = {
      {"qwen_mul1", Exllamav3Family::kQwen3Moe, "mul1", 1, Codebook::kMul1},
      {"qwen_mcg_sharded", Exllamav3Family::kQwen3Moe, "mcg", 3, Codebook::kMcg},
      {"qwen_3inst", Exllamav3Family::kQwen3Moe, "3inst", 1, Codebook::k3Inst},
      {"glm_mtp", Exllamav3Family::kGlm4Moe, "mul1", 2, Codebook::kMul1},
      {"dsv4_release", Exllamav3Family::kDeepseekV4, "mul1", 2, Codebook::kMul1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    testing::Exllamav3DirSpec spec;
    spec.family = c.family;
    spec.codebook = c.codebook;
    spec.shards = c.shards;
    const std::string dir = WriteExllamav3(c.name, spec);
    absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir);
    ASSERT_TRUE(m.ok()) << m.status();
    const MoeConfig& cfg = (*m)->config();
    EXPECT_EQ(cfg.quant_method, "exl3");
    EXPECT_EQ(cfg.quant_version, "1.6.5");
    EXPECT_EQ(cfg.quant_codebook, c.codebook);
    EXPECT_DOUBLE_EQ(cfg.bits, 4.02);
    ASSERT_TRUE((*m)->storage().has_value());
    EXPECT_EQ((*m)->storage()->version, "1.6.5");
    // Every layer is MoE; GLM's MTP block (layer num_hidden_layers) is not a decoder layer.
    EXPECT_EQ(cfg.MoeLayers(), (std::vector<int>{0, 1}));
    for (int l : {0, 1}) {
      EXPECT_EQ((*m)->HeldExperts(l).size(), 4u);
      ASSERT_NE((*m)->Expert(l, 3), nullptr);
      EXPECT_EQ((*m)->Expert(l, 3)->down.bits, 4);
      EXPECT_EQ((*m)->Expert(l, 3)->gate.codebook, c.want);
      ASSERT_NE((*m)->RouterWeight(l), nullptr);
    }
    EXPECT_TRUE((*m)->HeldExperts(2).empty());
    if (c.family == Exllamav3Family::kDeepseekV4) {
      // Release names, read under the project's.
      EXPECT_EQ((*m)->tensors().naming(), CheckpointNaming::kDeepseekRelease);
      EXPECT_EQ((*m)->Linear(1, 2, Projection::kDown)->prefix, "model.layers.1.ffn.experts.2.w2");
      EXPECT_EQ((*m)->tensors().StoredName("model.layers.1.ffn.experts.2.w2.trellis"),
                "layers.1.ffn.experts.2.w2.trellis");
      int64_t vocab = 0;
      EXPECT_NE((*m)->HashTable(0, &vocab), nullptr);
      EXPECT_EQ(vocab, 128);
      EXPECT_EQ((*m)->CorrectionBias(0), nullptr);
      EXPECT_NE((*m)->CorrectionBias(1), nullptr);
      EXPECT_NE((*m)->SharedExpert(1), nullptr);
      EXPECT_TRUE((*m)->tensors().Has("model.embed_tokens.weight"));
      EXPECT_TRUE((*m)->tensors().Has("model.hc_head.hc_fn"));
      EXPECT_TRUE((*m)->tensors().Has("head.trellis"));
    }
    if (c.family == Exllamav3Family::kGlm4Moe) {
      EXPECT_NE((*m)->CorrectionBias(1), nullptr);
      EXPECT_NE((*m)->SharedExpert(1), nullptr);
      EXPECT_TRUE((*m)->tensors().Has("model.layers.2.eh_proj.trellis"));  // kept, not read
    }
    // The layer runs: reference and CPU backend agree.
    const int H = spec.hidden, T = 3;
    absl::StatusOr<MoeLayerView> view = (*m)->LayerView(1);
    ASSERT_TRUE(view.ok()) << view.status();
    const auto x = testing::RandomVector(static_cast<size_t>(T) * H, 5);
    std::vector<int32_t> ids(T * 2);
    std::vector<float> w(T * 2);
    ASSERT_TRUE(RouteTokens(cfg, 1, (*m)->RouterWeight(1), (*m)->CorrectionBias(1), x.data(), T,
                            ids.data(), w.data()).ok());
    std::vector<float> ref(T * H), out(T * H);
    const MoeAssignments a = MoeAssignments::Fixed(T, 2, ids.data(), w.data());
    ASSERT_TRUE(MoeForwardReference(*view, x.data(), a, true, ref.data()).ok());
    cpu::CpuBackend cpu(2);
    ASSERT_TRUE(cpu.Moe(*view, x.data(), a, true, out.data()).ok());
    EXPECT_LT(testing::RelErr(out.data(), ref.data(), ref.size()), 1e-5);
    std::filesystem::remove_all(dir);
  }
}

// A half-integer rate is refused where it is read, by name; a share without that expert opens.
TEST(Exl3ModelTest, Exllamav3HalfIntegerRateIsRefusedByName) {
  testing::Exllamav3DirSpec spec;
  spec.half_integer_expert = true;
  const std::string dir = WriteExllamav3("half", spec);
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("tensor 'model.layers.0.mlp.experts.1.gate_proj.trellis' has "
                                      "shape [16, 8, 40]: a half-integer bit rate (K = 2.5"),
            std::string::npos) << m.status();
  Exl3ModelOptions share;
  share.experts = std::map<int, std::vector<int>>{{0, {0, 2}}, {1, {1}}};
  m = Exl3Model::Open(dir, share);
  ASSERT_TRUE(m.ok()) << m.status();
  std::filesystem::remove_all(dir);
}

// The MoE side does not read the embedding; whoever asks for it learns how it is stored.
TEST(Exl3ModelTest, Exllamav3QuantizedEmbeddingIsNamedWhenRead) {
  testing::Exllamav3DirSpec spec;
  spec.quantized_embedding = true;
  const std::string dir = WriteExllamav3("qembed", spec);
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<TensorView> e = (*m)->tensors().Get("model.embed_tokens.weight");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("'model.embed_tokens' is stored as an exllamav3 quantized "
                                      "embedding table"),
            std::string::npos) << e.status();
  std::filesystem::remove_all(dir);
}

TEST(Exl3ModelTest, Exllamav3RecordThatDoesNotMatchTheFilesIsRefused) {
  testing::Exllamav3DirSpec spec;
  spec.edit_storage = [](nlohmann::json& j) {
    j["tensor_storage"]["lm_head"]["bits_per_weight"] = 5;
  };
  const std::string dir = WriteExllamav3("badrecord", spec);
  absl::StatusOr<std::unique_ptr<Exl3Model>> m = Exl3Model::Open(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(m.status().message().find("quantization_config.json: module 'lm_head': bits_per_weight "
                                      "5, but its trellis holds 6"),
            std::string::npos) << m.status();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace exl3
