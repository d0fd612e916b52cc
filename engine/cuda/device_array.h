// A typed device allocation that frees itself (kernels/cuda/cuda_backend.h's DeviceAlloc), for the
// CUDA engine's weights, cache and activations. Move-only; Reserve grows it (contents dropped).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "base/status_macros.h"
#include "kernels/cuda/cuda_backend.h"

namespace exl3::engine::cuda {

using StreamHandle = void*;

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  ~DeviceArray() { exl3::cuda::DeviceFree(data_); }
  DeviceArray(DeviceArray&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  // At least n elements (reallocated, contents lost, when smaller).
  absl::Status Reserve(size_t n) {
    if (n <= size_) return absl::OkStatus();
    exl3::cuda::DeviceFree(data_);
    data_ = nullptr;
    size_ = 0;
    EXL3_ASSIGN_OR_RETURN(void* p, exl3::cuda::DeviceAlloc(n * sizeof(T)));
    data_ = static_cast<T*>(p);
    size_ = n;
    return absl::OkStatus();
  }
  // Exactly the host vector's elements, copied.
  absl::Status Upload(const T* host, size_t n) {
    EXL3_RETURN_IF_ERROR(Reserve(n));
    return n == 0 ? absl::OkStatus() : exl3::cuda::CopyToDevice(data_, host, n * sizeof(T));
  }
  absl::Status Upload(const std::vector<T>& host) { return Upload(host.data(), host.size()); }

  T* get() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace exl3::engine::cuda
