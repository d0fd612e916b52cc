// The engine step's cost of constrained decoding (tools/exl3_bench/constraint_step_bench.h, what
// exl3-engine-bench --constrained-tokenizer runs on the GPU engine) end to end on the CPU engine:
// a generated GLM-4 MoE model with random weights (vocab 512, EOS 1) and the test models' real
// tokenizer (tests/fixtures/tokenizer/glm4_moe). Checks what the measurement claims: the
// unconstrained run's requests each generate max_tokens tokens and about `steps` steps hold the
// whole batch; a constrained request its grammar ends is replaced so that every slot still
// generates max_tokens tokens; the JSON carries both runs and the difference. Timings are not
// checked (2 shared cores).
#include "tools/exl3_bench/constraint_step_bench.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cpu/cpu_model.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/tiny_synthetic_model.h"

namespace exl3::bench {
namespace {

namespace fs = std::filesystem;

constexpr char kTokenizer[] = "tests/fixtures/tokenizer/glm4_moe/tokenizer.json";  // 512 ids

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(ConstraintStepMaxTokensTest, CoversThePrefillSteps) {
  // One prompt of 1024 in a step of 2048: one prefill step, the first token with it.
  EXPECT_EQ(ConstraintStepMaxTokens(1, 1024, 32, 2048), 32 + 1 + 1);
  // 64 prompts of 1024 in steps of 2048 of which 64 go to decoding sequences: ceil(65536 / 1984).
  EXPECT_EQ(ConstraintStepMaxTokens(64, 1024, 32, 2048), 32 + 34 + 1);
  EXPECT_EQ(ConstraintStepMaxTokens(4, 8, 12, 64), 12 + 1 + 1);
  EXPECT_EQ(ConstraintStepMaxTokens(8, 8, 5, 8), 5 + 64 + 1);  // a budget of the batch alone: one token a step
}

TEST(ConstraintStepRowTest, ShareNeedsBothRunsMeasured) {
  ConstraintStepBenchRow row;
  row.plain.step_s = 0.010;
  row.constrained.step_s = 0.0105;
  EXPECT_FALSE(row.Share().has_value());
  row.plain.full_batch_steps = 30;
  EXPECT_FALSE(row.Share().has_value());
  row.constrained.full_batch_steps = 2;
  ASSERT_TRUE(row.Share().has_value());
  EXPECT_NEAR(*row.Share(), 0.05, 1e-9);
}

class ConstraintStepBenchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() / ("exl3_constraint_step_bench_" + std::to_string(::getpid())));
    ASSERT_TRUE(engine::testing::WriteTinySyntheticModel(*dir_).ok());
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }

  static std::unique_ptr<engine::ModelRunner> Open(const std::string& dir) {
    engine::CpuModelOptions mo;
    mo.num_threads = 2;
    auto model = engine::CpuModel::Open(dir, mo);
    EXPECT_TRUE(model.ok()) << model.status();
    return model.ok() ? std::move(*model) : nullptr;
  }
  static std::unique_ptr<engine::ModelRunner> OpenSynthetic() { return Open(dir_->string()); }

  static ConstraintStepBenchOptions Small() {
    ConstraintStepBenchOptions o;
    o.batches = {1, 4};
    o.prompt_tokens = 8;
    o.steps = 12;
    o.tokenizer_json = ReadFile(kTokenizer);
    o.engine.block_size = 4;
    o.engine.kv_capacity = {engine::KvCacheCapacity::Unit::kBlocks, 256};
    o.engine.scheduler.max_num_batched_tokens = 64;
    return o;
  }

  // What both kinds of run promise, whatever the grammar did.
  static void ExpectSlotsFilled(const ConstraintStepBenchRow& row) {
    for (const ConstraintStepRun* r : {&row.plain, &row.constrained}) {
      SCOPED_TRACE(r->constrained ? "constrained" : "unconstrained");
      EXPECT_EQ(r->max_tokens, ConstraintStepMaxTokens(row.batch, 8, 12, 64));
      // Every slot generated max_tokens tokens, over one request or several.
      EXPECT_NEAR(r->tokens_mean * r->requests, static_cast<double>(row.batch) * r->max_tokens, 1e-6);
      EXPECT_GE(r->requests, row.batch);
      EXPECT_LE(r->requests - row.batch, r->ended_by_grammar);
      EXPECT_LE(r->full_batch_steps, r->decode_steps);
      EXPECT_GE(r->tokens_min, 1);
      EXPECT_LE(r->tokens_max, r->max_tokens);
    }
    // The unconstrained run: no request ends early, and about `steps` steps hold the whole batch.
    EXPECT_FALSE(row.plain.constrained);
    EXPECT_EQ(row.plain.requests, row.batch);
    EXPECT_EQ(row.plain.ended_by_grammar, 0);
    EXPECT_EQ(row.plain.tokens_min, row.plain.max_tokens);
    // One fewer where the engine took the first request before the others were submitted.
    EXPECT_GE(row.plain.full_batch_steps, 12 - 1);
    EXPECT_GT(row.plain.step_s, 0);
    EXPECT_GT(row.plain.forward_s, 0);
    EXPECT_TRUE(row.constrained.constrained);
  }

  static fs::path* dir_;
};

fs::path* ConstraintStepBenchTest::dir_ = nullptr;

TEST_F(ConstraintStepBenchTest, MeasuresBothRunsOfEachBatch) {
  absl::StatusOr<ConstraintStepBenchResult> result = RunConstraintStepBench(Small(), OpenSynthetic);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->vocab_size, 512);
  EXPECT_EQ(result->prompt_tokens, 8);
  EXPECT_GT(result->compiler_s, 0);
  EXPECT_GT(result->schema_compile_s, 0);
  const fs::path json_path = *dir_ / "bench.json";
  FILE* json = std::fopen(json_path.c_str(), "w");
  ASSERT_NE(json, nullptr);
  PrintConstraintStepBench(*result, stdout, json, "local");
  std::fclose(json);
  ASSERT_EQ(result->rows.size(), 2u);
  for (const ConstraintStepBenchRow& row : result->rows) {
    SCOPED_TRACE(row.batch);
    ExpectSlotsFilled(row);
  }
  EXPECT_EQ(result->rows[0].batch, 1);
  EXPECT_EQ(result->rows[1].batch, 4);

  std::ifstream in(json_path);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    std::printf("%s\n", line.c_str());
    const nlohmann::json j = nlohmann::json::parse(line);
    const ConstraintStepBenchRow& row = result->rows[lines++];
    EXPECT_EQ(j["bench"], "engine_constraint_step");
    EXPECT_EQ(j["experts"], "local");
    EXPECT_EQ(j["batch"], row.batch);
    EXPECT_EQ(j["context"], 8);
    EXPECT_EQ(j["plain_requests"], row.batch);
    EXPECT_EQ(j["constrained_requests"], row.constrained.requests);
    EXPECT_EQ(j["constrained_full_batch_steps"], row.constrained.full_batch_steps);
    EXPECT_EQ(j["share"].is_null(), !row.Share().has_value());
  }
  EXPECT_EQ(lines, 2);
}

TEST_F(ConstraintStepBenchTest, RequestsTheirGrammarEndsAreReplaced) {
  // A grammar complete within a few tokens ("true" or "false", then EOS): every slot runs through
  // several requests, each replaced as its grammar ends, until the slot has max_tokens tokens.
  ConstraintStepBenchOptions o = Small();
  o.schema = R"({"type": "boolean"})";
  absl::StatusOr<ConstraintStepBenchResult> result = RunConstraintStepBench(o, OpenSynthetic);
  ASSERT_TRUE(result.ok()) << result.status();
  PrintConstraintStepBench(*result, stdout);
  for (const ConstraintStepBenchRow& row : result->rows) {
    SCOPED_TRACE(row.batch);
    ExpectSlotsFilled(row);
    EXPECT_GE(row.constrained.ended_by_grammar, row.batch);
    EXPECT_GE(row.constrained.requests, 2 * row.batch);
    // "false" and EOS at most a handful of byte-level tokens.
    EXPECT_LE(row.constrained.tokens_min, 8);
  }
}

TEST_F(ConstraintStepBenchTest, RefusesWhatCannotBeMeasured) {
  ConstraintStepBenchOptions o = Small();
  o.tokenizer_json.clear();
  EXPECT_EQ(RunConstraintStepBench(o, OpenSynthetic).status().code(), absl::StatusCode::kInvalidArgument);
  o = Small();
  o.engine.scheduler.max_num_batched_tokens = 3;  // below the batch of 4
  absl::Status st = RunConstraintStepBench(o, OpenSynthetic).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("below the largest batch 4"), std::string::npos) << st;
  o = Small();
  o.prompt_tokens = 4090;  // the model's context is 4096
  st = RunConstraintStepBench(o, OpenSynthetic).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("exceed the model's context of 4096"), std::string::npos) << st;
  o = Small();
  o.schema = "{not json";
  EXPECT_EQ(RunConstraintStepBench(o, OpenSynthetic).status().code(), absl::StatusCode::kInvalidArgument);

  // The fixture model's vocabulary of 128 cannot hold the tokenizer's 512 ids: refused before and
  // after opening a model.
  const std::string text = ReadFile(kTokenizer);
  st = CheckConstraintTokenizer(kTokenizer, text, 128);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(kTokenizer), std::string::npos) << st;
  EXPECT_TRUE(CheckConstraintTokenizer(kTokenizer, text, 151552).ok());  // padded: ids past 512 never allowed
  st = RunConstraintStepBench(Small(), [] { return Open("tests/fixtures/engine/glm4_moe_all"); }).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
}

}  // namespace
}  // namespace exl3::bench
