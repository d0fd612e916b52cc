// Qwen4-Exp's (Qwen3.8-Flash-Next, `Qwen4ExpForConditionalGeneration`) text-model configuration
// beyond what Qwen3-Next shares with it, as transformers 5.25's Qwen4ExpTextConfig defines it
// (docs/engine.md, "Qwen4-Exp"): the gated hyper-connections, the QSA indexer of the
// `indexed_attention` layers, the PLE n-gram layers and the DeltaNet output gate's activation.
// engine/config/qwen4exp_section.h reads it from config.json.
#pragma once

#include <cstdint>
#include <vector>

namespace exl3::engine {

// The activation applied to z in the DeltaNet's gated output norm (`output_gate_type`, else
// `hidden_act`).
enum class OutputGateActivation { kSilu, kSigmoid };

// QSA: a query sees the tokens of the `budget / compress_ratio` complete blocks of
// `compress_ratio` positions its indexer scores highest, plus the incomplete last block.
struct QsaIndexerConfig {
  int num_heads = 0;       // indexer_n_heads (one key head: indexer_kv_heads must be 1)
  int head_dim = 0;        // indexer_head_dim
  int budget = 0;          // indexer_budget, a multiple of compress_ratio
  int compress_ratio = 0;  // indexer_compress_ratio
  int block_topk() const { return budget / compress_ratio; }
};

// The PLE layers: hashed n-gram embeddings injected ahead of some linear-attention layers.
struct PleConfig {
  std::vector<int> layers;   // 0-based layers that carry one (ple_layer_ids are one-based)
  int embed_dim = 0;         // ple_embed_dim (default hidden_size)
  int conv_kernel = 4;       // ple_conv_kernel_size; the conv is dilated by ngram_size
  int ngram_size = 3;
  int heads_per_ngram = 8;
  int64_t vocab_size_base = 20000000;  // ngram_vocab_size_base
  int vocab_divisor = 128;             // make_ngram_vocab_size_divisible_by
  int64_t seed = 1234;
  int split_parts = 512;     // split_ngram_parts: the table's pieces in a checkpoint
  int32_t eos_token_id = 0;  // the context before a sequence and across an eos

  int num_heads() const { return (ngram_size - 1) * heads_per_ngram; }
  int head_dim() const { return embed_dim / num_heads(); }
  int context_tokens() const { return ngram_size - 1; }
  int conv_state_positions() const { return (conv_kernel - 1) * ngram_size; }
  // Index of `layer` among the PLE layers (its hash multipliers and primes depend on it), or -1.
  int PleIndex(int layer) const;
};

struct Qwen4ExpConfig {
  int hc_count = 4;     // residual streams
  int hc_lowrank = 320;
  QsaIndexerConfig indexer;
  PleConfig ple;
  OutputGateActivation output_gate = OutputGateActivation::kSilu;

  // Floats one sequence's PLE state takes in a PLE layer: its last ngram_size - 1 tokens (as
  // floats, exact below 2^24), then the conv's last (kernel - 1) * ngram_size inputs of
  // hc_count * hidden floats.
  int64_t PleStateFloats(int hidden_size) const {
    return ple.context_tokens() +
           static_cast<int64_t>(ple.conv_state_positions()) * hc_count * hidden_size;
  }
};

}  // namespace exl3::engine
