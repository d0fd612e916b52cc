// The kernels of DeepSeek-V4's DSPARK block drafter on the GPU (engine/cuda/cuda_dspark_drafter.h;
// docs/dspark.md says what it computes) that no other block of the GPU engine has: the gather of
// each draft's attention keys (its history of main-kv rows from the paged row cache, then the
// block's own rows) into one contiguous run per draft, and the greedy Markov bigram loop with the
// confidence head. Everything else of the drafter runs on the engine's existing kernels (linears,
// RMSNorm, the DeepSeek-V4 rope tail and sliding attention with sinks, hyper-connections, the MoE).
// Host launchers only: this header includes no CUDA header; every pointer is device memory, every
// launch goes on `stream`, none synchronises. fp32 like the CPU drafter (engine/cpu/mtp/dspark_drafter.h),
// its dot products summed in double as the CPU sums them.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/dsv4_attention_kernels.h"

namespace exl3::engine::cuda {

using StreamHandle = void*;  // cudaStream_t

// What each draft s of a call (S drafts, block_size B) reads: int32 [S] each.
struct DsparkDraftFacts {
  const int32_t* table_offset = nullptr;  // where draft s's block table starts in `tables`
  const int32_t* p0 = nullptr;            // its first block position (the seed's)
  const int32_t* hist = nullptr;          // its history rows: positions p0 - hist .. p0 - 1
  const int32_t* tables = nullptr;        // every draft's block table, concatenated
};

// keys [S, key_rows, D] fp32: draft s's rows 0 .. hist[s] - 1 = the rows of positions
// p0[s] - hist[s] .. p0[s] - 1 in `rows` (one block's main-kv row cache, paged as a DeepSeek-V4
// sliding layer's kv: Dsv4CacheView with token_floats D, no block area), then rows hist[s] ..
// hist[s] + B - 1 = block_rows [S * B, D] fp32 rows s * B .. s * B + B - 1; rows past those are
// left as they are. key_rows >= max hist + B. D = rows.token_floats.
absl::Status DsparkGatherKeys(const Dsv4CacheView& rows, const DsparkDraftFacts& facts, const float* block_rows,
                              int num_drafts, int block_size, int key_rows, float* keys, StreamHandle stream);

// The Markov head and the confidence head of the drafter's last block.
struct DsparkHeads {
  const float* markov_w1 = nullptr;  // [V, r] fp32 (an embedding table)
  const float* markov_w2 = nullptr;  // [V, r] fp32
  const float* markov_b2 = nullptr;  // [V] fp32, or null
  const float* conf_w = nullptr;     // [H + r] fp32
  float conf_b = 0.0f;
  int vocab = 0, rank = 0, hidden = 0;  // V, r, H
};

// Floats of DsparkMarkovStep's partial maxima for S drafts (their indices: as many int32).
int DsparkMarkovPartials(int vocab);

// Step j of the greedy Markov loop of S drafts (j = 0 .. B - 1, launched in order), as
// DsparkDrafter::Draft: with t_j = tokens[s, j] (tokens [S, B + 1] int32, tokens[s, 0] the seed)
// and e = markov_w1[t_j] [r],
//   logits[s * B + j, v] += markov_w2[v] · e (+ markov_b2[v])         logits [S * B, V] fp32, in place
//   tokens[s, j + 1] = drafts[s * B + j] = the arg max of that row (the lowest id on ties)
//   confidence[s * B + j] = conf_w · [pre[s * B + j] ; e] + conf_b    pre [S * B, H] fp32 (hc_head's)
// drafts [S * B] int32, confidence [S * B] fp32. partial_max / partial_arg: DsparkMarkovPartials(V) * S
// floats / int32 of scratch.
absl::Status DsparkMarkovStep(const DsparkHeads& heads, int num_drafts, int block_size, int j, const float* pre,
                              float* logits, int32_t* tokens, int32_t* drafts, float* confidence, float* partial_max,
                              int32_t* partial_arg, StreamHandle stream);

}  // namespace exl3::engine::cuda
