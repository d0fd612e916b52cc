// What every mixer kind of recurrent layers (engine/cuda/recurrent_mixer.h)
// keeps across a step: the per-sequence state store of its layers
// (engine/cuda/device_sequence_states.h: a step reads each chunk's current copy and writes others,
// committed only once the step has succeeded) and the step's chunk table
// (engine/cuda/recurrent_chunks.h): per row its chunk, per chunk [first row, rows, state row read,
// state row written, kept states, the slot's first row], one chunk per padding row of a decode
// graph (reading the store's zero row, writing its spare row), so a captured decode step replays
// for any slots.
//
//   Allocate(cfg, shape.num_sequence_slots, shape.max_logit_rows_per_chunk)
//                                               CudaMixerKind::AllocateCache
//   BeginStep(batch, stream)                    CudaMixerKind::BeginStep
//   Pack(tokens, rows, &facts)                  CudaMixerKind::PackStep
//   Bind(rows, device_facts)                    CudaMixerKind::BindStep
//   StepFor(first, n)                           per layer call, for rows [first, first + n)
//   CommitStep(batch)                           CudaMixerKind::EndStep
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "engine/cuda/device_sequence_states.h"
#include "engine/cuda/recurrent_chunks.h"
#include "engine/config/model_config.h"
#include "engine/core/model_runner.h"
#include "engine/core/step_tokens.h"

namespace exl3::engine::cuda {

class RecurrentLayerStates {
 public:
  // A store of `num_slots` slots for the recurrent layers of `cfg` (the state of every earlier
  // layer before a layer's own within a row: StateOffset), for chunks keeping up to
  // `max_kept_states` states (verify chunks of that many logit rows; 1 without speculation).
  absl::Status Allocate(const ModelConfig& cfg, int num_slots, int max_kept_states = 1);
  // Where layer `layer`'s state starts within a store row.
  static int64_t StateOffset(const ModelConfig& cfg, int layer);

  absl::Status BeginStep(const StepBatch& batch, StreamHandle stream);
  void CommitStep(const StepBatch& batch);

  // Appends the step's chunk facts to `facts`: chunk_of [rows], then the table. Rows from
  // tokens.num_tokens on are a decode graph's padding rows, one chunk each.
  absl::Status Pack(const StepTokens& tokens, int rows, std::vector<int32_t>* facts);
  // `device_facts`: the uploaded array Pack appended to; `rows` as given to Pack.
  void Bind(int rows, const int32_t* device_facts);
  // The chunks of rows [first, first + n) (whole chunks: a chunk never straddles `first`).
  RecurrentStep StepFor(int first, int n) const;

  // Null before Allocate.
  const DeviceSequenceStates* store() const { return states_.get(); }

 private:
  std::unique_ptr<DeviceSequenceStates> states_;
  const int32_t* chunk_of_ = nullptr;  // device: the step's chunk_of, then its table
  const int32_t* table_ = nullptr;
  std::vector<int> chunk_first_;  // host: each chunk's first row, in order
  int max_kept_states_ = 1;       // host: the most states a chunk of the step keeps
  size_t facts_at_ = 0;           // where Pack put them in the step's array
};

}  // namespace exl3::engine::cuda
