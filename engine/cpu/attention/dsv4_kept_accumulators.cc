#include "engine/cpu/attention/dsv4_kept_accumulators.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace exl3::engine {

absl::Status Dsv4KeptAccumulators::Allocate(int num_slots, int max_kept, int accumulator_floats) {
  slots_.clear();
  data_.reset();
  max_kept_ = 0;
  accumulator_floats_ = accumulator_floats;
  if (max_kept <= 0) return absl::OkStatus();
  if (num_slots < 1)
    return absl::InvalidArgumentError(absl::StrCat(
        "DeepSeek-V4 verifies drafts per state slot: the cache needs state slots (num_sequence_slots ",
        num_slots, ")"));
  const size_t n = static_cast<size_t>(num_slots) * max_kept * accumulator_floats;
  data_.reset(static_cast<float*>(std::calloc(std::max<size_t>(n, 1), sizeof(float))));
  if (data_ == nullptr)
    return absl::ResourceExhaustedError(absl::StrCat(
        "DeepSeek-V4's kept compressor states (", num_slots, " slots x ", max_kept, " x ",
        accumulator_floats * 4, " bytes) cannot be allocated; lower --max-num-seqs or "
        "--num-speculative-tokens"));
  slots_.resize(num_slots);
  max_kept_ = max_kept;
  return absl::OkStatus();
}

const float* Dsv4KeptAccumulators::Find(int slot, int64_t sequence_id, int position, int32_t block) const {
  if (!enabled()) return nullptr;
  const Slot& s = slots_[slot];
  if (s.sequence_id != sequence_id) return nullptr;
  for (size_t k = 0; k < s.kept.size(); ++k)
    if (s.kept[k].count == position && s.kept[k].block == block) return Data(slot, static_cast<int>(k));
  return nullptr;
}

void Dsv4KeptAccumulators::Begin(int slot, int64_t sequence_id) {
  if (!enabled()) return;
  Slot& s = slots_[slot];
  s.sequence_id = sequence_id;
  s.kept.clear();
}

void Dsv4KeptAccumulators::Keep(int slot, int count, int32_t block, const float* accumulators) {
  if (!enabled()) return;
  Slot& s = slots_[slot];
  const int k = static_cast<int>(s.kept.size());
  if (k == max_kept_) return;  // Forward checks a chunk's rows against max_kept: never reached
  std::copy_n(accumulators, accumulator_floats_, Data(slot, k));
  s.kept.push_back({count, block});
}

}  // namespace exl3::engine
