// DeepSeek-V4's attention configuration (DeepseekV4Config in transformers 5.24; read by
// engine/config/dsv4_section.h, which tells the config.json fields) and the layout of its
// per-token cache slots.
#pragma once

#include <string>
#include <vector>

#include "engine/config/rope_parameters.h"

namespace exl3::engine {

enum class Dsv4LayerType {
  kSlidingWindow,      // the last sliding_window positions only
  kCompressedSparse,   // + the compressed entries (overlapping windows) its indexer picks
  kHeavilyCompressed,  // + every compressed entry (non-overlapping windows)
};

// The DSPARK block drafter (the checkpoint's mtp.* component, docs/dspark.md): read from the
// dspark_* fields and the entries of compress_ratios past num_hidden_layers (one per MTP block,
// each 0: sliding, no compressor). num_blocks 0: the config names no MTP block.
struct Dsv4DsparkConfig {
  int num_blocks = 0;        // len(compress_ratios) - num_hidden_layers, at least 0
  int block_size = 0;        // dspark_block_size: the draft block's length, seed included
  int noise_token_id = 0;    // dspark_noise_token_id: fills block positions 1..block_size-1
  int markov_rank = 256;     // dspark_markov_rank
  std::vector<int> target_layer_ids;  // dspark_target_layer_ids, ascending, distinct

  // The drafter can run: MTP blocks, a block, and at least one tapped layer.
  bool enabled() const { return num_blocks > 0 && block_size > 0 && !target_layer_ids.empty(); }
  int num_taps() const { return static_cast<int>(target_layer_ids.size()); }
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
  Dsv4DsparkConfig dspark;

  // m of a compressed layer; 0 for a sliding-window layer.
  int CompressRate(int layer) const;
};

// What a layer of type `type` keeps in the paged KV cache (offsets in floats).
//
// Per token slot: its normalised, rotated shared key/value [head_dim] (the sliding window reads
// the last sliding_window of them). Sliding-window layers keep nothing else.
//
// Per block, on compressed layers (the block area, engine/cpu/paged_kv_cache.h):
//   folded:   how many of the block's positions are folded into its accumulators (one float);
//   per compressor (the layer's own at head_dim; CSA's indexer's at index_head_dim), the running
//   softmax of its open window(s) after the block's last folded position, per channel a
//   log-sum-exp of the gate logits and the softmax-weighted mean of the kv projections
//   ([2, dim] each): `current` for the entry the open window closes, and on CSA (overlapping
//   windows) `next` for the entry after it, which the open window's first half starts;
//   then the entries of the windows whose last position lies in the block
//   ([entries_per_block, dim]; entries_per_block = ceil(block_size / m)).
// Everything in a block is a function of the tokens up to the block's end, written by the one
// sequence that fills it, and never written again once the block is full: full blocks can be
// shared between sequences (prefix caching), a sequence resumes at any position (the first
// position of a block starts from the previous block's accumulators), and a preempted one is
// recomputed like any other. A position folded twice (a failed step run again) is skipped by
// the count.
struct Dsv4CompressorCache {
  int dim = 0;               // of an entry; 0: the layer has no such compressor
  bool overlapping = false;  // CSA: two accumulators
  int current = 0, next = 0;  // accumulators [2, dim]: log-sum-exp, then the weighted mean
  int entries = 0;            // [entries_per_block, dim]
};
struct Dsv4CacheLayout {
  int token_width = 0;  // the token's kv [head_dim] at offset 0 of its slot
  int entries_per_block = 0;
  int folded = 0;
  Dsv4CompressorCache compressor, indexer;
  int accumulators_end = 0;  // the accumulators are [folded + 1, accumulators_end)
  int block_width = 0;       // 0 on sliding-window layers
};
Dsv4CacheLayout CacheLayoutFor(const Dsv4Config& cfg, Dsv4LayerType type, int block_size);

}  // namespace exl3::engine
