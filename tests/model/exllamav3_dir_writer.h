// Test helper: writes a small model directory laid out as exllamav3 1.6.5's converter writes one
// (its conversion/compile.py and quant_config.py, read for this): config.json with the source
// config plus quantization_config {quant_method "exl3", version, bits, head_bits, calibration,
// out_scales, codebook}; model.safetensors, or model-0000N-of-0000M.safetensors with
// model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}) when sharded;
// quantization_config.json (the same settings plus tensor_storage: every leaf module's stored
// tensors, EXL3 modules' bits_per_weight and codebook multiplier); and the source's other files
// copied beside them (tokenizer.json, tokenizer_config.json, generation_config.json).
//
// EXL3 layers: trellis int16 [k/16, n/16, 16K], suh/svh fp16, an int32 scalar mcg/mul1 flag
// (3INST: none), fp16 bias; unquantized tensors fp16 (linears [out, in]), the correction bias
// fp32, DeepSeek-V4's tid2eid int64. Families: Qwen3-MoE (transformers names), GLM-4 MoE with an
// MTP block stored as one more layer, model.layers.{num_hidden_layers}.* (eh_proj, enorm, hnorm,
// its own attention and MoE), as exllamav3 keeps GLM-MoE-DSA's (the loader reads both GLM
// configs alike), and DeepSeek-V4 in the release names exllamav3 reads and writes
// (layers.L.ffn.experts.E.w1, embed.weight, ...).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "kernels/codebook.h"
#include "kernels/fp16.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace exl3::testing {

enum class Exllamav3Family { kQwen3Moe, kGlm4Moe, kDeepseekV4 };

struct Exllamav3DirSpec {
  Exllamav3Family family = Exllamav3Family::kQwen3Moe;
  int hidden = 256;
  int inter = 128;  // expert and dense intermediate size
  int layers = 2;
  int experts = 4;
  int top_k = 2;
  int vocab = 128;
  int bits = 4;                    // every decoder EXL3 layer
  int head_bits = 6;
  std::string codebook = "mul1";   // mul1, mcg, 3inst (the converter's -cb)
  int shards = 1;                  // > 1: that many shards and an index
  // Layer 0's expert 1 gate projection at 2.5 bits (the half-integer mul1 rate: 40 words a tile).
  bool half_integer_expert = false;
  // The token embedding as exllamav3's quantized table (-eb): EMBED.trellis + EMBED.signs.
  bool quantized_embedding = false;
  bool write_storage = true;  // quantization_config.json
  // Applied to quantization_config.json before it is written (tests that damage the record).
  std::function<void(nlohmann::json&)> edit_storage;
  uint32_t seed = 7;
};

class Exllamav3DirWriter {
 public:
  explicit Exllamav3DirWriter(const Exllamav3DirSpec& s) : s_(s), rng_(s.seed) {}

  absl::Status Write(const std::string& dir) {
    namespace fs = std::filesystem;
    fs::create_directories(dir);
    const bool v4 = s_.family == Exllamav3Family::kDeepseekV4;
    const bool glm = s_.family == Exllamav3Family::kGlm4Moe;
    const std::string lp = v4 ? "layers." : "model.layers.";
    const int H = s_.hidden, I = s_.inter;

    // The token embedding.
    const std::string embed = v4 ? "embed" : "model.embed_tokens";
    if (s_.quantized_embedding) {
      // One 256-wide group per row at 4 bits: 1 + 16 * 4 words per group (ngram codec layout).
      const int groups = (H + 255) / 256;
      AddRandomI16(embed, embed + ".trellis", {s_.vocab, groups * (1 + 16 * 4)});
      AddHalf(embed, embed + ".signs", {groups, 256}, 1.0f);
    } else {
      AddHalf(embed, embed + ".weight", {s_.vocab, H}, 1.0f);
    }
    const int mtp_layer = glm ? s_.layers : -1;  // GLM keeps its MTP block as one more layer
    for (int l = 0; l < s_.layers + (glm ? 1 : 0); ++l) {
      const std::string p = absl::StrCat(lp, l, ".");
      AddHalf(p + (v4 ? "attn_norm" : "input_layernorm"),
              p + (v4 ? "attn_norm.weight" : "input_layernorm.weight"), {H}, 1.0f);
      AddHalf(p + (v4 ? "ffn_norm" : "post_attention_layernorm"),
              p + (v4 ? "ffn_norm.weight" : "post_attention_layernorm.weight"), {H}, 1.0f);
      if (v4) {
        AddLinear(p + "attn.wq_a", H, H, s_.bits);
      } else {
        for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
          AddLinear(p + "self_attn." + proj, H, H, s_.bits);
        }
      }
      if (l == mtp_layer) {
        AddLinear(p + "eh_proj", 2 * H, H, s_.bits);  // the MTP block's own layers
        AddHalf(p + "enorm", p + "enorm.weight", {H}, 1.0f);
        AddHalf(p + "hnorm", p + "hnorm.weight", {H}, 1.0f);
      }
      const std::string mlp = p + (v4 ? "ffn." : "mlp.");
      for (int e = 0; e < s_.experts; ++e) {
        const std::string ep = absl::StrCat(mlp, "experts.", e, ".");
        const bool half = s_.half_integer_expert && l == 0 && e == 1;
        AddLinear(ep + (v4 ? "w1" : "gate_proj"), H, I, s_.bits, half);
        AddLinear(ep + (v4 ? "w3" : "up_proj"), H, I, s_.bits);
        AddLinear(ep + (v4 ? "w2" : "down_proj"), I, H, s_.bits);
      }
      if (glm || v4) {
        const std::string sp = mlp + "shared_experts.";
        AddLinear(sp + (v4 ? "w1" : "gate_proj"), H, I, s_.bits);
        AddLinear(sp + (v4 ? "w3" : "up_proj"), H, I, s_.bits);
        AddLinear(sp + (v4 ? "w2" : "down_proj"), I, H, s_.bits);
      }
      // The router: an unquantized linear [experts, hidden]; GLM's correction bias fp32, not
      // listed in tensor_storage (it belongs to the MoE block, not a leaf module).
      AddHalf(mlp + "gate", mlp + "gate.weight", {s_.experts, H}, 1.0f / 16);
      if (glm) AddF32(mlp + "gate.e_score_correction_bias", {s_.experts});
      if (v4 && l == 0) {  // hash-routed: experts by token id
        std::vector<int64_t> t(static_cast<size_t>(s_.vocab) * s_.top_k);
        for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int64_t>(i % s_.experts);
        Add("", mlp + "gate.tid2eid", DType::kI64, {s_.vocab, s_.top_k}, t.data(), t.size() * 8);
      } else if (v4) {
        AddF32(mlp + "gate.bias", {s_.experts});
      }
    }
    AddHalf(v4 ? "norm" : "model.norm", v4 ? "norm.weight" : "model.norm.weight", {H}, 1.0f);
    if (v4) {
      AddF32("hc_head_fn", {4, 4 * H});
      AddF32("hc_head_base", {4});
      AddF32("hc_head_scale", {1});
    }
    AddLinear(v4 ? "head" : "lm_head", H, s_.vocab, s_.head_bits);

    EXL3_RETURN_IF_ERROR(WriteShards(dir));
    WriteConfig(dir);
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
      std::ofstream(fs::path(dir) / f) << "{}";
    }
    if (s_.write_storage) WriteStorage(dir);
    return absl::OkStatus();
  }

  // The quantization settings both config.json and quantization_config.json carry.
  nlohmann::json QuantizationConfig() const {
    return {{"quant_method", "exl3"}, {"version", "1.6.5"}, {"bits", s_.bits + 0.02},
            {"head_bits", s_.head_bits}, {"calibration", {{"rows", 250}, {"cols", 2048}}},
            {"out_scales", "auto"}, {"codebook", s_.codebook}};
  }

 private:
  struct Tensor {
    std::string module;  // the leaf module it belongs to; empty: none (listed nowhere)
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };

  void Add(const std::string& module, const std::string& name, DType dtype,
           std::vector<int64_t> shape, const void* data, size_t n) {
    Tensor t{module, dtype, std::move(shape), {}};
    t.bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + n);
    order_.push_back(name);
    tensors_[name] = std::move(t);
  }
  void AddHalf(const std::string& module, const std::string& name, std::vector<int64_t> shape,
               float scale) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::normal_distribution<float> nd(0.f, scale);
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = FloatToHalfBits(nd(rng_));
    Add(module, name, DType::kF16, std::move(shape), v.data(), n * 2);
  }
  void AddF32(const std::string& name, std::vector<int64_t> shape) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::normal_distribution<float> nd(0.f, 0.05f);
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng_);
    // Module-less, as exllamav3 emits the MoE block's own tensors; the hc_head_* belong to the
    // HyperHead module, which is not a leaf of the record either.
    Add("", name, DType::kF32, std::move(shape), v.data(), n * 4);
  }
  void AddRandomI16(const std::string& module, const std::string& name, std::vector<int64_t> shape) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = static_cast<uint16_t>(rng_());
    Add(module, name, DType::kI16, std::move(shape), v.data(), n * 2);
  }
  void AddLinear(const std::string& prefix, int k, int n, int K, bool half_integer = false) {
    // A half-integer rate K + 0.5 stores 16 * K + 8 words per tile.
    AddRandomI16(prefix, prefix + ".trellis", {k / 16, n / 16, half_integer ? 16 * 2 + 8 : 16 * K});
    const float sk = 1.0f / std::sqrt(static_cast<float>(k));
    std::vector<uint16_t> suh(k), svh(n);
    for (auto& v : suh) v = FloatToHalfBits(rng_() & 1 ? -sk : sk);
    for (auto& v : svh) v = FloatToHalfBits(rng_() & 1 ? -1.0f : 1.0f);
    Add(prefix, prefix + ".suh", DType::kF16, {k}, suh.data(), suh.size() * 2);
    Add(prefix, prefix + ".svh", DType::kF16, {n}, svh.data(), svh.size() * 2);
    const std::string cb = half_integer ? "mul1" : s_.codebook;
    if (cb == "mcg" || cb == "mul1") {
      const uint32_t v = cb == "mcg" ? kMcgMultiplier : kMul1Multiplier;
      Add(prefix, prefix + "." + cb, DType::kI32, {}, &v, 4);
    }
    exl3_modules_[prefix] = half_integer ? 2.5 : K;
  }

  absl::Status WriteShards(const std::string& dir) {
    const int shards = std::max(1, s_.shards);
    const size_t per = (order_.size() + shards - 1) / shards;
    nlohmann::json index;
    uint64_t total = 0;
    for (int i = 0; i < shards; ++i) {
      const std::string file = shards == 1 ? "model.safetensors"
                                           : absl::StrFormat("model-%05d-of-%05d.safetensors",
                                                             i + 1, shards);
      SafetensorsWriter w;
      for (size_t j = i * per; j < std::min(order_.size(), (i + 1) * per); ++j) {
        const Tensor& t = tensors_[order_[j]];
        w.Add(order_[j], t.dtype, t.shape, t.bytes.data(), t.bytes.size());
        index["weight_map"][order_[j]] = file;
        total += t.bytes.size();
      }
      EXL3_RETURN_IF_ERROR(w.Write(dir + "/" + file));
    }
    if (shards > 1) {
      index["metadata"] = {{"total_size", total}};
      std::ofstream(dir + "/model.safetensors.index.json") << index.dump(4);
    }
    return absl::OkStatus();
  }

  void WriteConfig(const std::string& dir) const {
    nlohmann::json j;
    switch (s_.family) {
      case Exllamav3Family::kQwen3Moe:
        j["architectures"] = {"Qwen3MoeForCausalLM"};
        j["num_local_experts"] = s_.experts;  // transformers 5.x
        j["num_experts"] = s_.experts;        // what exllamav3 reads
        j["norm_topk_prob"] = true;
        j["decoder_sparse_step"] = 1;
        j["mlp_only_layers"] = nlohmann::json::array();
        break;
      case Exllamav3Family::kGlm4Moe:
        j["architectures"] = {"Glm4MoeForCausalLM"};
        j["n_routed_experts"] = s_.experts;
        j["n_shared_experts"] = 1;
        j["first_k_dense_replace"] = 0;
        j["routed_scaling_factor"] = 2.0;
        j["n_group"] = 1;
        j["topk_group"] = 1;
        j["num_nextn_predict_layers"] = 1;
        break;
      case Exllamav3Family::kDeepseekV4:
        // The release config's field names (exllamav3 reads these).
        j["architectures"] = {"DeepseekV4ForCausalLM"};
        j["n_routed_experts"] = s_.experts;
        j["n_shared_experts"] = 1;
        j["num_hash_layers"] = 1;
        j["compress_ratios"] = {0, 4};
        j["scoring_func"] = "sqrtsoftplus";
        j["topk_method"] = "noaux_tc";
        j["routed_scaling_factor"] = 1.5;
        j["swiglu_limit"] = 10.0;
        break;
    }
    j["hidden_size"] = s_.hidden;
    j["num_hidden_layers"] = s_.layers;
    j["num_experts_per_tok"] = s_.top_k;
    j["moe_intermediate_size"] = s_.inter;
    j["intermediate_size"] = s_.inter;
    j["vocab_size"] = s_.vocab;
    j["tie_word_embeddings"] = false;  // the converter always writes it false
    j["quantization_config"] = QuantizationConfig();
    std::ofstream(dir + "/config.json") << j.dump(4);
  }

  void WriteStorage(const std::string& dir) const {
    nlohmann::json storage = nlohmann::json::object();
    for (const std::string& name : order_) {
      const Tensor& t = tensors_.at(name);
      if (t.module.empty()) continue;
      nlohmann::json& m = storage[t.module];
      static const std::map<DType, const char*> kTorch = {
          {DType::kF16, "torch.float16"}, {DType::kF32, "torch.float32"},
          {DType::kI16, "torch.int16"},   {DType::kI32, "torch.int32"},
          {DType::kI64, "torch.int64"}};
      m["stored_tensors"][name] = {{"shape", t.shape}, {"n_bytes", t.bytes.size()},
                                   {"dtype", kTorch.at(t.dtype)}};
      auto q = exl3_modules_.find(t.module);
      if (q != exl3_modules_.end()) {
        m["quant_format"] = "exl3";
        if (q->second == static_cast<int>(q->second)) {
          m["bits_per_weight"] = static_cast<int>(q->second);
        } else {
          m["bits_per_weight"] = q->second;
        }
        if (tensors_.count(t.module + ".mcg")) m["mcg_multiplier"] = kMcgMultiplier;
        if (tensors_.count(t.module + ".mul1")) m["mul1_multiplier"] = kMul1Multiplier;
      }
    }
    nlohmann::json j = QuantizationConfig();
    j["tensor_storage"] = storage;
    if (s_.edit_storage) s_.edit_storage(j);
    std::ofstream(dir + "/quantization_config.json") << j.dump(4);
  }

  Exllamav3DirSpec s_;
  std::mt19937 rng_;
  std::vector<std::string> order_;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, double> exl3_modules_;  // prefix -> bits per weight
};

}  // namespace exl3::testing
