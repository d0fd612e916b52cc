// Prompt logprobs (GenerateParams::prompt_logprobs) through the engine over the real CPU model on
// transformers fixtures (tests/fixtures/engine): every prompt token but the first gets the
// log_softmax of the fixture's reference logits at the position before it (teacher-forced rows),
// within the fixtures' logit bound, with the prompt split over several steps and beside other
// sequences; a prompt already in the prefix cache still gets all its rows; a request that fails
// fails alone. GQA (GLM-4 MoE), MLA (DeepSeek-V3) and a recurrent family (Qwen3-Next).
#include <algorithm>
#include <cmath>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/fake_model_runner.h"
#include "tests/engine/prompt_logprobs_check.h"

namespace exl3::engine {
namespace {

using testing::Greedy32;
using testing::Int32Rows;
using testing::RequestResults;

const char* const kFixtures[] = {"tests/fixtures/engine/glm4_moe_all", "tests/fixtures/engine/deepseek_v3_all",
                                 "tests/fixtures/engine/qwen3_next_all"};
constexpr int kTopN = 3;

class PromptLogprobsTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto ref = TensorSource::Open(std::string(GetParam()) + "/reference.safetensors");
    ASSERT_TRUE(ref.ok()) << ref.status();
    prompts_ = Int32Rows(**ref, "prompt.");
    greedy_ = Int32Rows(**ref, "greedy.");
    for (size_t i = 0; i < prompts_.size(); ++i) logits_.push_back(*ToFloat32(*(*ref)->Get("logits." + std::to_string(i))));
    CpuModelOptions mo;
    mo.num_threads = 2;
    auto model = CpuModel::Open(GetParam(), mo);
    ASSERT_TRUE(model.ok()) << model.status();
    vocab_ = (*model)->info().vocab_size;
    EngineOptions eo;
    eo.block_size = 4;
    eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 256};
    eo.scheduler.max_num_batched_tokens = 24;  // prompts over several steps
    eo.scheduler.max_prompt_logit_rows = 10;   // and prompt rows over more
    eo.sampling_threads = 2;
    engine_ = std::make_unique<Engine>(eo, std::move(*model));
    ASSERT_TRUE(engine_->Start().ok());
  }

  // Checks prompt i's prompt logprobs against the reference logits' log_softmax; returns the
  // worst absolute logprob error.
  double CheckAgainstReference(size_t i, const std::vector<SampledToken>& got) {
    SCOPED_TRACE(::testing::Message() << "prompt " << i);
    // The fixtures bound logits to 1e-3 relative; a logprob moves by at most twice a logit's error.
    return testing::CheckPromptLogprobs(prompts_[i], logits_[i], vocab_, got, kTopN, [&](const float* row) {
      double max_abs = 0;
      for (int t = 0; t < vocab_; ++t) max_abs = std::max<double>(max_abs, std::fabs(row[t]));
      return 2e-3 * max_abs + 1e-5;
    });
  }

  std::vector<std::vector<int32_t>> prompts_, greedy_;
  std::vector<std::vector<float>> logits_;
  int vocab_ = 0;
  std::unique_ptr<Engine> engine_;
};

TEST_P(PromptLogprobsTest, EqualTheReferenceLogSoftmaxBesideOtherSequences) {
  RequestResults r;
  std::vector<uint64_t> with, without;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    GenerateParams g = Greedy32(prompts_[i]);
    g.prompt_logprobs = kTopN;
    auto id = engine_->Submit(g, r.Callback());
    ASSERT_TRUE(id.ok()) << id.status();
    with.push_back(*id);
    auto plain = engine_->Submit(Greedy32(prompts_[i]), r.Callback());  // beside it, without
    ASSERT_TRUE(plain.ok()) << plain.status();
    without.push_back(*plain);
  }
  r.Wait(2 * prompts_.size());
  for (size_t i = 0; i < prompts_.size(); ++i) {
    ASSERT_TRUE(r.finish[with[i]].status.ok()) << r.finish[with[i]].status;
    EXPECT_EQ(r.prompt_logprobs_events[with[i]], 1) << "delivered once, with the first token";
    const double worst = CheckAgainstReference(i, r.prompt_logprobs[with[i]]);
    std::printf("%s prompt %zu (%zu tokens): worst prompt logprob abs err %.2e\n", GetParam(), i,
                prompts_[i].size(), worst);
    EXPECT_EQ(r.TokenIds(with[i]), greedy_[i]) << "the continuation is unchanged";
    EXPECT_EQ(r.TokenIds(without[i]), greedy_[i]);
    EXPECT_FALSE(r.prompt_logprobs.contains(without[i]));
  }
}

TEST_P(PromptLogprobsTest, APrefixCachedPromptStillGetsEveryRow) {
  const size_t i = prompts_.size() - 1;
  RequestResults first;
  GenerateParams g = Greedy32(prompts_[i]);
  g.max_tokens = 2;
  ASSERT_TRUE(engine_->Submit(g, first.Callback()).ok());
  first.Wait(1);
  RequestResults second;
  g.prompt_logprobs = kTopN;
  auto id = engine_->Submit(g, second.Callback());
  ASSERT_TRUE(id.ok());
  second.Wait(1);
  ASSERT_TRUE(second.finish[*id].status.ok()) << second.finish[*id].status;
  EXPECT_EQ(second.finish[*id].usage.cached_tokens, 0) << "the lookup is skipped";
  CheckAgainstReference(i, second.prompt_logprobs[*id]);
  // Its blocks were registered: a third request without prompt logprobs hits them where the
  // model can resume from cached blocks.
  RequestResults third;
  g.prompt_logprobs.reset();
  auto third_id = engine_->Submit(g, third.Callback());
  ASSERT_TRUE(third_id.ok());
  third.Wait(1);
  if (PrefixCachingUsable(engine_->model_info())) {
    EXPECT_GT(third.finish[*third_id].usage.cached_tokens, 0);
  }
}

TEST_P(PromptLogprobsTest, OutOfRangeIsRefusedAlone) {
  GenerateParams g = Greedy32(prompts_[0]);
  g.prompt_logprobs = vocab_ + 1;
  RequestResults r;
  auto refused = engine_->Submit(g, r.Callback());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("prompt_logprobs"), std::string_view::npos);
  auto ok = engine_->Submit(Greedy32(prompts_[0]), r.Callback());
  ASSERT_TRUE(ok.ok());
  r.Wait(1);
  EXPECT_EQ(r.TokenIds(*ok), greedy_[0]);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PromptLogprobsTest, ::testing::ValuesIn(kFixtures));

// The fake runner's logits are a function of the history: position p's row is HistoryLogits of
// prompt[0..p], whose log_softmax at prompt[p + 1] is the expected logprob.
void ExpectFakePromptLogprobs(const std::vector<int32_t>& prompt, const std::vector<SampledToken>& got,
                              int vocab, size_t top_n) {
  ASSERT_EQ(got.size(), prompt.size() - 1);
  for (size_t p = 0; p + 1 < prompt.size(); ++p) {
    std::vector<float> row(vocab);
    testing::FakeModelRunner::HistoryLogits(std::span<const int32_t>(prompt).first(p + 1), row.data(), vocab);
    const float max_logit = *std::max_element(row.begin(), row.end());
    double sum = 0;
    for (float v : row) sum += std::exp(v - max_logit);
    const double want = row[prompt[p + 1]] - max_logit - std::log(sum);
    EXPECT_EQ(got[p].token, prompt[p + 1]);
    EXPECT_NEAR(*got[p].logprob, want, 1e-5) << "position " << p;
    EXPECT_EQ(got[p].top_logprobs.size(), top_n);
    const int higher = static_cast<int>(
        std::count_if(row.begin(), row.end(), [&](float v) { return v > row[prompt[p + 1]]; }));
    EXPECT_EQ(got[p].rank, 1 + higher);
  }
}

// A step failure while prompt rows run fails only the sequence whose tokens fail (the engine
// retries the step's chunks alone); the others get their prompt logprobs and tokens.
TEST(PromptLogprobsFakeRunnerTest, AFailedRequestFailsAlone) {
  testing::FakeModelOptions fo;
  auto runner = std::make_unique<testing::FakeModelRunner>(fo);
  testing::FakeModelRunner* fake = runner.get();
  // A prompt holding it fails every step its prompt chunk runs in (prompt chunks only: the good
  // request may sample the same id, and its decode steps must not fail for that).
  static constexpr int32_t kPoison = 13;
  fake->SetFault([](int, const StepBatch& batch) {
    for (const SequenceChunk& c : batch.chunks)
      if (c.start_position == 0 && std::find(c.tokens.begin(), c.tokens.end(), kPoison) != c.tokens.end())
        return absl::InternalError("poisoned token");
    return absl::OkStatus();
  });
  EngineOptions eo;
  eo.block_size = 4;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
  Engine engine(eo, std::move(runner));
  ASSERT_TRUE(engine.Start().ok());
  RequestResults r;
  GenerateParams good;
  good.prompt = {5, 6, 7, 8, 9, 10};
  good.max_tokens = 3;
  good.ignore_eos = true;
  good.prompt_logprobs = 2;
  GenerateParams bad = good;
  bad.prompt = {5, 6, kPoison, 8};
  auto good_id = engine.Submit(good, r.Callback());
  auto bad_id = engine.Submit(bad, r.Callback());
  ASSERT_TRUE(good_id.ok() && bad_id.ok());
  r.Wait(2);
  EXPECT_EQ(r.finish[*bad_id].reason, FinishReason::kError);
  EXPECT_TRUE(r.finish[*good_id].status.ok()) << r.finish[*good_id].status;
  ExpectFakePromptLogprobs(good.prompt, r.prompt_logprobs[*good_id], fo.vocab_size, 2);
  EXPECT_EQ(r.sampled[*good_id].size(), 3u);
  EXPECT_EQ(fake->num_check_failures(), 0);
}

// Sequences preempted while (and after) their prompt rows run get them all the same, once; a
// runner that samples rows itself (as the GPU's) gets the steps without prompt rows.
TEST(PromptLogprobsFakeRunnerTest, PreemptionAndARunnerThatSamples) {
  testing::FakeModelOptions fo;
  fo.samples_rows_up_to_logprobs = 5;
  auto runner = std::make_unique<testing::FakeModelRunner>(fo);
  testing::FakeModelRunner* fake = runner.get();
  EngineOptions eo;
  eo.block_size = 4;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 10};  // 40 tokens for 3 x (12 + 20)
  eo.scheduler.max_num_batched_tokens = 5;                 // prompts over several steps,
  eo.scheduler.max_prompt_logit_rows = 3;                  // slower while others decode
  Engine engine(eo, std::move(runner));
  ASSERT_TRUE(engine.Start().ok());
  std::promise<void> all_submitted = testing::HoldFirstStep(*fake);
  RequestResults r;
  std::vector<GenerateParams> params;
  std::vector<uint64_t> ids;
  for (int s = 0; s < 3; ++s) {
    GenerateParams g;
    for (int i = 0; i < 12; ++i) g.prompt.push_back(2 + (i * 7 + s * 5) % 60);
    g.max_tokens = 20;
    g.ignore_eos = true;
    g.sampling.temperature = 0;
    g.prompt_logprobs = 1;
    auto id = engine.Submit(g, r.Callback());
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    params.push_back(g);
  }
  all_submitted.set_value();
  r.Wait(3);
  EXPECT_GT(engine.Stats().preemptions, 0);
  for (size_t s = 0; s < ids.size(); ++s) {
    EXPECT_TRUE(r.finish[ids[s]].status.ok()) << r.finish[ids[s]].status;
    EXPECT_EQ(r.prompt_logprobs_events[ids[s]], 1);
    ExpectFakePromptLogprobs(params[s].prompt, r.prompt_logprobs[ids[s]], fo.vocab_size, 1);
    EXPECT_EQ(r.sampled[ids[s]].size(), 20u);
  }
  EXPECT_GT(fake->num_sampled_rows(), 0) << "decode steps were sampled by the runner";
  EXPECT_EQ(fake->num_check_failures(), 0);
}

// A runner that cannot return prompt rows refuses the request by name.
class NoPromptRowsRunner final : public testing::FakeModelRunner {
 public:
  using FakeModelRunner::FakeModelRunner;
  absl::Status CheckPromptLogitRows() const override {
    return absl::FailedPreconditionError("no prompt rows here");
  }
};

TEST(PromptLogprobsFakeRunnerTest, ARunnerWithoutPromptRowsRefusesByName) {
  EngineOptions eo;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
  Engine engine(eo, std::make_unique<NoPromptRowsRunner>(testing::FakeModelOptions{}));
  ASSERT_TRUE(engine.Start().ok());
  GenerateParams g;
  g.prompt = {5, 6, 7};
  g.prompt_logprobs = 0;
  RequestResults r;
  auto refused = engine.Submit(g, r.Callback());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("prompt_logprobs refused"), std::string_view::npos)
      << refused.status();
}

TEST(PromptLogprobsFakeRunnerTest, NoPromptRowsPerStepIsABadOption) {
  EngineOptions eo;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
  eo.scheduler.max_prompt_logit_rows = 0;  // a sequence wanting them would never advance
  Engine engine(eo, std::make_unique<testing::FakeModelRunner>(testing::FakeModelOptions{}));
  const absl::Status st = engine.Start();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("max_prompt_logit_rows"), std::string_view::npos) << st;
}

}  // namespace
}  // namespace exl3::engine
