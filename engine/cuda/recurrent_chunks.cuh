// Device-side reading of a step's chunk table (engine/cuda/recurrent_chunks.h) for the recurrent
// layers' kernels (engine/cuda/deltanet_kernels.cu, kda_kernels.cu, delta_rule_kernels.cu,
// ple_kernels.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/cuda/recurrent_chunks.h"

namespace exl3::engine::cuda {

// One chunk: rows [first, first + tokens) of the step, its state read from read_row and, after its
// last token, written to write_row of the store; kept_states > 1 for a verify chunk, whose earlier
// kept states go to the slot's other rows (KeptRow).
struct RecurrentChunk {
  int first, tokens, read_row, write_row, kept_states, slot_row;

  // The first of the chunk's tokens whose state is kept (the state after it).
  __device__ __forceinline__ int first_kept_token() const { return tokens - kept_states; }
  // The row of kept state k (after the chunk's token first_kept_token() + k), k < kept_states.
  __device__ __forceinline__ int KeptRow(int k) const {
    return k == kept_states - 1 ? write_row : KeptStateRow(slot_row, read_row, k);
  }
};

__device__ __forceinline__ RecurrentChunk LoadChunk(const RecurrentChunks& ch, int c) {
  const int32_t* e = ch.table + static_cast<size_t>(c) * kRecurrentChunkInts;
  return RecurrentChunk{e[0], e[1], e[2], e[3], e[4], e[5]};
}

// The start of the layer's part of state row `row`.
__device__ __forceinline__ float* StateRow(const RecurrentChunks& ch, int row) {
  return ch.states + static_cast<size_t>(row) * ch.row_floats;
}

}  // namespace exl3::engine::cuda
