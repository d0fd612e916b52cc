#include "engine/cuda/gated_residual_stream.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/cuda_ple_layer.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/gated_connection.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/cuda/ple_windows.h"
#include "engine/cuda/recurrent_layer_states.h"
#include "engine/config/qwen4exp_config.h"
#include "kernels/cuda/cuda_status.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {
namespace {

class GatedResidualStream final : public ResidualStream {
 public:
  GatedResidualStream(const ModelConfig& cfg, const GatedResidualShape& shape, const CudaLinearContext& ctx)
      : cfg_(cfg), shape_(shape), ctx_(ctx), windows_(cfg.qwen4exp->ple) {}

  absl::Status Load(const TensorSource& src) {
    layers_.reserve(cfg_.num_layers);
    for (int l = 0; l < cfg_.num_layers; ++l) {
      const std::string p = LayerPrefix(cfg_.moe, l);
      EXL3_ASSIGN_OR_RETURN(CudaGatedConnection mixer,
                            CudaGatedConnection::Load(src, p + "attn_hyper_connection.", shape_, true));
      EXL3_ASSIGN_OR_RETURN(CudaGatedConnection mlp,
                            CudaGatedConnection::Load(src, p + "mlp_hyper_connection.", shape_, true));
      layers_.push_back(Layer{std::move(mixer), std::move(mlp), nullptr, -1});
      if (cfg_.qwen4exp->ple.PleIndex(l) >= 0) {
        EXL3_ASSIGN_OR_RETURN(layers_.back().ple, CudaPleLayer::Load(cfg_, src, l));
        layers_.back().ple_index = num_ple_++;
      }
    }
    EXL3_ASSIGN_OR_RETURN(head_, CudaGatedConnection::Load(src, TextModelPrefix(cfg_.moe) + "hyper_connection_mixer.",
                                                           shape_, false));
    return absl::OkStatus();
  }

  absl::Status Reserve(int rows, int logit_rows, bool* moved) override {
    const size_t t = static_cast<size_t>(rows), S = static_cast<size_t>(shape_.streams);
    const std::pair<DeviceArray<float>*, size_t> needs[] = {{&streams_, t * S * shape_.hidden}, {&inject_, t * S}};
    for (const auto& [array, n] : needs) {
      if (array->size() >= n) continue;
      *moved = true;
      EXL3_RETURN_IF_ERROR(array->Reserve(n));
    }
    if (num_ple_ > 0) EXL3_RETURN_IF_ERROR(ple_ws_.Reserve(PleShapeOf(), rows, moved));
    return workspace_.Reserve(shape_, std::max(rows, logit_rows), moved);
  }
  absl::Status Embed(const void* table, EmbeddingDType dtype, const int32_t* ids, int rows, float* x) override {
    EXL3_RETURN_IF_ERROR(EmbedRows(table, dtype, ids, rows, shape_.hidden, x, ctx_.stream));
    EXL3_RETURN_IF_ERROR(BroadcastStreams(x, rows, shape_.streams, shape_.hidden, streams_.get(), ctx_.stream));
    return Check(streams_.get(), 0, rows, shape_.streams * shape_.hidden, "embedding", ": streams", 0);
  }
  absl::Status MixerInput(int layer, int first, int n, float*, float* x) override {
    // The previous block's output was expanded into the streams at its MlpOutput; a PLE layer adds
    // its output to them ahead of the collapse.
    const Layer& L = layers_[layer];
    if (L.ple != nullptr) {
      if (states_ == nullptr || ple_rows_ == nullptr)
        return absl::InternalError("a PLE layer runs before the step's n-gram rows and states are bound");
      const float* e = ple_rows_ + static_cast<size_t>(L.ple_index) * ple_layer_ints_;
      const int wide = shape_.streams * shape_.hidden;
      EXL3_RETURN_IF_ERROR(Check(e, first, n, cfg_.qwen4exp->ple.embed_dim, "PLE", ": n-gram rows", layer));
      EXL3_RETURN_IF_ERROR(L.ple->Forward(streams_.get(), e, first, n, states_->StepFor(first, n), ple_ws_, ctx_));
      // Its intermediates, each stage after the one before (the first non-finite names the stage).
      EXL3_RETURN_IF_ERROR(Check(ple_ws_.key.get(), first, n, wide, "PLE", ": key (projected, normed)", layer));
      EXL3_RETURN_IF_ERROR(Check(ple_ws_.value.get(), first, n, shape_.hidden, "PLE", ": value", layer));
      EXL3_RETURN_IF_ERROR(Check(ple_ws_.query.get(), first, n, wide, "PLE", ": query (normed streams)", layer));
      EXL3_RETURN_IF_ERROR(Check(ple_ws_.v.get(), first, n, wide, "PLE", ": gated value", layer));
      EXL3_RETURN_IF_ERROR(Check(ple_ws_.normed.get(), first, n, wide, "PLE", ": conv input (normed)", layer));
      EXL3_RETURN_IF_ERROR(Check(streams_.get(), first, n, wide, "PLE", ": streams", layer));
    }
    return Collapse(L.mixer, layer, "mixer", first, n, x);
  }
  absl::Status MlpInput(int layer, int first, int n, float* d, float* x) override {
    EXL3_RETURN_IF_ERROR(Expand(layers_[layer].mixer, layer, "mixer", first, n, d));
    return Collapse(layers_[layer].mlp, layer, "feed-forward", first, n, x);
  }
  absl::Status MlpOutput(int layer, int first, int n, float* d) override {
    return Expand(layers_[layer].mlp, layer, "feed-forward", first, n, d);
  }
  absl::Status HeadInput(int, const float*, const int32_t* logit_rows, int R, float* head_in) override {
    return head_.Collapse(streams_.get(), logit_rows, R, workspace_, head_in, nullptr, ctx_);
  }
  int streams() const override { return shape_.streams; }
  absl::Status CopyStreams(int rows, float* out) override {
    const size_t n = static_cast<size_t>(rows) * shape_.streams * shape_.hidden;
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, streams_.get(), n * sizeof(float), cudaMemcpyDeviceToDevice,
                                              static_cast<cudaStream_t>(ctx_.stream)));
    return absl::OkStatus();
  }

  absl::Status BindRecurrentStates(const RecurrentLayerStates* states) override {
    if (num_ple_ > 0 && states == nullptr)
      return absl::InternalError("Qwen4-Exp's PLE layers need the recurrent layers' state store");
    states_ = states;
    return absl::OkStatus();
  }
  // Each PLE layer's n-gram rows of the step's windows, [rows, embed_dim] per layer in order (a
  // decode graph's padding rows zero), appended as float bits.
  absl::Status PackStep(const StepTokens& tokens, int rows, std::vector<int32_t>* facts) override {
    if (num_ple_ == 0) return absl::OkStatus();
    EXL3_RETURN_IF_ERROR(windows_.Build(tokens, &windows_host_));
    // Each layer's rows start 16-byte aligned (the projections' vector loads).
    const size_t E = static_cast<size_t>(cfg_.qwen4exp->ple.embed_dim);
    ple_at_ = (facts->size() + 3) / 4 * 4;
    ple_layer_ints_ = (static_cast<size_t>(rows) * E + 3) / 4 * 4;
    facts->resize(ple_at_ + static_cast<size_t>(num_ple_) * ple_layer_ints_, 0);
    for (const Layer& L : layers_) {
      if (L.ple == nullptr) continue;
      float* e = reinterpret_cast<float*>(facts->data() + ple_at_ + static_cast<size_t>(L.ple_index) * ple_layer_ints_);
      EXL3_RETURN_IF_ERROR(L.ple->Embed(windows_host_.data(), tokens.num_tokens, e));
    }
    return absl::OkStatus();
  }
  void BindStep(const int32_t* device_facts) override {
    if (num_ple_ > 0) ple_rows_ = reinterpret_cast<const float*>(device_facts + ple_at_);
  }
  void EndStep() override { windows_.Commit(); }
  void SetFiniteCheck(FiniteCheck* check) override { finite_check_ = check; }

 private:
  struct Layer {
    CudaGatedConnection mixer, mlp;
    std::unique_ptr<CudaPleLayer> ple;  // on ple_layer_ids, else null
    int ple_index = -1;                 // among the PLE layers
  };
  PleShape PleShapeOf() const {
    const PleConfig& ple = cfg_.qwen4exp->ple;
    return PleShape{shape_.streams, shape_.hidden, ple.conv_kernel, ple.ngram_size};
  }
  // Rows [first, first + n): x = the connection's collapse of their streams, its inject weights kept.
  absl::Status Collapse(const CudaGatedConnection& g, int layer, const char* block, int first, int n, float* x) {
    const size_t r = static_cast<size_t>(first), S = static_cast<size_t>(shape_.streams);
    const int wide = shape_.streams * shape_.hidden;
    EXL3_RETURN_IF_ERROR(Check(streams_.get(), first, n, wide, block, "'s streams before the collapse", layer));
    EXL3_RETURN_IF_ERROR(g.Collapse(streams_.get() + r * S * shape_.hidden, nullptr, n, workspace_,
                                    x + r * shape_.hidden, inject_.get() + r * S, ctx_));
    // The connection's intermediates hold the collapse's rows from row 0.
    EXL3_RETURN_IF_ERROR(Check(workspace_.normed.get(), 0, n, wide, block, "'s collapse: stream norm", layer));
    EXL3_RETURN_IF_ERROR(Check(workspace_.low.get(), 0, n, shape_.lowrank, block, "'s collapse: low rank", layer));
    EXL3_RETURN_IF_ERROR(Check(workspace_.weights.get(), 0, n, wide, block, "'s collapse: mix weights", layer));
    return Check(inject_.get(), first, n, shape_.streams, block, "'s collapse: inject weights", layer);
  }
  // Rows [first, first + n): the block's output d expanded into their streams with the kept weights.
  absl::Status Expand(const CudaGatedConnection& g, int layer, const char* block, int first, int n, const float* d) {
    const size_t r = static_cast<size_t>(first), S = static_cast<size_t>(shape_.streams);
    EXL3_RETURN_IF_ERROR(g.Expand(inject_.get() + r * S, d + r * shape_.hidden, n,
                                  streams_.get() + r * S * shape_.hidden, ctx_.stream));
    return Check(streams_.get(), first, n, shape_.streams * shape_.hidden, block, "'s expand: streams", layer);
  }
  absl::Status Check(const float* values, int first, int n, int width, const char* block, const char* what,
                     int layer) {
    if (finite_check_ == nullptr) return absl::OkStatus();
    const std::string where = absl::StrCat(block, what);
    return finite_check_->CheckRows(values, first, n, width, where.c_str(), layer, ctx_.stream);
  }

  const ModelConfig& cfg_;
  GatedResidualShape shape_;
  CudaLinearContext ctx_;
  std::vector<Layer> layers_;
  CudaGatedConnection head_;         // hyper_connection_mixer: no inject
  DeviceArray<float> streams_;       // [rows, S, hidden]
  DeviceArray<float> inject_;        // the last collapse's inject weights [rows, S]
  GatedConnectionWorkspace workspace_;
  // The PLE layers': their windows' contexts per state slot (host), the recurrent store their carried
  // conv inputs sit in, the step's n-gram rows (in the step's uploaded array) and their workspace.
  int num_ple_ = 0;
  PleWindows windows_;
  std::vector<int32_t> windows_host_;
  const RecurrentLayerStates* states_ = nullptr;
  size_t ple_at_ = 0;          // where PackStep put the rows in the step's array
  size_t ple_layer_ints_ = 0;  // ints of each layer's part (its rows · embed_dim, rounded up to 4)
  const float* ple_rows_ = nullptr;
  PleWorkspace ple_ws_;
  FiniteCheck* finite_check_ = nullptr;  // CudaModelOptions::check_finite
};

}  // namespace

absl::StatusOr<std::unique_ptr<ResidualStream>> LoadGatedResidual(const ModelConfig& cfg, const TensorSource& src,
                                                                  const CudaLinearContext& ctx) {
  if (cfg.qwen4exp == nullptr)
    return absl::InternalError(absl::StrCat(cfg.architecture(), " has no gated hyper-connections"));
  const GatedResidualShape shape{cfg.hidden_size, cfg.qwen4exp->hc_count, cfg.qwen4exp->hc_lowrank, cfg.rms_norm_eps};
  auto residual = std::make_unique<GatedResidualStream>(cfg, shape, ctx);
  EXL3_RETURN_IF_ERROR(residual->Load(src));
  return residual;
}

}  // namespace exl3::engine::cuda
