// DeepSeek-V4's and GLM-5.3-Flash's manifold-constrained hyper-connections on the GPU: the same
// arithmetic as the CPU engine's engine/cpu/residual/hyper_connections.h (which says what the mixing is), on
// device memory. Host launchers only: this header includes no CUDA header; every pointer is device
// memory, every launch goes on `stream` (a collapse's mix on a HyperMixStream's side stream where
// given), none synchronises or allocates.
//
// The residual of each token is `streams` (hc_mult, N ≤ 16) copies [N, hidden]; a block's mixing
// weights come from the RMS-normalised (no weight) concatenation of the N streams through fn.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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

// A collapse's optional first step: the previous block's output joins the streams in place, as
// HyperExpand does (the same arithmetic), before they are collapsed.
struct HyperExpandInput {
  const float* post = nullptr;          // [T, N] fp32
  const float* comb = nullptr;          // [T, N, N] fp32
  const float* block_output = nullptr;  // [T, hidden] fp32
};

// What a collapse writes; every array fp32.
struct HyperCollapseOutput {
  float* block_input = nullptr;  // [T, hidden] = Σ_n pre[n] stream[n]
  float* post = nullptr;         // [T, N]
  float* comb = nullptr;         // [T, N, N]: comb[t][j][k] weighs input stream j into output stream k
  // normed [T, hidden] = rmsnorm(block_input) · norm_weight [hidden] (RmsNorm's arithmetic, eps
  // norm_eps): the block's input norm; skipped where normed is null.
  const float* norm_weight = nullptr;
  float norm_eps = 0.0f;
  float* normed = nullptr;
};

class HyperMixStream;

// streams [T, N, hidden] → block input, post and comb, as HyperConnection::Collapse, and the
// block's normed input; with `expand`, the previous block's output joins the streams first
// (streams written; expand's post / comb / block_output may be the arrays this collapse writes:
// they are read first). The sums over each token's N × hidden inputs (fn's mix rows and the
// streams' pairwise products, in double as the CPU sums) split over about 128 blocks of a token
// each, or from 16 tokens on (N ≤ 4) about 512 blocks of 64 tokens each, into `scratch`
// (HyperCollapseScratchDoubles doubles, for up to that many tokens), then their fixed-order
// totals: the block input and its norm over a few blocks a token, post and the Sinkhorn comb on a
// warp a token. With a mix_stream, post and comb (which the block itself does not
// read) are formed on its side stream, and the block input's launch ends without waiting for
// them: the caller joins (mix_stream->Join) before anything but another such collapse reads post
// or comb; the collapse joins the previous one itself (it rewrites the scratch the mix reads).
// Null: all on `stream`. Either way the same bits.
size_t HyperCollapseScratchDoubles(const HyperConnectionArgs& a, int num_tokens);
absl::Status HyperCollapse(const HyperConnectionArgs& a, const HyperExpandInput* expand, float* streams,
                           int num_tokens, const HyperCollapseOutput& out, double* scratch, StreamHandle stream,
                           HyperMixStream* mix_stream);

// A second stream for the collapses' post / comb (CollapseMixKernel), forked from the caller's
// stream after a collapse's sums by an event and joined back by another: a fork and a join of a
// CUDA graph when the caller's stream is being captured, the same waits eagerly. One caller
// stream at a time; not thread-safe. The side stream is FIFO, so a join waits for every mix
// forked before it.
class HyperMixStream {
 public:
  static absl::StatusOr<std::unique_ptr<HyperMixStream>> Create();
  ~HyperMixStream();  // waits for the side stream's work
  HyperMixStream(const HyperMixStream&) = delete;
  HyperMixStream& operator=(const HyperMixStream&) = delete;

  // `stream` waits for every mix forked since the last join (nothing queued where none was).
  absl::Status Join(StreamHandle stream);
  // Drops a join owed by a step that ended before it (a failed step, or a capture that failed and
  // was thrown away: its events cannot be waited for outside it). The side stream's later work
  // still queues behind any of the failed step's.
  void Forget() { pending_ = false; }

 private:
  friend absl::Status HyperCollapse(const HyperConnectionArgs& a, const HyperExpandInput* expand, float* streams,
                                    int num_tokens, const HyperCollapseOutput& out, double* scratch,
                                    StreamHandle stream, HyperMixStream* mix_stream);
  HyperMixStream() = default;
  // The side stream, after it waits for `stream`'s work so far.
  absl::StatusOr<StreamHandle> Fork(StreamHandle stream);
  // After the side stream's launches: the next Join waits for them.
  absl::Status Forked();

  StreamHandle side_ = nullptr;  // cudaStream_t, non-blocking
  void* forked_ = nullptr;       // cudaEvent_t: recorded on the caller's stream at a fork
  void* done_ = nullptr;         // cudaEvent_t: recorded on the side stream after its mix
  bool pending_ = false;         // a mix forked and not yet joined
};

// streams [T, N, hidden] ← post[k] * block_output [T, hidden] + Σ_j comb[j][k] stream[j], in
// place, as HyperConnection::Expand.
absl::Status HyperExpand(const float* post, const float* comb, const float* block_output,
                         int num_tokens, int streams_per_token, int hidden, float* streams,
                         StreamHandle stream);

// The head's collapse (HyperHead::Collapse) of rows[r] of streams [T, N, hidden] into
// out [R, hidden]: fn [N, N * hidden], base [N], one scale. rows [R] int32, or null: rows 0 .. R - 1.
absl::Status HyperHeadCollapse(const float* fn, const float* base, float scale, int streams_per_token,
                               int hidden, float eps, float norm_eps, const float* streams,
                               const int32_t* rows, int num_rows, float* out, StreamHandle stream);

// GLM-5.3-Flash's head (HyperHead::Mean), and DeepSeek-V4's DSPARK taps (the stream mean of a
// tapped layer's output, engine/cuda/cuda_dspark_drafter.h): out [R, out_stride] = the unweighted
// mean of the N streams of rows[r] of streams [T, N, hidden] in each row's first hidden floats.
// rows [R] int32, or null: rows 0 .. R - 1; out_stride 0: hidden.
absl::Status HyperMeanCollapse(int streams_per_token, int hidden, const float* streams, const int32_t* rows,
                               int num_rows, float* out, StreamHandle stream, int out_stride = 0);

// streams [T, N, hidden]: every stream of token t = x [T, hidden] row t (the embeddings).
absl::Status BroadcastStreams(const float* x, int num_tokens, int streams_per_token, int hidden,
                              float* streams, StreamHandle stream);

}  // namespace exl3::engine::cuda
