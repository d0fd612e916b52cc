// DeviceLinear (cuda_backend.h): one linear layer's tensors copied into one device allocation.
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::cuda {

absl::StatusOr<std::unique_ptr<DeviceLinear>> DeviceLinear::Upload(const Exl3LinearView& host) {
  EXL3_RETURN_IF_ERROR(ValidateLinear(host));
  const size_t tb = host.trellis_words() * 2, kb = host.in_features * 2ul, nb = host.out_features * 2ul;
  auto align = [](size_t x) { return (x + 255) & ~size_t{255}; };
  const size_t total = align(tb) + align(kb) + 2 * align(nb);
  std::unique_ptr<DeviceLinear> d(new DeviceLinear());
  EXL3_CUDA_RETURN_IF_ERROR(cudaMalloc(&d->block_, total));
  char* base = static_cast<char*>(d->block_);
  d->view_ = host;
  auto put = [&](const uint16_t* src, size_t bytes, size_t& off) -> absl::StatusOr<const uint16_t*> {
    char* dst = base + off;
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    off += align(bytes);
    return reinterpret_cast<const uint16_t*>(dst);
  };
  size_t off = 0;
  auto t = put(host.trellis, tb, off);
  if (!t.ok()) return t.status();
  d->view_.trellis = *t;
  auto su = put(host.suh, kb, off);
  if (!su.ok()) return su.status();
  d->view_.suh = *su;
  auto sv = put(host.svh, nb, off);
  if (!sv.ok()) return sv.status();
  d->view_.svh = *sv;
  if (host.bias) {
    auto b = put(host.bias, nb, off);
    if (!b.ok()) return b.status();
    d->view_.bias = *b;
  }
  return d;
}

DeviceLinear::~DeviceLinear() {
  if (block_) cudaFree(block_);
}

}  // namespace exl3::cuda
