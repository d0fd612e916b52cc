// MTP drafting (engine/core/model_runner.h MtpSpan): which chunks of the last step a model kept
// the per-token states of (StepBatch::keep_hidden_states), and where each chunk's rows start in
// those states (step order), so that a span of the drafting call after the step is checked
// against its chunk and finds its rows, and the MTP layer's chunk of a span. The CPU model
// (engine/cpu/cpu_model.h) and the GPU model's drafting (engine/cuda/mtp_drafting.h) hold a
// KeptChunks beside the rows they keep.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/core/model_runner.h"

namespace exl3::engine {

class KeptChunks {
 public:
  // The last step kept nothing (or failed): no span matches until the next Record.
  void Clear() { kept_ = false; }
  // `batch`'s states were kept: its chunks, in step order, their rows one after another.
  void Record(const StepBatch& batch);
  // FailedPrecondition when the last step kept nothing; InvalidArgument naming the first span
  // whose chunk, sequence, start position, positions, next tokens or draft count do not fit it.
  absl::Status CheckSpans(std::span<const MtpSpan> spans) const;
  // The row of chunk `chunk`'s first token in the kept states (a checked span's chunk_index).
  int first_row(int chunk) const { return first_rows_[chunk]; }

 private:
  bool kept_ = false;
  std::vector<int64_t> sequence_ids_;
  std::vector<int> start_positions_, first_rows_, num_tokens_;
};

// The MTP layer's chunk of span `s`: its positions with their next tokens, on its sequence's
// blocks and state slot, wanting the logits of its last position when it drafts (num_drafts > 0).
SequenceChunk MtpChunkOf(const MtpSpan& s);

}  // namespace exl3::engine
