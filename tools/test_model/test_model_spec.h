// Generated MoE test models in the real key layout and config.json of nine families:
//   glm4_moe     Glm4MoeForCausalLM     sigmoid router + e_score_correction_bias, shared experts,
//                                       dense first layers (first_k_dense_replace)
//   deepseek_v3  DeepseekV3ForCausalLM  as GLM plus grouped routing (n_group/topk_group), MLA
//                                       attention tensors
//   qwen3_moe    Qwen3MoeForCausalLM    softmax router, norm_topk_prob, no shared expert
//   mixtral      MixtralForCausalLM     softmax router, block_sparse_moe.experts.E.w1/w2/w3
//   glm_moe_dsa  GlmMoeDsaForCausalLM   as GLM (sigmoid router, shared expert, dense first
//                                       layers) with MLA attention plus DSA's lightning indexer
//                                       (self_attn.indexer.wq_b / wk / k_norm / weights_proj)
//   deepseek_v4  DeepseekV4ForCausalLM  sqrt-softplus router + bias, first layers hash-routed
//                                       (ffn.gate.tid2eid), one shared expert, every layer MoE;
//                                       shared-KV attention per layer_types (sliding window,
//                                       compressor, CSA indexer), hyper-connections (hc_*)
//   qwen3_next   Qwen3NextForCausalLM   softmax router, gated shared expert; gated DeltaNet
//                                       (linear_attn.*) and gated full attention per layer_types
//   glm5_next    Glm5NextForConditionalGeneration (GLM-5.3-Flash's text model; config.json's
//                                       fields nested in text_config, tensors under
//                                       model.language_model.): as GLM (sigmoid router + bias,
//                                       shared expert, dense first layers per mlp_layer_types);
//                                       per layer_types Kimi delta attention (self_attn.q/k/v/o_proj,
//                                       the low-rank gates f_/g_a/b_proj and b_proj, q/k/v_conv1d,
//                                       A_log, dt_bias, o_norm) or NoPE MLA with the k-pooled
//                                       indexer (index_kpool_compress_gate / _ape); hyper-connections
//                                       (hc_attn_*, hc_ffn_*) on every layer, a mean head (no
//                                       hc_head tensors). No vision tower (the engine loads it
//                                       when present and needs none); the MTP layer with --mtp.
//   qwen4_exp    Qwen4ExpForConditionalGeneration (Qwen3.8-Flash-Next's text model; config.json's
//                                       fields nested in text_config, tensors under
//                                       model.language_model.): softmax router, gated shared expert,
//                                       every layer MoE; per layer_types gated DeltaNet with
//                                       Qwen3.5's separate in_proj_qkv / _z / _b / _a (sigmoid
//                                       output gate) or QSA (Qwen3-Next's gated GQA and
//                                       self_attn.indexer.index_qk_proj / q_layernorm /
//                                       k_layernorm); low-rank gated hyper-connections
//                                       (attn_hyper_connection, mlp_hyper_connection,
//                                       hyper_connection_mixer) instead of layer norms, no final
//                                       norm; a PLE layer (ple.*: the hashed n-gram table in
//                                       split_ngram_parts pieces, its hashing constants, key/value
//                                       projections, norms, dilated conv) on each of ple_layer_ids;
//                                       no vision tower; the MTP head (mtp.*) with --mtp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace exl3 {

// The layer kinds of TestModelSpec::layer_types.
namespace layer_kind {
inline constexpr char kSliding[] = "sliding_attention";
inline constexpr char kCsa[] = "compressed_sparse_attention";
inline constexpr char kHca[] = "heavily_compressed_attention";
inline constexpr char kLinear[] = "linear_attention";
inline constexpr char kFull[] = "full_attention";
inline constexpr char kIndexed[] = "indexed_attention";  // GLM-5.3-Flash's MLA with the k-pooled indexer
}  // namespace layer_kind

struct TestModelSpec {
  std::string arch = "glm4_moe";  // glm4_moe | deepseek_v3 | qwen3_moe | mixtral | glm_moe_dsa |
                                  // deepseek_v4 | qwen3_next | glm5_next | qwen4_exp
  int layers = 3;
  int hidden = 256;
  int experts = 16;
  int top_k = 4;
  int intermediate = 128;       // routed expert's intermediate size
  int shared = -1;              // n_shared_experts; -1: family default (1 GLM/DeepSeek/Qwen3-Next, 0 others)
  int dense_layers = -1;        // first_k_dense_replace; -1: family default (1 GLM/DeepSeek, 0)
  int dense_intermediate = 0;   // dense MLP's intermediate_size; 0: 2 * intermediate
  int n_group = -1;             // -1: family default (GLM 1; DeepSeek up to 4 groups)
  int topk_group = -1;
  float routed_scaling_factor = -1;  // -1: family default (GLM 1.0, DeepSeek and GLM-5.3-Flash 2.5,
                                     // DeepSeek-V4 1.5, others 1)
  float swiglu_limit = 0;       // written to config.json when > 0 (glm5_next: always, default 10)
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
  int qk_rope_head_dim = -1;  // -1: family default (16; glm5_next 0, its attention is NoPE)
  int v_head_dim = 32;
  // GLM-MoE-DSA's lightning indexer (every layer runs its own).
  int index_heads = 4;
  int index_head_dim = 32;  // >= qk_rope_head_dim
  int index_topk = 64;
  // GLM-5.3-Flash's k-pooled indexer: positions per pool (index_topk a multiple of it).
  int index_kpool = 4;
  // DeepSeek-V4 (DeepseekV4Config's names). Its attention: heads x head_dim queries over one
  // shared key/value of head_dim, the last qk_rope_head_dim dimensions rotated; q_lora_rank and
  // the index_* fields above are shared with MLA / DSA.
  std::vector<std::string> layer_types;  // empty: family default (below); else one per layer
  int sliding_window = 8;
  int csa_compress_rate = 4;    // compress_rates.compressed_sparse_attention
  int hca_compress_rate = 16;   // compress_rates.heavily_compressed_attention (transformers: 128)
  int o_groups = 2;
  int o_lora_rank = 0;          // 0: heads * head_dim / o_groups
  int hc_mult = 4;
  int hc_sinkhorn_iters = 20;
  int hash_layers = 1;          // mlp_layer_types: the first hash_layers "hash_moe", the rest "moe"
  // Qwen3-Next's gated DeltaNet (linear_* of Qwen3NextConfig) and its layer_types default: every
  // full_attention_interval-th layer full attention (0: 4, or the last layer of a smaller model).
  int linear_key_heads = 2;
  int linear_value_heads = 4;
  int linear_key_head_dim = 64;
  int linear_value_head_dim = 64;
  int linear_conv_kernel = 4;
  int full_attention_interval = 0;
  // GLM-5.3-Flash's Kimi delta attention (Glm5NextTextConfig's linear_num_heads, linear_head_dim;
  // the conv taps are linear_conv_kernel above). layer_types as Qwen3-Next's, with
  // indexed_attention in place of full_attention (every full_attention_interval-th layer).
  int linear_heads = 2;
  int linear_head_dim = 64;
  // Qwen4-Exp (Qwen4ExpTextConfig's names). Its DeltaNet takes Qwen3-Next's linear_* fields above,
  // its QSA indexer the index_* ones (index_heads: indexer_n_heads, index_head_dim:
  // indexer_head_dim, index_topk: indexer_budget, index_kpool: indexer_compress_ratio), its
  // hyper-connections hc_mult (hc_count) and layer_types Qwen3-Next's pattern with
  // indexed_attention in place of full_attention (release layout: full_attention).
  int hc_lowrank = 32;
  std::vector<int> ple_layer_ids;  // one-based linear_attention layers; empty: the first one
  int ple_embed_dim = 0;           // 0: hidden (transformers' default)
  int ple_conv_kernel = 4;
  int ngram_size = 3;
  int heads_per_ngram = 8;
  int64_t ngram_vocab_size_base = 1000;  // rows per n-gram head (the next primes); the real one 20M
  // The table's pieces (ngram_embedding.shard_{i}), all but the last of ceil(rows / parts) rows;
  // 0: transformers' 512 where that makes 512 pieces, else 128 (equal pieces: the rows are padded
  // to a multiple of 128).
  int split_ngram_parts = 0;
  // glm4_moe, deepseek_v3, glm_moe_dsa, glm5_next: also the DeepSeek-V3 MTP layer
  // (engine/cpu/mtp/mtp_head.h), one more layer model.layers.{layers}.* (glm5_next:
  // model.language_model.layers.{layers}.*) in a shard of its own: enorm, hnorm, eh_proj [hidden,
  // 2 * hidden], shared_head.norm and a MoE decoder layer (DSA: with its own indexer; glm5_next:
  // MLA with its own k-pooled indexer, no hyper-connections); config.json num_nextn_predict_layers 1.
  // qwen4_exp: Qwen4-Exp's own MTP head (engine/cpu/mtp/qwen4exp_mtp_head.h) in a shard of its own:
  // mtp.fc_hidden, mtp.fc_embedding, their norms, one QSA MoE block mtp.layers.0.* with its
  // hyper-connections, mtp.hyper_connection_mixer; text_config.mtp_num_hidden_layers 1.
  bool mtp = false;
  // glm5_next: config.json in the release checkpoint's layout (the MLA layers named
  // deepseek_sparse_attention, KDA's shape in a linear_attn_config dict), with the vision
  // preprocessor's processor_config.json beside it: the layout exllamav3 reads (transformers and
  // the engine read both). qwen4_exp: the QSA layers named full_attention in layer_types (the
  // only name exllamav3 reads).
  bool release_layout = false;
};

// Sigmoid routing with a correction bias, shared experts and dense first layers: glm4_moe,
// deepseek_v3, glm_moe_dsa, glm5_next.
bool IsSigmoidFamily(const std::string& arch);

// MLA attention (GLM-5.3-Flash's on its indexed layers, NoPE).
bool IsLatentAttention(const std::string& arch);

}  // namespace exl3
