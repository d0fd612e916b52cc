// DeepSeek-V4's attention (transformers 5.24's DeepseekV4Attention with its compressors and
// indexer), one layer, on the CPU.
//
// Per token (x: the collapsed, input-normalised hidden state):
//   q_resid = q_norm(wq_a · x)                                          [q_lora_rank]
//   q       = per-head unweighted RMS norm of wq_b · q_resid             [heads, head_dim]
//   kv      = norm(wkv · x)                                              [head_dim]
//   q and kv rotated on their LAST rope_dim dimensions, pairs (2i, 2i+1) interleaved, at the
//   token's position (rope "main" on sliding layers, "compress" on compressed ones).
// One key/value head serves every query head (kv is the key and the value). A query attends
// to the kv of its last sliding_window positions (itself included) and, on compressed layers,
// to compressed entries: scores q·k / sqrt(head_dim), a per-head sink logit (attn_sink) joins
// the softmax and is dropped; the output's rope slice is rotated back (the conjugate angles of
// the query's position); then the grouped output projection: heads split into o_groups groups,
// group g through its own o_lora_rank rows of wo_a, the concatenation through wo_b.
//
// Compressed entries. A window of m consecutive positions [w m, (w + 1) m) becomes entry w once
// its last position is in the cache: per channel, softmax over the window of (wgate · x +
// ape[position % m]) weighs (wkv · x); the sum goes through the compressor's norm and is rotated
// at position w m (rope "compress"). HCA (m = compress_rates' heavily_compressed_attention) uses
// non-overlapping windows and every entry the query may see (w < (position + 1) / m). CSA (m =
// compressed_sparse_attention) projects twice the width: the first half of window w - 1 and the
// second half of window w form entry w (2 m terms; m for entry 0); its indexer runs the same
// compressor at index_head_dim over the same windows (keys), scores each visible entry as
// Σ_h w_h relu(q_h · key) / sqrt(index_head_dim) with q = indexer.wq_b · q_resid rotated at
// the query's position and w = indexer.weights_proj · x / sqrt(index_n_heads), and the query
// attends to the index_topk best (all while it sees no more).
//
// Where the state lives (engine/config/dsv4_config.h's Dsv4CacheLayout): every token's slot in the
// paged KV cache holds its kv, which the sliding window reads. A compressor folds each token's
// projections, in position order, into a running softmax per open window kept in the area of
// the token's cache block (log-sum-exp and weighted mean per channel: the entry is that mean);
// when a window closes, its entry goes into the area of the block holding its last position.
// A block's first position starts from the previous block's accumulators, so nothing is kept
// per sequence outside the cache: a sequence stops and resumes at any token (prefill, decode,
// prefill again), a preempted one is recomputed like any other, and full blocks can be shared by
// prefix caching (a block depends only on the tokens up to its end). Per token that is head_dim
// floats plus, on compressed layers, the block's accumulators and entries shared out over its
// slots (instead of the raw projections of every token, which the windows need only while open).
//
// Verify chunks (speculative decoding): a folded draft cannot be taken out of a running softmax,
// so a compressed layer keeps the accumulators after each of a verify chunk's rows but the last
// per state slot (engine/cpu/attention/dsv4_kept_accumulators.h), and the sequence's next chunk, starting at the
// length the scheduler kept, restores the state for that length before folding on. The kv slots
// of rejected positions and the entries of windows they closed are written again before anything
// reads them (a query reads only positions up to its own and windows closed by then).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "engine/cpu/attention/attention.h"
#include "engine/config/dsv4_config.h"
#include "engine/cpu/attention/dsv4_kept_accumulators.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/rope.h"

namespace exl3::engine {

class Dsv4Attention final : public Attention {
 public:
  static absl::StatusOr<std::unique_ptr<Dsv4Attention>> Load(const ModelConfig& cfg,
                                                             const TensorSource& src, int layer);
  absl::Status Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                       AttentionCarry& carry, float* out, CpuCompute& compute) override;

 private:
  // A window compressor: `compressor.*` of the layer or `indexer.compressor.*` of CSA's indexer.
  struct Compressor {
    Linear wkv, wgate;         // hidden → width
    std::vector<float> ape;    // [m, width]: position_bias
    std::vector<float> norm;   // [dim]
    int dim = 0;               // of an entry
    int width = 0;             // dim, or 2 dim (overlapping windows)
    Dsv4CompressorCache cache;  // where its accumulators and entries lie in a block area
  };
  // One compressor's projections of the step's tokens: kv and gate (+ position bias) [T, width].
  struct Projections {
    std::vector<float> kv, gate;
  };
  struct Indexer {
    Linear wq_b, weights_proj;
    Compressor compressor;
  };

  Dsv4Attention(const ModelConfig& cfg, int layer);
  absl::Status Project(const Compressor& c, const float* x, const StepTokens& tokens,
                       Projections* out, CpuCompute& compute) const;
  // Folds tokens [t0, t1) (one chunk, consecutive positions) into their blocks' accumulators,
  // writing the entries of the windows they close; a verify chunk keeps the accumulators after
  // its rows, and a chunk resuming after rejected drafts restores the kept ones first.
  absl::Status Fold(int t0, int t1, const StepTokens& tokens, PagedKvCache& cache,
                    const Projections& comp, const Projections* ix);
  // Sizes the block areas and the kept states for the cache's shape.
  absl::Status UseCacheShape(const KvCacheShape& shape);
  // Folds one position's projections (row `t`) of `c` into `area`; at a window's last position
  // writes its entry (normalised, rotated) into the area's entries.
  void FoldPosition(const Compressor& c, const Projections& proj, int t, int position, float* area) const;
  // Entry w of `c` (its window's last position is in the cache).
  const float* Entry(const Compressor& c, PagedKvCache& cache, const std::vector<int32_t>& table,
                     int w) const;
  // The compressed entries token t attends to (CSA: its indexer's choice).
  absl::Status SelectEntries(const float* x, const std::vector<float>& q_resid,
                             const StepTokens& tokens, PagedKvCache& cache,
                             std::vector<std::vector<int32_t>>* entries, CpuCompute& compute) const;

  const ModelConfig& cfg_;
  const Dsv4Config& v4_;
  int layer_;
  Dsv4LayerType type_;
  int rate_ = 0;  // m (0: sliding only)
  Dsv4CacheLayout layout_;  // at the cache's block size (set by the first Forward)
  int layout_block_size_ = 0;
  KvCacheShape kept_shape_;           // the shape kept_ was allocated for
  Dsv4KeptAccumulators kept_;         // compressed layers, with speculative decoding
  Rope rope_;     // main or compress, by layer type
  Linear wq_a_, wq_b_, wkv_, wo_b_;
  std::vector<Linear> wo_a_;  // one per group: [o_lora_rank] from [heads * head_dim / o_groups]
  std::vector<float> q_norm_, kv_norm_, sinks_;
  std::optional<Compressor> compressor_;
  std::optional<Indexer> indexer_;
};

}  // namespace exl3::engine
