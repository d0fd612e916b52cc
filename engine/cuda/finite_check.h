// A debugging aid for the GPU engine's forward pass (CudaModelOptions::check_finite): after each
// block of each layer the step waits for the GPU and looks for a NaN or an infinity in the block's
// output rows, so the first layer and block that produce one are named instead of a NaN logit at
// the end. It synchronises once per check: for tests and diagnosis, never for serving speed.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/engine_kernels.h"

namespace exl3::engine::cuda {

class FiniteCheck {
 public:
  // The index of the first non-finite float of values[0, n) (device memory, written by work queued on
  // `stream`), or nullopt where every one is finite. Waits for `stream`.
  absl::StatusOr<std::optional<int64_t>> FirstNonFinite(const float* values, int64_t n, StreamHandle stream);

  // OK where rows [first, first + n) of `values` ([rows, width] floats) are finite; else an Internal
  // error naming `where`, the row and the column of the first non-finite value and how many rows hold one.
  absl::Status CheckRows(const float* values, int first, int n, int width, const char* where, int layer,
                         StreamHandle stream);

 private:
  DeviceArray<unsigned long long> result_;  // [2]: the first index (min), then the count
};

}  // namespace exl3::engine::cuda
