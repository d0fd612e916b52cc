#include "engine/cuda/hyper_residual.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/env_switch.h"
#include "base/status_macros.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/cuda/weight_upload.h"
#include "engine/config/dsv4_config.h"
#include "engine/config/glm5next_config.h"
#include "engine/cpu/residual/hyper_connections.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {

absl::StatusOr<HyperConnectionWeights> UploadHyperConnection(const TensorSource& src, const std::string& prefix,
                                                             const HyperConnectionShape& shape) {
  EXL3_ASSIGN_OR_RETURN(HyperConnection hc, HyperConnection::Load(src, prefix, shape));
  HyperConnectionWeights w;
  EXL3_RETURN_IF_ERROR(w.fn.Upload(hc.fn()));
  EXL3_RETURN_IF_ERROR(w.base.Upload(hc.base()));
  w.args.fn = w.fn.get();  // the arrays' storage moves with them
  w.args.base = w.base.get();
  for (int i = 0; i < 3; ++i) w.args.scale[i] = hc.scale()[i];
  w.args.streams = shape.streams;
  w.args.hidden = shape.hidden;
  w.args.sinkhorn_iters = shape.sinkhorn_iters;
  w.args.eps = shape.eps;
  w.args.norm_eps = shape.norm_eps;
  return w;
}

namespace {

// What the families' hyper-connected streams differ in, chosen once at load (as the CPU engine's
// engine/cpu/cpu_model.cc loads them): the shape's fields, the layer norms' names and the head.
struct HyperFamily {
  HyperConnectionShape shape;
  std::string input_norm, post_attention_norm;  // under each layer's prefix
  HyperHeadKind head = HyperHeadKind::kLearned;
};

absl::StatusOr<HyperFamily> HyperFamilyOf(const ModelConfig& cfg) {
  const int H = cfg.hidden_size;
  // DeepSeek-V4's checkpoints keep the original names (attn_norm / ffn_norm) and a learned head.
  if (cfg.dsv4 != nullptr)
    return HyperFamily{{H, cfg.dsv4->hc_mult, cfg.dsv4->hc_sinkhorn_iters, cfg.dsv4->hc_eps, cfg.rms_norm_eps},
                       "attn_norm.weight", "ffn_norm.weight", HyperHeadKind::kLearned};
  // GLM-5.3-Flash: transformers' names, and the streams' mean as the head.
  if (cfg.glm5next != nullptr)
    return HyperFamily{
        {H, cfg.glm5next->hc_mult, cfg.glm5next->hc_sinkhorn_iters, cfg.glm5next->hc_eps, cfg.rms_norm_eps},
        "input_layernorm.weight", "post_attention_layernorm.weight", HyperHeadKind::kMean};
  return absl::InternalError(absl::StrCat(cfg.architecture(), " has no hyper-connections"));
}

// EXL3_HC_MIX_STREAM=0 forms the collapses' post / comb on the model's stream, at the end of the
// block input's launch, instead of on a side stream (HyperMixStream): for measuring what the side
// stream gains. Read once.
bool MixStreamEnabled() {
  static const bool enabled = EnvSwitchOn("EXL3_HC_MIX_STREAM");
  return enabled;
}

class HyperResidual final : public ResidualStream {
 public:
  HyperResidual(const ModelConfig& cfg, HyperFamily family, StreamHandle stream)
      : cfg_(cfg), stream_(stream), family_(std::move(family)), shape_(family_.shape) {}

  absl::Status Load(const TensorSource& src) {
    const int H = cfg_.hidden_size;
    layers_.resize(cfg_.num_layers);
    for (int l = 0; l < cfg_.num_layers; ++l) {
      const std::string p = LayerPrefix(cfg_.moe, l);
      Layer& L = layers_[l];
      EXL3_ASSIGN_OR_RETURN(L.input_norm, UploadNorm(src, p + family_.input_norm, H, cfg_.norm_weights));
      EXL3_ASSIGN_OR_RETURN(L.post_attention_norm,
                            UploadNorm(src, p + family_.post_attention_norm, H, cfg_.norm_weights));
      EXL3_ASSIGN_OR_RETURN(L.mixer_hc, UploadHyperConnection(src, p + "hc_attn_", shape_));
      EXL3_ASSIGN_OR_RETURN(L.mlp_hc, UploadHyperConnection(src, p + "hc_ffn_", shape_));
    }
    if (MixStreamEnabled()) {
      EXL3_ASSIGN_OR_RETURN(mix_stream_, HyperMixStream::Create());
    }
    EXL3_ASSIGN_OR_RETURN(final_norm_,
                          UploadNorm(src, TextModelPrefix(cfg_.moe) + "norm.weight", H, cfg_.norm_weights));
    if (family_.head == HyperHeadKind::kLearned) {
      EXL3_ASSIGN_OR_RETURN(HyperHead head, HyperHead::Load(src, "model.hc_head.", shape_));
      EXL3_RETURN_IF_ERROR(head_fn_.Upload(head.fn()));
      EXL3_RETURN_IF_ERROR(head_base_.Upload(head.base()));
      head_scale_ = head.scale();
    }
    return absl::OkStatus();
  }

  absl::Status Reserve(int rows, int logit_rows, bool* moved) override {
    const size_t t = static_cast<size_t>(rows), N = static_cast<size_t>(shape_.streams), H = cfg_.hidden_size;
    const std::pair<DeviceArray<float>*, size_t> needs[] = {
        {&streams_, t * N * H}, {&post_, t * N}, {&comb_, t * N * N}, {&head_pre_, static_cast<size_t>(logit_rows) * H}};
    for (const auto& [array, n] : needs) {
      if (array->size() >= n) continue;
      *moved = true;
      EXL3_RETURN_IF_ERROR(array->Reserve(n));
    }
    const size_t scratch = HyperCollapseScratchDoubles(layers_.front().mixer_hc.args, rows);
    if (collapse_scratch_.size() < scratch) {
      *moved = true;
      EXL3_RETURN_IF_ERROR(collapse_scratch_.Reserve(scratch));
    }
    return absl::OkStatus();
  }
  absl::Status Embed(const void* table, EmbeddingDType dtype, const int32_t* ids, int rows, float* x) override {
    // A step starts with every mix joined; one that failed before its join owes none (a thrown-away
    // capture's events cannot be waited for).
    if (mix_stream_ != nullptr) mix_stream_->Forget();
    EXL3_RETURN_IF_ERROR(EmbedRows(table, dtype, ids, rows, cfg_.hidden_size, x, stream_));
    return BroadcastStreams(x, rows, shape_.streams, cfg_.hidden_size, streams_.get(), stream_);
  }
  absl::Status MixerInput(int layer, int first, int n, float* d, float* x) override {
    // d is free here (the previous block's output was expanded into the streams): the collapse's output.
    return Collapse(layers_[layer].mixer_hc, layers_[layer].input_norm, first, n, d, x, /*expand_first=*/false);
  }
  absl::Status MlpInput(int layer, int first, int n, float* d, float* x) override {
    // The mixer's output d expanded into the streams by the collapse's first launch.
    return Collapse(layers_[layer].mlp_hc, layers_[layer].post_attention_norm, first, n, d, x, /*expand_first=*/true);
  }
  absl::Status MlpOutput(int, int first, int n, float* d) override { return Expand(first, n, d); }
  absl::Status HeadInput(int, const float*, const int32_t* logit_rows, int R, float* head_in) override {
    const float eps = cfg_.rms_norm_eps;
    // Nothing forked is left unjoined at the step's end (a graph's capture must join every fork).
    if (mix_stream_ != nullptr) EXL3_RETURN_IF_ERROR(mix_stream_->Join(stream_));
    switch (family_.head) {
      case HyperHeadKind::kLearned:
        EXL3_RETURN_IF_ERROR(HyperHeadCollapse(head_fn_.get(), head_base_.get(), head_scale_, shape_.streams,
                                               cfg_.hidden_size, shape_.eps, eps, streams_.get(), logit_rows, R,
                                               head_pre_.get(), stream_));
        break;
      case HyperHeadKind::kMean:
        EXL3_RETURN_IF_ERROR(HyperMeanCollapse(shape_.streams, cfg_.hidden_size, streams_.get(), logit_rows, R,
                                               head_pre_.get(), stream_));
        break;
    }
    return RmsNorm(head_pre_.get(), final_norm_.get(), R, cfg_.hidden_size, eps, head_in, stream_);
  }
  int streams() const override { return shape_.streams; }
  absl::Status StreamMean(int first, int n, float* out, int out_stride) override {
    const size_t r = static_cast<size_t>(first), N = static_cast<size_t>(shape_.streams), H = cfg_.hidden_size;
    return HyperMeanCollapse(shape_.streams, cfg_.hidden_size, streams_.get() + r * N * H, /*rows=*/nullptr, n, out,
                             stream_, out_stride);
  }

 private:
  struct Layer {
    DeviceArray<float> input_norm, post_attention_norm;
    HyperConnectionWeights mixer_hc, mlp_hc;
  };
  // Rows [first, first + n): d = the collapse of their streams, x = rmsnorm(d) · norm (HyperCollapse);
  // the mix kept, formed on mix_stream_'s side stream where there is one (joined by the next
  // collapse or Expand, the mix's readers). expand_first: d (the previous block's output) joins
  // the streams with the kept mix first.
  absl::Status Collapse(const HyperConnectionWeights& hc, const DeviceArray<float>& norm, int first, int n, float* d,
                        float* x, bool expand_first) {
    const size_t r = static_cast<size_t>(first), N = static_cast<size_t>(shape_.streams), H = cfg_.hidden_size;
    HyperExpandInput expand;
    expand.post = post_.get() + r * N;
    expand.comb = comb_.get() + r * N * N;
    expand.block_output = d + r * H;
    HyperCollapseOutput out;
    out.block_input = d + r * H;
    out.post = post_.get() + r * N;
    out.comb = comb_.get() + r * N * N;
    out.norm_weight = norm.get();
    out.norm_eps = cfg_.rms_norm_eps;
    out.normed = x + r * H;
    return HyperCollapse(hc.args, expand_first ? &expand : nullptr, streams_.get() + r * N * H, n, out,
                         collapse_scratch_.get(), stream_, mix_stream_.get());
  }
  // Rows [first, first + n): the block's output d expanded into their streams with the kept mix.
  absl::Status Expand(int first, int n, const float* d) {
    const size_t r = static_cast<size_t>(first), N = static_cast<size_t>(shape_.streams), H = cfg_.hidden_size;
    if (mix_stream_ != nullptr) EXL3_RETURN_IF_ERROR(mix_stream_->Join(stream_));  // the mix it reads
    return HyperExpand(post_.get() + r * N, comb_.get() + r * N * N, d + r * H, n, shape_.streams, cfg_.hidden_size,
                       streams_.get() + r * N * H, stream_);
  }

  const ModelConfig& cfg_;
  StreamHandle stream_;
  HyperFamily family_;
  HyperConnectionShape shape_;
  std::vector<Layer> layers_;
  DeviceArray<float> final_norm_;
  DeviceArray<float> head_fn_, head_base_;  // the learned head's (empty for the mean)
  float head_scale_ = 1.0f;
  DeviceArray<float> streams_;  // [rows, N, hidden]
  DeviceArray<float> post_, comb_;  // the last collapse's mix: [rows, N], [rows, N, N]
  DeviceArray<double> collapse_scratch_;  // HyperCollapse's partial sums
  std::unique_ptr<HyperMixStream> mix_stream_;  // null: EXL3_HC_MIX_STREAM=0
  DeviceArray<float> head_pre_;     // [logit rows, hidden]
};

}  // namespace

absl::StatusOr<std::unique_ptr<ResidualStream>> LoadHyperResidual(const ModelConfig& cfg, const TensorSource& src,
                                                                  StreamHandle stream) {
  EXL3_ASSIGN_OR_RETURN(HyperFamily family, HyperFamilyOf(cfg));
  auto residual = std::make_unique<HyperResidual>(cfg, std::move(family), stream);
  EXL3_RETURN_IF_ERROR(residual->Load(src));
  return residual;
}

}  // namespace exl3::engine::cuda
