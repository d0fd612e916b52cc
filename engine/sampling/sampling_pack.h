// Packs a step's RowSampling (engine/sampling/sampler.h) into the compact form a device sampler reads
// (engine/sampling/packed_sampling.h), and unpacks its results into SampledTokens.
//
//   SamplingPacker packer(vocab_size);                  // scratch: one per sampler
//   PackedSampling packed;
//   packer.Pack(rows, &packed);                         // rows: one per logit row
//   ... the device samples packed.rows / packed.entries into OutputWordsPerRow(packed.max_top)
//   ... words per row ...
//   SampledToken t = UnpackSampledRow(words_of_row_i, packed.rows[i]);
//
// Penalties travel as a list per row of the distinct tokens they touch with their output counts,
// rebuilt every step from the sequence's history (O(prompt + output) on the host for rows with a
// penalty, as the CPU sampler's own pass is; nothing for rows without). Nothing is kept on the
// device between steps, so preemption, recomputation, retried steps and prefix-cache hits need
// nothing of it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/sampling/packed_sampling.h"
#include "engine/sampling/sampler.h"

namespace exl3::engine {

struct PackedSampling {
  std::vector<PackedSamplingRow> rows;
  std::vector<PackedPenaltyEntry> entries;
  int max_top = 0;  // the most top logprobs any row asks (the results' row width)
};

class SamplingPacker {
 public:
  explicit SamplingPacker(int vocab_size);

  // Replaces `out` with the rows' packed form. Every token id must be in [0, vocab_size) (the
  // engine checks prompts; sampled tokens are) and every row's logprobs at most
  // kMaxDeviceTopLogprobs.
  void Pack(std::span<const RowSampling> rows, PackedSampling* out);

 private:
  const int vocab_size_;
  std::vector<int32_t> output_counts_;  // per token, zero between calls
  std::vector<uint8_t> marks_;          // per token: 1 touched, 2 banned; zero between calls
  std::vector<int32_t> touched_;
};

// The SampledToken of one row's results (`words`: OutputWordsPerRow(max_top) words).
SampledToken UnpackSampledRow(std::span<const uint32_t> words, const PackedSamplingRow& row);

}  // namespace exl3::engine
