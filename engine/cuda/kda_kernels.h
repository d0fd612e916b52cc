// The kernels of GLM-5.3-Flash's KDA layer on the GPU (engine/cuda/cuda_kimi_delta_attention.h
// runs them between its projections), the CPU layer's arithmetic (engine/cpu/linear_attention/kimi_delta_attention.h,
// which states it) in fp32: the causal depthwise convolutions of q, k and v over each sequence's
// conv state + SiLU, the L2 norms of q and k (q scaled), the per-channel log-decay and β, the Kimi
// delta rule token by token (engine/cuda/delta_rule_kernels.h), and the
// output RMSNorm · sigmoid(gate). Host launchers only: this header includes no CUDA header. Every
// pointer is device memory, every launch goes on `stream` and none synchronises; which state each
// chunk reads and writes comes from device arrays (engine/cuda/recurrent_chunks.h), so a decode
// step's launches can be captured in a CUDA graph and replayed with other slots.
//
// Token rows are the step's rows: a launch runs rows [first, first + n) or chunks
// [first_chunk, first_chunk + num_chunks) of buffers laid out for the whole step. Below, W =
// num_heads · head_dim (q, k and v alike), C = 3 · W (the conv channels: q | k | v), D = head_dim.
//
// The state of each chunk at this layer's part of a store row, as the CPU store lays it out: the
// conv state [conv_kernel - 1, C] fp32 (oldest input first), then S [num_heads, D, D] fp32 (S[h][c]
// [e]: key channel c, value channel e).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/recurrent_chunks.h"

// The shape's helpers compile for the kernels too (nvcc) without a CUDA header here.
#if defined(__CUDACC__)
#define EXL3_KDA_HD __host__ __device__
#else
#define EXL3_KDA_HD
#endif

namespace exl3::engine::cuda {

// The layer's shape (engine/config/model_config.h LinearAttentionConfig: KDA's key and value heads and
// dims are the same).
struct KdaDims {
  int num_heads = 0, head_dim = 0, conv_kernel = 0;

  EXL3_KDA_HD int width() const { return num_heads * head_dim; }
  EXL3_KDA_HD int conv_channels() const { return 3 * width(); }
  EXL3_KDA_HD int64_t conv_state_floats() const {
    return static_cast<int64_t>(conv_kernel - 1) * conv_channels();
  }
};

// KDA's forget gate (engine/config/glm5next_config.h): log-decay = lower_bound · sigmoid(exp(A_log) · g),
// or without a bound −exp(A_log) · softplus(g).
struct KdaForgetGate {
  enum class Form { kLowerBounded, kSoftplus };
  Form form = Form::kLowerBounded;
  float lower_bound = -5.0f;  // read by kLowerBounded only
};

// conv_out[t, c] = silu(Σ_i w[c, i] · u(j + i, c)) for rows t in [first, first + n), where j is t's
// index in its chunk and u(i, c) the chunk's window: the conv state's input i for i < K - 1, else
// the chunk's token i - (K - 1). q, k, v [step rows, W] fp32 (the projections); conv_weight [C, K]
// fp32 (q's channels, then k's, then v's); conv_out [step rows, C] fp32 (q | k | v).
absl::Status KdaConv(const float* q, const float* k, const float* v, const float* conv_weight,
                     const KdaDims& dims, const RecurrentChunks& chunks, int first, int n,
                     float* conv_out, StreamHandle stream);

// The conv state each chunk of [first_chunk, first_chunk + num_chunks) leaves: the last K - 1
// inputs of its window [K - 1, C], written to its write_row (read from its read_row where the chunk
// is shorter than K - 1); a verify chunk's after each of its kept tokens, to their rows
// (engine/cuda/recurrent_chunks.h). q, k, v as above.
absl::Status KdaConvState(const float* q, const float* k, const float* v, const KdaDims& dims,
                          const RecurrentChunks& chunks, int first_chunk, int num_chunks,
                          StreamHandle stream);

// In place over rows [first, first + n), per (token, head):
//   conv_out [step rows, C]: q and k of the head L2-normalised (x / sqrt(Σx² + 1e-6), the sum in
//     double as the CPU's), then q times D^-1/2;
//   log_decay [step rows, W] fp32: in f_b_proj's output, out the log-decay of `gate` with
//     g = in + dt_bias; decay_rate = exp(A_log) [num_heads] fp32, dt_bias [W] fp32;
//   beta [step rows, num_heads] fp32: in b_proj's output, out its sigmoid.
absl::Status KdaNormAndGates(float* conv_out, float* log_decay, float* beta,
                             const float* decay_rate, const float* dt_bias,
                             const KdaForgetGate& gate, const KdaDims& dims, int first, int n,
                             StreamHandle stream);

// The Kimi delta rule (engine/cpu/linear_attention/kimi_delta_rule.h's recurrent form) of chunks [first_chunk,
// first_chunk + num_chunks) (engine/cuda/delta_rule_kernels.h): S from the chunk's read_row,
// then per token S ← diag(exp(g))·S; S ← S + k ⊗ β(v − Sᵀk); core[t, h] = Sᵀq; S to the
// write_row (and a verify chunk's kept states to their rows: it runs every chunk token by token,
// so each is, bit for bit, the state a chunk of only those tokens leaves from the same inputs).
// conv_out (normalised), log_decay and beta as KdaNormAndGates leaves them; core [step rows, W]
// fp32.
absl::Status KdaRecurrence(const float* conv_out, const float* log_decay, const float* beta,
                           const KdaDims& dims, const RecurrentChunks& chunks, int first_chunk,
                           int num_chunks, float* core, StreamHandle stream);

// In place over core rows [first, first + n): each head's vector rmsnorm(o) · w · sigmoid(gate)
// (the mean of squares in double as the CPU's); gate [step rows, W] fp32 (g_b_proj's output);
// o_norm [D] fp32.
absl::Status KdaGatedNorm(float* core, const float* gate, const float* o_norm, const KdaDims& dims,
                          float eps, int first, int n, StreamHandle stream);

// Whether the kernels take `dims` (head_dim at most 128: GLM-5.3-Flash's linear_head_dim).
absl::Status CheckKdaDims(const KdaDims& dims);

}  // namespace exl3::engine::cuda
