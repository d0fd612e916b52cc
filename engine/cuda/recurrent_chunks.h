// Where each chunk of a step's recurrent layer (Qwen3-Next's gated DeltaNet, GLM-5.3-Flash's KDA)
// reads and writes its per-sequence state: the kernels' view of the step's chunk table
// (engine/cuda/recurrent_layer_states.h packs it). Plain data, no CUDA header: it is a kernel
// argument of engine/cuda/deltanet_kernels.h and engine/cuda/kda_kernels.h.
#pragma once

#include <cstdint>

// KeptStateRow compiles for the kernels too (nvcc) without a CUDA header here.
#if defined(__CUDACC__)
#define EXL3_RECURRENT_HD __host__ __device__
#else
#define EXL3_RECURRENT_HD
#endif

namespace exl3::engine::cuda {

// The state store (engine/cuda/device_sequence_states.h) is rows of row_floats floats (one copy of
// one slot, every layer); `states` points at one layer's part of row 0, so chunk c reads
// states + table[c].read_row * row_floats and writes at its write_row.
//
// A verify chunk (speculative decoding) keeps the state after each of its last kept_states tokens
// (engine/cpu/sequence_state.h): kept state k (after the chunk's token tokens - kept_states + k) goes
// to KeptStateRow(slot_row, read_row, k) for k < kept_states - 1, the last to write_row. Any other
// chunk keeps 1 state (write_row) and its slot_row is not read.
struct RecurrentChunks {
  const int32_t* chunk_of = nullptr;  // [step rows]: the row's chunk (row of `table`)
  // [chunks, kRecurrentChunkInts] int32: first row, rows, state row read, state row written (after
  // the last token), kept states, the row of the slot's copy 0.
  const int32_t* table = nullptr;
  float* states = nullptr;
  int64_t row_floats = 0;
  // The most states a chunk of the step keeps, known on the host: above 1 (a verify chunk among
  // them) the delta-rule kernel runs its form that stores kept states, so a plain step's kernel is
  // the one it was without speculation.
  int max_kept_states = 1;
};
constexpr int kRecurrentChunkInts = 6;

// The row kept state k of a chunk goes to: the slot's copies other than the one it reads, in
// order (SequenceStateSlots::KeptCopy), the slot's copy c at row slot_row + c.
EXL3_RECURRENT_HD inline int32_t KeptStateRow(int32_t slot_row, int32_t read_row, int k) {
  return slot_row + k >= read_row ? slot_row + k + 1 : slot_row + k;
}

// The step's chunk facts on the device and which part of the step a layer call runs.
struct RecurrentStep {
  RecurrentChunks chunks;  // `states` left null: the layer points it at its own part of row 0
  float* store = nullptr;  // row 0 of the state store (DeviceSequenceStates::layer(0))
  int first_chunk = 0, num_chunks = 0;  // the chunks of rows [first, first + n), whole
};

}  // namespace exl3::engine::cuda
