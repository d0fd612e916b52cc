#include "engine/cuda/pinned_buffer.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace exl3::engine::cuda {

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

absl::Status PinnedBuffer::Reserve(size_t n) {
  if (n <= size_) return absl::OkStatus();
  if (data_ != nullptr) cudaFreeHost(data_);  // callers grow it between steps, with no copy in flight
  data_ = nullptr;
  size_ = 0;
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, n * sizeof(float), cudaHostAllocDefault);
  if (e != cudaSuccess)
    return absl::ResourceExhaustedError(absl::StrCat("pinned host memory of ", n * sizeof(float),
                                                     " bytes: ", cudaGetErrorString(e)));
  data_ = static_cast<float*>(p);
  size_ = n;
  return absl::OkStatus();
}

}  // namespace exl3::engine::cuda
