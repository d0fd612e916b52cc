// The tests' writer of small EXL3 MoE model directories (the model, engine and services tests all
// use it; exl3-tool make-test-model's generator, model/testmodel, makes whole models): random
// trellis bits, random +-1 suh/svh (or packed su/sv), codebook flags, bf16 router weights, fp32
// correction biases, two shards with model.safetensors.index.json. Routed experts mix K and
// codebooks: gate K 2..4 by expert (MCG), up K 3 (3INST), down K 2 (MUL1).
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/codebook.h"
#include "kernels/fp16.h"
#include "model/config/read_moe_config.h"
#include "model/moe_config.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace exl3::testing {

struct TestModelSpec {
  int hidden = 256;
  int intermediate = 128;  // routed (and shared) expert's intermediate size
  int layers = 3;
  int first_dense = 1;
  int experts = 8;
  int top_k = 2;
  int shared = 1;  // n_shared_experts
  float scale = 2.5f;
  float swiglu_limit = 0.0f;
  bool packed_signs = false;  // su/sv instead of suh/svh
  uint32_t seed = 1;
  std::vector<int> skip_experts;  // routed experts whose tensors are left out of every layer
  // Tensor names for which `skip` returns true are left out; `shape_override` may change the
  // trellis shape of one layer (return true after editing `shape`).
  std::function<bool(const std::string&)> skip;
  std::function<bool(const std::string&, std::vector<int64_t>&)> shape_override;
  // Also write weights.digest.json (model/weight_digest.h), as exl3-tool quantize does.
  bool weight_digests = false;
};

// The same layout as other families' config.json (Qwen3-Next: shared expert with gate; Mixtral:
// block_sparse_moe keys, no shared expert).
inline nlohmann::json Qwen3NextConfig(const TestModelSpec& s) {
  nlohmann::json j;
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

inline nlohmann::json MixtralConfig(const TestModelSpec& s) {
  nlohmann::json j;
  j["architectures"] = {"MixtralForCausalLM"};
  j["hidden_size"] = s.hidden;
  j["num_hidden_layers"] = s.layers;
  j["num_local_experts"] = s.experts;
  j["num_experts_per_tok"] = s.top_k;
  j["intermediate_size"] = s.intermediate;
  j["quantization_config"] = {{"quant_method", "exl3"}, {"bits", 4.0}};
  return j;
}

inline nlohmann::json GlmConfig(const TestModelSpec& s) {
  nlohmann::json j;
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

// The services tests' model: GLM-style, layer 0 dense, top-4 of 8 experts, no shared expert,
// unscaled routing.
inline TestModelSpec ServiceModelSpec() {
  TestModelSpec s;
  s.top_k = 4;
  s.shared = 0;
  s.scale = 1.0f;
  s.seed = 1234;
  return s;
}

class TestModelWriter {
 public:
  explicit TestModelWriter(const TestModelSpec& s) : s_(s), rng_(s.seed) {}

  // Writes config.json (from `config`, default GlmConfig) and two shards into `dir`.
  absl::Status Write(const std::string& dir, const nlohmann::json* config = nullptr) {
    std::filesystem::create_directories(dir);
    const nlohmann::json cfg = config ? *config : GlmConfig(s_);
    std::ofstream(dir + "/config.json") << cfg.dump(2);
    absl::StatusOr<MoeConfig> c = ParseMoeConfig(cfg.dump(), "config.json");
    if (!c.ok()) return c.status();
    SafetensorsWriter shard[2];
    nlohmann::json index;
    index["metadata"] = nlohmann::json::object();
    const char* names[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    for (int L : c->MoeLayers()) {
      SafetensorsWriter& w = shard[L % 2];
      auto add_linear = [&](const std::string& prefix, int k, int n, int K, Codebook cb) {
        AddLinear(w, prefix, k, n, K, cb);
      };
      for (int e = 0; e < c->num_experts; ++e) {
        if (std::find(s_.skip_experts.begin(), s_.skip_experts.end(), e) != s_.skip_experts.end()) continue;
        add_linear(RoutedExpertPrefix(*c, L, e, Projection::kGate), s_.hidden, s_.intermediate, 2 + e % 3, Codebook::kMcg);
        add_linear(RoutedExpertPrefix(*c, L, e, Projection::kUp), s_.hidden, s_.intermediate, 3, Codebook::k3Inst);
        add_linear(RoutedExpertPrefix(*c, L, e, Projection::kDown), s_.intermediate, s_.hidden, 2, Codebook::kMul1);
      }
      if (c->has_shared_expert()) {
        const int si = c->shared_intermediate_size;
        add_linear(SharedExpertPrefix(*c, L, Projection::kGate), s_.hidden, si, 4, Codebook::kMcg);
        add_linear(SharedExpertPrefix(*c, L, Projection::kUp), s_.hidden, si, 4, Codebook::kMcg);
        add_linear(SharedExpertPrefix(*c, L, Projection::kDown), si, s_.hidden, 4, Codebook::kMcg);
      }
      // Router weight bf16 [E, hidden], small so that logits are O(1).
      std::normal_distribution<float> nd(0.f, 1.0f / std::sqrt(static_cast<float>(s_.hidden)));
      std::vector<uint16_t> router(static_cast<size_t>(c->num_experts) * s_.hidden);
      for (auto& v : router) v = FloatToBFloat16Bits(nd(rng_));
      Add(w, RouterWeightKey(*c, L), DType::kBF16, {c->num_experts, s_.hidden}, router.data(),
          router.size() * 2);
      if (!SharedExpertGateKey(*c, L).empty()) {
        std::vector<uint16_t> g(s_.hidden);
        for (auto& v : g) v = FloatToBFloat16Bits(nd(rng_));
        Add(w, SharedExpertGateKey(*c, L), DType::kBF16, {1, s_.hidden}, g.data(), g.size() * 2);
      }
      if (!CorrectionBiasKey(*c, L).empty()) {
        std::normal_distribution<float> bd(0.f, 0.05f);
        std::vector<float> bias(c->num_experts);
        for (auto& v : bias) v = bd(rng_);
        Add(w, CorrectionBiasKey(*c, L), DType::kF32, {c->num_experts}, bias.data(), bias.size() * 4);
      }
    }
    for (int i = 0; i < 2; ++i) {
      for (const auto& n : names_[i]) index["weight_map"][n] = names[i];
      absl::Status st = shard[i].Write(dir + "/" + names[i]);
      if (!st.ok()) return st;
    }
    std::ofstream(dir + "/model.safetensors.index.json") << index.dump(1);
    if (s_.weight_digests) return WriteWeightDigests(dir);
    return absl::OkStatus();
  }

 private:
  void Add(SafetensorsWriter& w, const std::string& name, DType dt, std::vector<int64_t> shape,
           const void* data, size_t bytes) {
    if (s_.skip && s_.skip(name)) return;
    w.Add(name, dt, std::move(shape), data, bytes);
    names_[CurrentShard(name)].push_back(name);
  }
  int CurrentShard(const std::string& name) {
    // model.layers.L....: the shard is L % 2.
    const size_t p = name.find("layers.") + 7;
    return std::stoi(name.substr(p)) % 2;
  }

  void AddLinear(SafetensorsWriter& w, const std::string& prefix, int k, int n, int K, Codebook cb) {
    std::vector<int64_t> tshape = {k / 16, n / 16, 16 * K};
    if (s_.shape_override) s_.shape_override(prefix + ".trellis", tshape);
    size_t words = 1;
    for (int64_t d : tshape) words *= static_cast<size_t>(d);
    std::vector<uint16_t> trellis(words);
    for (auto& v : trellis) v = static_cast<uint16_t>(rng_());
    Add(w, prefix + ".trellis", DType::kI16, tshape, trellis.data(), words * 2);
    if (s_.packed_signs) {
      std::vector<uint16_t> su(k / 16), sv(n / 16);
      for (auto& v : su) v = static_cast<uint16_t>(rng_());
      for (auto& v : sv) v = static_cast<uint16_t>(rng_());
      Add(w, prefix + ".su", DType::kI16, {k / 16}, su.data(), su.size() * 2);
      Add(w, prefix + ".sv", DType::kI16, {n / 16}, sv.data(), sv.size() * 2);
    } else {
      const float sk = 1.0f / std::sqrt(static_cast<float>(k));
      std::vector<uint16_t> suh(k), svh(n);
      for (auto& v : suh) v = FloatToHalfBits(rng_() & 1 ? -sk : sk);
      for (auto& v : svh) v = FloatToHalfBits(rng_() & 1 ? -1.0f : 1.0f);
      Add(w, prefix + ".suh", DType::kF16, {k}, suh.data(), suh.size() * 2);
      Add(w, prefix + ".svh", DType::kF16, {n}, svh.data(), svh.size() * 2);
    }
    if (cb == Codebook::kMcg) {
      const uint32_t v = kMcgMultiplier;
      Add(w, prefix + ".mcg", DType::kI32, {}, &v, 4);
    } else if (cb == Codebook::kMul1) {
      const uint32_t v = kMul1Multiplier;
      Add(w, prefix + ".mul1", DType::kI32, {}, &v, 4);
    }
  }

  TestModelSpec s_;
  std::mt19937 rng_;
  std::vector<std::string> names_[2];
};

inline absl::Status WriteTestModel(const std::string& dir, const TestModelSpec& spec) {
  return TestModelWriter(spec).Write(dir);
}

}  // namespace exl3::testing
