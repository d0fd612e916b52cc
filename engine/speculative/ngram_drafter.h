// Speculative decoding's n-gram (prompt-lookup) drafter: proposes the tokens that followed the
// most recent earlier occurrence of a sequence's last n tokens, in its prompt and output so far.
//
//   NgramDrafter drafter({/*min_n=*/2, /*max_n=*/4});
//   std::vector<int32_t> drafts = drafter.Propose(tokens, /*max_drafts=*/3);
//
// n runs from max_n down to min_n; the first n whose last-n-token suffix occurs earlier in
// `tokens` wins, and of its occurrences the latest (the one nearest the end). The drafts are the
// tokens after that occurrence, at most max_drafts of them and never past the end of `tokens`
// (an occurrence that overlaps the suffix proposes fewer). No occurrence: no drafts.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace exl3::engine {

struct NgramDrafterOptions {
  int min_n = 5;  // shortest suffix matched (vLLM's prompt_lookup_min)
  int max_n = 5;  // longest suffix matched (vLLM's prompt_lookup_max)
};

class NgramDrafter {
 public:
  // min_n >= 1 and max_n >= min_n (SpeculativeOptions checks them: engine/speculative/speculative_options.h).
  explicit NgramDrafter(const NgramDrafterOptions& options) : options_(options) {}

  std::vector<int32_t> Propose(std::span<const int32_t> tokens, int max_drafts) const;

 private:
  const NgramDrafterOptions options_;
};

}  // namespace exl3::engine
