#include "engine/cuda/kda_mixer.h"

#include "base/status_macros.h"
#include "engine/cuda/cuda_kimi_delta_attention.h"
#include "engine/cuda/recurrent_layer_states.h"

namespace exl3::engine::cuda {
namespace {

struct KdaShared {
  KdaShared(const ModelConfig& c, const CudaLinearContext& l) : cfg(c), linear(l) {}
  const ModelConfig& cfg;
  CudaLinearContext linear;
  RecurrentLayerStates states;  // the store (allocated by AllocateCache) and the step's chunks
  KdaWorkspace ws;
};

class KdaMixer final : public CudaMixer {
 public:
  KdaMixer(KdaShared& shared, std::unique_ptr<CudaKimiDeltaAttention> layer)
      : s_(shared), layer_(std::move(layer)) {}

  absl::Status Forward(const CudaStep&, const float* x, int first, int n, float* out) override {
    return layer_->Forward(x, first, n, s_.states.StepFor(first, n), s_.ws, s_.linear, out);
  }
  int64_t weight_bytes() const override { return layer_->weight_bytes(); }
  std::vector<const CudaLinear*> linears() const override { return layer_->linears(); }

 private:
  KdaShared& s_;
  std::unique_ptr<CudaKimiDeltaAttention> layer_;
};

class KdaKind final : public CudaMixerKind {
 public:
  KdaKind(const ModelConfig& cfg, const CudaLinearContext& linear) : s_(cfg, linear) {}

  absl::StatusOr<std::unique_ptr<CudaMixer>> LoadLayer(const TensorSource& src, int layer) override {
    EXL3_ASSIGN_OR_RETURN(
        std::unique_ptr<CudaKimiDeltaAttention> kda,
        CudaKimiDeltaAttention::Load(s_.cfg, src, layer, RecurrentLayerStates::StateOffset(s_.cfg, layer)));
    return std::make_unique<KdaMixer>(s_, std::move(kda));
  }

  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle) override {
    return s_.states.Allocate(s_.cfg, shape.num_sequence_slots);
  }
  int64_t KvBytesPerToken() const override { return 0; }  // a state per sequence, not per token

  absl::Status BeginStep(const StepBatch& batch, StreamHandle stream) override {
    return s_.states.BeginStep(batch, stream);
  }
  absl::Status EndStep(const StepBatch& batch, StreamHandle) override {
    s_.states.CommitStep(batch);
    return absl::OkStatus();
  }

  absl::Status Reserve(int rows, int, bool* moved) override {
    bool ws_moved = false;
    EXL3_RETURN_IF_ERROR(s_.ws.Reserve(s_.cfg.linear_attention, rows, &ws_moved));
    *moved |= ws_moved;
    return absl::OkStatus();
  }

  absl::Status PackStep(const StepTokens& tokens, int rows, std::vector<int32_t>* facts) override {
    return s_.states.Pack(tokens, rows, facts);
  }
  absl::Status BindStep(const CudaStep& step, const StepTokens&, const int32_t* device_facts, StreamHandle) override {
    s_.states.Bind(step.rows, device_facts);
    return absl::OkStatus();
  }

 private:
  KdaShared s_;
};

}  // namespace

std::unique_ptr<CudaMixerKind> MakeKdaKind(const ModelConfig& cfg, const CudaLinearContext& linear) {
  return std::make_unique<KdaKind>(cfg, linear);
}

}  // namespace exl3::engine::cuda
