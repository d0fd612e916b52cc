#include "engine/core/step_tokens.h"

#include "absl/strings/str_cat.h"

namespace exl3::engine {

absl::Status FlattenStep(const StepBatch& batch, int vocab_size, const KvCacheShape& cache,
                         int max_context, StepTokens* out) {
  *out = StepTokens{};
  out->batch = &batch;
  for (size_t c = 0; c < batch.chunks.size(); ++c) {
    const SequenceChunk& ch = batch.chunks[c];
    const int n = static_cast<int>(ch.tokens.size());
    const int end = ch.start_position + n;
    if (n == 0 || ch.start_position < 0)
      return absl::InvalidArgumentError(absl::StrCat("step chunk ", c, " (sequence ", ch.sequence_id,
                                                     ") is empty or starts before position 0"));
    if (end > max_context)
      return absl::InvalidArgumentError(absl::StrCat("sequence ", ch.sequence_id, " reaches position ",
                                                     end, " beyond the context of ", max_context));
    const int64_t blocks_needed = (end + cache.block_size - 1) / cache.block_size;
    if (static_cast<int64_t>(ch.block_table.size()) < blocks_needed)
      return absl::InternalError(absl::StrCat("sequence ", ch.sequence_id, ": block table of ",
                                              ch.block_table.size(), " blocks for ", end, " positions"));
    for (int32_t b : ch.block_table)
      if (b < 0 || b >= cache.num_blocks)
        return absl::InternalError(absl::StrCat("sequence ", ch.sequence_id, ": block ", b,
                                                " outside the cache of ", cache.num_blocks));
    for (int i = 0; i < n; ++i) {
      const int32_t tok = ch.tokens[i];
      if (tok < 0 || tok >= vocab_size)
        return absl::InvalidArgumentError(absl::StrCat("sequence ", ch.sequence_id, ": token id ", tok,
                                                       " outside the vocabulary of ", vocab_size));
      out->token_ids.push_back(tok);
      out->positions.push_back(ch.start_position + i);
      out->chunk_of.push_back(static_cast<int32_t>(c));
      out->seq_len_after.push_back(end);
    }
    if (ch.wants_logits) {
      if (ch.num_logit_rows < 1 || ch.num_logit_rows > n)
        return absl::InvalidArgumentError(absl::StrCat("sequence ", ch.sequence_id, ": ", ch.num_logit_rows,
                                                       " logit rows wanted of a chunk of ", n, " tokens"));
      const int32_t end_token = static_cast<int32_t>(out->token_ids.size());
      for (int32_t t = end_token - ch.num_logit_rows; t < end_token; ++t) out->logit_tokens.push_back(t);
    }
  }
  out->num_tokens = static_cast<int>(out->token_ids.size());
  return absl::OkStatus();
}

std::vector<ChunkRun> ChunkRuns(const StepTokens& tokens) {
  std::vector<ChunkRun> runs;
  for (int t = 0; t < tokens.num_tokens; ++t) {
    if (runs.empty() || runs.back().chunk != tokens.chunk_of[t]) runs.push_back({tokens.chunk_of[t], t, 0});
    ++runs.back().num_tokens;
  }
  return runs;
}

}  // namespace exl3::engine
