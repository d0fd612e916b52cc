// Constrained decoding and logit_bias through the Engine over the real CPU model: a generated
// GLM-4 MoE model with random weights (tools/test_model/test_model.h, vocab 512, EOS 1) and the
// test models' tokenizer (tests/fixtures/tokenizer/glm4_moe). Random weights make the
// unconstrained text arbitrary, so whatever parses and validates does so because of the mask.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "engine/sampling/token_grammar.h"
#include "gtest/gtest.h"
#include "tests/engine/tiny_synthetic_model.h"
#include "nlohmann/json.hpp"
#include "tests/engine/byte_level_vocab.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/fake_model_runner.h"
#include "tests/engine/partial_character_tokenizer.h"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;

constexpr char kTokenizer[] = "tests/fixtures/tokenizer/glm4_moe/tokenizer.json";
constexpr int32_t kEos = 1;

constexpr char kSchema[] = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "member": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]}
  },
  "required": ["name", "age", "member", "color"]
})";

// Whether `s` is UTF-8 as a strict decoder takes it (no overlong forms, surrogates or truncated
// sequences), and its bytes in hex for a failure's message.
bool ValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    int n = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c < 0x80) n = 1;
    else if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) { n = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { n = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else return false;
    if (i + n > s.size()) return false;
    for (int k = 1; k < n; ++k) {
      const unsigned char b = s[i + k];
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return false;
    }
    i += n;
  }
  return true;
}

std::string Hex(const std::string& s) {
  std::string out;
  char buf[4];
  for (unsigned char c : s) {
    std::snprintf(buf, sizeof buf, "%02x ", c);
    out += buf;
  }
  return out;
}

// The schema's checks, by hand: exactly its four properties, of its types and ranges.
void ExpectValid(const std::string& text) {
  ASSERT_TRUE(ValidUtf8(text)) << "not UTF-8: " << Hex(text);
  const nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(doc.is_discarded()) << "not JSON: " << nlohmann::json(text).dump();
  ASSERT_TRUE(doc.is_object()) << text;
  EXPECT_EQ(doc.size(), 4u) << text;
  ASSERT_TRUE(doc.contains("name") && doc["name"].is_string()) << text;
  EXPECT_LE(doc["name"].get<std::string>().size(), 6u * 4) << text;  // 6 characters of UTF-8
  ASSERT_TRUE(doc.contains("age") && doc["age"].is_number_integer()) << text;
  EXPECT_GE(doc["age"].get<int64_t>(), 0) << text;
  EXPECT_LE(doc["age"].get<int64_t>(), 120) << text;
  ASSERT_TRUE(doc.contains("member") && doc["member"].is_boolean()) << text;
  ASSERT_TRUE(doc.contains("color") && doc["color"].is_string()) << text;
  const std::set<std::string> colors = {"red", "green", "blue"};
  EXPECT_TRUE(colors.contains(doc["color"].get<std::string>())) << text;
}

class StructuredOutputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("exl3_structured_output_" + std::to_string(::getpid())));
    ASSERT_TRUE(testing::WriteTinySyntheticModel(*dir_).ok());
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }

  void SetUp() override {
    engine_ = StartEngine(EngineOptions{});
    ASSERT_NE(engine_, nullptr);
    std::ifstream in(kTokenizer);
    std::stringstream text;
    text << in.rdbuf();
    auto compiler = TokenGrammarCompiler::FromTokenizerJson(text.str(), 512, {kEos});
    ASSERT_TRUE(compiler.ok()) << compiler.status();
    compiler_ = std::move(*compiler);
  }

  static std::unique_ptr<Engine> StartEngine(EngineOptions eo) {
    CpuModelOptions mo;
    mo.num_threads = 2;
    auto model = CpuModel::Open(dir_->string(), mo);
    EXPECT_TRUE(model.ok()) << model.status();
    if (!model.ok()) return nullptr;
    EXPECT_EQ((*model)->info().vocab_size, 512);
    eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 512};
    auto engine = std::make_unique<Engine>(eo, std::move(*model));
    const absl::Status started = engine->Start();
    EXPECT_TRUE(started.ok()) << started;
    return started.ok() ? std::move(engine) : nullptr;
  }

  std::shared_ptr<const TokenGrammar> Compile(ConstraintSpec spec) {
    auto g = compiler_->Compile(spec);
    EXPECT_TRUE(g.ok()) << g.status();
    return g.ok() ? *g : nullptr;
  }

  // JSON integers over the test tokenizer with one token renamed to end inside a UTF-8 character
  // (tests/engine/partial_character_tokenizer.h): xgrammar's mask allows it where an integer
  // starts and its matcher refuses it. Null (with a test failure) where it does not compile.
  static std::shared_ptr<const TokenGrammar> IntegerGrammarWithAPartialCharacterToken() {
    std::ifstream in(kTokenizer);
    std::stringstream text;
    text << in.rdbuf();
    auto compiler = TokenGrammarCompiler::FromTokenizerJson(
        testing::TokenizerWithAPartialCharacterToken(text.str()), 512, {kEos});
    EXPECT_TRUE(compiler.ok()) << compiler.status();
    if (!compiler.ok()) return nullptr;
    auto grammar = (*compiler)->Compile({ConstraintKind::kJsonSchema, R"({"type": "integer"})", {}});
    EXPECT_TRUE(grammar.ok()) << grammar.status();
    return grammar.ok() ? *grammar : nullptr;
  }

  static GenerateParams Params(std::optional<uint64_t> seed, int max_tokens = 160) {
    GenerateParams p;
    p.prompt = {3, 40, 41, 42, 43, 5};
    p.max_tokens = max_tokens;
    p.sampling.temperature = seed.has_value() ? 1.0f : 0.0f;
    p.sampling.seed = seed.value_or(0);
    return p;
  }

  // Runs the requests together; returns each one's text (the EOS that ended it left out) and
  // finish.
  std::vector<std::string> Texts(const std::vector<GenerateParams>& params,
                                 std::vector<FinishInfo>* finish) {
    std::vector<std::string> out;
    for (const std::vector<SampledToken>& tokens : testing::RunAllAtOnce(*engine_, params, finish)) {
      std::vector<int32_t> ids;
      for (const SampledToken& t : tokens) ids.push_back(t.token);
      if (!ids.empty() && ids.back() == kEos) ids.pop_back();
      out.push_back(vocab_.Decode(ids));
    }
    return out;
  }

  static fs::path* dir_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<TokenGrammarCompiler> compiler_;
  const testing::ByteLevelVocab vocab_ = testing::ByteLevelVocab::Load(kTokenizer);
};

fs::path* StructuredOutputTest::dir_ = nullptr;

TEST_F(StructuredOutputTest, JsonSchemaOutputsParseAndValidate) {
  auto grammar = Compile({ConstraintKind::kJsonSchema, kSchema, {}});
  std::vector<GenerateParams> params;
  params.push_back(Params(std::nullopt));  // greedy
  for (uint64_t seed = 1; seed <= 100; ++seed) params.push_back(Params(seed));
  for (GenerateParams& p : params) p.sampling.grammar = grammar;
  std::vector<FinishInfo> finish;
  const std::vector<std::string> texts = Texts(params, &finish);
  std::set<std::string> distinct;
  for (size_t i = 0; i < texts.size(); ++i) {
    SCOPED_TRACE(Hex(texts[i]));
    EXPECT_EQ(finish[i].reason, FinishReason::kStop);
    ExpectValid(texts[i]);
    distinct.insert(texts[i]);
  }
  EXPECT_GT(distinct.size(), 1u);  // the seeds sample, the mask does not pick one answer
}

TEST_F(StructuredOutputTest, RegexAndChoiceOutputsMatch) {
  auto regex = Compile({ConstraintKind::kRegex, "[a-z]{3}-[0-9]{2}", {}});
  const std::vector<std::string> choices = {"alpha", "beta", "gamma delta"};
  auto choice = Compile({ConstraintKind::kChoice, "", choices});
  std::vector<GenerateParams> params;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    params.push_back(Params(seed));
    params.back().sampling.grammar = regex;
    params.push_back(Params(seed));
    params.back().sampling.grammar = choice;
  }
  params.push_back(Params(std::nullopt));
  params.back().sampling.grammar = regex;
  std::vector<FinishInfo> finish;
  const std::vector<std::string> texts = Texts(params, &finish);
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(finish[i].reason, FinishReason::kStop) << texts[i];
    if (params[i].sampling.grammar == regex) {
      EXPECT_TRUE(std::regex_match(texts[i], std::regex("[a-z]{3}-[0-9]{2}"))) << texts[i];
    } else {
      EXPECT_NE(std::find(choices.begin(), choices.end(), texts[i]), choices.end()) << texts[i];
    }
  }
}

TEST_F(StructuredOutputTest, TaggedJsonIsOneCallInItsTags) {
  // A tool call as Qwen's (hermes) template writes it, held to one of two functions' schemas.
  auto call = [](const std::string& name, const std::string& arguments) {
    return TaggedJson{"<tool_call>\n",
                      R"({"type": "object", "properties": {"name": {"const": ")" + name +
                          R"("}, "arguments": )" + arguments + R"(}, "required": ["name", "arguments"]})",
                      "\n</tool_call>"};
  };
  ConstraintSpec spec{ConstraintKind::kTaggedJson, "", {}, {}};
  spec.tagged.push_back(call("get_weather", R"({"type": "object", "properties": {"city": {"type":
      "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
      "required": ["city", "days"]})"));
  spec.tagged.push_back(call("now", R"({"type": "object", "properties": {}})"));
  auto grammar = Compile(spec);
  std::vector<GenerateParams> params;
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    params.push_back(Params(seed));
    params.back().sampling.grammar = grammar;
  }
  std::vector<FinishInfo> finish;
  const std::vector<std::string> texts = Texts(params, &finish);
  std::set<std::string> names;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string& t = texts[i];
    SCOPED_TRACE(Hex(t));
    EXPECT_EQ(finish[i].reason, FinishReason::kStop);
    ASSERT_TRUE(t.starts_with("<tool_call>\n") && t.ends_with("\n</tool_call>"));
    const std::string body = t.substr(12, t.size() - 12 - 13);
    ASSERT_TRUE(ValidUtf8(body));
    const nlohmann::json doc = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(doc.is_object() && doc.size() == 2u && doc["arguments"].is_object());
    names.insert(doc["name"].get<std::string>());
    const nlohmann::json& args = doc["arguments"];
    if (doc["name"] == "now") {
      EXPECT_TRUE(args.empty());
    } else {
      ASSERT_EQ(doc["name"], "get_weather");
      ASSERT_TRUE(args.size() == 2u && args["city"].is_string() && args["days"].is_number_integer());
      EXPECT_GE(args["days"].get<int>(), 1);
      EXPECT_LE(args["days"].get<int>(), 7);
    }
  }
  EXPECT_EQ(names.size(), 2u);  // both functions come up in 12 seeds
}

TEST_F(StructuredOutputTest, UnconstrainedNeighboursAreUnchanged) {
  std::vector<GenerateParams> plain;
  plain.push_back(Params(std::nullopt, 24));
  plain.push_back(Params(11, 24));
  plain.push_back(Params(12, 24));
  for (GenerateParams& p : plain) p.ignore_eos = true;
  const std::vector<std::string> alone = Texts(plain, nullptr);
  std::vector<GenerateParams> mixed = plain;
  mixed.insert(mixed.begin() + 1, Params(5));
  mixed[1].sampling.grammar = Compile({ConstraintKind::kJsonSchema, kSchema, {}});
  const std::vector<std::string> together = Texts(mixed, nullptr);
  EXPECT_EQ(together[0], alone[0]);
  EXPECT_EQ(together[2], alone[1]);
  EXPECT_EQ(together[3], alone[2]);
  ExpectValid(together[1]);
}

TEST_F(StructuredOutputTest, ConstrainedSequencesGetNoDrafts) {
  // n-gram drafts from a one-token match: an unconstrained sequence over a repeating prompt gets
  // drafts at almost every step.
  EngineOptions eo;
  eo.scheduler.speculative.method = SpeculativeMethod::kNgram;
  eo.scheduler.speculative.num_speculative_tokens = 3;
  eo.scheduler.speculative.prompt_lookup_min = 1;
  eo.scheduler.speculative.prompt_lookup_max = 2;
  std::unique_ptr<Engine> engine = StartEngine(eo);
  ASSERT_NE(engine, nullptr);
  GenerateParams plain = Params(std::nullopt, 24);
  plain.prompt = {3, 40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41};
  plain.ignore_eos = true;
  // Stats are published after the step that delivered the final events: wait for them.
  auto stats_after = [&](int64_t finished) {
    for (int i = 0; i < 2000 && engine->Stats().requests_finished < finished; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return engine->Stats();
  };
  testing::RunAllAtOnce(*engine, {plain});
  const int64_t drafts = stats_after(1).speculative.num_drafts;
  EXPECT_GT(drafts, 0);
  GenerateParams constrained = plain;
  constrained.ignore_eos = false;
  constrained.max_tokens = 160;
  constrained.sampling.grammar = Compile({ConstraintKind::kJsonSchema, kSchema, {}});
  std::vector<FinishInfo> finish;
  const auto tokens = testing::RunAllAtOnce(*engine, {constrained, constrained}, &finish);
  EXPECT_EQ(stats_after(3).speculative.num_drafts, drafts);
  for (size_t i = 0; i < tokens.size(); ++i) {
    std::vector<int32_t> ids;
    for (const SampledToken& t : tokens[i]) ids.push_back(t.token);
    ASSERT_EQ(ids.back(), kEos);
    ids.pop_back();
    ExpectValid(vocab_.Decode(ids));
    EXPECT_EQ(finish[i].reason, FinishReason::kStop);
  }
  engine->Stop();
}

// Runs `params` on a fake runner that samples rows itself (with masks, as the GPU engine does)
// or leaves them to the engine's host sampler; returns each request's tokens.
std::vector<std::vector<int32_t>> FakeRunnerTokens(const std::vector<GenerateParams>& params, bool runner_samples,
                                                   std::optional<TokenBias> favoured, int* sampled_on_runner,
                                                   int* masked_row_reads, std::vector<FinishInfo>* finish) {
  testing::FakeModelOptions fo;
  fo.vocab_size = 512;
  fo.eos_token_ids = {kEos};
  if (runner_samples) fo.samples_rows_up_to_logprobs = 2;
  fo.favoured_token = favoured;
  auto runner = std::make_unique<testing::FakeModelRunner>(fo);
  testing::FakeModelRunner* fake = runner.get();
  EngineOptions eo;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 256};
  Engine engine(eo, std::move(runner));
  EXPECT_TRUE(engine.Start().ok());
  std::vector<std::vector<int32_t>> out;
  for (const std::vector<SampledToken>& tokens : testing::RunAllAtOnce(engine, params, finish)) {
    std::vector<int32_t>& ids = out.emplace_back();
    for (const SampledToken& t : tokens) ids.push_back(t.token);
  }
  *sampled_on_runner = fake->num_sampled_rows();
  *masked_row_reads = fake->num_masked_row_reads();
  engine.Stop();
  return out;
}

TEST_F(StructuredOutputTest, ARunnerThatSamplesAppliesTheMasks) {
  // Constrained rows go to a runner that samples (as the GPU engine's do) with their masks, beside
  // unconstrained ones: the same tokens as the engine's host sampling, greedy and sampled, with
  // logprobs, and the outputs match their grammars.
  std::vector<GenerateParams> params;
  for (std::optional<uint64_t> seed : {std::optional<uint64_t>{}, std::optional<uint64_t>{5}}) {
    GenerateParams p = Params(seed, 40);
    p.sampling.grammar = Compile({ConstraintKind::kRegex, "[a-z]{3}-[0-9]{2}", {}});
    p.sampling.logprobs = 2;
    params.push_back(p);
    GenerateParams plain = Params(seed, 8);
    plain.ignore_eos = true;
    params.push_back(plain);
  }
  int on_runner = 0, reads = 0;
  std::vector<FinishInfo> finish;
  const auto runner = FakeRunnerTokens(params, true, std::nullopt, &on_runner, &reads, &finish);
  int on_host_runner = 0, host_reads = 0;
  const auto host = FakeRunnerTokens(params, false, std::nullopt, &on_host_runner, &host_reads, nullptr);
  EXPECT_EQ(runner, host);
  int rows = 0;
  for (const auto& ids : runner) rows += static_cast<int>(ids.size());
  EXPECT_EQ(on_runner, rows);
  EXPECT_EQ(on_host_runner, 0);
  EXPECT_EQ(reads, 0);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(finish[i].status.ok()) << finish[i].status;
    if (params[i].sampling.grammar == nullptr) continue;
    std::vector<int32_t> ids = runner[i];
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids.back(), kEos);
    ids.pop_back();
    EXPECT_TRUE(std::regex_match(vocab_.Decode(ids), std::regex("[a-z]{3}-[0-9]{2}"))) << vocab_.Decode(ids);
  }
}

TEST_F(StructuredOutputTest, ARunnerSampledTokenTheMatcherRefusesIsDrawnAgainOnTheHost) {
  // A model favouring a token xgrammar's mask allows where an integer starts and its matcher
  // refuses (tests/engine/partial_character_tokenizer.h): the runner draws it, the constraint
  // refuses it, the engine draws the row again from the runner's masked logits; the tokens are
  // the host path's and the output an integer.
  const std::shared_ptr<const TokenGrammar> grammar = IntegerGrammarWithAPartialCharacterToken();
  ASSERT_NE(grammar, nullptr);
  std::vector<GenerateParams> params;
  for (std::optional<uint64_t> seed : {std::optional<uint64_t>{}, std::optional<uint64_t>{5}}) {
    GenerateParams p = Params(seed, 12);
    p.sampling.grammar = grammar;
    params.push_back(p);
  }
  const TokenBias favoured{testing::kPartialCharacterToken, 100.0f};
  int on_runner = 0, reads = 0, unused = 0;
  std::vector<FinishInfo> finish;
  const auto runner = FakeRunnerTokens(params, true, favoured, &on_runner, &reads, &finish);
  const auto host = FakeRunnerTokens(params, false, favoured, &unused, &unused, nullptr);
  EXPECT_EQ(runner, host);
  EXPECT_GT(on_runner, 0);
  EXPECT_GE(reads, 2);  // the first token of each request at least
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(finish[i].status.ok()) << finish[i].status;
    std::vector<int32_t> ids = runner[i];
    if (!ids.empty() && ids.back() == kEos) ids.pop_back();
    EXPECT_TRUE(std::regex_match(vocab_.Decode(ids), std::regex("-?[0-9]+"))) << Hex(vocab_.Decode(ids));
  }
}

TEST_F(StructuredOutputTest, LogitBiasForcesAndBansTokens) {
  // +100 on token 300 makes it every token, greedy or sampled.
  for (std::optional<uint64_t> seed : {std::optional<uint64_t>{}, std::optional<uint64_t>{3}}) {
    GenerateParams p = Params(seed, 12);
    p.ignore_eos = true;
    p.sampling.logit_bias = {{300, 100.0f}};
    const auto tokens = testing::RunAllAtOnce(*engine_, {p});
    ASSERT_EQ(tokens[0].size(), 12u);
    for (const SampledToken& t : tokens[0]) EXPECT_EQ(t.token, 300);
  }
  // -100 on the greedy run's tokens: none of them comes back.
  GenerateParams greedy = Params(std::nullopt, 12);
  greedy.ignore_eos = true;
  const auto before = testing::RunAllAtOnce(*engine_, {greedy});
  std::set<int32_t> banned;
  for (const SampledToken& t : before[0]) banned.insert(t.token);
  for (int32_t t : banned) greedy.sampling.logit_bias.push_back({t, -100.0f});
  const auto after = testing::RunAllAtOnce(*engine_, {greedy});
  for (const SampledToken& t : after[0]) EXPECT_FALSE(banned.contains(t.token)) << t.token;
}

TEST_F(StructuredOutputTest, ATokenTheMaskAllowsButTheMatcherRefusesIsDrawnAgain) {
  // +100 on a token xgrammar's mask allows where an integer starts and its matcher refuses
  // (tests/engine/partial_character_tokenizer.h): greedy and sampled, the engine draws the next
  // token instead and the output is an integer.
  const std::shared_ptr<const TokenGrammar> grammar = IntegerGrammarWithAPartialCharacterToken();
  ASSERT_NE(grammar, nullptr);
  std::vector<GenerateParams> params;
  for (std::optional<uint64_t> seed : {std::optional<uint64_t>{}, std::optional<uint64_t>{5}}) {
    GenerateParams p = Params(seed, 12);
    p.sampling.grammar = grammar;
    p.sampling.logit_bias = {{testing::kPartialCharacterToken, 100.0f}};
    params.push_back(p);
  }
  std::vector<FinishInfo> finish;
  const std::vector<std::string> texts = Texts(params, &finish);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(finish[i].status.ok()) << finish[i].status;
    EXPECT_TRUE(std::regex_match(texts[i], std::regex("-?[0-9]+"))) << Hex(texts[i]);
  }
}

TEST_F(StructuredOutputTest, ConstraintAllowingNoTokenFailsItsSequenceAlone) {
  // After a choice is complete only EOS may follow, and min_tokens bans it.
  GenerateParams stuck = Params(std::nullopt, 40);
  stuck.min_tokens = 30;
  stuck.sampling.grammar = Compile({ConstraintKind::kChoice, "", {"x"}});
  GenerateParams other = Params(std::nullopt, 8);
  testing::RequestResults r;
  auto a = engine_->Submit(stuck, r.Callback());
  auto b = engine_->Submit(other, r.Callback());
  ASSERT_TRUE(a.ok() && b.ok());
  r.Wait(2);
  EXPECT_EQ(r.finish[*a].reason, FinishReason::kError);
  EXPECT_EQ(r.finish[*a].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.finish[*a].status.message().find("allows no token"), std::string::npos);
  EXPECT_TRUE(r.finish[*b].status.ok()) << r.finish[*b].status;
}

TEST_F(StructuredOutputTest, BadBiasesAndForeignGrammarsAreRefused) {
  auto refused = [&](GenerateParams p, const std::string& says) {
    auto id = engine_->Submit(p, [](const GenerateEvent&) {});
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(id.status().message().find(says), std::string::npos) << id.status();
  };
  GenerateParams p = Params(std::nullopt);
  p.sampling.logit_bias = {{512, 1.0f}};
  refused(p, "outside the vocabulary");
  p.sampling.logit_bias = {{5, 100.5f}};
  refused(p, "outside [-100, 100]");
  p.sampling.logit_bias = {{5, std::nanf("")}};
  refused(p, "outside [-100, 100]");
  p.sampling.logit_bias.clear();
  std::ifstream in(kTokenizer);
  std::stringstream text;
  text << in.rdbuf();
  auto wider = TokenGrammarCompiler::FromTokenizerJson(text.str(), 520, {kEos});
  ASSERT_TRUE(wider.ok());
  p.sampling.grammar = *(*wider)->Compile({ConstraintKind::kJsonObject, "", {}});
  refused(p, "compiled for a vocabulary of 520");
}

}  // namespace
}  // namespace exl3::engine
