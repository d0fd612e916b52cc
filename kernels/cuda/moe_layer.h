// An MoE layer's weights on the device (cuda_backend.h's DeviceMoeLayer): per-projection pointer
// tables indexed by expert id, over tensors uploaded into one device block or read in place from
// registered host memory. The routed experts of one projection may differ in K and codebook: they
// are grouped into (K, codebook) classes (kernels/moe_classes.h), whose row chunks the routing
// kernel keeps apart so that each class runs in the launch of its own kernel instance
// (moe_runner.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/moe_classes.h"

namespace exl3::cuda {

// Per-projection device pointer tables, indexed by expert id.
struct ProjTable {
  const uint16_t** trellis = nullptr;  // [E] (null: expert not held)
  const uint16_t** suh = nullptr;
  const uint16_t** svh = nullptr;
  const uint16_t** bias = nullptr;  // entries may be null
  // [E] (routed) or [1] (shared): each expert's MoeSpecCode, for kernels that pick the decoder per
  // expert at run time (moe_cooperative.cu); 0 where the expert is not held.
  const uint8_t* code = nullptr;
  int k = 0, n = 0;
  int bits = 0, cb = 0;  // the first held expert's (every expert's in a uniform layer)
  const uint16_t* const* host_trellis = nullptr;  // host copy of `trellis` (host code only)
  const MoeProjSpec* host_spec = nullptr;         // [E]: each expert's K and codebook (host code only)
};

// The most experts a device layer may have: RouteKernel (moe_kernels.cu) keeps a count and a
// prefix sum per expert in shared memory, this long.
inline constexpr int kMaxExperts = 2048;

// One number per (K, codebook): (K - 1) * 3 + codebook, 0..23 (codebook: kernels/codebook.h's
// Codebook, trellis_decode.cuh's kCb* values).
inline constexpr int kMoeSpecCodes = 24;
__host__ __device__ constexpr int MoeSpecCode(int bits, int codebook) { return (bits - 1) * 3 + codebook; }

// The routing kernel's view of the classes (device arrays in the layer's block; moe_kernels.h's
// LaunchRoute). order null: one class, experts in id order (a uniform layer).
struct RouteClasses {
  const int* order = nullptr;        // [E]: experts by class (MoeExpertClasses::order)
  const int* class_first = nullptr;  // [num_classes + 1]: class k's positions in `order`
  int num_classes = 1;
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
  MoeExpertClasses classes;  // the routed experts' (K, codebook) classes
  RouteClasses route_classes;  // device copies of classes.order/class_first (mixed layers)
  std::vector<MoeProjSpec> host_specs;  // storage of the routed tables' host_spec (3 x E)
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
