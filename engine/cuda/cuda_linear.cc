#include "engine/cuda/cuda_linear.h"

#include <cublas_v2.h>

#include "absl/strings/str_cat.h"
#include "engine/cuda/dense_gemv_kernels.h"
#include "engine/cuda/engine_kernels.h"

namespace exl3::engine::cuda {

absl::StatusOr<CudaLinear> CudaLinear::Load(const TensorSource& src, const std::string& prefix, int in, int out) {
  EXL3_ASSIGN_OR_RETURN(Linear host, Linear::Load(src, prefix, in, out));
  return Upload(host);
}

absl::StatusOr<CudaLinear> CudaLinear::Upload(const Linear& host) {
  CudaLinear l;
  l.in_ = host.in_features();
  l.out_ = host.out_features();
  if (const Exl3LinearView* v = host.exl3_view()) {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<exl3::cuda::DeviceLinear> d, exl3::cuda::DeviceLinear::Upload(*v));
    l.exl3_ = std::move(d);
    l.weight_bytes_ = static_cast<int64_t>(v->trellis_words()) * 2 + (v->in_features + v->out_features) * 2 +
                      (v->bias != nullptr ? v->out_features * 2 : 0);
    return l;
  }
  EXL3_RETURN_IF_ERROR(l.dense_.Upload(host.stored_dense_weight()));
  EXL3_RETURN_IF_ERROR(l.bias_.Upload(host.stored_dense_bias()));
  l.weight_bytes_ = static_cast<int64_t>(l.in_) * l.out_ * 4;
  return l;
}

absl::StatusOr<CudaLinear> CudaLinear::UploadDense(const float* w, int in_features, int out_features) {
  CudaLinear l;
  l.in_ = in_features;
  l.out_ = out_features;
  EXL3_RETURN_IF_ERROR(l.dense_.Upload(w, static_cast<size_t>(in_features) * out_features));
  l.weight_bytes_ = static_cast<int64_t>(in_features) * out_features * 4;
  return l;
}

absl::Status CudaLinear::Forward(const float* x, int T, float* y, const CudaLinearContext& ctx) const {
  if (T == 0) return absl::OkStatus();
  if (exl3_ != nullptr)
    return exl3::cuda::LinearForward(exl3_->view(), x, T, y, ctx.workspace, ctx.stream);
  if (T <= kDenseGemvMaxRows) {
    const DenseGemvJob job = dense_job(y);
    return DenseGemv(&job, 1, x, T, in_, ctx.stream);
  }
  // Row-major y [T, out] = x [T, in] · Wᵀ is column-major yᵀ [out, T] = W [out, in] · xᵀ, where
  // the row-major W is a column-major [in, out] matrix: op(A) = Aᵀ.
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t st = cublasSgemm(static_cast<cublasHandle_t>(ctx.cublas), CUBLAS_OP_T, CUBLAS_OP_N,
                                        out_, T, in_, &alpha, dense_.get(), in_, x, in_, &beta, y, out_);
  if (st != CUBLAS_STATUS_SUCCESS)
    return absl::InternalError(absl::StrCat("cublasSgemm [", T, " x ", in_, "] x [", in_, " x ", out_,
                                            "]: status ", static_cast<int>(st)));
  if (!bias_.empty()) return AddBias(y, bias_.get(), T, out_, ctx.stream);
  return absl::OkStatus();
}

absl::Status CudaLinear::ForwardShared(const CudaLinear* const* layers, int count, const float* x, int T,
                                       float* const* y, const CudaLinearContext& ctx) {
  if (T == 0) return absl::OkStatus();
  const Exl3LinearView* views[4];
  bool all_exl3 = count >= 1 && count <= 4;
  for (int i = 0; i < count && all_exl3; ++i) {
    all_exl3 = layers[i]->exl3_ != nullptr;
    if (all_exl3) views[i] = &layers[i]->exl3_->view();
  }
  if (all_exl3) return exl3::cuda::LinearForwardShared(views, count, x, T, y, ctx.workspace, ctx.stream);
  bool all_dense = count >= 1 && count <= kDenseGemvMaxJobs && T <= kDenseGemvMaxRows;
  for (int i = 0; i < count && all_dense; ++i)
    all_dense = layers[i]->exl3_ == nullptr && layers[i]->in_ == layers[0]->in_;
  if (all_dense) {
    DenseGemvJob jobs[kDenseGemvMaxJobs];
    for (int i = 0; i < count; ++i) jobs[i] = layers[i]->dense_job(y[i]);
    return DenseGemv(jobs, count, x, T, layers[0]->in_, ctx.stream);
  }
  for (int i = 0; i < count; ++i) EXL3_RETURN_IF_ERROR(layers[i]->Forward(x, T, y[i], ctx));
  return absl::OkStatus();
}

absl::Status CudaLinear::ForwardEach(const CudaLinear* const* layers, const float* const* x, int count, int T,
                                     float* const* y, const CudaLinearContext& ctx) {
  if (T == 0) return absl::OkStatus();
  bool all_dense = count >= 1 && count <= kDenseGemvMaxJobs && T <= kDenseGemvMaxRows;
  for (int i = 0; i < count && all_dense; ++i)
    all_dense = layers[i]->exl3_ == nullptr && layers[i]->in_ == layers[0]->in_;
  if (all_dense) {
    DenseGemvJob jobs[kDenseGemvMaxJobs];
    for (int i = 0; i < count; ++i) {
      jobs[i] = layers[i]->dense_job(y[i]);
      jobs[i].x = x[i];
    }
    return DenseGemv(jobs, count, nullptr, T, layers[0]->in_, ctx.stream);
  }
  for (int i = 0; i < count; ++i) EXL3_RETURN_IF_ERROR(layers[i]->Forward(x[i], T, y[i], ctx));
  return absl::OkStatus();
}

DenseGemvJob CudaLinear::dense_job(float* y) const {
  DenseGemvJob job;
  job.weight = dense_.get();
  job.bias = bias_.empty() ? nullptr : bias_.get();
  job.y = y;
  job.out_features = out_;
  return job;
}

}  // namespace exl3::engine::cuda
