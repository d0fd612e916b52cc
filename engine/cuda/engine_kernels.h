// The CUDA engine's own kernels (everything of a forward pass that is not an EXL3 or dense linear
// layer nor the experts, nor attention): embedding gather, RMSNorm fused with the residual add,
// RoPE, SwiGLU, gated attention's query/gate split and output gate, the MoE gate and the row
// gather of the head. Host launchers only: this header includes no CUDA header. Every pointer is device memory, every
// launch goes on `stream` and none synchronises, so a step can be captured in a CUDA graph.
//
// Activations are fp32 throughout. The KV cache and attention are engine/cuda/attention_kernels.h's.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {

using StreamHandle = void*;  // cudaStream_t

enum class EmbeddingDType { kF32, kF16, kBF16 };

// out [T, hidden] fp32 = table[ids[t]] converted; table [vocab, hidden] of `dtype`; ids [T] int32
// (checked on the host before: every id in [0, vocab)).
absl::Status EmbedRows(const void* table, EmbeddingDType dtype, const int32_t* ids, int num_tokens,
                       int hidden, float* out, StreamHandle stream);

// y[r] = rmsnorm(x[r]) * w for `rows` rows of n floats; x [rows, n], w [n], y [rows, n] (y may be
// x). The mean of squares is accumulated in double, as the CPU engine does.
absl::Status RmsNorm(const float* x, const float* w, int rows, int n, float eps, float* y,
                     StreamHandle stream);

// Residual add fused with the next norm: h[r] += d[r]; y[r] = rmsnorm(h[r]) * w. h, d, y
// [rows, n], w [n].
absl::Status AddRmsNorm(float* h, const float* d, const float* w, int rows, int n, float eps,
                        float* y, StreamHandle stream);

// h += d over n floats.
absl::Status AddInPlace(float* h, const float* d, int64_t n, StreamHandle stream);

// Rotates the first rotary_dim dimensions of `num_heads` heads per token in place: x [T, row
// stride floats], head h of token t at x + t * row_stride + h * head_stride; cos/sin [T,
// rotary_dim / 2] (already scaled by the attention factor, engine/cpu/rope.h). interleaved: pairs
// (2i, 2i+1) and the output de-interleaved (DeepSeek); else pairs (i, i + rotary_dim / 2).
absl::Status ApplyRope(float* x, int num_tokens, int num_heads, int row_stride, int head_stride,
                       int rotary_dim, bool interleaved, const float* cos, const float* sin,
                       StreamHandle stream);

// gate[i] = silu(gate[i]) * up[i] over n floats (the dense MLP's SwiGLU, no clamp).
absl::Status SiluMul(float* gate, const float* up, int64_t n, StreamHandle stream);
// SiluMul with GLM-5.3-Flash's clamp (its dense MLP's swiglu_limit; kernels/moe_cpu.h's SwiGlu with
// limit > 0): gate[i] = silu(min(gate[i], limit)) * clamp(up[i], -limit, limit). limit > 0, finite.
absl::Status ClampedSiluMul(float* gate, const float* up, int64_t n, float limit, StreamHandle stream);

// Qwen3-Next's gated attention: q_proj's output qg [rows, 2 * head_dim] (rows = tokens * heads;
// per head its query, then the gate of its output) split into q and gate [rows, head_dim].
absl::Status SplitQueryGate(const float* qg, int64_t rows, int head_dim, float* q, float* gate,
                            StreamHandle stream);

// x[i] *= sigmoid(gate[i]) over n floats (the attention output's gate, before o_proj).
absl::Status SigmoidGate(float* x, const float* gate, int64_t n, StreamHandle stream);

// The MoE gate's choice from router logits [T, E] fp32, as model/routing.h's RouteFromLogits
// does it (softmax, or sigmoid / sqrt-softplus with the correction bias and grouped selection):
// ids [T, k] int32 in descending choice score (lower index first on ties), weights [T, k] fp32.
// bias [E] or null.
struct GateConfig {
  ScoringFunc scoring = ScoringFunc::kSoftmax;
  int num_experts = 0, top_k = 0;
  int n_group = 1, topk_group = 1;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
};
// The routing facts of a model's MoE layers (a kernel argument: no vectors).
GateConfig GateConfigFor(const MoeConfig& moe);
absl::Status RouteOnDevice(const GateConfig& cfg, const float* logits, const float* bias,
                           int num_tokens, int32_t* ids, float* weights, StreamHandle stream);

// The gate of a hash-routed layer (DeepSeek-V4's hash_moe), as model/routing.h's RouteHashed: the
// experts of token t are tid2eid[ids[t]] [k] (the table's order), weighted by the layer's score
// of its router logits (sigmoid or sqrt-softplus), normalised when norm_topk_prob, times the
// routed scaling factor. logits [T, E]; tid2eid [vocab, k] int32 (checked at load: every entry in
// [0, E), vocab covering every token id); token_ids [T] int32; ids [T, k], weights [T, k].
absl::Status HashRouteOnDevice(const GateConfig& cfg, const float* logits, const int32_t* tid2eid,
                               const int32_t* token_ids, int num_tokens, int32_t* ids, float* weights,
                               StreamHandle stream);

// out[r] = rmsnorm(h[rows[r]]) * w: the final norm of the rows whose logits are wanted. h [T, n],
// rows [R] int32, out [R, n].
absl::Status GatherRmsNorm(const float* h, const int32_t* rows, int num_rows, const float* w,
                           int n, float eps, float* out, StreamHandle stream);

// out[r] = x[rows[r]]: rows of x [T, n] gathered into out [R, n]; rows [R] int32.
absl::Status GatherRows(const float* x, const int32_t* rows, int num_rows, int n, float* out, StreamHandle stream);

// y[t, o] += bias[o] for y [T, out] (dense layers' fp32 bias).
absl::Status AddBias(float* y, const float* bias, int num_tokens, int out_features,
                     StreamHandle stream);

}  // namespace exl3::engine::cuda
