// The residual stream between a CUDA model's blocks, and each layer's norms on it: what joins a
// block's output to the residual and makes the next block's normed input. Three kinds, chosen by the
// model's configuration:
//   plain           (engine/cuda/plain_residual_stream.h): h += block output; x = rmsnorm(h) · w (the
//                   add fused with the next norm)
//   hyper-connected (DeepSeek-V4's and GLM-5.3-Flash's mHC, engine/cuda/hyper_residual.h): hc_mult
//                   streams per token; a block's input collapsed from them and its output expanded back
//   gated           (Qwen4-Exp's low-rank gated hyper-connections, engine/cuda/gated_residual_stream.h):
//                   hc_count streams, collapsed and expanded through small projections; no norms
// LoadResidualStream (engine/cuda/load_residual_stream.h) picks the kind and loads it. The layer
// loop (engine/cuda/cuda_model.h) is the same for every kind:
//
//   Embed(ids)  then per layer: MixerInput → mixer → MlpInput → MLP / experts → MlpOutput
//   HeadInput(logit rows) → the head
//
// Every call takes rows [first, first + n) of the step (a micro-batch, or all of it); `d` is the
// step's block-output buffer [rows, hidden] (the hyper-connected kind also uses it between its
// launches), `x` the blocks' input buffer [rows, hidden].
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/finite_check.h"
#include "engine/config/model_config.h"
#include "engine/core/model_runner.h"
#include "engine/core/step_tokens.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

class RecurrentLayerStates;  // engine/cuda/recurrent_layer_states.h

class ResidualStream {
 public:
  virtual ~ResidualStream() = default;

  // Grows the stream for steps of `rows` rows and `logit_rows` head rows; *moved: an address changed.
  virtual absl::Status Reserve(int rows, int logit_rows, bool* moved) = 0;
  // Every row starts as its token's embedding: table [vocab, hidden] of `dtype`, ids [rows].
  virtual absl::Status Embed(const void* table, EmbeddingDType dtype, const int32_t* ids, int rows, float* x) = 0;
  // x = layer l's mixer input: the previous block's output d joins the stream, the input norm.
  virtual absl::Status MixerInput(int layer, int first, int n, float* d, float* x) = 0;
  // x = layer l's MLP input: the mixer's output d joins the stream, the post-attention norm.
  virtual absl::Status MlpInput(int layer, int first, int n, float* d, float* x) = 0;
  // The MLP's output d [rows] of layer l is done (the plain stream adds it at the next input).
  virtual absl::Status MlpOutput(int layer, int first, int n, float* d) = 0;
  // head_in [R, hidden] = the final norm of the stream's rows logit_rows [R] (device), after the
  // last layer's output d joined it; `rows`: the step's.
  virtual absl::Status HeadInput(int rows, const float* d, const int32_t* logit_rows, int num_logit_rows,
                                 float* head_in) = 0;
  // Streams per token (1 for the plain stream).
  virtual int streams() const = 0;
  // out [rows, streams, hidden] = the streams as the last layer left them, before the head
  // collapses them (Qwen4-Exp's MTP drafter reads them); after the last layer's MlpOutput.
  // UNIMPLEMENTED for the kinds no drafter reads so.
  virtual absl::Status CopyStreams(int /*rows*/, float* /*out*/) {
    return absl::UnimplementedError("this residual stream does not hand out its streams");
  }
  // out[r * out_stride ..] [hidden] = the mean of the streams of row first + r (r < n) as the layer
  // whose MlpOutput ran last left them (DeepSeek-V4's DSPARK drafter taps them,
  // engine/cuda/cuda_dspark_drafter.h). UNIMPLEMENTED for the kinds no drafter taps.
  virtual absl::Status StreamMean(int /*first*/, int /*n*/, float* /*out*/, int /*out_stride*/) {
    return absl::UnimplementedError("this residual stream does not hand out its streams' mean");
  }

  // Per-step hooks for a stream with per-sequence state (Qwen4-Exp's PLE layers: their n-gram rows
  // read on the host for each step, their conv inputs carried in the recurrent layers' store); the
  // other streams have none. Called as the mixer kinds' (engine/cuda/cuda_mixer.h): once after
  // loading, the model's recurrent states (null where it has no recurrent layers); per step the
  // stream's facts appended to the step's array, where they were uploaded, and after a step that
  // succeeded.
  virtual absl::Status BindRecurrentStates(const RecurrentLayerStates* /*states*/) { return absl::OkStatus(); }
  virtual absl::Status PackStep(const StepTokens& /*tokens*/, int /*rows*/, std::vector<int32_t>* /*facts*/) {
    return absl::OkStatus();
  }
  virtual void BindStep(const int32_t* /*device_facts*/) {}
  virtual void EndStep() {}

  // CudaModelOptions::check_finite: a stream with buffers of its own between the blocks (the gated
  // kind's streams and its connections' intermediates) checks them too; null: off.
  virtual void SetFiniteCheck(FiniteCheck* /*check*/) {}
};

}  // namespace exl3::engine::cuda
