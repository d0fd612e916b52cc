#include "engine/cuda/cuda_qwen4exp_mtp_head.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/cuda/weight_upload.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {
namespace {

constexpr char kPrefix[] = "mtp.";
constexpr char kLayer[] = "mtp.layers.0.";

}  // namespace

absl::StatusOr<std::unique_ptr<CudaQwen4ExpMtpHead>> CudaQwen4ExpMtpHead::Load(const ModelConfig& model_cfg,
                                                                               const TensorSource& src,
                                                                               const CudaMtpModelParts& parts) {
  if (model_cfg.qwen4exp == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(model_cfg.architecture(), " has no Qwen4-Exp MTP head"));
  if (parts.head == nullptr || parts.embedding == nullptr)
    return absl::InvalidArgumentError("the MTP head needs the model's embeddings and head");
  const Qwen4ExpConfig& q = *model_cfg.qwen4exp;
  const int n = model_cfg.num_layers, H = model_cfg.hidden_size, S = q.hc_count;
  const GatedResidualShape shape{H, S, q.hc_lowrank, model_cfg.rms_norm_eps};
  std::unique_ptr<CudaQwen4ExpMtpHead> m(
      new CudaQwen4ExpMtpHead(WithMtpLayer(model_cfg, /*moe=*/true), shape, parts));
  const ModelConfig& cfg = m->cfg_;
  const std::string p = kPrefix, l = kLayer;
  const NormWeightConvention zc = NormWeightConvention::kOffsetFromOne;
  EXL3_ASSIGN_OR_RETURN(m->hidden_norm_, UploadNorm(src, p + "pre_fc_norm_hidden.weight", S * H, zc));
  EXL3_ASSIGN_OR_RETURN(m->embedding_norm_, UploadNorm(src, p + "pre_fc_norm_embedding.weight", H, zc));
  EXL3_ASSIGN_OR_RETURN(m->fc_hidden_, CudaLinear::Load(src, p + "fc_hidden", H, H));
  EXL3_ASSIGN_OR_RETURN(m->fc_embedding_, CudaLinear::Load(src, p + "fc_embedding", H, H));
  EXL3_ASSIGN_OR_RETURN(CudaGatedConnection attn, CudaGatedConnection::Load(src, l + "attn_hyper_connection.", shape, true));
  EXL3_ASSIGN_OR_RETURN(CudaGatedConnection mlp, CudaGatedConnection::Load(src, l + "mlp_hyper_connection.", shape, true));
  EXL3_ASSIGN_OR_RETURN(CudaGatedConnection mixer,
                        CudaGatedConnection::Load(src, p + "hyper_connection_mixer.", shape, false));
  m->attn_connection_.emplace(std::move(attn));
  m->mlp_connection_.emplace(std::move(mlp));
  m->head_mixer_.emplace(std::move(mixer));
  EXL3_ASSIGN_OR_RETURN(m->attention_, CudaMtpAttention::Load(cfg, src, n, parts, l));
  EXL3_ASSIGN_OR_RETURN(CudaMtpMoe moe, CudaMtpMoe::Load(cfg, src, n, l, parts.max_moe_tokens, parts.linear));
  m->moe_.emplace(std::move(moe));
  // The uploads ran on the legacy stream, which the model's non-blocking stream does not wait for.
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return m;
}

absl::Status CudaQwen4ExpMtpHead::AllocateCache(const KvCacheShape& shape, StreamHandle stream) {
  return attention_.AllocateCache(shape, stream);
}

absl::Status CudaQwen4ExpMtpHead::Reserve(int T, int R) {
  bool moved = false;  // no decode graph holds these addresses
  EXL3_RETURN_IF_ERROR(moe_->Reserve(T));
  EXL3_RETURN_IF_ERROR(connection_ws_.Reserve(shape_, std::max(T, R), &moved));
  const size_t t = static_cast<size_t>(T), r = static_cast<size_t>(R), H = static_cast<size_t>(shape_.hidden);
  const size_t S = static_cast<size_t>(shape_.streams);
  const std::pair<DeviceArray<float>*, size_t> needs[] = {
      {&stream_, t * H}, {&e_, t * H},          {&x_, t * H},      {&d_, t * H},
      {&normed_, t * S * H}, {&broadcast_, t * S * H}, {&inject_, t * S}, {&head_in_, r * H}};
  for (const auto& [array, size] : needs)
    if (array->size() < size) EXL3_RETURN_IF_ERROR(array->Reserve(size));
  return absl::OkStatus();
}

absl::Status CudaQwen4ExpMtpHead::Forward(const StepTokens& tokens, const float* states, float* out, float* logits) {
  const int T = tokens.num_tokens, R = static_cast<int>(tokens.logit_tokens.size());
  const int H = shape_.hidden, S = shape_.streams;
  if (T == 0) return absl::OkStatus();
  const StreamHandle stream = parts_.linear.stream;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const float eps = cfg_.rms_norm_eps;
  EXL3_ASSIGN_OR_RETURN(const CudaStep* step, attention_.BeginStep(tokens, stream));
  EXL3_RETURN_IF_ERROR(Reserve(T, R));
  // normed [T, S, H]: stream k of every token normed by its own weights (a stream's rows are
  // strided by S · H: gathered, normed, put back).
  const size_t row = static_cast<size_t>(H) * sizeof(float), wide = static_cast<size_t>(S) * row;
  for (int k = 0; k < S; ++k) {
    const size_t at = static_cast<size_t>(k) * H;
    EXL3_CUDA_RETURN_IF_ERROR(
        cudaMemcpy2DAsync(stream_.get(), row, states + at, wide, row, T, cudaMemcpyDeviceToDevice, s));
    EXL3_RETURN_IF_ERROR(RmsNorm(stream_.get(), hidden_norm_.get() + at, T, H, eps, stream_.get(), stream));
    EXL3_CUDA_RETURN_IF_ERROR(
        cudaMemcpy2DAsync(normed_.get() + at, wide, stream_.get(), row, row, T, cudaMemcpyDeviceToDevice, s));
  }
  // out = fc_hidden of every normed stream + the embedding branch in every stream.
  EXL3_RETURN_IF_ERROR(fc_hidden_.Forward(normed_.get(), T * S, out, parts_.linear));
  EXL3_RETURN_IF_ERROR(EmbedRows(parts_.embedding, parts_.embedding_dtype, step->ids, T, H, x_.get(), stream));
  EXL3_RETURN_IF_ERROR(RmsNorm(x_.get(), embedding_norm_.get(), T, H, eps, x_.get(), stream));
  EXL3_RETURN_IF_ERROR(fc_embedding_.Forward(x_.get(), T, e_.get(), parts_.linear));
  EXL3_RETURN_IF_ERROR(BroadcastStreams(e_.get(), T, S, H, broadcast_.get(), stream));
  EXL3_RETURN_IF_ERROR(AddInPlace(out, broadcast_.get(), static_cast<int64_t>(T) * S * H, stream));
  // The block around its gated residual connections, on the streams `out` in place.
  EXL3_RETURN_IF_ERROR(attn_connection_->Collapse(out, nullptr, T, connection_ws_, x_.get(), inject_.get(),
                                                  parts_.linear));
  EXL3_RETURN_IF_ERROR(attention_.Forward(*step, x_.get(), T, d_.get()));
  EXL3_RETURN_IF_ERROR(attn_connection_->Expand(inject_.get(), d_.get(), T, out, stream));
  EXL3_RETURN_IF_ERROR(mlp_connection_->Collapse(out, nullptr, T, connection_ws_, x_.get(), inject_.get(),
                                                 parts_.linear));
  EXL3_RETURN_IF_ERROR(moe_->Forward(*step, x_.get(), T, d_.get()));
  EXL3_RETURN_IF_ERROR(mlp_connection_->Expand(inject_.get(), d_.get(), T, out, stream));
  if (R == 0) return absl::OkStatus();
  // logits = lm_head(hyper_connection_mixer(o)) of the logit rows.
  EXL3_RETURN_IF_ERROR(head_mixer_->Collapse(out, step->logit_rows, R, connection_ws_, head_in_.get(), nullptr,
                                             parts_.linear));
  return parts_.head->Forward(head_in_.get(), R, logits, parts_.linear);
}

absl::Status CudaQwen4ExpMtpHead::EndStep(const StepBatch& batch) {
  return attention_.EndStep(batch, parts_.linear.stream);
}

}  // namespace exl3::engine::cuda
