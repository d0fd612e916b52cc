#include "engine/core/kept_chunks.h"

#include "absl/strings/str_cat.h"

namespace exl3::engine {

void KeptChunks::Record(const StepBatch& batch) {
  sequence_ids_.clear();
  start_positions_.clear();
  first_rows_.clear();
  num_tokens_.clear();
  int first = 0;
  for (const SequenceChunk& c : batch.chunks) {
    sequence_ids_.push_back(c.sequence_id);
    start_positions_.push_back(c.start_position);
    first_rows_.push_back(first);
    num_tokens_.push_back(static_cast<int>(c.tokens.size()));
    first += static_cast<int>(c.tokens.size());
  }
  kept_ = true;
}

absl::Status KeptChunks::CheckSpans(std::span<const MtpSpan> spans) const {
  if (!kept_)
    return absl::FailedPreconditionError("the last step kept no hidden states (StepBatch::keep_hidden_states)");
  for (const MtpSpan& s : spans) {
    const int c = s.chunk_index;
    if (c < 0 || c >= static_cast<int>(sequence_ids_.size()) || sequence_ids_[c] != s.sequence_id ||
        start_positions_[c] != s.start_position || s.num_positions < 1 || s.num_positions > num_tokens_[c] ||
        static_cast<int>(s.next_tokens.size()) != s.num_positions || s.num_drafts < 0)
      return absl::InvalidArgumentError(absl::StrCat("MTP span of sequence ", s.sequence_id,
                                                     " does not match the last step's chunk ", c));
  }
  return absl::OkStatus();
}

SequenceChunk MtpChunkOf(const MtpSpan& s) {
  SequenceChunk chunk;
  chunk.sequence_id = s.sequence_id;
  chunk.tokens = s.next_tokens;
  chunk.start_position = s.start_position;
  chunk.block_table = s.block_table;
  chunk.wants_logits = s.num_drafts > 0;
  chunk.state_slot = s.state_slot;
  return chunk;
}

}  // namespace exl3::engine
