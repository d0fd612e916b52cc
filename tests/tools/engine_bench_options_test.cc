// exl3-engine-bench's command line and its expert-map check (tools/exl3_bench/engine_bench_options.h),
// which run before any GPU work.
#include "tools/exl3_bench/engine_bench_options.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::bench {
namespace {

namespace fs = std::filesystem;

const char kModel[] = "tests/fixtures/engine/glm4_moe_all";  // 2 layers (the first dense), 8 experts

std::string WriteMap(const std::string& name, const std::string& yaml) {
  const fs::path dir = fs::temp_directory_path() / "exl3_engine_bench_options_test";
  fs::create_directories(dir);
  const fs::path p = dir / name;
  std::ofstream(p) << yaml;
  return p.string();
}

TEST(EngineBenchOptionsTest, DefaultsAreTheIssuesTables) {
  auto o = ParseEngineBenchArgs({"--model", kModel});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->contexts, (std::vector<int>{1024, 8192}));
  EXPECT_EQ(o->batches, (std::vector<int>{1, 8, 32, 64}));
  EXPECT_FALSE(o->remote());
  EXPECT_EQ(o->micro_batches, std::vector<int>{1});
  EXPECT_TRUE(o->graphs);
  EXPECT_FALSE(o->verify_graphs);
  auto verify = ParseEngineBenchArgs({"--model", kModel, "--verify-graphs"});
  ASSERT_TRUE(verify.ok()) << verify.status();
  EXPECT_TRUE(verify->verify_graphs);
}

TEST(EngineBenchOptionsTest, RemoteExpertsFlags) {
  auto o = ParseEngineBenchArgs({"--model", kModel, "--expert-map", "map.yaml", "--micro-batches", "1,2",
                                 "--shared-expert", "worker:w0", "--worker-shm-mb", "0", "--batch", "1,8",
                                 "--context", "1024", "--ready-timeout-s", "30"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->remote());
  EXPECT_EQ(o->expert_map, "map.yaml");
  EXPECT_EQ(o->micro_batches, (std::vector<int>{1, 2}));
  EXPECT_EQ(o->shared_expert, "worker:w0");
  EXPECT_EQ(o->worker_shm_mb, 0);
  EXPECT_EQ(o->batches, (std::vector<int>{1, 8}));
  EXPECT_EQ(o->contexts, std::vector<int>{1024});
  EXPECT_EQ(o->ready_timeout_s, 30);
}

TEST(EngineBenchOptionsTest, SpeculativeBenchFlags) {
  auto o = ParseEngineBenchArgs({"--model", kModel, "--speculative-acceptance", "0,0.7,1", "--num-speculative-tokens",
                                 "1,3", "--speculative-draft-length", "adaptive", "--context", "1024", "--steps", "64"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->speculative());
  EXPECT_EQ(o->speculative_acceptances, (std::vector<double>{0, 0.7, 1}));
  EXPECT_EQ(o->speculative_ks, (std::vector<int>{1, 3}));
  EXPECT_EQ(o->speculative_draft_length, "adaptive");
  auto goodput = ParseEngineBenchArgs(
      {"--model", kModel, "--speculative-acceptance", "0.7", "--speculative-draft-length", "goodput"});
  ASSERT_TRUE(goodput.ok()) << goodput.status();
  EXPECT_EQ(goodput->speculative_draft_length, "goodput");
  auto defaults = ParseEngineBenchArgs({"--model", kModel, "--speculative-acceptance", "0.7"});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->speculative_ks, (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(defaults->speculative_draft_length, "fixed");
  EXPECT_FALSE(ParseEngineBenchArgs({"--model", kModel})->speculative());
}

TEST(EngineBenchOptionsTest, ConstrainedTokenizerFlag) {
  auto o = ParseEngineBenchArgs({"--model", kModel, "--constrained-tokenizer", "tok.json", "--batch", "1,64",
                                 "--context", "1024", "--steps", "32", "--expert-map", "map.yaml"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->constrained());
  EXPECT_FALSE(o->speculative());
  EXPECT_EQ(o->constrained_tokenizer, "tok.json");
  EXPECT_EQ(o->batches, (std::vector<int>{1, 64}));
  EXPECT_EQ(o->steps, 32);
  EXPECT_TRUE(o->remote());  // remote experts go with it
  EXPECT_FALSE(ParseEngineBenchArgs({"--model", kModel})->constrained());
}

TEST(EngineBenchOptionsTest, SamplingOnlyNeedsNoModel) {
  auto o = ParseEngineBenchArgs({"--sampling-only", "--vocab", "32000", "--batch", "1,64"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->sampling_only);
  EXPECT_EQ(o->sampling_vocab, 32000);
  EXPECT_EQ(o->batches, (std::vector<int>{1, 64}));
}

TEST(EngineBenchOptionsTest, BadArgumentsAreNamed) {
  struct Case {
    std::vector<std::string> args;
    std::string names;
  };
  const std::vector<Case> cases = {
      {{"--model", kModel, "--batch", "1,x"}, "--batch"},
      {{"--model", kModel, "--batch", "1,,8"}, "--batch"},
      {{"--model", kModel, "--context", "-5"}, "--context"},
      {{"--model", kModel, "--steps"}, "--steps needs a value"},
      {{"--model", kModel, "--expert-map", "m.yaml", "--micro-batches", "3"}, "--micro-batches"},
      {{"--model", kModel, "--expert-map", "m.yaml", "--shared-expert", "gpu"}, "--shared-expert"},
      {{"--model", kModel, "--micro-batches", "2"}, "need --expert-map"},
      {{"--model", kModel, "--frobnicate"}, "unknown argument --frobnicate"},
      {{"--batch", "1"}, "--model DIR is required"},
      {{"--attention-only", "--attention-shape", "96,8"}, "--attention-shape"},
      {{"--attention-only", "--expert-map", "m.yaml"}, "no --expert-map"},
      {{"--sampling-only", "--vocab", "0"}, "--vocab"},
      {{"--sampling-only", "--attention-only"}, "one at a time"},
      {{"--model", kModel, "--speculative-acceptance", "1.5"}, "--speculative-acceptance: '1.5'"},
      {{"--model", kModel, "--speculative-acceptance", "0.5,x"}, "--speculative-acceptance: 'x'"},
      {{"--model", kModel, "--speculative-acceptance", "0.5", "--num-speculative-tokens", "0"},
       "--num-speculative-tokens"},
      {{"--model", kModel, "--speculative-acceptance", "0.5", "--speculative-draft-length", "auto"},
       "--speculative-draft-length"},
      {{"--model", kModel, "--num-speculative-tokens", "2"}, "need --speculative-acceptance"},
      {{"--sampling-only", "--speculative-acceptance", "0.5"}, "no --speculative-acceptance"},
      {{"--model", kModel, "--constrained-tokenizer"}, "--constrained-tokenizer needs a value"},
      {{"--model", kModel, "--constrained-tokenizer", ""}, "--constrained-tokenizer: empty file name"},
      {{"--model", kModel, "--constrained-tokenizer", "t.json", "--speculative-acceptance", "0.5"},
       "--constrained-tokenizer and --speculative-acceptance: one at a time"},
      {{"--attention-only", "--constrained-tokenizer", "t.json"}, "no --constrained-tokenizer"},
      {{"--sampling-only", "--constrained-tokenizer", "t.json"}, "no --constrained-tokenizer"},
      {{"--constrained-tokenizer", "t.json"}, "--model DIR is required"},
  };
  for (const Case& c : cases) {
    auto o = ParseEngineBenchArgs(c.args);
    ASSERT_FALSE(o.ok()) << c.names;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << o.status();
    EXPECT_NE(o.status().message().find(c.names), std::string::npos) << o.status();
  }
  auto help = ParseEngineBenchArgs({"--help"});
  ASSERT_TRUE(help.ok()) << help.status();
  EXPECT_TRUE(help->help);
  EXPECT_NE(std::string(kEngineBenchUsage).find("--constrained-tokenizer FILE"), std::string::npos);
}

TEST(EngineBenchOptionsTest, ExpertMapIsCheckedAgainstTheModel) {
  const std::string one = WriteMap("one.yaml",
                                   "workers:\n  - name: w0\n    address: 127.0.0.1:1\n    experts: all\n"
                                   "    shared_expert: true\n");
  auto o = ParseEngineBenchArgs({"--model", kModel, "--expert-map", one, "--shared-expert", "worker:w0"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(CheckBenchExpertMap(*o).ok()) << CheckBenchExpertMap(*o);

  // Two workers splitting the experts: covered; the shared expert named on an unmarked worker.
  const std::string two = WriteMap("two.yaml",
                                   "workers:\n  - name: w0\n    address: 127.0.0.1:1\n    experts: 0-3\n"
                                   "  - name: w1\n    address: 127.0.0.1:2\n    experts: 4-7\n");
  o = ParseEngineBenchArgs({"--model", kModel, "--expert-map", two});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(CheckBenchExpertMap(*o).ok()) << CheckBenchExpertMap(*o);
  o = ParseEngineBenchArgs({"--model", kModel, "--expert-map", two, "--shared-expert", "worker:w1"});
  ASSERT_TRUE(o.ok()) << o.status();
  absl::Status st = CheckBenchExpertMap(*o);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("not marked shared_expert"), std::string::npos) << st;
  o = ParseEngineBenchArgs({"--model", kModel, "--expert-map", two, "--shared-expert", "worker:w9"});
  ASSERT_TRUE(o.ok()) << o.status();
  st = CheckBenchExpertMap(*o);
  EXPECT_NE(st.message().find("no worker w9"), std::string::npos) << st;

  // Experts 4-7 of layer 1 held by nobody.
  const std::string gap = WriteMap("gap.yaml", "workers:\n  - name: w0\n    address: 127.0.0.1:1\n    experts: 0-3\n");
  o = ParseEngineBenchArgs({"--model", kModel, "--expert-map", gap});
  ASSERT_TRUE(o.ok()) << o.status();
  st = CheckBenchExpertMap(*o);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("4-7"), std::string::npos) << st;

  o = ParseEngineBenchArgs({"--model", kModel, "--expert-map", "/nonexistent/map.yaml"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(CheckBenchExpertMap(*o).ok());
}

}  // namespace
}  // namespace exl3::bench
