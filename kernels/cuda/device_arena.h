// One device allocation carved into named regions. Each region is declared with the pointer it
// sets and its element count on one line, so a region's name, type and size cannot drift apart:
//   DeviceArena arena;
//   arena.Region(&route.slot_token, slots);   // int[slots]
//   arena.Region(&buf.a_gate, slots * hidden); // __half[slots * hidden]
//   EXL3_RETURN_IF_ERROR(arena.AllocateZeroed(&block));  // sets every declared pointer
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::cuda {

class DeviceArena {
 public:
  // Regions start at multiples of this many bytes.
  static constexpr size_t kAlign = 256;

  // Declares a region of `count` elements of T; *field points at it after AllocateZeroed.
  template <typename T>
  void Region(T** field, size_t count) {
    const size_t offset = bytes_;
    bytes_ += (count * sizeof(T) + kAlign - 1) & ~(kAlign - 1);
    assign_.push_back([field, offset](char* base) { *field = reinterpret_cast<T*>(base + offset); });
  }

  // Bytes of all regions declared so far.
  size_t bytes() const { return bytes_; }

  // One cudaMalloc for all regions, zeroed; points every declared field into it. The caller owns
  // *block (cudaFree).
  absl::Status AllocateZeroed(void** block) const {
    EXL3_CUDA_RETURN_IF_ERROR(cudaMalloc(block, bytes_));
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemset(*block, 0, bytes_));
    for (const auto& assign : assign_) assign(static_cast<char*>(*block));
    return absl::OkStatus();
  }

 private:
  size_t bytes_ = 0;
  std::vector<std::function<void(char*)>> assign_;
};

}  // namespace exl3::cuda
