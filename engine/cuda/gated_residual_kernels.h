// The kernels of Qwen4-Exp's low-rank gated hyper-connections on the GPU
// (engine/cuda/gated_connection.h runs them around its three projections): the CPU engine's
// arithmetic (engine/cpu/residual/gated_residual.h states the formulas) in fp32, in its order of operations.
// Host launchers only: this header includes no CUDA header; every pointer is device memory, every
// launch goes on `stream`, none synchronises or allocates, and 0 tokens launch nothing.
//
// A token's residual is `streams` (S) copies of the hidden state: h [tokens, S, hidden].
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/engine_kernels.h"

namespace exl3::engine::cuda {

// normed [T, S, hidden] = RMSNorm of every stream of token rows[t] of h [*, S, hidden] with its
// own part of weight [S * hidden] (already 1 + w), the sum of squares in double; rows [T] int32,
// or null for rows 0..T-1.
absl::Status GatedStreamNorm(const float* h, const int32_t* rows, int num_tokens, int streams, int hidden,
                             const float* weight, float eps, float* normed, StreamHandle stream);

// In place, in one launch: low [n_low] ← silu(low / S) (the down projection's output) and inject
// [n_inject] ← 2 · sigmoid(inject / S) (block_inject's; n_inject 0 and inject null for the head's
// mixer).
absl::Status GatedActivations(float* low, int64_t n_low, float* inject, int64_t n_inject, int streams,
                              StreamHandle stream);

// x [T, hidden] = (Σ_k sigmoid(w[t, k, i]) · normed[t, k, i]) · (1 / S), k in order; w and normed
// [T, S, hidden].
absl::Status GatedStreamMix(const float* w, const float* normed, int num_tokens, int streams, int hidden,
                            float* x, StreamHandle stream);

// h [T, S, hidden]: h[t, k] += inject[t, k] · out[t] for every stream; inject [T, S], out
// [T, hidden].
absl::Status GatedExpand(const float* inject, const float* out, int num_tokens, int streams, int hidden, float* h,
                         StreamHandle stream);

}  // namespace exl3::engine::cuda
