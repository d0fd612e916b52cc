// Exl3Storage: quantization_config.json as exllamav3 writes it, parsed and checked against the
// model's tensors (directories from tests/model/exllamav3_dir_writer.h).
#include "model/exl3_storage.h"

#include <filesystem>
#include <string>
#include <unistd.h>

#include "gtest/gtest.h"
#include "kernels/codebook.h"
#include "tests/model/exllamav3_dir_writer.h"

namespace exl3 {
namespace {

using testing::Exllamav3DirSpec;
using testing::Exllamav3DirWriter;
using testing::Exllamav3Family;

std::string WriteDir(const std::string& name, const Exllamav3DirSpec& spec) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("exl3_storage_test_" + std::to_string(::getpid()) + "_" + name)).string();
  std::filesystem::remove_all(dir);
  Exllamav3DirWriter w(spec);
  absl::Status s = w.Write(dir);
  EXPECT_TRUE(s.ok()) << s;
  return dir;
}

// Reads and checks the record of `dir`; the check's status.
absl::Status ReadAndCheck(const std::string& dir) {
  absl::StatusOr<std::optional<Exl3Storage>> st = ReadExl3Storage(dir);
  if (!st.ok()) return st.status();
  if (!st->has_value()) return absl::NotFoundError("no record");
  absl::StatusOr<std::unique_ptr<TensorSource>> src = TensorSource::Open(dir);
  if (!src.ok()) return src.status();
  return CheckExl3Storage(**st, **src);
}

TEST(Exl3Storage, ReadsTheRecordAndItMatchesTheFiles) {
  Exllamav3DirSpec spec;
  spec.codebook = "mcg";
  const std::string dir = WriteDir("qwen", spec);
  absl::StatusOr<std::optional<Exl3Storage>> st = ReadExl3Storage(dir);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_TRUE(st->has_value());
  const Exl3Storage& s = **st;
  EXPECT_EQ(s.quant_method, "exl3");
  EXPECT_EQ(s.version, "1.6.5");
  EXPECT_DOUBLE_EQ(s.bits, 4.02);
  EXPECT_DOUBLE_EQ(s.head_bits, 6);
  EXPECT_EQ(s.codebook, "mcg");
  const ModuleRecord& gate = s.modules.at("model.layers.1.mlp.experts.3.gate_proj");
  EXPECT_EQ(gate.storage, ModuleStorage::kExl3);
  EXPECT_EQ(gate.bits_per_weight, 4);
  EXPECT_EQ(gate.mcg_multiplier, kMcgMultiplier);
  EXPECT_EQ(gate.mul1_multiplier, 0u);
  EXPECT_FALSE(gate.half_integer_rate());
  const StoredTensorRecord& trellis = gate.tensors.at("model.layers.1.mlp.experts.3.gate_proj.trellis");
  EXPECT_EQ(trellis.shape, (std::vector<int64_t>{16, 8, 64}));
  EXPECT_EQ(trellis.dtype, DType::kI16);
  EXPECT_EQ(s.modules.at("lm_head").bits_per_weight, 6);
  const ModuleRecord& router = s.modules.at("model.layers.0.mlp.gate");
  EXPECT_EQ(router.storage, ModuleStorage::kUnquantized);
  EXPECT_EQ(router.tensors.at("model.layers.0.mlp.gate.weight").dtype, DType::kF16);
  EXPECT_FALSE(s.modules.at("model.embed_tokens").quantized_embedding());
  EXPECT_TRUE(ReadAndCheck(dir).ok()) << ReadAndCheck(dir);
  std::filesystem::remove_all(dir);
}

TEST(Exl3Storage, NoRecordIsNotAnError) {
  Exllamav3DirSpec spec;
  spec.write_storage = false;
  const std::string dir = WriteDir("none", spec);
  absl::StatusOr<std::optional<Exl3Storage>> st = ReadExl3Storage(dir);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_FALSE(st->has_value());
  std::filesystem::remove_all(dir);
}

TEST(Exl3Storage, ShardedDeepseekReleaseNamesAndHalfRatesAreRecorded) {
  Exllamav3DirSpec spec;
  spec.family = Exllamav3Family::kDeepseekV4;
  spec.hidden = 128;
  spec.shards = 3;
  spec.half_integer_expert = true;
  spec.quantized_embedding = true;
  const std::string dir = WriteDir("v4", spec);
  absl::StatusOr<std::optional<Exl3Storage>> st = ReadExl3Storage(dir);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_TRUE(st->has_value());
  // The record keeps the stored (release) names; the check maps them to the source's.
  const ModuleRecord& half = (*st)->modules.at("layers.0.ffn.experts.1.w1");
  EXPECT_TRUE(half.half_integer_rate());
  EXPECT_DOUBLE_EQ(half.bits_per_weight, 2.5);
  EXPECT_EQ(half.mul1_multiplier, kMul1Multiplier);
  EXPECT_TRUE((*st)->modules.at("embed").quantized_embedding());
  EXPECT_TRUE(ReadAndCheck(dir).ok()) << ReadAndCheck(dir);
  std::filesystem::remove_all(dir);
}

// A record that does not match the files (a shard from another conversion, an edited file) is
// an error naming the module and the tensor.
TEST(Exl3Storage, MismatchesAreNamed) {
  struct Case {
    const char* name;
    std::function<void(nlohmann::json&)> edit;
    const char* expect;
  };
  const std::string gate = "model.layers.0.mlp.experts.0.gate_proj";
  const Case cases[] = {
      {"shape", [&](nlohmann::json& j) {
         j["tensor_storage"][gate]["stored_tensors"][gate + ".trellis"]["shape"] = {16, 8, 48};
       }, "tensor 'model.layers.0.mlp.experts.0.gate_proj.trellis' is I16 [16, 8, 64]"},
      {"bits", [&](nlohmann::json& j) { j["tensor_storage"][gate]["bits_per_weight"] = 3; },
       "bits_per_weight 3, but its trellis holds 4 bits per weight"},
      {"missing", [&](nlohmann::json& j) {
         j["tensor_storage"][gate]["stored_tensors"][gate + ".bias"] = {
             {"shape", {128}}, {"n_bytes", 256}, {"dtype", "torch.float16"}};
       }, "tensor 'model.layers.0.mlp.experts.0.gate_proj.bias' is not in the model"},
      {"multiplier", [&](nlohmann::json& j) { j["tensor_storage"][gate]["mul1_multiplier"] = 5; },
       "mul1_multiplier 5 is not MUL1's"},
      {"codebook", [&](nlohmann::json& j) { j["tensor_storage"][gate].erase("mul1_multiplier"); },
       "codebook flag tensors and its recorded multipliers disagree"},
  };
  for (const Case& c : cases) {
    Exllamav3DirSpec spec;
    spec.edit_storage = c.edit;
    const std::string dir = WriteDir(c.name, spec);
    absl::Status s = ReadAndCheck(dir);
    EXPECT_FALSE(s.ok()) << c.name;
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << c.name << ": " << s;
    EXPECT_NE(s.message().find("quantization_config.json: module '" + gate + "'"), std::string::npos)
        << c.name << ": " << s;
    std::filesystem::remove_all(dir);
  }
}

TEST(Exl3Storage, RefusesWhatItDoesNotKnowByName) {
  const char* base = R"({"quant_method": "exl3", "tensor_storage": {"m": {"stored_tensors": {}%s}}})";
  auto parse = [&](const std::string& extra) {
    char buf[512];
    std::snprintf(buf, sizeof(buf), base, extra.c_str());
    return ParseExl3Storage(buf, "q.json").status();
  };
  EXPECT_TRUE(parse("").ok());
  absl::Status s = parse(R"(, "quant_format": "gptq", "bits_per_weight": 4)");
  EXPECT_NE(s.message().find("q.json: tensor_storage['m']: quant_format \"gptq\" is not supported"),
            std::string::npos) << s;
  s = parse(R"(, "quant_format": "exl3")");
  EXPECT_NE(s.message().find("without a numeric bits_per_weight"), std::string::npos) << s;
  s = ParseExl3Storage(R"({"quant_method": "gptq", "tensor_storage": {}})", "q.json").status();
  EXPECT_NE(s.message().find("quant_method is 'gptq'"), std::string::npos) << s;
  s = ParseExl3Storage(R"({"quant_method": "exl3"})", "q.json").status();
  EXPECT_NE(s.message().find("no tensor_storage"), std::string::npos) << s;
  s = ParseExl3Storage(R"({"quant_method": "exl3", "tensor_storage": {"m": {"stored_tensors":
      {"m.x": {"shape": [2], "n_bytes": 2, "dtype": "torch.complex64"}}}}})", "q.json").status();
  EXPECT_NE(s.message().find("dtype 'torch.complex64' is not one this project reads"),
            std::string::npos) << s;
  EXPECT_FALSE(ParseExl3Storage("[1, 2]", "q.json").ok());
}

}  // namespace
}  // namespace exl3
