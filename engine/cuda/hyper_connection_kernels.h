// DeepSeek-V4's and GLM-5.3-Flash's manifold-constrained hyper-connections on the GPU: the same
// arithmetic as the CPU engine's engine/cpu/residual/hyper_connections.h (which says what the mixing is), on
// device memory. Host launchers only: this header includes no CUDA header; every pointer is device
// memory, every launch goes on `stream`, none synchronises or allocates.
//
// The residual of each token is `streams` (hc_mult, N ≤ 16) copies [N, hidden]; a block's mixing
// weights come from the RMS-normalised (no weight) concatenation of the N streams through fn.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace exl3::engine::cuda {

using StreamHandle = void*;  // cudaStream_t

// One hyper-connection's weights on the device and the scalars it needs.
struct HyperConnectionArgs {
  const float* fn = nullptr;    // [(2 + N) * N, N * hidden] fp32
  const float* base = nullptr;  // [(2 + N) * N] fp32
  float scale[3] = {1.0f, 1.0f, 1.0f};  // pre, post, comb (hc_*_scale)
  int streams = 0;              // N
  int hidden = 0;
  int sinkhorn_iters = 0;
  float eps = 0.0f;             // hc_eps
  float norm_eps = 0.0f;        // rms_norm_eps of the streams' norm
};

// streams [T, N, hidden] → block_input [T, hidden] = Σ_n pre[n] stream[n]; post [T, N] and
// comb [T, N, N] (comb[t][j][k] weighs input stream j into output stream k), as
// HyperConnection::Collapse. fp32; the norm's and fn's sums in double, as the CPU does. The sums
// over the N × hidden inputs run split over many blocks (a decode step's one token would leave one
// block latency-bound on 1.5 MB of fn): their partial sums go through `scratch`
// (HyperCollapseScratchDoubles doubles).
size_t HyperCollapseScratchDoubles(const HyperConnectionArgs& a, int num_tokens);
absl::Status HyperCollapse(const HyperConnectionArgs& a, const float* streams, int num_tokens,
                           float* block_input, float* post, float* comb, double* scratch, StreamHandle stream);

// streams [T, N, hidden] ← post[k] * block_output [T, hidden] + Σ_j comb[j][k] stream[j], in
// place, as HyperConnection::Expand.
absl::Status HyperExpand(const float* post, const float* comb, const float* block_output,
                         int num_tokens, int streams_per_token, int hidden, float* streams,
                         StreamHandle stream);

// The head's collapse (HyperHead::Collapse) of rows[r] of streams [T, N, hidden] into
// out [R, hidden]: fn [N, N * hidden], base [N], one scale. rows [R] int32.
absl::Status HyperHeadCollapse(const float* fn, const float* base, float scale, int streams_per_token,
                               int hidden, float eps, float norm_eps, const float* streams,
                               const int32_t* rows, int num_rows, float* out, StreamHandle stream);

// GLM-5.3-Flash's head (HyperHead::Mean): out [R, hidden] = the unweighted mean of the N streams of
// rows[r] of streams [T, N, hidden]. rows [R] int32.
absl::Status HyperMeanCollapse(int streams_per_token, int hidden, const float* streams, const int32_t* rows,
                               int num_rows, float* out, StreamHandle stream);

// streams [T, N, hidden]: every stream of token t = x [T, hidden] row t (the embeddings).
absl::Status BroadcastStreams(const float* x, int num_tokens, int streams_per_token, int hidden,
                              float* streams, StreamHandle stream);

}  // namespace exl3::engine::cuda
