// The MoE layout of a model (read from its config.json by model/config/read_moe_config.h), and
// the tensor key naming of each family.
//
// Usage:
//   absl::StatusOr<MoeConfig> cfg = LoadMoeConfig("/models/GLM-4.5-Air-exl3");  // dir or file
//   for (int L : cfg->MoeLayers()) {
//     std::string key = RoutedExpertPrefix(*cfg, L, /*expert=*/3, Projection::kGate);
//     // "model.layers.L.mlp.experts.3.gate_proj" (+ ".trellis", ".suh", ...)
//   }
//
// The supported architectures and their MoE families: model/config/architecture.h. Anything else
// is refused with a message naming the architecture and the list.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config/architecture.h"

namespace exl3 {

// How router logits become scores (docs/format.md, "Routing functions").
enum class ScoringFunc {
  kSoftmax,       // Qwen3-MoE, Qwen3-Next, Mixtral
  kSigmoid,       // GLM-4.x/5.x, DeepSeek-V3 (with correction bias, groups)
  kSqrtSoftplus,  // DeepSeek-V4 (with correction bias; first layers hash-routed)
};

enum class Projection { kGate, kUp, kDown };

// What a decoder layer's MLP is.
enum class MlpKind {
  kDense,    // one dense MLP (GLM/DeepSeek first_k_dense_replace, Qwen mlp_only_layers)
  kMoe,      // routed experts chosen by the router
  kHashMoe,  // routed experts chosen by token id through tid2eid (DeepSeek-V4 "hash_moe")
};

std::string_view ScoringFuncName(ScoringFunc s);  // "softmax", "sigmoid", "sqrtsoftplus"
std::string_view ProjectionName(Projection p);    // "gate", "up", "down"
std::string_view MlpKindName(MlpKind k);          // "dense", "moe", "hash_moe"

struct MoeConfig {
  std::string architecture;  // as written in config.json
  Architecture arch = Architecture::kGlm4Moe;  // the same, as the table names it
  MoeFamily family = MoeFamily::kGlm;
  int hidden_size = 0;
  int num_hidden_layers = 0;
  std::vector<bool> moe_layers;  // [num_hidden_layers]: true where the layer's MLP is MoE
  // [num_hidden_layers]: true where a MoE layer is hash-routed (DeepSeek-V4 mlp_layer_types
  // "hash_moe"; older files: the first num_hash_layers layers).
  std::vector<bool> hash_routed_layers;

  int num_experts = 0;             // routed experts per MoE layer
  int top_k = 0;                   // num_experts_per_tok
  int moe_intermediate_size = 0;   // routed expert's intermediate size

  // Shared expert: one MLP per MoE layer (DeepSeek-V3/GLM fuse n_shared_experts into one MLP of
  // n_shared_experts * moe_intermediate_size; DeepSeek-V4 has one of moe_intermediate_size;
  // Qwen3-Next has one of shared_expert_intermediate_size).
  int num_shared_experts = 0;        // as configured (0: none)
  int shared_intermediate_size = 0;  // of the (fused) shared MLP; 0 when there is none
  bool shared_expert_gated = false;  // Qwen3-Next: output scaled by sigmoid(x · shared_expert_gate)

  // Routing.
  ScoringFunc scoring = ScoringFunc::kSoftmax;
  bool norm_topk_prob = false;         // Mixtral: always true
  float routed_scaling_factor = 1.0f;  // routed_scaling_factor or route_scale; 1 for softmax families
  int n_group = 1;
  int topk_group = 1;
  bool has_correction_bias = false;  // a correction bias on every router-chosen (not hash) layer
  // Clamp of the routed experts' gate (<= limit) and up (within +-limit) pre-activations; 0: none.
  float swiglu_limit = 0.0f;
  // The same clamp on the shared expert (DeepSeek-V4: transformers 5.24's shared MLP clamps too).
  float shared_swiglu_limit = 0.0f;

  // quantization_config (empty quant_method when the config has none). exllamav3 writes
  // quant_method "exl3", version (its own), bits (the average it reached, e.g. 4.02 or 2.5),
  // head_bits, codebook ("mul1", "mcg", "3inst"; older files none: then per tensor only),
  // calibration {rows, cols}, out_scales, and mtp_bits / vision_bits when it quantized those.
  std::string quant_method;
  std::string quant_version;
  double bits = 0.0;
  double head_bits = 0.0;
  std::string quant_codebook;

  bool IsMoeLayer(int layer) const {
    return layer >= 0 && layer < num_hidden_layers && moe_layers[layer];
  }
  // Hash-routed (DeepSeek-V4's "hash_moe" layers): experts come from token ids, not the router.
  bool IsHashRoutedLayer(int layer) const {
    return IsMoeLayer(layer) && layer < static_cast<int>(hash_routed_layers.size()) &&
           hash_routed_layers[layer];
  }
  // kDense for layers outside [0, num_hidden_layers) too.
  MlpKind LayerKind(int layer) const {
    return !IsMoeLayer(layer) ? MlpKind::kDense
                              : IsHashRoutedLayer(layer) ? MlpKind::kHashMoe : MlpKind::kMoe;
  }
  bool has_shared_expert() const { return shared_intermediate_size > 0; }
  std::vector<int> MoeLayers() const;
};

// OK when quantization_config.quant_method is "exl3".
absl::Status RequireExl3(const MoeConfig& cfg);

// ---- Tensor key naming (prefixes without the ".trellis"/".suh"/... suffix) ----

// Where the language model's tensors live: "model." ("model.language_model." for
// Glm5NextForConditionalGeneration and Qwen4ExpForConditionalGeneration), e.g.
// TextModelPrefix(cfg) + "embed_tokens.weight".
std::string TextModelPrefix(const MoeConfig& cfg);
// Layer L's prefix: TextModelPrefix(cfg) + "layers.L.".
std::string LayerPrefix(const MoeConfig& cfg, int layer);

// Routed expert E's projection of layer L, e.g. "model.layers.3.mlp.experts.17.gate_proj"
// (Mixtral: "model.layers.3.block_sparse_moe.experts.17.w1"; DeepSeek-V4:
// "model.layers.3.ffn.experts.17.w1", w1 gate, w3 up, w2 down).
std::string RoutedExpertPrefix(const MoeConfig& cfg, int layer, int expert, Projection p);
// Shared expert's projection ("model.layers.L.mlp.shared_experts.gate_proj", Qwen3-Next
// "mlp.shared_expert.gate_proj", DeepSeek-V4 "ffn.shared_experts.w1"); empty when the model has
// no shared expert.
std::string SharedExpertPrefix(const MoeConfig& cfg, int layer, Projection p);
// Router weight [num_experts, hidden], e.g. "model.layers.L.mlp.gate.weight" (DeepSeek-V4
// "ffn.gate.weight", Mixtral "block_sparse_moe.gate.weight").
std::string RouterWeightKey(const MoeConfig& cfg, int layer);
// Correction bias [num_experts] ("model.layers.L.mlp.gate.e_score_correction_bias", DeepSeek-V4
// "ffn.gate.bias"); empty when the family or the layer (hash-routed) has none.
std::string CorrectionBiasKey(const MoeConfig& cfg, int layer);
// Qwen3-Next's shared expert gate [1, hidden] ("model.layers.L.mlp.shared_expert_gate.weight");
// empty otherwise.
std::string SharedExpertGateKey(const MoeConfig& cfg, int layer);
// DeepSeek-V4 hash table [vocab, top_k] int ("model.layers.L.ffn.gate.tid2eid") of a hash-routed
// layer; empty otherwise.
std::string HashTableKey(const MoeConfig& cfg, int layer);
// The output head's weight [vocab, hidden]: "lm_head.weight" (DeepSeek-V4: "head.weight").
std::string HeadWeightKey(const MoeConfig& cfg);

}  // namespace exl3
