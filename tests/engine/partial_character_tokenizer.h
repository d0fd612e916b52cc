// The test models' tokenizer (tests/fixtures/tokenizer/glm4_moe) with its last token, 511 ("±or"),
// renamed "-à": the byte-level spelling of "-\xE0", a token that ends in the lead byte of a
// three-byte UTF-8 character. xgrammar 0.2.9's mask allows it where an integer starts and its
// matcher refuses it (tests/engine/sampling/token_constraint_test.cc), which the engine's sampling
// survives (Sampler::SampleAccepted, tests/engine/sampling/structured_output_test.cc).
#pragma once

#include <cstdint>
#include <string>

namespace exl3::engine::testing {

constexpr int32_t kPartialCharacterToken = 511;

// `tokenizer_json` is the fixture's text; empty when it does not hold the token to rename.
inline std::string TokenizerWithAPartialCharacterToken(std::string tokenizer_json) {
  const std::string last = "\"\u00b1or\": 511";
  const size_t at = tokenizer_json.find(last);
  if (at == std::string::npos) return "";
  return tokenizer_json.replace(at, last.size(), "\"-\u00e0\": 511");
}

}  // namespace exl3::engine::testing
