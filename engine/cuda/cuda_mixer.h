// A layer's token mixer on the GPU (its attention, or its recurrent layer in place of attention):
// the CUDA model's counterpart of the CPU engine's engine/cpu/attention/attention.h. Every layer has one
// CudaMixer; every layer of one kind (GQA, latent attention, gated DeltaNet, DeepSeek-V4's) shares
// a CudaMixerKind, which owns what the kind's layers share: their KV cache (or recurrent state),
// their workspace, and the per-step facts only that kind reads. The model calls the kinds' hooks
// around each step and the layers' Forward inside it:
//
//   AllocateCache(shape)                     when the engine sizes the cache
//   BeginStep(batch)                         before anything of the step is queued
//   Reserve(rows, splits)                    grows the workspace (a moved address drops decode graphs)
//   PackStep(tokens, rows, &facts)           appends the kind's facts to the step's int32 array
//   BindStep(step, tokens, device facts)     after the array's upload: where the kind's facts are
//   mixer.Forward(step, x, first, n, out)    per layer, for rows [first, first + n)
//   EndStep(batch)                           after the step's synchronisation, if it succeeded
//
// LoadCudaMixers (engine/cuda/load_cuda_mixers.h) is the factory, as engine/cpu/attention/load_attention.h's
// LoadAttention is the CPU engine's: a new kind is one mixer file pair and one line there.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/step_facts.h"
#include "engine/config/model_config.h"
#include "engine/core/model_runner.h"
#include "engine/core/step_tokens.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

class RecurrentLayerStates;  // engine/cuda/recurrent_layer_states.h

class CudaMixer {
 public:
  virtual ~CudaMixer() = default;
  // out rows [first, first + n) of [step rows, hidden] from the same rows of x (the layer's
  // normed input); writes those rows' keys (or state) into the kind's cache first. A kind whose
  // rows_split() is false runs whole steps only (first 0, n = step.rows).
  virtual absl::Status Forward(const CudaStep& step, const float* x, int first, int n, float* out) = 0;
  // Bytes a forward reads of the layer's weights, and its linear layers (for the benchmarks'
  // floors: the EXL3 weights it decodes).
  virtual int64_t weight_bytes() const = 0;
  virtual std::vector<const CudaLinear*> linears() const = 0;
};

class CudaMixerKind {
 public:
  virtual ~CudaMixerKind() = default;
  virtual absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayer(const TensorSource& src, int layer) = 0;
  // Layer `layer` from tensors under `prefix` (ending in '.') in place of the model's layer prefix:
  // an MTP layer stored apart (Qwen4-Exp's mtp.layers.0.). UNIMPLEMENTED for the kinds no such
  // layer has needed.
  virtual absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayerUnder(const TensorSource& /*src*/, int layer,
                                                                     const std::string& prefix) {
    return absl::UnimplementedError(
        absl::StrCat("this attention kind loads layer ", layer, " under its own prefix only, not ", prefix));
  }

  // The cache of the kind's layers for `shape` (one block more than asked: decode graphs' padding
  // rows write there), on `stream`; the bytes it holds per token.
  virtual absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle stream) = 0;
  virtual int64_t KvBytesPerToken() const = 0;
  virtual absl::Status BeginStep(const StepBatch& /*batch*/, StreamHandle /*stream*/) { return absl::OkStatus(); }
  // For a step of `rows` rows and `splits` attention splits; *moved set when an address changed.
  virtual absl::Status Reserve(int rows, int splits, bool* moved) = 0;
  virtual absl::Status PackStep(const StepTokens& /*tokens*/, int /*rows*/, std::vector<int32_t>* /*facts*/) {
    return absl::OkStatus();
  }
  // `device_facts`: the step's uploaded array (the kind's facts where PackStep appended them).
  virtual absl::Status BindStep(const CudaStep& /*step*/, const StepTokens& /*tokens*/,
                                const int32_t* /*device_facts*/, StreamHandle /*stream*/) {
    return absl::OkStatus();
  }
  virtual absl::Status EndStep(const StepBatch& /*batch*/, StreamHandle /*stream*/) { return absl::OkStatus(); }

  // Whether a decode step of the kind's layers can be captured in a CUDA graph.
  virtual bool graph_capturable() const { return true; }
  // Whether a layer can run part of a step's rows (two micro-batches).
  virtual bool rows_split() const { return true; }
  // How the kind's attention splits a token's positions; blocks_per_token 0: it does not split.
  virtual SplitShape split_shape() const { return SplitShape{0}; }
  // A recurrent kind's per-sequence state store and the step's chunk table (else null), which
  // Qwen4-Exp's PLE layers share (their carried inputs sit in the same rows, as on the CPU engine).
  virtual const RecurrentLayerStates* recurrent_states() const { return nullptr; }
};

// Every layer's mixer and the kinds they belong to.
struct CudaMixers {
  std::vector<std::unique_ptr<CudaMixerKind>> kinds;
  std::vector<std::unique_ptr<CudaMixer>> layers;  // by layer

  // The first attention kind's split shape (every model has at most one kind that splits).
  SplitShape split_shape() const;
  bool graph_capturable() const;
  bool rows_split() const;
  // The recurrent kind's states (at most one recurrent kind per model), or null.
  const RecurrentLayerStates* recurrent_states() const;
};

}  // namespace exl3::engine::cuda
