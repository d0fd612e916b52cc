// Speculative decoding's settings (vLLM's names): which drafter proposes tokens, how many per
// sequence and step, and the n-gram drafter's match lengths.
// "mtp" drafts with the model's own MTP head (ModelRunner::ProposeMtpDrafts); the engine refuses
// it at start for a model or runner without one (ModelRunner::CheckMtpDrafting).
//
//   SpeculativeOptions s;
//   EXL3_ASSIGN_OR_RETURN(s.method, ParseSpeculativeMethod("ngram"));
//   s.num_speculative_tokens = 3;
//   EXL3_ASSIGN_OR_RETURN(NgramDrafterOptions ngram, NgramOptionsOf(s));
//
// With a drafter, a decoding sequence's step runs its last sampled token followed by up to
// num_speculative_tokens drafts (fewer with the adaptive or goodput draft length,
// engine/speculative/draft_length.h, or a request's own cap) and samples every one of those positions; the drafts are accepted
// while they equal the token sampled before them (engine/core/scheduler.h).
#pragma once

#include <memory>
#include <optional>
#include <string_view>

#include "absl/status/statusor.h"
#include "engine/speculative/draft_proposer.h"
#include "engine/speculative/ngram_drafter.h"

namespace exl3::engine {

enum class SpeculativeMethod {
  kOff,    // one token per sequence and step
  kNgram,  // prompt lookup (engine/speculative/ngram_drafter.h)
  kMtp,    // the checkpoint's MTP head, run by the model runner (engine/cpu/mtp/mtp_head.h)
  // SpeculativeOptions::proposer, supplied by the program (benchmarks, tests:
  // engine/speculative/draft_proposer.h); not a server's choice, so ParseSpeculativeMethod refuses it.
  kProvided,
};

const char* SpeculativeMethodName(SpeculativeMethod method);
// "off", "ngram" or "mtp"; anything else is INVALID_ARGUMENT naming the choices.
absl::StatusOr<SpeculativeMethod> ParseSpeculativeMethod(std::string_view name);

// How many drafts a sequence gets per step (engine/speculative/draft_length.h).
enum class DraftLengthPolicy {
  kFixed,     // its cap every step (num_speculative_tokens, or the request's own)
  kAdaptive,  // 1..its cap, shrinking while its drafts are rejected and growing back as they land
  // 0..its cap, chosen for all decoding sequences of a step at once to maximise the step's expected
  // tokens per second under its learned cost (engine/speculative/goodput_draft_choice.h)
  kGoodput,
};
const char* DraftLengthPolicyName(DraftLengthPolicy policy);
// "fixed", "adaptive" or "goodput"; anything else is INVALID_ARGUMENT naming the choices.
absl::StatusOr<DraftLengthPolicy> ParseDraftLengthPolicy(std::string_view name);

// vLLM's default when neither prompt_lookup_min nor prompt_lookup_max is set; when only one is,
// the other takes its value (as vLLM does).
inline constexpr int kDefaultPromptLookup = 5;

struct SpeculativeOptions {
  SpeculativeMethod method = SpeculativeMethod::kOff;
  int num_speculative_tokens = 0;          // K; >= 1 with a drafter
  std::optional<int> prompt_lookup_max;    // n-gram: longest suffix matched
  std::optional<int> prompt_lookup_min;    // n-gram: shortest suffix matched
  // No drafts in a step while more than this many sequences run (0: no limit): at large batches
  // a verify chunk's extra rows cost compute the step no longer has spare (vLLM's
  // speculative_disable_by_batch_size).
  int disable_by_batch_size = 0;
  DraftLengthPolicy draft_length = DraftLengthPolicy::kFixed;
  // kProvided: the drafter (shared: the program may keep a handle to it).
  std::shared_ptr<const DraftProposer> proposer;

  bool enabled() const { return method != SpeculativeMethod::kOff; }
};

// Checks the options: a drafter needs num_speculative_tokens >= 1; 1 <= min <= max;
// disable_by_batch_size >= 0; kProvided needs a proposer, and a proposer needs kProvided.
absl::Status ValidateSpeculativeOptions(const SpeculativeOptions& options);
// The n-gram drafter's match lengths with the defaults above filled in.
absl::StatusOr<NgramDrafterOptions> NgramOptionsOf(const SpeculativeOptions& options);

}  // namespace exl3::engine
