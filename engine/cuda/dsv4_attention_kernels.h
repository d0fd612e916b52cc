// DeepSeek-V4's attention kernels on the GPU (engine/cpu/attention/dsv4_attention.h has the arithmetic; the
// layer class is engine/cuda/dsv4_attention.h): the rope of the trailing rope_dim dimensions
// (pairs interleaved, in place), the shared key/value's cache write, the compressors' fold of the
// step's tokens into their blocks' running softmax (closing windows into compressed entries), the
// CSA indexer's scores of the compressed entries, and the attention over the sliding window plus
// the compressed entries with the sink. Host launchers only: this header includes no CUDA
// header; every pointer is device memory, every launch goes on `stream`, none synchronises.
//
// The cache of one layer is fp32 and laid out as the CPU engine's (engine/cpu/paged_kv_cache.h, with
// engine/config/dsv4_config.h's Dsv4CacheLayout for the block areas): block b at layer + b *
// block_stride holds block_size slots of token_floats (the token's normalised, rotated kv), then
// the block area (block_stride - block_size * token_floats floats; none on sliding layers).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/attention_kernels.h"

namespace exl3::engine::cuda {

struct Dsv4CacheView {
  float* layer = nullptr;  // the layer's first float
  int block_size = 16;
  int token_floats = 0;    // head_dim
  int block_stride = 0;    // floats per block: block_size * token_floats + the block area
  // With speculative decoding, on compressed layers: the layer's kept accumulators
  // (Dsv4FoldArgs::kept); else null.
  float* kept = nullptr;
};

// x [rows, heads, dim] in place: with `normalize`, each head first divided by its RMS (no
// weight; mean of squares in double + eps); then its last rope_dim dimensions rotated, pairs
// (2i, 2i + 1), by the angles of its row: cos/sin [rows, rope_dim / 2], sign -1 rotating back.
absl::Status Dsv4RotateTail(float* x, int rows, int heads, int dim, int rope_dim, const float* cos,
                            const float* sin, float sign, bool normalize, float eps, StreamHandle stream);

// The slot of token t (its position in its sequence's blocks) ← kv [T, token_floats].
absl::Status Dsv4WriteSlots(const float* kv, int num_tokens, const AttentionTokens& tokens,
                            const Dsv4CacheView& cache, StreamHandle stream);

// One compressor of a layer: its step projections and where its state lies in a block area
// (engine/config/dsv4_config.h's Dsv4CompressorCache; offsets in floats).
struct Dsv4CompressorArgs {
  int dim = 0;               // of an entry; 0: no such compressor
  bool overlapping = false;  // CSA: projections of 2 dim, accumulators current and next
  int current = 0, next = 0, entries = 0;
  const float* kv = nullptr;    // [T, width] (width = overlapping ? 2 dim : dim)
  const float* gate = nullptr;  // [T, width], without the position bias
  const float* ape = nullptr;   // [rate, width] position bias
  const float* norm = nullptr;  // [dim] the entry's RMSNorm weight
};
// A chunk's keeping (Dsv4FoldArgs::chunk_keeping; engine/cuda/dsv4_kept_row_slots.h plans it):
// [restore row (-1: none), first token of the step whose state is kept (the step's token count:
// none), its slot's first row].
inline constexpr int kDsv4KeepingInts = 3;

struct Dsv4FoldArgs {
  int rate = 0;          // m
  int folded = 0;        // offset of the folded-positions count in the area
  int accumulators_end = 0;  // accumulators are [folded + 1, accumulators_end)
  int rope_dim = 0;
  float eps = 0.0f;      // rms_norm_eps of the entry norm
  Dsv4CompressorArgs compressor, indexer;  // indexer.dim 0: none (HCA)
  // Speculative decoding (engine/cuda/dsv4_kept_row_slots.h), else both null: the layer's kept
  // accumulators [rows, accumulators_end - folded - 1] and per chunk its keeping
  // [kDsv4KeepingInts]: the row to restore before its first position (-1: none), the first token
  // whose state it keeps (then each token's but its last, unless it ends its block, in the slot's
  // rows from the given first, skipping the restored one).
  float* kept = nullptr;
  const int32_t* chunk_keeping = nullptr;
};

// Folds every chunk's tokens (chunk c: tokens [chunk_start[c], chunk_start[c + 1]), consecutive
// positions of one sequence) into their blocks' accumulators in position order, writing the
// entries of the windows they close, as Dsv4Attention::Fold (one block of the grid per chunk, the
// channels in parallel). entry_cos/sin [T, rope_dim / 2]: the angles of (position / m) * m. A
// position its block has already folded is skipped (a failed step run again), unless it is the
// chunk's first and the chunk restores a kept state: then the block continues from that state
// (drafts the scheduler rejected are folded over). A chunk that cannot continue its block's state
// (the CPU engine's InternalError) stops and leaves its code in *error (1: the previous block is
// not full; 2: positions of the block were skipped), unless an earlier code is there.
absl::Status Dsv4Fold(const Dsv4FoldArgs& args, const Dsv4CacheView& cache, const AttentionTokens& tokens,
                      const int32_t* chunk_start, int num_chunks, const float* entry_cos, const float* entry_sin,
                      int32_t* error, StreamHandle stream);

// The CSA indexer's scores of the compressed entries of `num_tokens` tokens from first_token:
// scores[i * row_length + e] = Σ_h max(q[t, h] · key_e, 0) * scale * (weights[t, h] *
// head_weight) for t = first_token + i and e ≤ last_entry[t] (keys: the indexer compressor's
// entries, at `entries` in the block areas, of index_head_dim floats); rows of tokens that see no
// more than topk entries are not written (IndexerTopk takes all of theirs). q [T, heads,
// head_dim] (rotated); weights [T, heads].
struct Dsv4IndexShape {
  int heads = 0, head_dim = 0, rate = 0, entries = 0, topk = 0;
};
absl::Status Dsv4IndexScores(const float* q, const float* weights, float head_weight, float scale,
                             const Dsv4CacheView& cache, const AttentionTokens& tokens, const int32_t* last_entry,
                             const Dsv4IndexShape& shape, int first_token, int num_tokens, int blocks_per_token,
                             float* scores, int row_length, StreamHandle stream);

// Which compressed entries each token attends to.
struct Dsv4Entries {
  int rate = 0;     // m; 0: none (sliding-window layers)
  int offset = 0;   // the layer compressor's entries in a block area
  // CSA: the indexer's choice, selected[t * stride ..] of count[t] entries; null: HCA, every
  // entry e < (position + 1) / m.
  const int32_t* selected = nullptr;
  const int32_t* count = nullptr;
  int stride = 0;
};

// out [T, heads * dim] = per (token, head) softmax over the token's keys (its window's slots
// first_visible..position, then its entries) and the head's sink logit sinks[h] (no value) of
// scale * q · key, weighing the keys (key = value); then its last rope_dim dimensions rotated back
// by the token's angles cos/sin [T, rope_dim / 2]. q [T, heads, dim]; dim a multiple of 32, ≤ 512.
absl::Status Dsv4Attend(const float* q, const float* sinks, const Dsv4CacheView& cache,
                        const AttentionTokens& tokens, const Dsv4Entries& entries, int num_tokens, int heads,
                        int dim, int rope_dim, float scale, const float* cos, const float* sin, float* out,
                        StreamHandle stream);

}  // namespace exl3::engine::cuda
