// The CUDA engine's attention: the fp16 paged KV cache's write, split-K decode attention and
// tensor-core prefill attention over that cache. Host launchers only: this header includes no CUDA
// header. Every pointer is device memory, every launch goes on `stream` and none synchronises, so
// a step can be captured in a CUDA graph.
//
// The cache holds fp16 (IEEE binary16) keys and values in the CPU engine's slot layout
// (engine/cpu/paged_kv_cache.h): per layer [num_blocks * block_size slots, 2 * kv_floats], a slot being
// the keys of every KV head, then the values of every KV head, head_dim each. Queries, outputs and
// every accumulation are fp32; the tensor-core kernels round queries and the softmax
// probabilities to fp16 for their products (about 5e-4 relative).
//
// Both attention launchers cut the work the same way (split-K flash-decoding, GQA-aware): a block
// of the grid takes one KV head, one range of key positions (a split) and a tile of query rows,
// a row being one (query token, query head of that KV head's group) pair, so each KV head's keys
// are read once for the whole group. With one split the output is written directly; with several,
// each block writes its rows' partial (max, sum, unnormalised output) to `scratch` and a second
// kernel combines them.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace exl3::engine::cuda {

using StreamHandle = void*;  // cudaStream_t

// One element of the KV cache as stored: fp16 bits (the kernels read it as __half).
using KvHalf = uint16_t;

// cache_layer[slot[t] * width + j] = fp16(j < kv_floats ? k[t, j] : v[t, j - kv_floats]) with
// width = 2 * kv_floats, rounded to nearest; k, v [T, kv_floats] fp32; slot [T] int32.
absl::Status WriteKv(const float* k, const float* v, const int32_t* slot, int num_tokens,
                     int kv_floats, KvHalf* cache_layer, StreamHandle stream);

// What paged attention reads of each query token (all [T] int32 unless said).
struct AttentionTokens {
  const int32_t* position = nullptr;       // its position in its sequence
  const int32_t* first_visible = nullptr;  // first position it may see (sliding window; else 0)
  const int32_t* table_offset = nullptr;   // where its sequence's block table starts in `tables`
  const int32_t* tables = nullptr;         // every chunk's block table, concatenated
  int block_size = 16;
};

// Scratch for the split-K partials: floats for T tokens, num_heads heads, head_dim, splits.
int64_t AttentionScratchFloats(int num_tokens, int num_heads, int head_dim, int splits);

// Splits of a decode step's attention (CUDA graphs fix them at capture; the positions per split
// follow each step's context). A decode block has four warps on its token's keys; where the
// tokens give at most one (token, KV head) block per two SMs, about 1.5 blocks per SM (at most 32
// splits), else one split. From exl3-engine-bench's sweep on an H200 (96/8 heads of 128;
// bench/results/engine-h200.md): batch 1, 8-16 splits best at 1k (20.0 us), 16-32 at 8k (34.8);
// batch 8, 4 splits at 8k (100 us; 2: 150, 8: 109), 3-4 at 1k; batch 32 and 64 one split (8k × 64:
// 644 us, 1.25× the KV-read floor).
int DecodeAttentionSplits(int num_tokens, int num_kv_heads, int sm_count);

// Decode attention, each of the T query tokens of its own sequence (or of one sequence, each
// token then still run on its own: the path for a few tokens):
// out[t, h] = softmax(scale * q[t, h] · K[first..pos]) · V[first..pos] over the paged cache, keys
// of KV head g = h / (num_heads / num_kv_heads). q [T, num_heads * head_dim] fp32; cache_layer as
// WriteKv wrote it; out [T, num_heads * head_dim] fp32. A token's positions [first, pos] are split
// into `splits` ranges of *split_positions (the last split takes whatever is left), combined
// through `scratch` (AttentionScratchFloats) when splits > 1. split_positions: one int32 in device
// memory (so a captured graph reads each step's). Head dims 64, 128 and 256 run on tensor cores;
// others (a multiple of 4, at most 256) on a CUDA-core kernel.
absl::Status PagedAttention(const float* q, const KvHalf* cache_layer, const AttentionTokens& tokens,
                            int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                            float scale, int splits, const int32_t* split_positions, float* scratch,
                            float* out, StreamHandle stream);

// Prefill attention on tensor cores (flash-attention style, causal, sliding window through
// first_visible): the T query tokens are consecutive tokens of ONE sequence (a prefill chunk; its
// earlier positions, written by earlier steps, are read from the paged cache like its own).
// Arguments as PagedAttention's; a block's query tile holds 64 rows (tokens × group heads), so
// every key tile is read once per 64 rows instead of once per token. Splits as PagedAttention's,
// counted from the first position the tile's tokens may see.
absl::Status PrefillAttention(const float* q, const KvHalf* cache_layer, const AttentionTokens& tokens,
                              int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                              float scale, int splits, const int32_t* split_positions, float* scratch,
                              float* out, StreamHandle stream);

// Whether PrefillAttention takes this head_dim (64, 128, 256).
bool PrefillAttentionSupports(int head_dim);

// A chunk of at least this many tokens of one sequence goes to PrefillAttention. Below it the
// chunk is decode-like (a few tokens, e.g. a short tail of a prompt) and PagedAttention's
// per-token blocks with split-K keep the GPU busier than a few prefill tiles would: at 16 tokens a
// prefill tile holds 16 × group rows (≥ 64 for GLM-4.5-Air's group of 12), reading each key once
// for all of them.
constexpr int kPrefillMinTokens = 16;

}  // namespace exl3::engine::cuda
