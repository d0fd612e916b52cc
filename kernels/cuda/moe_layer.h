// An MoE layer's weights on the device (cuda_backend.h's DeviceMoeLayer): per-projection pointer
// tables indexed by expert id, over tensors uploaded into one device block or read in place from
// registered host memory.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cuda/cuda_backend.h"

namespace exl3::cuda {

// Per-projection device pointer tables, indexed by expert id.
struct ProjTable {
  const uint16_t** trellis = nullptr;  // [E] (null: expert not held)
  const uint16_t** suh = nullptr;
  const uint16_t** svh = nullptr;
  const uint16_t** bias = nullptr;  // entries may be null
  int k = 0, n = 0, bits = 0, cb = 0;
  const uint16_t* const* host_trellis = nullptr;  // host copy of `trellis` (host code only)
};

struct DeviceMoeLayer::Impl {
  int hidden = 0, inter = 0, num_experts = 0, held = 0;
  float limit = 0.f;
  ProjTable gate, up, down;     // routed
  bool has_shared = false;
  int shared_inter = 0;
  float shared_limit = 0.f;
  ProjTable sgate, sup, sdown;  // shared expert: tables of one entry
  const float* shared_gate_vec = nullptr;  // device [hidden] fp32 or null
  void* block = nullptr;
  size_t bytes = 0;
  std::vector<const void*> host_tables;  // host image of the device pointer tables
  std::unique_ptr<HostRegistration> own_pages;  // Register mode without a caller's registration
  size_t copied_bytes = 0;  // Register mode: misaligned tensors copied into `block` instead
  ~Impl() {
    if (block) cudaFree(block);
  }
};

}  // namespace exl3::cuda
