#include "engine/cuda/cuda_mtp_head.h"

#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/weight_upload.h"
#include "kernels/cuda/cuda_status.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {
namespace {

bool HasLinear(const TensorSource& src, const std::string& prefix) {
  return src.Has(prefix + ".weight") || src.Has(prefix + ".trellis");
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaMtpHead>> CudaMtpHead::Load(const ModelConfig& model_cfg, const TensorSource& src,
                                                               const CudaMtpModelParts& parts) {
  if (parts.head == nullptr || parts.embedding == nullptr)
    return absl::InvalidArgumentError("the MTP head needs the model's embeddings and head");
  const int n = model_cfg.num_layers, H = model_cfg.hidden_size;
  const std::string p = LayerPrefix(model_cfg.moe, n);
  const bool moe = src.Has(RouterWeightKey(model_cfg.moe, n));
  std::unique_ptr<CudaMtpHead> m(new CudaMtpHead(WithMtpLayer(model_cfg, moe), parts));
  const ModelConfig& cfg = m->cfg_;
  const NormWeightConvention nw = cfg.norm_weights;
  EXL3_ASSIGN_OR_RETURN(m->enorm_, UploadNorm(src, p + "enorm.weight", H, nw));
  EXL3_ASSIGN_OR_RETURN(m->hnorm_, UploadNorm(src, p + "hnorm.weight", H, nw));
  EXL3_ASSIGN_OR_RETURN(m->eh_proj_, CudaLinear::Load(src, p + "eh_proj", 2 * H, H));
  EXL3_ASSIGN_OR_RETURN(m->input_norm_, UploadNorm(src, p + "input_layernorm.weight", H, nw));
  EXL3_ASSIGN_OR_RETURN(m->post_attention_norm_, UploadNorm(src, p + "post_attention_layernorm.weight", H, nw));
  EXL3_ASSIGN_OR_RETURN(m->attention_, CudaMtpAttention::Load(cfg, src, n, parts));
  if (moe) {
    EXL3_ASSIGN_OR_RETURN(CudaMtpMoe block, CudaMtpMoe::Load(cfg, src, n, p, parts.max_moe_tokens, parts.linear));
    m->moe_.emplace(std::move(block));
  } else {
    EXL3_ASSIGN_OR_RETURN(CudaDenseMlp mlp, CudaDenseMlp::Load(src, p + "mlp.", H, cfg.intermediate_size,
                                                               cfg.dense_swiglu_limit));
    m->dense_mlp_.emplace(std::move(mlp));
  }
  EXL3_ASSIGN_OR_RETURN(m->shared_norm_, UploadNorm(src, p + "shared_head.norm.weight", H, nw));
  if (HasLinear(src, p + "shared_head.head")) {
    EXL3_ASSIGN_OR_RETURN(CudaLinear head, CudaLinear::Load(src, p + "shared_head.head", H, cfg.vocab_size));
    m->own_head_.emplace(std::move(head));
    m->head_ = &*m->own_head_;
  } else {
    m->head_ = parts.head;
  }
  // The uploads ran on the legacy stream, which the model's non-blocking stream does not wait for.
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return m;
}

absl::Status CudaMtpHead::AllocateCache(const KvCacheShape& shape, StreamHandle stream) {
  return attention_.AllocateCache(shape, stream);
}

absl::Status CudaMtpHead::Reserve(int T, int R) {
  if (moe_.has_value()) EXL3_RETURN_IF_ERROR(moe_->Reserve(T));
  const size_t t = static_cast<size_t>(T), r = static_cast<size_t>(R), H = static_cast<size_t>(cfg_.hidden_size);
  const size_t I = dense_mlp_.has_value() ? static_cast<size_t>(cfg_.intermediate_size) : 0;
  const std::pair<DeviceArray<float>*, size_t> needs[] = {
      {&x_, t * H}, {&d_, t * H}, {&cat_, 2 * t * H}, {&gate_, t * I}, {&up_, t * I}, {&head_in_, r * H}};
  for (const auto& [array, size] : needs)
    if (array->size() < size) EXL3_RETURN_IF_ERROR(array->Reserve(size));
  return absl::OkStatus();
}

absl::Status CudaMtpHead::Forward(const StepTokens& tokens, const float* states, float* out, float* logits) {
  const int T = tokens.num_tokens, R = static_cast<int>(tokens.logit_tokens.size()), H = cfg_.hidden_size;
  if (T == 0) return absl::OkStatus();
  const StreamHandle stream = parts_.linear.stream;
  const float eps = cfg_.rms_norm_eps;
  EXL3_ASSIGN_OR_RETURN(const CudaStep* step, attention_.BeginStep(tokens, stream));
  EXL3_RETURN_IF_ERROR(Reserve(T, R));
  float* x = x_.get();
  float* d = d_.get();
  float* h = out;  // the layer's residual stream, in place
  // cat = [enorm(embed(t_{i+1})) | hnorm(h_i)] per row, then x = eh_proj(cat).
  EXL3_RETURN_IF_ERROR(EmbedRows(parts_.embedding, parts_.embedding_dtype, step->ids, T, H, x, stream));
  EXL3_RETURN_IF_ERROR(RmsNorm(x, enorm_.get(), T, H, eps, x, stream));
  EXL3_RETURN_IF_ERROR(RmsNorm(states, hnorm_.get(), T, H, eps, d, stream));
  const size_t row = static_cast<size_t>(H) * sizeof(float);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(cat_.get(), 2 * row, x, row, row, T, cudaMemcpyDeviceToDevice, s));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(cat_.get() + H, 2 * row, d, row, row, T, cudaMemcpyDeviceToDevice, s));
  EXL3_RETURN_IF_ERROR(eh_proj_.Forward(cat_.get(), T, h, parts_.linear));
  // The decoder layer on h.
  EXL3_RETURN_IF_ERROR(RmsNorm(h, input_norm_.get(), T, H, eps, x, stream));
  EXL3_RETURN_IF_ERROR(attention_.Forward(*step, x, T, d));
  EXL3_RETURN_IF_ERROR(AddRmsNorm(h, d, post_attention_norm_.get(), T, H, eps, x, stream));
  if (dense_mlp_.has_value()) {
    EXL3_RETURN_IF_ERROR(dense_mlp_->Forward(x, T, gate_.get(), up_.get(), d, parts_.linear));
  } else {
    EXL3_RETURN_IF_ERROR(moe_->Forward(*step, x, T, d));
  }
  EXL3_RETURN_IF_ERROR(AddInPlace(h, d, static_cast<int64_t>(T) * H, stream));
  if (R == 0) return absl::OkStatus();
  // logits = head(shared_head.norm(o)) of the logit rows.
  EXL3_RETURN_IF_ERROR(GatherRmsNorm(h, step->logit_rows, R, shared_norm_.get(), H, eps, head_in_.get(), stream));
  return head_->Forward(head_in_.get(), R, logits, parts_.linear);
}

absl::Status CudaMtpHead::EndStep(const StepBatch& batch) {
  return attention_.EndStep(batch, parts_.linear.stream);
}

}  // namespace exl3::engine::cuda
