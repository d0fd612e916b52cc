// engine/sampling/token_grammar.h and engine/sampling/token_constraint.h in a build without xgrammar
// (-DEXL3_WITH_STRUCTURED_OUTPUT=OFF): no compiler can be made, so no grammar, so no sequence is
// ever constrained; the constraint's members are never reached.
#include <cstdlib>

#include "engine/sampling/token_constraint.h"
#include "engine/sampling/token_grammar.h"

namespace exl3::engine {

struct TokenGrammarImpl {};
struct TokenGrammarCompiler::Impl {};
struct TokenConstraint::Matcher {};

TokenGrammar::TokenGrammar(std::unique_ptr<TokenGrammarImpl> impl, int vocab_size)
    : impl_(std::move(impl)), vocab_size_(vocab_size) {}
TokenGrammar::~TokenGrammar() = default;
TokenGrammarCompiler::~TokenGrammarCompiler() = default;

absl::StatusOr<std::unique_ptr<TokenGrammarCompiler>> TokenGrammarCompiler::FromTokenizerJson(
    std::string_view, int, std::vector<int32_t>) {
  return absl::UnimplementedError(
      "structured output is not built in (configure with -DEXL3_WITH_STRUCTURED_OUTPUT=ON)");
}

absl::StatusOr<std::shared_ptr<const TokenGrammar>> TokenGrammarCompiler::Compile(
    const ConstraintSpec&) const {
  return absl::UnimplementedError("structured output is not built in");
}

// No TokenGrammar exists in this build, so no TokenConstraint is ever made.
TokenConstraint::TokenConstraint(std::shared_ptr<const TokenGrammar>) { std::abort(); }
TokenConstraint::~TokenConstraint() = default;
void TokenConstraint::FillNextTokenMask() { std::abort(); }
absl::Status TokenConstraint::Accept(int32_t) { std::abort(); }
bool TokenConstraint::AllowsAnyToken(std::span<const uint32_t>, std::span<const int32_t>) {
  std::abort();
}

}  // namespace exl3::engine
