// Generated MoE test models in the real key layout and config.json of four families:
//   glm4_moe     Glm4MoeForCausalLM     sigmoid router + e_score_correction_bias, shared experts,
//                                       dense first layers (first_k_dense_replace)
//   deepseek_v3  DeepseekV3ForCausalLM  as GLM plus grouped routing (n_group/topk_group), MLA
//                                       attention tensors
//   qwen3_moe    Qwen3MoeForCausalLM    softmax router, norm_topk_prob, no shared expert
//   mixtral      MixtralForCausalLM     softmax router, block_sparse_moe.experts.E.w1/w2/w3
//
// WriteHfTestModel writes a Hugging Face checkpoint (bf16 weights with random values, fp32
// correction biases, tiny attention/norm/embedding tensors so that the checkpoint is complete,
// one shard per layer with model.safetensors.index.json); convert it with
// model/encoder/checkpoint_converter.h.
// WriteSyntheticExl3Model writes an EXL3 model directly, with random trellis bits (valid EXL3,
// no encoding): for benchmarks at real shapes. Only MoE layers' tensors are written (router,
// correction bias, routed and shared experts), one shard per MoE layer, streamed to disk.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codebook.h"
#include "nlohmann/json.hpp"

namespace exl3 {

struct TestModelSpec {
  std::string arch = "glm4_moe";  // glm4_moe | deepseek_v3 | qwen3_moe | mixtral
  int layers = 3;
  int hidden = 256;
  int experts = 16;
  int top_k = 4;
  int intermediate = 128;       // routed expert's intermediate size
  int shared = -1;              // n_shared_experts; -1: family default (1 GLM/DeepSeek, 0 others)
  int dense_layers = -1;        // first_k_dense_replace; -1: family default (1 GLM/DeepSeek, 0)
  int dense_intermediate = 0;   // dense MLP's intermediate_size; 0: 2 * intermediate
  int n_group = -1;             // -1: family default (GLM 1; DeepSeek up to 4 groups)
  int topk_group = -1;
  float routed_scaling_factor = -1;  // -1: family default (GLM 1.0, DeepSeek 2.5, others 1)
  float swiglu_limit = 0;       // written to config.json when > 0
  int vocab = 512;
  uint64_t seed = 1;
};

// Fills the family defaults (-1 fields) and checks the spec (multiples of 128 for hidden and
// intermediate sizes, top_k <= experts, groups dividing experts, ...).
absl::StatusOr<TestModelSpec> ResolveTestModelSpec(const TestModelSpec& spec);

// The Hugging Face config.json of a resolved spec (no quantization_config).
nlohmann::json TestModelConfig(const TestModelSpec& resolved);

// Writes the HF checkpoint into `dir` (created). progress: a bar on stderr.
absl::Status WriteHfTestModel(const TestModelSpec& spec, const std::string& dir,
                              bool progress = false);

struct SyntheticOptions {
  int bits = 2;          // experts' K
  int down_bits = 0;     // down projections' K (0: bits)
  Codebook codebook = Codebook::kMcg;
  bool progress = true;
};

// Bytes the synthetic model's shards will take.
uint64_t SyntheticModelBytes(const TestModelSpec& resolved, const SyntheticOptions& opts);

absl::Status WriteSyntheticExl3Model(const TestModelSpec& spec, const SyntheticOptions& opts,
                                     const std::string& dir);

}  // namespace exl3
