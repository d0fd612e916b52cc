#include "engine/core/micro_batches.h"

namespace exl3::engine {

std::vector<MicroBatchRange> SplitIntoMicroBatches(const StepBatch& batch, int micro_batches) {
  const int chunks = static_cast<int>(batch.chunks.size());
  const int total = batch.NumTokens();
  if (micro_batches < 2 || chunks < 2) return {MicroBatchRange{0, chunks, 0, total}};
  int split = 1, prefix = 0, split_tokens = static_cast<int>(batch.chunks[0].tokens.size());
  for (int i = 0; i + 1 < chunks; ++i) {
    prefix += static_cast<int>(batch.chunks[i].tokens.size());
    if (2 * prefix <= total) {
      split = i + 1;
      split_tokens = prefix;
    }
  }
  return {MicroBatchRange{0, split, 0, split_tokens},
          MicroBatchRange{split, chunks - split, split_tokens, total - split_tokens}};
}

StepBatch MicroBatchChunks(const StepBatch& batch, const MicroBatchRange& range) {
  StepBatch out;
  out.chunks.assign(batch.chunks.begin() + range.first_chunk,
                    batch.chunks.begin() + range.first_chunk + range.num_chunks);
  return out;
}

}  // namespace exl3::engine
