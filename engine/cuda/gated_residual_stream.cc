#include "engine/cuda/gated_residual_stream.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/gated_connection.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/qwen4exp_config.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {
namespace {

class GatedResidualStream final : public ResidualStream {
 public:
  GatedResidualStream(const ModelConfig& cfg, const GatedResidualShape& shape, const CudaLinearContext& ctx)
      : cfg_(cfg), shape_(shape), ctx_(ctx) {}

  absl::Status Load(const TensorSource& src) {
    layers_.reserve(cfg_.num_layers);
    for (int l = 0; l < cfg_.num_layers; ++l) {
      const std::string p = LayerPrefix(cfg_.moe, l);
      EXL3_ASSIGN_OR_RETURN(CudaGatedConnection mixer,
                            CudaGatedConnection::Load(src, p + "attn_hyper_connection.", shape_, true));
      EXL3_ASSIGN_OR_RETURN(CudaGatedConnection mlp,
                            CudaGatedConnection::Load(src, p + "mlp_hyper_connection.", shape_, true));
      layers_.push_back(Layer{std::move(mixer), std::move(mlp)});
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
    return workspace_.Reserve(shape_, std::max(rows, logit_rows), moved);
  }
  absl::Status Embed(const void* table, EmbeddingDType dtype, const int32_t* ids, int rows, float* x) override {
    EXL3_RETURN_IF_ERROR(EmbedRows(table, dtype, ids, rows, shape_.hidden, x, ctx_.stream));
    return BroadcastStreams(x, rows, shape_.streams, shape_.hidden, streams_.get(), ctx_.stream);
  }
  absl::Status MixerInput(int layer, int first, int n, float*, float* x) override {
    // The previous block's output was expanded into the streams at its MlpOutput.
    return Collapse(layers_[layer].mixer, first, n, x);
  }
  absl::Status MlpInput(int layer, int first, int n, float* d, float* x) override {
    EXL3_RETURN_IF_ERROR(Expand(layers_[layer].mixer, first, n, d));
    return Collapse(layers_[layer].mlp, first, n, x);
  }
  absl::Status MlpOutput(int layer, int first, int n, float* d) override {
    return Expand(layers_[layer].mlp, first, n, d);
  }
  absl::Status HeadInput(int, const float*, const int32_t* logit_rows, int R, float* head_in) override {
    return head_.Collapse(streams_.get(), logit_rows, R, workspace_, head_in, nullptr, ctx_);
  }
  int streams() const override { return shape_.streams; }

 private:
  struct Layer {
    CudaGatedConnection mixer, mlp;
  };
  // Rows [first, first + n): x = the connection's collapse of their streams, its inject weights kept.
  absl::Status Collapse(const CudaGatedConnection& g, int first, int n, float* x) {
    const size_t r = static_cast<size_t>(first), S = static_cast<size_t>(shape_.streams);
    return g.Collapse(streams_.get() + r * S * shape_.hidden, nullptr, n, workspace_, x + r * shape_.hidden,
                      inject_.get() + r * S, ctx_);
  }
  // Rows [first, first + n): the block's output d expanded into their streams with the kept weights.
  absl::Status Expand(const CudaGatedConnection& g, int first, int n, const float* d) {
    const size_t r = static_cast<size_t>(first), S = static_cast<size_t>(shape_.streams);
    return g.Expand(inject_.get() + r * S, d + r * shape_.hidden, n, streams_.get() + r * S * shape_.hidden,
                    ctx_.stream);
  }

  const ModelConfig& cfg_;
  GatedResidualShape shape_;
  CudaLinearContext ctx_;
  std::vector<Layer> layers_;
  CudaGatedConnection head_;         // hyper_connection_mixer: no inject
  DeviceArray<float> streams_;       // [rows, S, hidden]
  DeviceArray<float> inject_;        // the last collapse's inject weights [rows, S]
  GatedConnectionWorkspace workspace_;
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
