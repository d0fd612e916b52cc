#include "tools/test_model/expert_test_model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/config/read_moe_config.h"
#include "model/moe_config.h"
#include "model/write_weight_digests.h"
#include "tools/test_model/generated_tensor.h"
#include "tools/test_model/shard_writer.h"

namespace exl3::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kShards = 2;

// The model's tensors in the order their values are drawn, and each one's shard (layer L % 2).
struct ExpertModelPlan {
  std::vector<GenTensor> order;
  std::vector<int> shard_of;
};

void AddLayer(const ExpertModelSpec& s, const MoeConfig& c, int L, ExpertModelPlan* plan) {
  std::vector<GenTensor> t;
  auto linear = [&](const std::string& prefix, int in_f, int out_f, int K, Codebook cb) {
    // |suh| = 1 / sqrt(in_f), |svh| = 1; or packed sign bits.
    const Exl3SignForm signs =
        s.packed_signs ? Exl3SignForm{SignVectors::kPackedBits}
                       : Exl3SignForm{SignVectors::kHalf, 1.0f / std::sqrt(static_cast<float>(in_f)), 1.0f};
    AddExl3Linear(prefix, out_f, in_f, K, cb, signs, &t, s.shape_override);
  };
  for (int e = 0; e < c.num_experts; ++e) {
    if (std::find(s.skip_experts.begin(), s.skip_experts.end(), e) != s.skip_experts.end()) continue;
    linear(RoutedExpertPrefix(c, L, e, Projection::kGate), s.hidden, s.intermediate, 2 + e % 3, Codebook::kMcg);
    linear(RoutedExpertPrefix(c, L, e, Projection::kUp), s.hidden, s.intermediate, 3, Codebook::k3Inst);
    linear(RoutedExpertPrefix(c, L, e, Projection::kDown), s.intermediate, s.hidden, 2, Codebook::kMul1);
  }
  if (c.has_shared_expert()) {
    const int si = c.shared_intermediate_size;
    linear(SharedExpertPrefix(c, L, Projection::kGate), s.hidden, si, 4, Codebook::kMcg);
    linear(SharedExpertPrefix(c, L, Projection::kUp), s.hidden, si, 4, Codebook::kMcg);
    linear(SharedExpertPrefix(c, L, Projection::kDown), si, s.hidden, 4, Codebook::kMcg);
  }
  // Router weight bf16 [E, hidden], small so that logits are O(1).
  const float router_std = 1.0f / std::sqrt(static_cast<float>(s.hidden));
  t.push_back({RouterWeightKey(c, L), DType::kBF16, {c.num_experts, s.hidden}, GenTensor::kGaussian, router_std});
  if (!SharedExpertGateKey(c, L).empty()) {
    t.push_back({SharedExpertGateKey(c, L), DType::kBF16, {1, s.hidden}, GenTensor::kGaussian, router_std});
  }
  if (!CorrectionBiasKey(c, L).empty()) {
    t.push_back({CorrectionBiasKey(c, L), DType::kF32, {c.num_experts}, GenTensor::kGaussian, 0.05f});
  }
  for (GenTensor& g : t) {
    plan->order.push_back(std::move(g));
    plan->shard_of.push_back(L % kShards);
  }
}

}  // namespace

json Qwen3NextConfig(const ExpertModelSpec& s) {
  json j;
  j["architectures"] = {"Qwen3NextForCausalLM"};
  j["hidden_size"] = s.hidden;
  j["num_hidden_layers"] = s.layers;
  j["num_experts"] = s.experts;
  j["num_experts_per_tok"] = s.top_k;
  j["moe_intermediate_size"] = s.intermediate;
  j["shared_expert_intermediate_size"] = s.intermediate;
  j["norm_topk_prob"] = true;
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = {0};
  j["quantization_config"] = {{"quant_method", "exl3"}, {"bits", 3.0}};
  return j;
}

json MixtralConfig(const ExpertModelSpec& s) {
  json j;
  j["architectures"] = {"MixtralForCausalLM"};
  j["hidden_size"] = s.hidden;
  j["num_hidden_layers"] = s.layers;
  j["num_local_experts"] = s.experts;
  j["num_experts_per_tok"] = s.top_k;
  j["intermediate_size"] = s.intermediate;
  j["quantization_config"] = {{"quant_method", "exl3"}, {"bits", 4.0}};
  return j;
}

json GlmConfig(const ExpertModelSpec& s) {
  json j;
  j["architectures"] = {"Glm4MoeForCausalLM"};
  j["hidden_size"] = s.hidden;
  j["num_hidden_layers"] = s.layers;
  j["first_k_dense_replace"] = s.first_dense;
  j["n_routed_experts"] = s.experts;
  j["num_experts_per_tok"] = s.top_k;
  j["moe_intermediate_size"] = s.intermediate;
  j["n_shared_experts"] = s.shared;
  j["norm_topk_prob"] = true;
  j["routed_scaling_factor"] = s.scale;
  j["n_group"] = 1;
  j["topk_group"] = 1;
  if (s.swiglu_limit > 0) j["swiglu_limit"] = s.swiglu_limit;
  j["quantization_config"] = {{"quant_method", "exl3"}, {"version", "0.0.6"}, {"bits", 2.5},
                              {"head_bits", 6}};
  return j;
}

ExpertModelSpec ServiceModelSpec() {
  ExpertModelSpec s;
  s.top_k = 4;
  s.shared = 0;
  s.scale = 1.0f;
  s.seed = 1234;
  return s;
}

absl::Status WriteExpertModel(const std::string& dir_str, const ExpertModelSpec& spec, const json* config) {
  if (spec.hidden <= 0 || spec.hidden % 16 != 0 || spec.intermediate <= 0 || spec.intermediate % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("expert model: hidden ", spec.hidden, " and intermediate ",
                                                   spec.intermediate, " must be positive multiples of 16"));
  }
  const fs::path dir(dir_str);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir_str, ": ", ec.message()));
  const json cfg = config ? *config : GlmConfig(spec);
  EXL3_RETURN_IF_ERROR(WriteJson(dir / "config.json", cfg));
  EXL3_ASSIGN_OR_RETURN(const MoeConfig c, ParseMoeConfig(cfg.dump(), "config.json"));

  ExpertModelPlan plan;
  for (int L : c.MoeLayers()) AddLayer(spec, c, L, &plan);
  InOrderTensorValues values(spec.seed, plan.order);  // every planned tensor draws, skipped or not
  std::vector<std::vector<GenTensor>> shards(kShards);
  for (size_t i = 0; i < plan.order.size(); ++i) {
    if (spec.skip && spec.skip(plan.order[i].name)) continue;
    shards[plan.shard_of[i]].push_back(plan.order[i]);
  }
  json weight_map = json::object();
  for (int i = 0; i < kShards; ++i) {
    EXL3_RETURN_IF_ERROR(WriteShard(dir / ShardName(i, kShards), shards[i], values, /*bar=*/nullptr, &weight_map));
  }
  EXL3_RETURN_IF_ERROR(WriteIndex(dir, weight_map));
  if (spec.weight_digests) return WriteWeightDigests(dir_str);
  return absl::OkStatus();
}

}  // namespace exl3::testing
