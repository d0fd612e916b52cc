// The MoE layer's decode in one cooperative launch (moe_cooperative.cu): routing, the input
// transforms, gate+up of every chosen expert and the shared expert, the activation, down and the
// weighted sum, as phases of one persistent grid separated by grid-wide barriers. MoeRunner
// (moe_runner.cu, ChooseSequence) runs it for decode-sized batches and the launch chain
// (moe_kernels.h and the GEMV kernels) otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/cuda/moe_kernels.h"

namespace exl3::cuda {

inline constexpr int kMoeCoopThreads = 256;
// Every block routes all T * top_k assignments itself, one thread each (no routing launch and
// no barrier for it), so a launch takes at most one block's threads of assignments.
inline constexpr int kMoeCoopMaxAssign = kMoeCoopThreads;
// The token bound of the cooperative decode (with T * top_k <= kMoeCoopMaxAssign): two 8-row
// chunks per expert at most where routing spreads (each expert's rows are one mma's 8-wide side
// up to 8 tokens), and 2 x 8 = 16 so that the engine's batch-16 decode steps of top-8 models stay
// in one launch; above it the chain's grouped GEMV (one launch per projection) costs a small share
// of the step.
inline constexpr int kMoeCoopMaxTokens = 16;

struct MoeCoopArgs {
  const float* x = nullptr;          // [T, hidden] fp32
  const int32_t* ids = nullptr;      // [T, top_k] int32 (out of range / not held: skipped)
  const float* weights = nullptr;    // [T, top_k] fp32
  float* out = nullptr;              // [T, hidden] fp32, overwritten
  MoeDims d{};                       // with_shared 0: no shared expert
  int num_experts = 0;
  ProjTable gate, up, down;          // routed (ProjTable::code: each expert's decoder)
  ProjTable sgate, sup, sdown;       // shared expert (entry 0)
  const float* shared_gate_vec = nullptr;  // [hidden] fp32 or null
  MoeBuffers b{};                    // MoeWorkspace's activations, rows by slot (T * top_k) or token
};

// Blocks per SM that MoeCoopKernel keeps resident on the current device (its grid is this times
// the SM count); 0 where the device cannot launch cooperatively.
absl::StatusOr<int> MoeCoopBlocksPerSm();

// One cooperative launch of `grid` blocks (at most MoeCoopBlocksPerSm() * SMs). Requires
// a.d.T * a.d.topk <= kMoeCoopMaxAssign and hidden, inter, shared_inter multiples of 128.
// ResourceExhausted (nothing launched) where the runtime refuses the grid as too large for the
// SMs the context may use.
absl::Status LaunchMoeCoop(const MoeCoopArgs& a, int grid, cudaStream_t stream);

}  // namespace exl3::cuda
