#include "engine/cuda/weight_upload.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/linear.h"

namespace exl3::engine::cuda {
namespace {

absl::StatusOr<DeviceArray<float>> ToDevice(const std::vector<float>& v) {
  DeviceArray<float> d;
  EXL3_RETURN_IF_ERROR(d.Upload(v));
  return d;
}

}  // namespace

absl::StatusOr<DeviceArray<float>> UploadVector(const TensorSource& src, const std::string& name, int64_t length) {
  EXL3_ASSIGN_OR_RETURN(std::vector<float> v, LoadVector(src, name, length));
  return ToDevice(v);
}

absl::StatusOr<DeviceArray<float>> UploadNorm(const TensorSource& src, const std::string& name, int64_t length,
                                              NormWeightConvention convention) {
  EXL3_ASSIGN_OR_RETURN(std::vector<float> v, LoadNormWeight(src, name, length, convention));
  return ToDevice(v);
}

absl::StatusOr<DeviceArray<float>> UploadMatrix(const TensorSource& src, const std::string& name, int64_t rows,
                                                int64_t cols) {
  EXL3_ASSIGN_OR_RETURN(TensorView t, src.Get(name));
  if (t.info->shape != std::vector<int64_t>{rows, cols})
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected shape [", rows, ", ", cols, "]"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> v, ToFloat32(t));
  return ToDevice(v);
}

}  // namespace exl3::engine::cuda
