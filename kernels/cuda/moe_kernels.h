// The MoE layer's own kernels (the projections are the GEMV/GEMM kernels) as launchers, and the
// device structures they share with the launch sequence (moe_runner.cu):
//   RouteKernel        top-k ids/weights -> slots grouped by expert, row chunks per expert
//   MoeInputKernel     per slot: x ⊙ suh_gate/up · H -> fp16 A (and the shared expert's rows)
//   MoeMidKernel       output transforms, SwiGLU (+clamp), down's input transform -> fp16 A
//   MoeCombineKernel   per token: sum_k w * ((y·H) ⊙ svh + bias) + shared -> out fp32
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/moe_layer.h"

namespace exl3::cuda {

struct RouteOut {
  int* slot_token;    // [T*topk]
  int* slot_expert;   // [T*topk]
  float* slot_weight; // [T*topk]
  int* assign_slot;   // [T*topk]: slot of assignment i, -1 if dropped
  int* chunk_expert;  // [max_chunks]
  int* chunk_row0;
  int* chunk_rows;
  int* counts;        // [0] = slots, [1] = chunks
  // A mixed layer's (K, codebook) classes (moe_layer.h): the chunks are ordered by class; class k
  // owns chunks [class_chunk0[k], class_chunk0[k] + class_chunks[k]). Unwritten for a uniform
  // layer (its one class is all chunks: counts[1]).
  int* class_chunk0;  // [kMaxMoeClasses]
  int* class_chunks;  // [kMaxMoeClasses]
};

struct MoeBuffers {
  // routed
  __half* a_gate; __half* a_up; float* y_gate; float* y_up; __half* a_down; float* y_down;
  // shared
  __half* sa_gate; __half* sa_up; float* sy_gate; float* sy_up; __half* sa_down; float* sy_down;
  float* shared_scale;  // [T] sigmoid gate (Qwen3-Next) or 1
};

struct MoeDims {
  int T, topk, hidden, inter, shared_inter;
  float limit, shared_limit;
  int with_shared;
};

// One block: groups num_assign = T*topk assignments by expert into `o` (chunks of chunk_size rows),
// the experts in the order of `classes` (with the per-class chunk ranges) for a mixed layer.
absl::Status LaunchRoute(const int32_t* ids, const float* weights, int num_assign, int topk, int num_experts,
                         const uint16_t* const* held, const RouteClasses& classes, int chunk_size,
                         const RouteOut& o, cudaStream_t stream);
// `rows` = routed slots (T*topk) + shared-expert rows (T or 0). zero_outputs: also zero the rows'
// projection outputs (y_gate, y_up, y_down and the shared ones), for projections that add into
// them (the GEMV, the reference path); the one-k-slice GEMM stores them whole and needs none.
absl::Status LaunchMoeInput(int rows, const float* x, const MoeDims& d, const ProjTable& gate, const ProjTable& up,
                            const ProjTable& sgate, const ProjTable& sup, const float* shared_gate_vec,
                            const RouteOut& r, const MoeBuffers& b, bool zero_outputs, cudaStream_t stream);
absl::Status LaunchMoeMid(int rows, const MoeDims& d, const ProjTable& gate, const ProjTable& up,
                          const ProjTable& down, const ProjTable& sgate, const ProjTable& sup,
                          const ProjTable& sdown, const RouteOut& r, const MoeBuffers& b, cudaStream_t stream);
absl::Status LaunchMoeCombine(const MoeDims& d, const ProjTable& down, const ProjTable& sdown, const RouteOut& r,
                              const MoeBuffers& b, float* out, cudaStream_t stream);

}  // namespace exl3::cuda
