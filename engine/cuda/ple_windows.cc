#include "engine/cuda/ple_windows.h"

#include "absl/strings/str_cat.h"

namespace exl3::engine::cuda {

absl::Status PleWindows::Build(const StepTokens& tokens, std::vector<int32_t>* windows) {
  pending_.clear();
  const int n = ple_.ngram_size, ctx = ple_.context_tokens(), T = tokens.num_tokens;
  const StepBatch& batch = *tokens.batch;
  // Each chunk's carried context (eos for a fresh sequence), checked once per chunk.
  std::vector<const std::vector<int32_t>*> carried(batch.chunks.size(), nullptr);
  const std::vector<int32_t> fresh(ctx, ple_.eos_token_id);
  for (size_t c = 0; c < batch.chunks.size(); ++c) {
    const SequenceChunk& chunk = batch.chunks[c];
    if (chunk.start_position == 0) {
      carried[c] = &fresh;
      continue;
    }
    const size_t slot = static_cast<size_t>(chunk.state_slot);
    if (chunk.state_slot < 0 || slot >= context_.size() || static_cast<int>(context_[slot].size()) != ctx)
      return absl::FailedPreconditionError(absl::StrCat(
          "PLE: sequence ", chunk.sequence_id, " resumes at position ", chunk.start_position, " in state slot ",
          chunk.state_slot, ", which holds no context of it (its earlier steps did not run here)"));
    carried[c] = &context_[slot];
  }
  windows->assign(static_cast<size_t>(T) * n, 0);
  for (int t = 0; t < T; ++t) {
    const int c = tokens.chunk_of[t];
    const SequenceChunk& chunk = batch.chunks[c];
    const int j = tokens.positions[t] - chunk.start_position;  // index in the chunk
    int32_t* w = windows->data() + static_cast<size_t>(t) * n;
    for (int i = 0; i < n; ++i) {
      const int back = n - 1 - i;  // tokens before t
      w[i] = j - back >= 0 ? chunk.tokens[j - back] : (*carried[c])[ctx + (j - back)];
    }
  }
  for (size_t c = 0; c < batch.chunks.size(); ++c) {
    const SequenceChunk& chunk = batch.chunks[c];
    const int count = static_cast<int>(chunk.tokens.size());
    std::vector<int32_t> next(ctx);
    for (int i = 0; i < ctx; ++i) {
      const int j = count - ctx + i;  // index in the chunk
      next[i] = j >= 0 ? chunk.tokens[j] : (*carried[c])[ctx + j];
    }
    pending_.emplace_back(chunk.state_slot, std::move(next));
  }
  return absl::OkStatus();
}

void PleWindows::Commit() {
  for (auto& [slot, context] : pending_) {
    if (slot < 0) continue;
    if (static_cast<size_t>(slot) >= context_.size()) context_.resize(static_cast<size_t>(slot) + 1);
    context_[slot] = std::move(context);
  }
  pending_.clear();
}

}  // namespace exl3::engine::cuda
