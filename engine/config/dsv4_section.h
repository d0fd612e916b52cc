// The configuration section of DeepSeek-V4 (DeepseekV4ForCausalLM, DeepseekV4Config in
// transformers 5.24): shared-KV attention over a sliding window plus compressed entries
// (engine/cpu/attention/dsv4_attention.h), hyper-connections; what it reads fills ModelConfig::dsv4
// (engine/config/dsv4_config.h) and the attention fields it shares (head_dim's users, sliding_window,
// q_lora_rank, rope, attention_scale).
//
//   layer_types: per layer "sliding_attention", "compressed_sparse_attention" (CSA) or
//     "heavily_compressed_attention" (HCA); older files give `compress_ratios` (0 / 4 / 128 per
//     layer); neither: two HCA layers, then CSA and HCA alternating, as transformers defaults.
//   compress_rates {CSA: m, HCA: m'} (older files: compress_rate_csa / compress_rate_hca).
//   rope_parameters {"main": sliding layers, "compress": CSA / HCA layers, their compressors and
//     the indexer}; older files: rope_theta (main, default rope), compress_rope_theta with the
//     top-level rope scaling (compress; yarn gets attention_factor 1 unless given).
//   partial_rotary_factor (older files: qk_rope_head_dim / head_dim; default 64 / 512): the rope
//     part is the LAST rope_dim dimensions of each head, pairs interleaved (2i, 2i+1).
//   The DSPARK drafter (Dsv4Config::dspark, docs/dspark.md): compress_ratios' entries past
//     num_hidden_layers (one per MTP block, each must be 0), dspark_block_size (>= 0),
//     dspark_noise_token_id (a token id), dspark_markov_rank (> 0), dspark_target_layer_ids
//     (distinct trunk layer indices, kept ascending); errors name the field.
#pragma once

#include "absl/status/status.h"
#include "engine/config/model_config.h"
#include "model/config/config_file.h"

namespace exl3::engine {

absl::Status ReadDeepseekV4Section(const ConfigFile& file, ModelConfig* cfg);

}  // namespace exl3::engine
