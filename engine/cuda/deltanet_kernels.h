// The kernels of Qwen3-Next's gated DeltaNet layer on the GPU (engine/cuda/cuda_gated_deltanet.h
// runs them between its projections), the same arithmetic as the CPU layer
// (engine/cpu/linear_attention/gated_deltanet.h) in fp32: the causal depthwise conv1d + SiLU over each sequence's conv
// state, the L2 norms of q and k (q scaled), β and the decay, the delta-rule recurrence token by
// token (engine/cuda/delta_rule_kernels.h), the gated RMSNorm · SiLU(z).
// Host launchers only: this header includes no CUDA header. Every pointer is device memory, every
// launch goes on `stream` and none synchronises; which state each chunk reads and writes comes
// from device arrays (RecurrentChunks), so a decode step's launches can be captured in a CUDA graph
// and replayed with other slots.
//
// Token rows are the step's (global) rows: a launch runs rows [first, first + n) and chunks
// [first_chunk, first_chunk + num_chunks) of buffers laid out for the whole step.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/recurrent_chunks.h"

// The shape's helpers compile for the kernels too (nvcc) without a CUDA header here.
#if defined(__CUDACC__)
#define EXL3_DELTANET_HD __host__ __device__
#else
#define EXL3_DELTANET_HD
#endif

namespace exl3::engine::cuda {

// The layer's shape (engine/config/model_config.h LinearAttentionConfig, as a kernel argument).
struct DeltaNetDims {
  int num_key_heads = 0, num_value_heads = 0, key_head_dim = 0, value_head_dim = 0;
  int conv_kernel = 0;

  EXL3_DELTANET_HD int key_dim() const { return num_key_heads * key_head_dim; }
  EXL3_DELTANET_HD int value_dim() const { return num_value_heads * value_head_dim; }
  EXL3_DELTANET_HD int conv_channels() const { return 2 * key_dim() + value_dim(); }
  EXL3_DELTANET_HD int qkvz_width() const { return 2 * key_dim() + 2 * value_dim(); }
  EXL3_DELTANET_HD int64_t conv_state_floats() const {
    return static_cast<int64_t>(conv_kernel - 1) * conv_channels();
  }
};

// The state of each chunk (engine/cuda/recurrent_chunks.h) at this layer's part of a store row:
// the conv state [conv_kernel - 1, conv_channels] (oldest input first), then S [num_value_heads,
// key_head_dim, value_head_dim], as the CPU store lays them out.

// conv_out[t, c] = silu(Σ_i w[c, i] · u(j + i, c)) for rows t in [first, first + n), where j is t's
// index in its chunk and u(i, c) the chunk's window: the conv state's input i for i < K - 1, else
// the chunk's token i - (K - 1). qkvz [step tokens, qkvz_width] fp32 as in_proj_qkvz writes it (per
// key head: q, k, then v and z of its value heads); conv_weight [conv_channels, K] fp32; conv_out
// [step tokens, conv_channels] fp32 in conv order (q of every key head | k | v of every value
// head).
absl::Status DeltaNetConv(const float* qkvz, const float* conv_weight, const DeltaNetDims& dims,
                          const RecurrentChunks& chunks, int first, int n, float* conv_out,
                          StreamHandle stream);

// The conv state each chunk of [first_chunk, first_chunk + num_chunks) leaves: the last K - 1
// inputs of its window, written to its write_row (read from its read_row where the chunk is
// shorter than K - 1); a verify chunk's after each of its kept tokens, to their rows
// (engine/cuda/recurrent_chunks.h). qkvz as above.
absl::Status DeltaNetConvState(const float* qkvz, const DeltaNetDims& dims,
                               const RecurrentChunks& chunks, int first_chunk, int num_chunks,
                               StreamHandle stream);

// In place over conv_out [step tokens, conv_channels] rows [first, first + n): q and k of every key
// head L2-normalised (x / sqrt(Σx² + 1e-6)), q times key_head_dim^-1/2. And per value head h:
// beta[t, h] = sigmoid(b), decay[t, h] = exp(neg_a[h] · softplus(a + dt_bias[h])) from ba
// [step tokens, 2 * num_value_heads] (per key head: b of its value heads, then a); neg_a =
// -exp(A_log) and dt_bias [num_value_heads] fp32; beta, decay [step tokens, num_value_heads] fp32.
absl::Status DeltaNetNormAndGates(float* conv_out, const float* ba, const float* neg_a,
                                  const float* dt_bias, const DeltaNetDims& dims, int first, int n,
                                  float* beta, float* decay, StreamHandle stream);

// The delta rule of chunks [first_chunk, first_chunk + num_chunks)
// (engine/cuda/delta_rule_kernels.h): S from the chunk's read_row, then per token S ← decay·S;
// S ← S + k ⊗ β(v − Sᵀk); core[t, h] = Sᵀq; S to the write_row (and a verify chunk's kept
// states to their rows). conv_out (normalised), beta,
// decay as above; core [step tokens, num_value_heads, value_head_dim] fp32.
absl::Status DeltaNetRecurrence(const float* conv_out, const float* beta, const float* decay,
                                const DeltaNetDims& dims, const RecurrentChunks& chunks,
                                int first_chunk, int num_chunks, float* core, StreamHandle stream);

// The activation of z in the gated output norm: Qwen3-Next's SiLU, or Qwen4-Exp's
// `output_gate_type` (SiLU or sigmoid).
enum class DeltaNetOutputGate { kSilu, kSigmoid };

// In place over core rows [first, first + n): each value head's vector rmsnorm(o) · w · act(z),
// z from qkvz; norm_weight [value_head_dim] fp32 (used as stored).
absl::Status DeltaNetGatedNorm(float* core, const float* qkvz, const float* norm_weight,
                               const DeltaNetDims& dims, float eps, DeltaNetOutputGate gate, int first,
                               int n, StreamHandle stream);

// Qwen4-Exp's separate projections (Qwen3.5's layout) regrouped as in_proj_qkvz / in_proj_ba write
// theirs, for rows [first, first + n): qkv [step tokens, conv_channels] (q of every key head | k |
// v of every value head), z [step tokens, value_dim], b and a [step tokens, num_value_heads] into
// qkvz [step tokens, qkvz_width] and ba [step tokens, 2 * num_value_heads] (per key head: q, k, v
// of its value heads, z of them; b of its value heads, then a). No pointer may alias another.
absl::Status DeltaNetGroupSeparateProjections(const float* qkv, const float* z, const float* b, const float* a,
                                              const DeltaNetDims& dims, int first, int n, float* qkvz,
                                              float* ba, StreamHandle stream);

// Whether the kernels take `dims` (value heads a multiple of key heads, key_head_dim at most 128).
absl::Status CheckDeltaNetDims(const DeltaNetDims& dims);

}  // namespace exl3::engine::cuda
