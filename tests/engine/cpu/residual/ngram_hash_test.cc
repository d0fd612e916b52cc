// engine/cpu/residual/ngram_hash against transformers 5.25's Qwen4ExpTextNGramEmbedding: the multipliers, the
// per-head primes, the padded table size and the row of every (position, n-gram head) over
// random token sequences with frequent end-of-sequence tokens, for the released model's hashing
// fields (PLE layers 0 and 1) and a 4-gram configuration
// (tests/fixtures/engine/qwen4_exp_ngram_hash.json, scripts/conformance/qwen4exp_ngram_fixture.py).
#include "engine/cpu/residual/ngram_hash.h"

#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

using nlohmann::json;

json Fixture() {
  std::ifstream f("tests/fixtures/engine/qwen4_exp_ngram_hash.json");
  std::stringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str(), nullptr, false);
}

TEST(NgramHashTest, MatchesTransformers) {
  const json fx = Fixture();
  ASSERT_TRUE(fx.is_object()) << "tests/fixtures/engine/qwen4_exp_ngram_hash.json unreadable";
  ASSERT_GE(fx["cases"].size(), 3u);
  int positions = 0;
  for (const json& c : fx["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>() + " ple_index " + std::to_string(c["ple_index"].get<int>()));
    PleConfig ple;
    ple.ngram_size = c["ngram_size"];
    ple.heads_per_ngram = c["heads_per_ngram"];
    ple.vocab_size_base = c["ngram_vocab_size_base"];
    ple.seed = c["seed"];
    ple.eos_token_id = c["eos_token_id"];
    ple.vocab_divisor = 128;
    ple.embed_dim = ple.num_heads();
    const NgramHash hash = NgramHash::Build(ple, c["vocab_size"], c["ple_index"]);
    EXPECT_EQ(hash.multipliers(), c["multipliers"].get<std::vector<uint64_t>>());
    EXPECT_EQ(hash.head_sizes(), c["head_vocab_sizes"].get<std::vector<int64_t>>());
    EXPECT_EQ(hash.table_rows(), c["table_rows"].get<int64_t>());
    const int n = ple.ngram_size;
    for (const json& seq : c["sequences"]) {
      const std::vector<int32_t> tokens = seq["tokens"];
      const std::vector<std::vector<int64_t>> want = seq["rows"];
      ASSERT_EQ(want.size(), tokens.size());
      // The window of position p: the n - 1 tokens before it (eos before the start), then p's.
      std::vector<int32_t> history(n - 1, ple.eos_token_id);
      history.insert(history.end(), tokens.begin(), tokens.end());
      std::vector<int64_t> rows(hash.num_heads());
      for (size_t p = 0; p < tokens.size(); ++p) {
        hash.Rows(&history[p], rows.data());
        ASSERT_EQ(rows, want[p]) << "position " << p;
        for (int64_t r : rows) ASSERT_LT(r, hash.table_rows());
        ++positions;
      }
    }
  }
  EXPECT_GT(positions, 300);
}

}  // namespace
}  // namespace exl3::engine
