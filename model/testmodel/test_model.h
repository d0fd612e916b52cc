// Generated MoE test models in the real key layout and config.json of four families:
//   glm4_moe     Glm4MoeForCausalLM     sigmoid router + e_score_correction_bias, shared experts,
//                                       dense first layers (first_k_dense_replace)
//   deepseek_v3  DeepseekV3ForCausalLM  as GLM plus grouped routing (n_group/topk_group), MLA
//                                       attention tensors
//   qwen3_moe    Qwen3MoeForCausalLM    softmax router, norm_topk_prob, no shared expert
//   mixtral      MixtralForCausalLM     softmax router, block_sparse_moe.experts.E.w1/w2/w3
//   glm_moe_dsa  GlmMoeDsaForCausalLM   as GLM (sigmoid router, shared expert, dense first
//                                       layers) with MLA attention plus DSA's lightning indexer
//                                       (self_attn.indexer.wq_b / wk / k_norm / weights_proj)
//
// WriteHfTestModel writes a Hugging Face checkpoint (bf16 weights with random values, fp32
// correction biases, tiny attention/norm/embedding tensors so that the checkpoint is complete,
// one shard per layer with model.safetensors.index.json); convert it with
// model/encoder/checkpoint_converter.h.
// WriteSyntheticExl3Model writes an EXL3 model directly, with random trellis bits (valid EXL3,
// no encoding): for benchmarks at real shapes. By default only MoE layers' tensors are written
// (router, correction bias, routed and shared experts), one shard per MoE layer, streamed to
// disk; with SyntheticOptions::whole_model every layer and the embeddings and head too.
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
  std::string arch = "glm4_moe";  // glm4_moe | deepseek_v3 | qwen3_moe | mixtral | glm_moe_dsa
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
  int max_position = 4096;  // max_position_embeddings
  uint64_t seed = 1;
  // Attention. GQA families: heads x head_dim queries, kv_heads x head_dim keys and values.
  int heads = 4;
  int kv_heads = 0;   // 0: family default (2; DeepSeek-V3: heads)
  int head_dim = 0;   // 0: hidden / heads
  // DeepSeek-V3's (and GLM-MoE-DSA's) multi-head latent attention.
  int q_lora_rank = 64;
  int kv_lora_rank = 32;
  int qk_nope_head_dim = 32;
  int qk_rope_head_dim = 16;
  int v_head_dim = 32;
  // GLM-MoE-DSA's lightning indexer (every layer runs its own).
  int index_heads = 4;
  int index_head_dim = 32;  // >= qk_rope_head_dim
  int index_topk = 64;
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
  // Also attention, norms, dense MLPs, embeddings and the head (linears EXL3 where both
  // dimensions are multiples of 128, else bf16), so the engine can run it; else MoE layers only.
  bool whole_model = false;
  int bits = 2;            // experts' K (and every other EXL3 linear's unless set below)
  int down_bits = 0;       // routed and shared experts' down projections' K (0: bits)
  int attention_bits = 0;  // attention and dense MLP linears' K (0: bits)
  int head_bits = 0;       // lm_head's K (0: bits)
  Codebook codebook = Codebook::kMcg;
  bool progress = true;
};

// Bytes the synthetic model's shards will take.
uint64_t SyntheticModelBytes(const TestModelSpec& resolved, const SyntheticOptions& opts);

absl::Status WriteSyntheticExl3Model(const TestModelSpec& spec, const SyntheticOptions& opts,
                                     const std::string& dir);

}  // namespace exl3
