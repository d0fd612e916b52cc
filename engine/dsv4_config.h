// DeepSeek-V4's attention configuration (DeepseekV4Config in transformers 5.24) and the layout
// of its per-token cache slots.
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
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/model_config.h"
#include "nlohmann/json_fwd.hpp"

namespace exl3::engine {

enum class Dsv4LayerType {
  kSlidingWindow,      // the last sliding_window positions only
  kCompressedSparse,   // + the compressed entries (overlapping windows) its indexer picks
  kHeavilyCompressed,  // + every compressed entry (non-overlapping windows)
};

struct Dsv4Config {
  std::vector<Dsv4LayerType> layer_types;  // [num_layers]
  int sliding_window = 0;
  int csa_compress_rate = 4;
  int hca_compress_rate = 128;
  int q_lora_rank = 0;
  int head_dim = 0;   // of q, of the shared key/value, of a compressed entry
  int rope_dim = 0;   // trailing rotary dimensions of head_dim (and of index_head_dim)
  int o_groups = 0;
  int o_lora_rank = 0;
  int index_heads = 0;     // index_n_heads
  int index_head_dim = 0;
  int index_topk = 0;
  int hc_mult = 0;            // residual streams
  int hc_sinkhorn_iters = 0;
  float hc_eps = 0.0f;
  RopeConfig main_rope, compress_rope;

  // m of a compressed layer; 0 for a sliding-window layer.
  int CompressRate(int layer) const;
};

// Where each part of one token's cache slot lies in a layer of type `type` (offsets in floats;
// 0 width: absent). Every part is a pure function of the tokens up to the slot's position, so
// a slot never changes once written and full blocks can be shared between sequences (prefix
// caching) and recomputed after preemption like any other KV block.
//   kv:          the normalised, rotated shared key/value [head_dim]
//   comp_kv/gate: the compressor's projections of this token ([2 head_dim] CSA, [head_dim] HCA),
//                the gate with position_bias[position % m] added
//   comp_entry:  the compressed entry of the window this token closes [head_dim]; written only
//                where position % m == m - 1
//   ix_*:        the same for the CSA indexer's compressor, at index_head_dim
struct Dsv4SlotLayout {
  int kv = 0;
  int comp_kv = 0, comp_gate = 0, comp_entry = 0, comp_width = 0;  // comp_width: of kv and gate
  int ix_kv = 0, ix_gate = 0, ix_entry = 0, ix_width = 0;
  int width = 0;
};
Dsv4SlotLayout SlotLayoutFor(const Dsv4Config& cfg, Dsv4LayerType type);

// Fills cfg->dsv4 (and the attention fields of cfg it shares: head_dim, sliding_window,
// attention_scale) from config.json.
absl::Status ParseDsv4Config(const nlohmann::json& j, const std::string& source, ModelConfig* cfg);

}  // namespace exl3::engine
