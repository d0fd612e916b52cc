// One sequence's constrained decoding: the tokens its grammar (engine/sampling/token_grammar.h) allows
// next, as a bitmask the sampler applies (engine/sampling/sampler.h), and the grammar's progress through
// the tokens the sequence has taken.
//
//   TokenConstraint c(grammar);                   // at the sequence's start (no tokens yet)
//   c.FillNextTokenMask();                        // may run on another thread while the step's
//                                                 // forward pass runs: reads only accepted tokens
//   SequenceHistory h; h.allowed_tokens = c.next_token_mask();
//   ... sample ...
//   EXL3_RETURN_IF_ERROR(c.Accept(token));        // kTerminated: the output is complete
//
// The mask has one bit per token of the grammar's vocab_size, LSB first in 32-bit words (bit
// t % 32 of word t / 32): 1 where the token may come next. A completed grammar allows only the
// stop tokens (the model's EOS ids), even where nothing else could follow (a choice, a fixed
// string); accepting one terminates it.
//
// Not thread-safe: one thread at a time (the engine fills the mask on its worker during the
// forward pass and joins it before sampling and Accept).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/sampling/token_grammar.h"

namespace exl3::engine {

class TokenConstraint {
 public:
  enum class State {
    kMaskStale,   // tokens were accepted since the mask was filled (or it never was)
    kMaskReady,   // next_token_mask() is the mask of the next token
    kTerminated,  // the grammar is complete and ended: no further token
  };

  explicit TokenConstraint(std::shared_ptr<const TokenGrammar> grammar);
  ~TokenConstraint();
  TokenConstraint(const TokenConstraint&) = delete;
  TokenConstraint& operator=(const TokenConstraint&) = delete;

  State state() const { return state_; }
  // kMaskStale -> kMaskReady; nothing in the other states.
  void FillNextTokenMask();
  // The mask of the next token (kMaskReady only).
  std::span<const uint32_t> next_token_mask() const { return mask_; }
  // Takes the sampled token: INTERNAL when the grammar does not allow it (the mask was not
  // applied), FAILED_PRECONDITION once terminated. The mask goes stale, or the constraint
  // terminates.
  absl::Status Accept(int32_t token);

  // Whether any token the mask allows is not among `banned`.
  static bool AllowsAnyToken(std::span<const uint32_t> mask, std::span<const int32_t> banned);
  static bool Allowed(std::span<const uint32_t> mask, int32_t token) {
    return (mask[token >> 5] >> (token & 31)) & 1u;
  }

 private:
  struct Matcher;  // xgrammar's matcher (engine/sampling/token_constraint.cc)
  std::shared_ptr<const TokenGrammar> grammar_;
  std::unique_ptr<Matcher> matcher_;
  std::vector<uint32_t> mask_;
  State state_ = State::kMaskStale;
};

}  // namespace exl3::engine
