// MoeWorkspace (moe_workspace.h).
#include "kernels/cuda/moe_workspace.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/device_arena.h"

namespace exl3::cuda {

MoeWorkspace::~MoeWorkspace() {
  if (block_) cudaFree(block_);
}

absl::Status MoeWorkspace::Allocate(const MoeWorkspaceShape& s) {
  const size_t slots = static_cast<size_t>(s.max_tokens) * s.top_k;  // routed (token, expert) rows
  const size_t tokens = s.max_tokens;                                // shared-expert rows
  const size_t H = s.hidden, I = s.inter, SI = s.shared_inter;
  max_chunks = static_cast<int>(slots) + s.num_experts;
  DeviceArena arena;
  // Routing.
  arena.Region(&route.slot_token, slots);
  arena.Region(&route.slot_expert, slots);
  arena.Region(&route.slot_weight, slots);
  arena.Region(&route.assign_slot, slots);
  arena.Region(&route.chunk_expert, max_chunks);
  arena.Region(&route.chunk_row0, max_chunks);
  arena.Region(&route.chunk_rows, max_chunks);
  arena.Region(&route.counts, 2);  // slots, chunks
  arena.Region(&route.class_chunk0, kMaxMoeClasses);
  arena.Region(&route.class_chunks, kMaxMoeClasses);
  // Routed experts, one row per slot: gate/up inputs and outputs, down's input and output.
  arena.Region(&buf.a_gate, slots * H);
  arena.Region(&buf.a_up, slots * H);
  arena.Region(&buf.y_gate, slots * I);
  arena.Region(&buf.y_up, slots * I);
  arena.Region(&buf.a_down, slots * I);
  arena.Region(&buf.y_down, slots * H);
  // The shared expert, one row per token, and its per-token output scale.
  arena.Region(&buf.sa_gate, tokens * H);
  arena.Region(&buf.sa_up, tokens * H);
  arena.Region(&buf.sy_gate, tokens * SI);
  arena.Region(&buf.sy_up, tokens * SI);
  arena.Region(&buf.sa_down, tokens * SI);
  arena.Region(&buf.sy_down, tokens * H);
  arena.Region(&buf.shared_scale, tokens);
  // Host routing staging.
  arena.Region(&ids, slots);
  arena.Region(&weights, slots);
  return arena.AllocateZeroed(&block_);
}

}  // namespace exl3::cuda
