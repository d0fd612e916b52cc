#include "engine/cuda/plain_residual_stream.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/weight_upload.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {
namespace {

// h += d; x = rmsnorm(h) · w, fused: the residual is h [rows, hidden].
class PlainResidual final : public ResidualStream {
 public:
  PlainResidual(const ModelConfig& cfg, StreamHandle stream) : cfg_(cfg), stream_(stream) {}

  absl::Status Load(const TensorSource& src) {
    norms_.resize(cfg_.num_layers);
    for (int l = 0; l < cfg_.num_layers; ++l) {
      const std::string p = LayerPrefix(cfg_.moe, l);
      EXL3_ASSIGN_OR_RETURN(norms_[l].input,
                            UploadNorm(src, p + "input_layernorm.weight", cfg_.hidden_size, cfg_.norm_weights));
      EXL3_ASSIGN_OR_RETURN(norms_[l].post_attention, UploadNorm(src, p + "post_attention_layernorm.weight",
                                                                 cfg_.hidden_size, cfg_.norm_weights));
    }
    EXL3_ASSIGN_OR_RETURN(final_norm_, UploadNorm(src, TextModelPrefix(cfg_.moe) + "norm.weight", cfg_.hidden_size,
                                                 cfg_.norm_weights));
    return absl::OkStatus();
  }

  absl::Status Reserve(int rows, int, bool* moved) override {
    const size_t n = static_cast<size_t>(rows) * cfg_.hidden_size;
    if (h_.size() >= n) return absl::OkStatus();
    *moved = true;
    return h_.Reserve(n);
  }
  absl::Status Embed(const void* table, EmbeddingDType dtype, const int32_t* ids, int rows, float*) override {
    return EmbedRows(table, dtype, ids, rows, cfg_.hidden_size, h_.get(), stream_);
  }
  absl::Status MixerInput(int layer, int first, int n, float* d, float* x) override {
    const size_t r = Row(first);
    const float* w = norms_[layer].input.get();
    if (layer == 0) return RmsNorm(h_.get() + r, w, n, cfg_.hidden_size, cfg_.rms_norm_eps, x + r, stream_);
    // The previous layer's MLP output joins the residual stream here.
    return AddRmsNorm(h_.get() + r, d + r, w, n, cfg_.hidden_size, cfg_.rms_norm_eps, x + r, stream_);
  }
  absl::Status MlpInput(int layer, int first, int n, float* d, float* x) override {
    const size_t r = Row(first);
    return AddRmsNorm(h_.get() + r, d + r, norms_[layer].post_attention.get(), n, cfg_.hidden_size,
                      cfg_.rms_norm_eps, x + r, stream_);
  }
  absl::Status MlpOutput(int, int, int, float*) override { return absl::OkStatus(); }
  absl::Status HeadInput(int rows, const float* d, const int32_t* logit_rows, int R, float* head_in) override {
    const int H = cfg_.hidden_size;
    EXL3_RETURN_IF_ERROR(AddInPlace(h_.get(), d, static_cast<int64_t>(rows) * H, stream_));
    return GatherRmsNorm(h_.get(), logit_rows, R, final_norm_.get(), H, cfg_.rms_norm_eps, head_in, stream_);
  }
  int streams() const override { return 1; }

 private:
  struct LayerNorms {
    DeviceArray<float> input, post_attention;
  };
  size_t Row(int first) const { return static_cast<size_t>(first) * cfg_.hidden_size; }

  const ModelConfig& cfg_;
  StreamHandle stream_;
  std::vector<LayerNorms> norms_;
  DeviceArray<float> final_norm_;
  DeviceArray<float> h_;  // [rows, hidden]
};

}  // namespace

absl::StatusOr<std::unique_ptr<ResidualStream>> LoadPlainResidual(const ModelConfig& cfg, const TensorSource& src,
                                                                  StreamHandle stream) {
  auto plain = std::make_unique<PlainResidual>(cfg, stream);
  EXL3_RETURN_IF_ERROR(plain->Load(src));
  return plain;
}

}  // namespace exl3::engine::cuda
