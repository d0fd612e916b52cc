#include "tools/exl3_bench/recorded_drafter.h"

#include <algorithm>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "base/mix64.h"

namespace exl3::bench {

RecordedDrafter::RecordedDrafter(double acceptance, uint64_t seed, int vocab_size)
    : acceptance_(std::clamp(acceptance, 0.0, 1.0)), seed_(seed), vocab_size_(std::max(vocab_size, 2)) {}

uint64_t RecordedDrafter::PromptHash(std::span<const int32_t> prompt) {
  return std::hash<std::string_view>{}(
      std::string_view(reinterpret_cast<const char*>(prompt.data()), prompt.size_bytes()));
}

const RecordedDrafter::Recording* RecordedDrafter::Find(std::span<const int32_t> prompt, uint64_t hash) const {
  auto [begin, end] = recordings_.equal_range(hash);
  for (auto it = begin; it != end; ++it) {
    if (std::equal(prompt.begin(), prompt.end(), it->second.prompt.begin(), it->second.prompt.end()))
      return &it->second;
  }
  return nullptr;
}

absl::Status RecordedDrafter::Record(std::span<const int32_t> prompt, std::span<const int32_t> continuation) {
  if (prompt.empty()) return absl::InvalidArgumentError("recorded drafter: an empty prompt");
  for (std::span<const int32_t> tokens : {prompt, continuation}) {
    for (int32_t t : tokens) {
      if (t < 0 || t >= vocab_size_)
        return absl::InvalidArgumentError(
            absl::StrCat("recorded drafter: token ", t, " outside the vocabulary [0, ", vocab_size_, ")"));
    }
  }
  const uint64_t hash = PromptHash(prompt);
  if (Find(prompt, hash) != nullptr)
    return absl::InvalidArgumentError("recorded drafter: that prompt is recorded already");
  recordings_.emplace(hash, Recording{std::vector<int32_t>(prompt.begin(), prompt.end()),
                                      std::vector<int32_t>(continuation.begin(), continuation.end())});
  return absl::OkStatus();
}

std::vector<int32_t> RecordedDrafter::Propose(std::span<const int32_t> prompt, std::span<const int32_t> output,
                                              int max_drafts) const {
  const uint64_t hash = PromptHash(prompt);
  const Recording* r = Find(prompt, hash);
  if (r == nullptr) return {};
  const double p = acceptance_.load();
  std::vector<int32_t> drafts;
  for (size_t i = output.size(); i < r->continuation.size() && static_cast<int>(drafts.size()) < max_drafts; ++i) {
    const int32_t right = r->continuation[i];
    // Two independent draws per position: right or wrong, and which wrong token.
    const uint64_t draw = Mix64(seed_ ^ Mix64(hash + kGoldenGamma * (i + 1)));
    const double u = static_cast<double>(draw >> 11) * 0x1.0p-53;  // [0, 1)
    if (u < p) {
      drafts.push_back(right);
    } else {
      const uint64_t offset = 1 + Mix64(draw ^ kGoldenGamma) % static_cast<uint64_t>(vocab_size_ - 1);
      drafts.push_back(static_cast<int32_t>((right + offset) % static_cast<uint64_t>(vocab_size_)));
    }
  }
  return drafts;
}

}  // namespace exl3::bench
