#include "engine/sampling/token_constraint.h"

#include <bit>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/sampling/token_grammar_impl.h"

namespace exl3::engine {

struct TokenConstraint::Matcher {
  xgrammar::GrammarMatcher matcher;
};

TokenConstraint::TokenConstraint(std::shared_ptr<const TokenGrammar> grammar)
    : grammar_(std::move(grammar)),
      matcher_(std::make_unique<Matcher>(Matcher{xgrammar::GrammarMatcher(grammar_->impl().compiled)})),
      mask_(xgrammar::GetBitmaskSize(grammar_->vocab_size()), 0u) {}

TokenConstraint::~TokenConstraint() = default;

void TokenConstraint::FillNextTokenMask() {
  if (state_ != State::kMaskStale) return;
  int64_t shape[1] = {static_cast<int64_t>(mask_.size())};
  DLTensor tensor{};
  tensor.data = mask_.data();
  tensor.device = DLDevice{kDLCPU, 0};
  tensor.ndim = 1;
  tensor.dtype = DLDataType{kDLInt, 32, 1};
  tensor.shape = shape;
  // Throws only on a misuse this class rules out (a terminated matcher, a wrong buffer).
  matcher_->matcher.FillNextTokenBitmask(&tensor);
  state_ = State::kMaskReady;
}

absl::Status TokenConstraint::Accept(int32_t token) {
  if (state_ == State::kTerminated) {
    return absl::FailedPreconditionError("the constraint is complete: no token may follow");
  }
  bool accepted = false;
  try {
    accepted = token >= 0 && token < grammar_->vocab_size() && matcher_->matcher.AcceptToken(token);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("the constraint failed on token ", token, ": ", e.what()));
  }
  if (!accepted) {
    return absl::InternalError(absl::StrCat("token ", token, " does not match the constraint"));
  }
  state_ = matcher_->matcher.IsTerminated() ? State::kTerminated : State::kMaskStale;
  return absl::OkStatus();
}

bool TokenConstraint::AllowsAnyToken(std::span<const uint32_t> mask,
                                     std::span<const int32_t> banned) {
  int allowed = 0;
  for (uint32_t w : mask) allowed += std::popcount(w);
  if (allowed > static_cast<int>(banned.size())) return true;
  // Few allowed tokens: are they all banned? (banned may hold repeats)
  for (size_t word = 0; word < mask.size(); ++word) {
    for (uint32_t w = mask[word]; w != 0; w &= w - 1) {
      const int32_t t = static_cast<int32_t>(word * 32 + std::countr_zero(w));
      bool is_banned = false;
      for (int32_t b : banned) is_banned = is_banned || b == t;
      if (!is_banned) return true;
    }
  }
  return false;
}

}  // namespace exl3::engine
