#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/finite_check.h"
#include "engine/cuda/launch_status.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned long long kNone = ~0ull;

// result[0] = min index of a non-finite value of x[0, n) (kNone where none), result[1] = their count.
__global__ void FirstNonFiniteKernel(const float* x, int64_t n, unsigned long long* result) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (!isfinite(x[i])) {
      atomicMin(&result[0], static_cast<unsigned long long>(i));
      atomicAdd(&result[1], 1ull);
    }
  }
}

}  // namespace

absl::StatusOr<std::optional<int64_t>> FiniteCheck::FirstNonFinite(const float* values, int64_t n,
                                                                   StreamHandle stream) {
  EXL3_RETURN_IF_ERROR(result_.Reserve(2));
  const unsigned long long init[2] = {kNone, 0};
  EXL3_RETURN_IF_ERROR(exl3::cuda::CopyToDeviceAsync(result_.get(), init, sizeof(init), stream));
  if (n > 0) {
    const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1024));
    FirstNonFiniteKernel<<<blocks, kThreads, 0, S(stream)>>>(values, n, result_.get());
    EXL3_RETURN_IF_ERROR(LaunchStatus("non-finite check"));
  }
  unsigned long long out[2];
  EXL3_RETURN_IF_ERROR(exl3::cuda::CopyToHostAsync(out, result_.get(), sizeof(out), stream));
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(S(stream)));
  if (out[0] == kNone) return std::nullopt;
  return static_cast<int64_t>(out[0]);
}

absl::Status FiniteCheck::CheckRows(const float* values, int first, int n, int width, const char* where, int layer,
                                    StreamHandle stream) {
  const float* rows = values + static_cast<size_t>(first) * width;
  EXL3_ASSIGN_OR_RETURN(const std::optional<int64_t> bad,
                        FirstNonFinite(rows, static_cast<int64_t>(n) * width, stream));
  if (!bad.has_value()) return absl::OkStatus();
  std::vector<float> host(static_cast<size_t>(n) * width);
  EXL3_RETURN_IF_ERROR(exl3::cuda::CopyToHost(host.data(), rows, host.size() * sizeof(float)));
  int bad_rows = 0;
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < width; ++c) {
      if (!std::isfinite(host[static_cast<size_t>(r) * width + c])) {
        ++bad_rows;
        break;
      }
    }
  }
  return absl::InternalError(absl::StrCat("non-finite value after layer ", layer, "'s ", where, ": row ",
                                          first + *bad / width, " column ", *bad % width, " (",
                                          host[static_cast<size_t>(*bad)], "); ", bad_rows, " of rows ", first,
                                          "..", first + n - 1, " hold one"));
}

}  // namespace exl3::engine::cuda
