#include "engine/sampling/sampling_pack.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace exl3::engine {
namespace {

constexpr uint8_t kTouched = 1, kBanned = 2;

}  // namespace

SamplingPacker::SamplingPacker(int vocab_size)
    : vocab_size_(vocab_size), output_counts_(vocab_size, 0), marks_(vocab_size, 0) {}

void SamplingPacker::Pack(std::span<const RowSampling> rows, PackedSampling* out) {
  out->rows.clear();
  out->entries.clear();
  out->max_top = 0;
  for (const RowSampling& r : rows) {
    const SamplingParams& p = r.params;
    PackedSamplingRow row;
    const bool repetition = p.repetition_penalty != 1.0f;
    const bool additive = p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
    if (p.greedy()) {
      row.flags |= kPackedGreedy;
    } else {
      row.uniform = Sampler::UniformDraw(r.seed, r.history.output.size());
      row.inv_temperature = 1.0f / p.temperature;
    }
    row.top_k = p.top_k;
    row.top_p = p.top_p;
    if (p.top_p < 1.0f) row.flags |= kPackedTopP;
    if (p.min_p > 0.0f) {
      row.flags |= kPackedMinP;
      row.log_min_p = std::log(p.min_p);
    }
    row.repetition_penalty = p.repetition_penalty;
    row.presence_penalty = p.presence_penalty;
    row.frequency_penalty = p.frequency_penalty;
    if (repetition) row.flags |= kPackedRepetition;
    if (additive) row.flags |= kPackedAdditive;
    if (p.logprobs.has_value()) {
      row.num_logprobs = std::clamp(*p.logprobs, 0, vocab_size_);
      out->max_top = std::max(out->max_top, row.num_logprobs);
    }

    // The tokens the CPU sampler's bans and ApplyPenalties touch, each once.
    touched_.clear();
    auto touch = [&](int32_t t, uint8_t mark) {
      if (marks_[t] == 0) touched_.push_back(t);
      marks_[t] |= mark;
    };
    for (int32_t t : r.history.banned_tokens) touch(t, kBanned);
    if (repetition || additive) {
      if (repetition) {
        for (int32_t t : r.history.prompt) touch(t, kTouched);
      }
      for (int32_t t : r.history.output) {
        touch(t, kTouched);
        ++output_counts_[t];
      }
    }
    row.entries_begin = static_cast<int32_t>(out->entries.size());
    for (int32_t t : touched_) {
      PackedPenaltyEntry e;
      e.token = t;
      e.output_count = output_counts_[t];
      e.banned = (marks_[t] & kBanned) != 0 ? 1 : 0;
      out->entries.push_back(e);
      marks_[t] = 0;
      output_counts_[t] = 0;
    }
    row.entries_end = static_cast<int32_t>(out->entries.size());
    out->rows.push_back(row);
  }
}

SampledToken UnpackSampledRow(std::span<const uint32_t> words, const PackedSamplingRow& row) {
  SampledToken t;
  t.token = static_cast<int32_t>(words[kSampledToken]);
  if (row.num_logprobs >= 0) {
    t.logprob = std::bit_cast<float>(words[kSampledLogprob]);
    const int n = std::min(static_cast<int>(words[kSampledNumTop]), row.num_logprobs);
    t.top_logprobs.reserve(n);
    for (int i = 0; i < n; ++i) {
      t.top_logprobs.push_back({static_cast<int32_t>(words[kSampledTopBegin + 2 * i]),
                                std::bit_cast<float>(words[kSampledTopBegin + 2 * i + 1])});
    }
  }
  return t;
}

}  // namespace exl3::engine
