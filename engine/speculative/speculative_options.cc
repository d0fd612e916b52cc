#include "engine/speculative/speculative_options.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3::engine {

const char* SpeculativeMethodName(SpeculativeMethod method) {
  switch (method) {
    case SpeculativeMethod::kOff: return "off";
    case SpeculativeMethod::kNgram: return "ngram";
    case SpeculativeMethod::kMtp: return "mtp";
    case SpeculativeMethod::kProvided: return "provided";
  }
  return "unknown";
}

const char* DraftLengthPolicyName(DraftLengthPolicy policy) {
  switch (policy) {
    case DraftLengthPolicy::kFixed: return "fixed";
    case DraftLengthPolicy::kAdaptive: return "adaptive";
    case DraftLengthPolicy::kGoodput: return "goodput";
  }
  return "unknown";
}

absl::StatusOr<DraftLengthPolicy> ParseDraftLengthPolicy(std::string_view name) {
  if (name == "fixed") return DraftLengthPolicy::kFixed;
  if (name == "adaptive") return DraftLengthPolicy::kAdaptive;
  if (name == "goodput") return DraftLengthPolicy::kGoodput;
  return absl::InvalidArgumentError(
      absl::StrCat("speculative draft length \"", std::string(name), "\" is not one of: fixed, adaptive, goodput"));
}

absl::StatusOr<SpeculativeMethod> ParseSpeculativeMethod(std::string_view name) {
  if (name == "off") return SpeculativeMethod::kOff;
  if (name == "ngram") return SpeculativeMethod::kNgram;
  if (name == "mtp") return SpeculativeMethod::kMtp;
  return absl::InvalidArgumentError(
      absl::StrCat("speculative method \"", std::string(name), "\" is not one of: off, ngram, mtp"));
}

absl::StatusOr<NgramDrafterOptions> NgramOptionsOf(const SpeculativeOptions& o) {
  NgramDrafterOptions n;
  n.max_n = o.prompt_lookup_max.value_or(o.prompt_lookup_min.value_or(kDefaultPromptLookup));
  n.min_n = o.prompt_lookup_min.value_or(n.max_n);
  if (n.min_n < 1 || n.max_n < n.min_n) {
    return absl::InvalidArgumentError(
        absl::StrCat("the n-gram drafter needs 1 <= prompt_lookup_min (", n.min_n,
                     ") <= prompt_lookup_max (", n.max_n, ")"));
  }
  return n;
}

absl::Status ValidateSpeculativeOptions(const SpeculativeOptions& o) {
  if (o.disable_by_batch_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("speculative disable_by_batch_size must be >= 0, not ",
                                                   o.disable_by_batch_size));
  }
  if ((o.method == SpeculativeMethod::kProvided) != (o.proposer != nullptr)) {
    return absl::InvalidArgumentError(o.proposer == nullptr
                                          ? "speculative method provided needs a proposer"
                                          : "a speculative proposer needs the method provided");
  }
  if (!o.enabled()) return absl::OkStatus();
  if (o.num_speculative_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "speculative method ", SpeculativeMethodName(o.method),
        " needs num_speculative_tokens >= 1, not ", o.num_speculative_tokens));
  }
  if (o.method == SpeculativeMethod::kNgram) EXL3_RETURN_IF_ERROR(NgramOptionsOf(o).status());
  return absl::OkStatus();
}

}  // namespace exl3::engine
