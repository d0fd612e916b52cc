// One linear layer of the model in device memory, y [T, out] = x [T, in] · Wᵀ + b (fp32 in and
// out): EXL3 through the project's kernels (kernels/cuda/cuda_backend.h: GEMV for decode rows,
// the GEMM for prefill chunks), dense on an fp32 copy of the weight (engine/cuda/dense_gemv_kernels.h
// for decode rows, cuBLAS for more).
//
//   EXL3_ASSIGN_OR_RETURN(CudaLinear q, CudaLinear::Upload(host_linear));   // engine/cpu/linear.h
//   CudaLinearContext ctx{cublas, &workspace, stream};
//   EXL3_RETURN_IF_ERROR(q.Forward(d_x, T, d_y, ctx));
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/cuda/dense_gemv_kernels.h"
#include "engine/cuda/device_array.h"
#include "engine/cpu/linear.h"
#include "kernels/cuda/cuda_backend.h"

namespace exl3::engine::cuda {

// What every Forward of one stream shares.
struct CudaLinearContext {
  void* cublas = nullptr;             // cublasHandle_t, bound to `stream`
  exl3::cuda::Workspace* workspace = nullptr;
  StreamHandle stream = nullptr;
};

class CudaLinear {
 public:
  static absl::StatusOr<CudaLinear> Upload(const Linear& host);
  // The layer `prefix` of `src` (Linear::Load), uploaded.
  static absl::StatusOr<CudaLinear> Load(const TensorSource& src, const std::string& prefix, int in, int out);
  // A dense layer from an fp32 weight [out, in] in host memory (the MoE router).
  static absl::StatusOr<CudaLinear> UploadDense(const float* weight_out_in, int in_features,
                                                int out_features);

  absl::Status Forward(const float* x, int num_tokens, float* y, const CudaLinearContext& ctx) const;
  // y[i] = layers[i]'s Forward of the same x, for up to 4 layers (q, k, v): EXL3 layers together
  // through exl3::cuda::LinearForwardShared (fewer launches at decode sizes), dense ones together
  // at decode sizes (DenseGemv), others one by one.
  static absl::Status ForwardShared(const CudaLinear* const* layers, int count, const float* x, int num_tokens,
                                    float* const* y, const CudaLinearContext& ctx);
  // y[i] = layers[i]'s Forward of its own x[i], for up to 4 layers (KDA's f_b and g_b): dense
  // layers of one input width together at decode sizes (DenseGemv), others one by one.
  static absl::Status ForwardEach(const CudaLinear* const* layers, const float* const* x, int count,
                                  int num_tokens, float* const* y, const CudaLinearContext& ctx);
  int in_features() const { return in_; }
  int out_features() const { return out_; }
  // Bytes a forward reads of the weights (trellis + sign vectors + bias, or the fp32 matrix).
  int64_t weight_bytes() const { return weight_bytes_; }
  // The EXL3 layer's view (device pointers), or null for a dense layer.
  const Exl3LinearView* exl3_view() const { return exl3_ != nullptr ? &exl3_->view() : nullptr; }

 private:
  DenseGemvJob dense_job(float* y) const;  // a dense layer's weight, bias and out_features

  int in_ = 0, out_ = 0;
  int64_t weight_bytes_ = 0;
  std::shared_ptr<exl3::cuda::DeviceLinear> exl3_;  // EXL3, or null
  DeviceArray<float> dense_;                       // dense: [out, in]
  DeviceArray<float> bias_;                        // dense: [out] or empty
};

}  // namespace exl3::engine::cuda
