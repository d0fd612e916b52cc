#include "engine/cuda/ple_windows.h"

#include "absl/strings/str_cat.h"
#include "engine/cpu/sequence_state.h"

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
    const Held* held =
        chunk.state_slot >= 0 && slot < held_.size() && held_[slot].has_value() ? &*held_[slot] : nullptr;
    const int at = held != nullptr ? chunk.start_position - held->first_length : -1;
    if (held == nullptr || held->sequence_id != chunk.sequence_id || at < 0 ||
        at >= static_cast<int>(held->contexts.size()))
      return absl::FailedPreconditionError(absl::StrCat(
          "PLE: sequence ", chunk.sequence_id, " resumes at position ", chunk.start_position, " in state slot ",
          chunk.state_slot, ", which holds no context of it there (its earlier steps did not run here)"));
    carried[c] = &held->contexts[at];
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
  // The context after the chunk's first `folded` tokens, for each length the chunk keeps (the
  // last: after all of it).
  for (size_t c = 0; c < batch.chunks.size(); ++c) {
    const SequenceChunk& chunk = batch.chunks[c];
    const int count = static_cast<int>(chunk.tokens.size()), kept = KeptStatesOf(chunk);
    Held next{chunk.sequence_id, chunk.start_position + count - kept + 1, {}};
    for (int k = 0; k < kept; ++k) {
      const int folded = count - kept + 1 + k;
      std::vector<int32_t>& context = next.contexts.emplace_back(ctx);
      for (int i = 0; i < ctx; ++i) {
        const int j = folded - ctx + i;  // index in the chunk
        context[i] = j >= 0 ? chunk.tokens[j] : (*carried[c])[ctx + j];
      }
    }
    pending_.emplace_back(chunk.state_slot, std::move(next));
  }
  return absl::OkStatus();
}

void PleWindows::Commit() {
  for (auto& [slot, held] : pending_) {
    if (slot < 0) continue;
    if (static_cast<size_t>(slot) >= held_.size()) held_.resize(static_cast<size_t>(slot) + 1);
    held_[slot] = std::move(held);
  }
  pending_.clear();
}

}  // namespace exl3::engine::cuda
