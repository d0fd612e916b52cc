// Page-locked host memory (cudaHostAlloc) that grows on demand: the staging buffers of copies
// between the device and host-side code (the remote experts' exchange), which the copy engines
// read and write directly, without the driver's bounce buffer.
#pragma once

#include <cstddef>
#include <utility>

#include "absl/status/status.h"

namespace exl3::engine::cuda {

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // At least `n` floats (reallocated, contents lost, when smaller).
  absl::Status Reserve(size_t n);
  float* get() const { return data_; }

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace exl3::engine::cuda
