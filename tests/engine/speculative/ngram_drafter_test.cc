// The n-gram drafter (engine/speculative/ngram_drafter.h) and speculative decoding's options
// (engine/speculative/speculative_options.h).
#include "engine/speculative/ngram_drafter.h"

#include <vector>

#include "engine/speculative/speculative_options.h"
#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

using Tokens = std::vector<int32_t>;

TEST(NgramDrafterTest, ProposesWhatFollowedTheLatestOccurrence) {
  const NgramDrafter d({/*min_n=*/2, /*max_n=*/3});
  // Suffix [7, 8, 9] occurs at 0 (followed by 1 2) and at 5 (followed by 3 4): the latest wins.
  const Tokens t = {7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 5, 7, 8, 9};
  EXPECT_EQ(d.Propose(t, 2), (Tokens{3, 4}));
  EXPECT_EQ(d.Propose(t, 4), (Tokens{3, 4, 5, 7}));
  EXPECT_EQ(d.Propose(t, 0), Tokens{});
}

TEST(NgramDrafterTest, LongestSuffixFirstThenShorter) {
  const NgramDrafter d({/*min_n=*/1, /*max_n=*/3});
  // [5, 6, 7] never occurred before; [6, 7] did, at 2 (followed by 9), while [7] alone occurred
  // later at 6 (followed by 1): the longer match wins.
  const Tokens t = {1, 2, 6, 7, 9, 3, 7, 1, 5, 6, 7};
  EXPECT_EQ(d.Propose(t, 1), (Tokens{9}));
  const NgramDrafter unigram({1, 1});
  EXPECT_EQ(unigram.Propose(t, 2), (Tokens{1, 5}));
}

TEST(NgramDrafterTest, NoMatchShorterThanMinNoDrafts) {
  const NgramDrafter d({/*min_n=*/2, /*max_n=*/4});
  EXPECT_EQ(d.Propose(Tokens{1, 2, 3, 4, 5}, 3), Tokens{});
  // Only the unigram [5] repeats; min_n 2 does not look at it.
  EXPECT_EQ(d.Propose(Tokens{5, 1, 2, 3, 5}, 3), Tokens{});
  EXPECT_EQ(d.Propose(Tokens{}, 3), Tokens{});
  EXPECT_EQ(d.Propose(Tokens{4}, 3), Tokens{});
}

TEST(NgramDrafterTest, OverlappingOccurrenceProposesUpToTheEnd) {
  const NgramDrafter d({/*min_n=*/2, /*max_n=*/2});
  // [3, 3] last occurred at 2 (overlapping the suffix at 3): one token follows it.
  EXPECT_EQ(d.Propose(Tokens{1, 3, 3, 3}, 4), (Tokens{3}));
  // A period of 3: the latest occurrence is one period back.
  EXPECT_EQ(d.Propose(Tokens{1, 2, 3, 1, 2, 3, 1, 2}, 5), (Tokens{3, 1, 2}));
}

TEST(SpeculativeOptionsTest, ParsesMethodsAndRefusesOthers) {
  EXPECT_EQ(*ParseSpeculativeMethod("off"), SpeculativeMethod::kOff);
  EXPECT_EQ(*ParseSpeculativeMethod("ngram"), SpeculativeMethod::kNgram);
  EXPECT_EQ(*ParseSpeculativeMethod("mtp"), SpeculativeMethod::kMtp);
  const auto bad = ParseSpeculativeMethod("eagle");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("off, ngram, mtp"), std::string_view::npos) << bad.status();
}

TEST(SpeculativeOptionsTest, PromptLookupDefaultsAsVllm) {
  SpeculativeOptions o;
  o.method = SpeculativeMethod::kNgram;
  o.num_speculative_tokens = 3;
  EXPECT_TRUE(ValidateSpeculativeOptions(o).ok());
  EXPECT_EQ(NgramOptionsOf(o)->min_n, 5);
  EXPECT_EQ(NgramOptionsOf(o)->max_n, 5);
  o.prompt_lookup_max = 4;  // min follows max
  EXPECT_EQ(NgramOptionsOf(o)->min_n, 4);
  EXPECT_EQ(NgramOptionsOf(o)->max_n, 4);
  o.prompt_lookup_max.reset();
  o.prompt_lookup_min = 2;  // max follows min
  EXPECT_EQ(NgramOptionsOf(o)->min_n, 2);
  EXPECT_EQ(NgramOptionsOf(o)->max_n, 2);
  o.prompt_lookup_max = 6;
  EXPECT_EQ(NgramOptionsOf(o)->min_n, 2);
  EXPECT_EQ(NgramOptionsOf(o)->max_n, 6);
}

TEST(SpeculativeOptionsTest, RefusesBadCombinations) {
  SpeculativeOptions o;
  EXPECT_TRUE(ValidateSpeculativeOptions(o).ok());  // off needs nothing
  o.method = SpeculativeMethod::kNgram;
  EXPECT_EQ(ValidateSpeculativeOptions(o).code(), absl::StatusCode::kInvalidArgument);  // K = 0
  o.num_speculative_tokens = 2;
  o.prompt_lookup_min = 4;
  o.prompt_lookup_max = 3;
  EXPECT_EQ(ValidateSpeculativeOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o.prompt_lookup_min = 0;
  EXPECT_EQ(ValidateSpeculativeOptions(o).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3::engine
