// How a step splits into micro-batches for the ping-pong of attention and the MoE exchange
// (MegaScale-Infer): contiguous groups of the step's chunks, so that each micro-batch's tokens are
// a contiguous range of the step's flattened tokens (engine/core/step_tokens.h lays them out chunk by
// chunk) and its logit rows stay in chunk order. Used by the CPU model (engine/cpu/cpu_model.h) and the
// GPU model (engine/cuda/cuda_model.h).
#pragma once

#include <vector>

#include "engine/core/model_runner.h"

namespace exl3::engine {

// One micro-batch: chunks [first_chunk, first_chunk + num_chunks) of the step, which are its
// tokens [first_token, first_token + num_tokens).
struct MicroBatchRange {
  int first_chunk = 0, num_chunks = 0;
  int first_token = 0, num_tokens = 0;
};

// `micro_batches` 1: the whole step. 2 and a step of two chunks or more: the longest prefix of at
// most half the tokens (at least one chunk), then the rest. A step of one chunk is one micro-batch
// whatever is asked. micro_batches must be 1 or 2.
std::vector<MicroBatchRange> SplitIntoMicroBatches(const StepBatch& batch, int micro_batches);

// The chunks of `range` as a step of their own.
StepBatch MicroBatchChunks(const StepBatch& batch, const MicroBatchRange& range);

}  // namespace exl3::engine
