// MoeRunner's device memory, allocated once in MoeRunner::Create (none during Forward, so a
// forward can be captured in a CUDA graph): the routing results, the activations of the six
// projections and the staging of host routing arrays, as named regions of one zeroed allocation
// (device_arena.h).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/moe_kernels.h"

namespace exl3::cuda {

struct MoeWorkspaceShape {
  int max_tokens = 0, top_k = 0;
  int hidden = 0, inter = 0;
  int shared_inter = 0;  // the shared expert's buffers are this wide (at least 128, also without one)
  int num_experts = 0;
};

class MoeWorkspace {
 public:
  MoeWorkspace() = default;
  ~MoeWorkspace();
  MoeWorkspace(const MoeWorkspace&) = delete;
  MoeWorkspace& operator=(const MoeWorkspace&) = delete;

  absl::Status Allocate(const MoeWorkspaceShape& shape);

  RouteOut route{};   // RouteKernel's output: slots grouped by expert, row chunks
  MoeBuffers buf{};   // the projections' inputs (fp16) and outputs (fp32)
  int32_t* ids = nullptr;   // ForwardHostRouting's copy of the routing: [max_tokens * top_k]
  float* weights = nullptr;
  // The most row chunks RouteKernel can make: one per slot plus one partial chunk per expert.
  int max_chunks = 0;

 private:
  void* block_ = nullptr;
};

}  // namespace exl3::cuda
