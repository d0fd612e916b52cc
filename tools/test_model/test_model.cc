#include "tools/test_model/test_model.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/encoder/progress.h"
#include "tools/test_model/family_config.h"
#include "tools/test_model/generated_tensor.h"
#include "tools/test_model/model_layout.h"
#include "tools/test_model/resolve_test_model_spec.h"
#include "tools/test_model/shard_writer.h"

namespace exl3 {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

absl::Status WriteSideFiles(const TestModelSpec& s, const fs::path& dir) {
  for (const auto& [name, content] : TestModelSideFiles(s)) EXL3_RETURN_IF_ERROR(WriteJson(dir / name, content));
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteHfTestModel(const TestModelSpec& spec, const std::string& dir_str,
                              bool progress) {
  absl::StatusOr<TestModelSpec> rs = ResolveTestModelSpec(spec);
  if (!rs.ok()) return rs.status();
  const TestModelSpec& s = *rs;
  absl::StatusOr<MoeConfig> cfg = ParsedConfig(s);
  if (!cfg.ok()) return cfg.status();
  const fs::path dir(dir_str);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir_str, ": ", ec.message()));

  const std::vector<std::vector<GenTensor>> shards =
      WholeModelShards(s, *cfg, /*exl3=*/false, /*so=*/nullptr);
  const uint64_t total = ShardsBytes(shards);
  ProgressBar bar("exl3-tool make-test-model (hf)", total, progress);
  json weight_map = json::object();
  const int num_shards = static_cast<int>(shards.size());  // a layer each (and the MTP layer)
  SeededTensorValues values(s.seed, DefaultThreads());
  for (int i = 0; i < num_shards; ++i) {
    absl::Status st = WriteShard(dir / ShardName(i, num_shards), shards[i], values, &bar, &weight_map);
    if (!st.ok()) return st;
  }
  bar.Finish();
  absl::Status st = WriteIndex(dir, weight_map);
  if (!st.ok()) return st;
  json gen = {{"_from_model_config", true}, {"bos_token_id", 0}, {"eos_token_id", 1}};
  st = WriteJson(dir / "generation_config.json", gen);
  if (!st.ok()) return st;
  st = WriteSideFiles(s, dir);
  if (!st.ok()) return st;
  return WriteJson(dir / "config.json", TestModelConfig(s));
}

uint64_t SyntheticModelBytes(const TestModelSpec& spec, const SyntheticOptions& opts) {
  absl::StatusOr<TestModelSpec> rs = ResolveTestModelSpec(spec);
  if (!rs.ok()) return 0;
  absl::StatusOr<MoeConfig> cfg = ParsedConfig(*rs);
  if (!cfg.ok()) return 0;
  return ShardsBytes(SyntheticShards(*rs, *cfg, opts));
}

absl::Status WriteSyntheticExl3Model(const TestModelSpec& spec, const SyntheticOptions& opts,
                                     const std::string& dir_str) {
  absl::StatusOr<TestModelSpec> rs = ResolveTestModelSpec(spec);
  if (!rs.ok()) return rs.status();
  const TestModelSpec& s = *rs;
  for (int k : {opts.bits, opts.down_bits, opts.attention_bits, opts.head_bits}) {
    if (k != 0 && (k < 1 || k > 8)) return absl::InvalidArgumentError("bit widths must be in 1..8");
  }
  for (int k : opts.expert_bits_cycle) {
    if (k < 1 || k > 8) return absl::InvalidArgumentError("per-expert bit widths must be in 1..8");
  }
  if (opts.bits < 1) return absl::InvalidArgumentError("--bits must be in 1..8");
  absl::StatusOr<MoeConfig> cfg = ParsedConfig(s);
  if (!cfg.ok()) return cfg.status();
  const fs::path dir(dir_str);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir_str, ": ", ec.message()));

  const std::vector<std::vector<GenTensor>> shards = SyntheticShards(s, *cfg, opts);
  ProgressBar bar("exl3-tool make-test-model (synthetic)", ShardsBytes(shards), opts.progress);
  json weight_map = json::object();
  SeededTensorValues values(s.seed, opts.threads > 0 ? opts.threads : DefaultThreads());
  for (size_t i = 0; i < shards.size(); ++i) {
    bar.SetDetail(absl::StrCat("shard ", i + 1, " of ", shards.size()));
    absl::Status st = WriteShard(dir / ShardName(static_cast<int>(i), static_cast<int>(shards.size())),
                                 shards[i], values, &bar, &weight_map, opts.data_start);
    if (!st.ok()) return st;
  }
  bar.Finish();
  absl::Status st = WriteIndex(dir, weight_map);
  if (!st.ok()) return st;
  json c = TestModelConfig(s);
  const int db = opts.down_bits > 0 ? opts.down_bits : opts.bits;
  const double avg = (2.0 * opts.bits + db) / 3.0;
  c["quantization_config"] = {{"quant_method", "exl3"},
                              {"version", "0.0.6"},
                              {"bits", avg},
                              {"codebook", std::string(CodebookName(opts.codebook))},
                              {"expert_bits", opts.bits},
                              {"synthetic", "random trellis bits, not a quantized model"}};
  if (opts.whole_model) {
    json gen = {{"_from_model_config", true}, {"bos_token_id", 0}, {"eos_token_id", 1}};
    absl::Status gs = WriteJson(dir / "generation_config.json", gen);
    if (!gs.ok()) return gs;
  }
  if (opts.down_bits > 0) c["quantization_config"]["down_bits"] = opts.down_bits;
  if (opts.whole_model) {
    c["quantization_config"]["attention_bits"] = BitsOf(opts, LinearRole::kAttentionOrDense);
    c["quantization_config"]["head_bits"] = BitsOf(opts, LinearRole::kHead);
  }
  st = WriteSideFiles(s, dir);
  if (!st.ok()) return st;
  return WriteJson(dir / "config.json", c);
}

}  // namespace exl3
