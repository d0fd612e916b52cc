// The whole-model configuration the engine runs: attention, positions, norms, head, and the MoE
// layout (model/moe_config.h). engine/config/read_model_config.h reads it from a model directory's
// config.json, one section per family (engine/config/*_section.h).
//
// Families run by the engine: Glm4MoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM (GQA
// attention), DeepseekV3ForCausalLM (multi-head latent attention), GlmMoeDsaForCausalLM (MLA
// with DeepSeek sparse attention's lightning indexer), DeepseekV4ForCausalLM (shared-KV
// attention with compressors and hyper-connections; engine/config/dsv4_config.h) and
// Qwen3NextForCausalLM (per layer_types, gated DeltaNet linear attention or gated GQA),
// Glm5NextForConditionalGeneration (its text model: KDA linear attention or NoPE MLA with a
// k-pooled indexer, hyper-connections; engine/config/glm5next_config.h) and
// Qwen4ExpForConditionalGeneration's text model (engine/config/qwen4exp_config.h: gated DeltaNet or QSA
// attention, gated hyper-connections, PLE n-gram layers; fields in text_config).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/core/model_runner.h"
#include "engine/config/rope_parameters.h"
#include "model/moe_config.h"

namespace exl3::engine {

enum class AttentionKind {
  kGqa,  // q/k/v/o projections, grouped KV heads (Glm4Moe, Qwen3Moe, Mixtral)
  kMla,  // DeepSeek multi-head latent attention (q/kv low-rank, shared rope key)
  kDsa,  // MLA whose queries see only the top-k positions a lightning indexer picks (GLM-MoE-DSA)
  kDsv4,  // DeepSeek-V4: shared-KV MQA over a sliding window plus compressed entries
  // GLM-5.3-Flash's indexed layers: MLA without rope whose queries see the positions of the
  // pools of index_kpool positions its indexer picks (engine/cpu/attention/kpool_dsa_attention.h).
  kPooledDsa,
  kQsa,   // Qwen4-Exp: gated GQA over the position blocks a QSA indexer picks (engine/cpu/attention/qsa_attention.h)
};

struct Dsv4Config;      // engine/config/dsv4_config.h
struct Glm5NextConfig;  // engine/config/glm5next_config.h
struct Qwen4ExpConfig;  // engine/config/qwen4exp_config.h

// Whether a DSA layer runs its own indexer or reuses the selection of the last layer that did
// (GlmMoeDsaConfig's indexer_types "full" / "shared").
enum class IndexerMode { kFull, kShared };

// The lightning indexer of DSA layers: per query, index_n_heads heads of index_head_dim score
// every visible position; the query attends to the index_topk highest (all of them while it sees
// no more than index_topk). Its keys are cached beside the MLA latent of layers that run it.
struct IndexerConfig {
  int num_heads = 0;  // index_n_heads
  int head_dim = 0;   // index_head_dim: the first qk_rope_head_dim dimensions rotate
  int topk = 0;       // index_topk
  std::vector<IndexerMode> layer_modes;  // [num_layers]; layer 0 is kFull
};

// What mixes a layer's tokens.
enum class TokenMixer {
  kAttention,        // cfg.attention over the paged KV cache
  kLinearAttention,  // Qwen3-Next's gated DeltaNet or GLM-5.3-Flash's KDA: a fixed-size
                     // recurrent state per sequence
};

// GLM-5.3-Flash's KDA has the same shape with num_key_heads = num_value_heads = linear_num_heads
// and key_head_dim = value_head_dim = linear_head_dim.
// Qwen3-Next's gated DeltaNet layers (`linear_attn.*`): num_key_heads query/key heads of
// key_head_dim, num_value_heads value heads of value_head_dim (each key head serves
// num_value_heads / num_key_heads consecutive value heads), a causal depthwise convolution of
// conv_kernel taps over q, k and v.
struct LinearAttentionConfig {
  int num_key_heads = 0;    // linear_num_key_heads
  int num_value_heads = 0;  // linear_num_value_heads
  int key_head_dim = 0;     // linear_key_head_dim
  int value_head_dim = 0;   // linear_value_head_dim
  int conv_kernel = 0;      // linear_conv_kernel_dim

  int key_dim() const { return num_key_heads * key_head_dim; }
  int value_dim() const { return num_value_heads * value_head_dim; }
  int conv_channels() const { return 2 * key_dim() + value_dim(); }  // q, k, v
  // One sequence's state in one layer: the last conv_kernel - 1 inputs of every conv channel,
  // then a [key_head_dim, value_head_dim] matrix per value head.
  int64_t ConvStateFloats() const { return static_cast<int64_t>(conv_kernel - 1) * conv_channels(); }
  int64_t RecurrentStateFloats() const {
    return static_cast<int64_t>(num_value_heads) * key_head_dim * value_head_dim;
  }
};

// How an RMSNorm's stored weight scales the normalised input.
enum class NormWeightConvention {
  kScale,          // y = x̂ · w (most families)
  kOffsetFromOne,  // y = x̂ · (1 + w): zero-centred weights (Qwen3-Next)
};

struct ModelConfig {
  MoeConfig moe;  // architecture, family, hidden size, layers, which layers are MoE, routing
  AttentionKind attention = AttentionKind::kGqa;
  int vocab_size = 0;
  int hidden_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;            // GQA: per head, for q, k and v
  int intermediate_size = 0;   // dense MLP layers
  float rms_norm_eps = 1e-6f;
  bool qk_norm = false;        // RMSNorm over each head's q and k before RoPE
  int sliding_window = 0;      // 0: full causal attention; else key j visible to query i iff i - j < window
  bool tie_word_embeddings = false;
  int max_position_embeddings = 0;
  // MLA (attention == kMla).
  int q_lora_rank = 0;  // 0: a plain q_proj
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  IndexerConfig indexer;  // attention == kDsa
  // Qwen3-Next: the layers' token mixers (layer_types) and the DeltaNet shape; every other
  // family has only kAttention layers.
  std::vector<TokenMixer> layer_mixers;  // [num_layers]
  LinearAttentionConfig linear_attention;
  // Qwen3-Next's full attention: q_proj is twice as wide, each head's query followed by a gate
  // of the same size; the attention output is multiplied by sigmoid(gate) before o_proj.
  bool attention_output_gate = false;
  NormWeightConvention norm_weights = NormWeightConvention::kScale;
  std::shared_ptr<const Dsv4Config> dsv4;  // attention == kDsv4 (layer types, compressors, mHC)
  std::shared_ptr<const Glm5NextConfig> glm5next;  // attention == kPooledDsa (pools, KDA gate, mHC)
  // RMSNorm eps of MLA's q_a_layernorm / kv_a_layernorm (transformers builds DeepSeek-V3's and
  // GLM-MoE-DSA's with the norm's default 1e-6, GLM-5.3-Flash's with rms_norm_eps).
  float latent_norm_eps = 1e-6f;
  // Clamp of the dense MLPs' gate (<= limit) and up (within ±limit); 0: none (GLM-5.3-Flash:
  // swiglu_limit).
  float dense_swiglu_limit = 0.0f;
  std::shared_ptr<const Qwen4ExpConfig> qwen4exp;  // Qwen4-Exp (attention == kQsa): HC, QSA, PLE
  RopeConfig rope;
  float attention_scale = 0.0f;  // softmax scale of q·k
  std::vector<int32_t> eos_token_ids;
  std::vector<MediaPlaceholder> media_placeholders;  // image / video token ids (multimodal checkpoints)

  const std::string& architecture() const { return moe.architecture; }
  bool IsMoeLayer(int layer) const { return moe.IsMoeLayer(layer); }
  // MLA proper or DSA: latent attention with q/kv low-rank projections.
  bool IsLatentAttention() const { return attention == AttentionKind::kMla || attention == AttentionKind::kDsa; }
  bool IsLinearAttentionLayer(int layer) const {
    return layer_mixers[layer] == TokenMixer::kLinearAttention;
  }
  // Whether any layer keeps a recurrent state per sequence (instead of, or beside, KV blocks).
  bool HasRecurrentLayers() const;
  // Floats of fixed-size state one sequence holds in layer `layer` (linear attention: its conv
  // and recurrent state, then Qwen4-Exp's PLE state on PLE layers; else 0), and over all layers.
  int64_t StateFloats(int layer) const;
  int64_t StateFloatsPerSequence() const;
  // Whether DSA layer `layer` runs its own indexer (and caches its keys).
  bool HasOwnIndexer(int layer) const {
    return (attention == AttentionKind::kDsa || attention == AttentionKind::kPooledDsa) &&
           !IsLinearAttentionLayer(layer) && indexer.layer_modes[layer] == IndexerMode::kFull;
  }
  // Floats one token's keys and values take in layer `layer`'s cache slot (GQA: k and v of every
  // KV head; MLA: the normalised latent and the rotated shared key; DSA: those, then the rotated
  // indexer key on layers that run their own indexer; DeepSeek-V4: the shared key/value; QSA:
  // k and v, then the raw (unnormalised, unrotated) indexer key; linear attention: none).
  int KvWidth(int layer) const;
  // Floats one cache block of `block_size` slots keeps beside its slots in layer `layer`
  // (DeepSeek-V4's compressed layers: compressor state and compressed entries,
  // engine/config/dsv4_config.h's Dsv4CacheLayout; every other layer: none).
  int KvBlockFloats(int layer, int block_size) const;
  // One token's cache footprint over all layers in floats, the block areas shared out over
  // the block's slots (rounded up), for blocks of `block_size` (KvCacheShape's default).
  int64_t KvFloatsPerToken(int block_size = KvCacheShape{}.block_size) const;
};

// What the scheduler knows of a model in `dir`: its name (`served_name`, else the directory's
// base name), architecture, vocabulary, context, EOS ids, KV bytes per token and state bytes per
// sequence (engine/cpu/sequence_state.h: twice StateFloatsPerSequence, the store's two copies).
ModelInfo ModelInfoFor(const ModelConfig& cfg, const std::string& dir, const std::string& served_name);

// Per layer, the floats of one sequence's recurrent state (cfg.StateFloats; 0 for layers without),
// for a state store of `num_slots` slots (engine/cpu/sequence_state.h), as both engines size theirs:
// INVALID_ARGUMENT when the model has recurrent layers and the cache gives no slots.
absl::StatusOr<std::vector<int64_t>> StateFloatsPerLayer(const ModelConfig& cfg, int num_slots);


}  // namespace exl3::engine
