// The mixer kind of recurrent layers (engine/cuda/cuda_mixer.h): Qwen3-Next's gated DeltaNet
// (engine/cuda/cuda_gated_deltanet.h) and GLM-5.3-Flash's KDA (engine/cuda/cuda_kimi_delta_attention.h).
// The kind holds its layers' per-sequence recurrent state and the step's chunk table
// (engine/cuda/recurrent_layer_states.h) and their shared workspace; a layer reads and writes the
// state rows of its rows' chunks. `Layer` provides
//   static Load(cfg, src, layer, state_offset), Forward(x, first, n, RecurrentStep, Workspace&, ctx, out),
//   weight_bytes(), linears();
// `Workspace` provides Reserve(cfg.linear_attention, rows, &moved).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "base/status_macros.h"
#include "engine/cuda/cuda_mixer.h"
#include "engine/cuda/recurrent_layer_states.h"

namespace exl3::engine::cuda {

template <typename Layer, typename Workspace>
class RecurrentMixerKind final : public CudaMixerKind {
 public:
  RecurrentMixerKind(const ModelConfig& cfg, const CudaLinearContext& linear) : cfg_(cfg), linear_(linear) {}

  absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayer(const TensorSource& src, int layer) override {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Layer> loaded,
                          Layer::Load(cfg_, src, layer, RecurrentLayerStates::StateOffset(cfg_, layer)));
    return std::make_unique<Mixer>(*this, std::move(loaded));
  }

  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle) override {
    return states_.Allocate(cfg_, shape.num_sequence_slots, shape.max_logit_rows_per_chunk);
  }
  int64_t KvBytesPerToken() const override { return 0; }  // a state per sequence, not per token

  absl::Status BeginStep(const StepBatch& batch, StreamHandle stream) override {
    return states_.BeginStep(batch, stream);
  }
  absl::Status EndStep(const StepBatch& batch, StreamHandle) override {
    states_.CommitStep(batch);
    return absl::OkStatus();
  }
  absl::Status Reserve(int rows, int, bool* moved) override {
    bool ws_moved = false;
    EXL3_RETURN_IF_ERROR(ws_.Reserve(cfg_.linear_attention, rows, &ws_moved));
    *moved |= ws_moved;
    return absl::OkStatus();
  }
  absl::Status PackStep(const StepTokens& tokens, int rows, std::vector<int32_t>* facts) override {
    return states_.Pack(tokens, rows, facts);
  }
  absl::Status BindStep(const CudaStep& step, const StepTokens&, const int32_t* device_facts, StreamHandle) override {
    states_.Bind(step.rows, device_facts);
    return absl::OkStatus();
  }
  const RecurrentLayerStates* recurrent_states() const override { return &states_; }

 private:
  class Mixer final : public CudaMixer {
   public:
    Mixer(RecurrentMixerKind& kind, std::unique_ptr<Layer> layer) : kind_(kind), layer_(std::move(layer)) {}
    absl::Status Forward(const CudaStep&, const float* x, int first, int n, float* out) override {
      return layer_->Forward(x, first, n, kind_.states_.StepFor(first, n), kind_.ws_, kind_.linear_, out);
    }
    int64_t weight_bytes() const override { return layer_->weight_bytes(); }
    std::vector<const CudaLinear*> linears() const override { return layer_->linears(); }

   private:
    RecurrentMixerKind& kind_;
    std::unique_ptr<Layer> layer_;
  };

  const ModelConfig& cfg_;
  CudaLinearContext linear_;
  RecurrentLayerStates states_;  // the store (allocated by AllocateCache) and the step's chunks
  Workspace ws_;
};

}  // namespace exl3::engine::cuda
