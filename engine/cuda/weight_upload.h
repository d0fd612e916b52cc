// Vectors and matrices of a model's weights into device memory, fp32, as the CPU engine loads
// them (engine/cpu/linear.h LoadVector / LoadNormWeight). Linear layers: CudaLinear::Load.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "engine/cuda/device_array.h"
#include "engine/config/model_config.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// The tensor `name`, `length` values.
absl::StatusOr<DeviceArray<float>> UploadVector(const TensorSource& src, const std::string& name, int64_t length);
// An RMSNorm weight as the family stores it (Qwen3-Next's zero-centred: 1 + w).
absl::StatusOr<DeviceArray<float>> UploadNorm(const TensorSource& src, const std::string& name, int64_t length,
                                              NormWeightConvention convention);
// The tensor `name` of shape [rows, cols], row-major.
absl::StatusOr<DeviceArray<float>> UploadMatrix(const TensorSource& src, const std::string& name, int64_t rows,
                                                int64_t cols);

}  // namespace exl3::engine::cuda
