#include "engine/core/engine.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/fake_model_runner.h"

namespace exl3::engine {
namespace {

using namespace std::chrono_literals;
using testing::FakeModelOptions;
using testing::FakeModelRunner;

// Collects every request's events; thread-safe.
class Collector {
 public:
  EventCallback Callback() {
    return [this](const GenerateEvent& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (finish_.contains(e.request_id)) ++events_after_finish_;
      for (const SampledToken& t : e.tokens) {
        tokens_[e.request_id].push_back(t.token);
        if (t.logprob.has_value()) logprobs_[e.request_id].push_back(*t.logprob);
      }
      if (e.finish.has_value()) {
        finish_[e.request_id] = *e.finish;
        tags_[e.request_id] = std::string(e.tag);
        cv_.notify_all();
      }
    };
  }
  bool WaitFinished(uint64_t id, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return finish_.contains(id); });
  }
  bool WaitTokens(uint64_t id, size_t n, std::chrono::milliseconds timeout = 10s) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (tokens_[id].size() >= n) return true;
      }
      std::this_thread::sleep_for(200us);
    }
    return false;
  }
  std::vector<int32_t> Tokens(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return tokens_[id];
  }
  std::vector<float> Logprobs(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return logprobs_[id];
  }
  FinishInfo Finish(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return finish_.at(id);
  }
  std::string Tag(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return tags_.at(id);
  }
  int events_after_finish() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_after_finish_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::vector<int32_t>> tokens_;
  std::map<uint64_t, std::vector<float>> logprobs_;
  std::map<uint64_t, FinishInfo> finish_;
  std::map<uint64_t, std::string> tags_;
  int events_after_finish_ = 0;
};

struct TestEngine {
  ~TestEngine() {
    if (engine) engine->Stop();  // before the collector goes: Stop sends the last events
  }
  Collector events;
  FakeModelRunner* fake = nullptr;
  std::unique_ptr<Engine> engine;
};

EngineOptions Options(int num_blocks = 1024, int block_size = 16) {
  EngineOptions o;
  o.block_size = block_size;
  o.kv_capacity = {KvCacheCapacity::Unit::kBlocks, num_blocks};
  return o;
}

std::unique_ptr<TestEngine> StartEngine(EngineOptions options = Options(),
                                        FakeModelOptions model = {}) {
  auto t = std::make_unique<TestEngine>();
  auto runner = std::make_unique<FakeModelRunner>(model);
  t->fake = runner.get();
  t->engine = std::make_unique<Engine>(options, std::move(runner));
  const absl::Status s = t->engine->Start();
  EXPECT_TRUE(s.ok()) << s;
  return t;
}

// Stats once the loop has published the state after the last final event (it does so right after
// the step or cancel that ended the requests).
EngineStats IdleStats(TestEngine& t) {
  for (int i = 0; i < 2000; ++i) {
    const EngineStats s = t.engine->Stats();
    if (s.running + s.waiting == 0 && s.kv_usage == 0) return s;
    std::this_thread::sleep_for(100us);
  }
  return t.engine->Stats();
}

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = 2 + (i * 11 + salt * 17 + i * i) % 60;
  return p;
}

GenerateParams Params(int prompt_len, int salt, int max_tokens, bool seeded_sampling) {
  GenerateParams p;
  p.prompt = Prompt(prompt_len, salt);
  p.max_tokens = max_tokens;
  if (seeded_sampling) {
    p.sampling.temperature = 0.8f;
    p.sampling.top_p = 0.9f;
    p.sampling.seed = 1000 + salt;
  } else {
    p.sampling.temperature = 0;
  }
  return p;
}

// Greedy, running to max_tokens.
GenerateParams LongRun(int prompt_len, int salt, int max_tokens) {
  GenerateParams p = Params(prompt_len, salt, max_tokens, /*seeded_sampling=*/false);
  p.ignore_eos = true;
  return p;
}

FakeModelOptions SlowModel(std::chrono::microseconds step_delay) {
  FakeModelOptions model;
  model.step_delay = step_delay;
  return model;
}

uint64_t SubmitOk(TestEngine& t, GenerateParams p) {
  absl::StatusOr<uint64_t> id = t.engine->Submit(std::move(p), t.events.Callback());
  EXPECT_TRUE(id.ok()) << id.status();
  return id.value_or(0);
}

std::vector<int32_t> RunAlone(const GenerateParams& p, FakeModelOptions model = {}) {
  auto t = StartEngine(Options(), model);
  const uint64_t id = SubmitOk(*t, p);
  EXPECT_TRUE(t->events.WaitFinished(id));
  return t->events.Tokens(id);
}

// Eight prompts of different lengths, greedy and seeded sampling, some ending on EOS.
std::vector<GenerateParams> MixedBatch(const std::vector<int>& lengths) {
  std::vector<GenerateParams> batch;
  for (int i = 0; i < static_cast<int>(lengths.size()); ++i) {
    GenerateParams p = Params(lengths[i], i, 20 + 3 * i, /*seeded_sampling=*/i % 2 == 1);
    p.ignore_eos = i % 3 != 0;
    batch.push_back(p);
  }
  return batch;
}

const std::vector<int> kLengths = {1, 5, 16, 17, 33, 100, 250, 700};
// Fits 100 blocks of 4 tokens only with preemptions: 90 blocks of prompts, 20 to 41 tokens each.
const std::vector<int> kPreemptionLengths = {1, 5, 16, 17, 33, 60, 90, 120};

void ExpectBatchMatchesSolo(EngineOptions options, const std::vector<int>& lengths,
                            bool expect_preemption) {
  const std::vector<GenerateParams> batch = MixedBatch(lengths);
  auto t = StartEngine(options);
  std::promise<void> all_submitted = HoldFirstStep(*t->fake);
  std::vector<uint64_t> ids;
  for (const GenerateParams& p : batch) ids.push_back(SubmitOk(*t, p));
  all_submitted.set_value();
  for (size_t i = 0; i < batch.size(); ++i) {
    ASSERT_TRUE(t->events.WaitFinished(ids[i]));
    EXPECT_EQ(t->events.Tokens(ids[i]), RunAlone(batch[i])) << "prompt " << i;
    const FinishInfo f = t->events.Finish(ids[i]);
    EXPECT_TRUE(f.reason == FinishReason::kStop || f.reason == FinishReason::kLength);
    EXPECT_EQ(f.usage.prompt_tokens, static_cast<int>(batch[i].prompt.size()));
    EXPECT_EQ(f.usage.completion_tokens, static_cast<int>(t->events.Tokens(ids[i]).size()));
  }
  EXPECT_EQ(t->fake->num_check_failures(), 0);
  EXPECT_EQ(t->events.events_after_finish(), 0);
  if (expect_preemption) {
    EXPECT_GT(t->engine->Stats().preemptions, 0);
  }
}

TEST(Engine, BatchGivesTheSameTokensAsEachPromptAlone) {
  ExpectBatchMatchesSolo(Options(), kLengths, /*expect_preemption=*/false);
}

TEST(Engine, SmallChunksGiveTheSameTokens) {
  EngineOptions o = Options();
  o.scheduler.max_num_batched_tokens = 64;
  o.scheduler.long_prefill_token_threshold = 24;
  ExpectBatchMatchesSolo(o, kLengths, /*expect_preemption=*/false);
}

TEST(Engine, ParallelSamplingGivesTheSameTokens) {
  EngineOptions o = Options();
  o.sampling_threads = 3;
  ExpectBatchMatchesSolo(o, kLengths, /*expect_preemption=*/false);
}

// A batch's tokens and logprobs per request, the rows the runner sampled itself and the drafts
// accepted, from a fresh engine over a fake runner that samples rows asking at most
// `runner_logprobs` top logprobs (none: every row sampled by the engine on the host).
struct SampledBatch {
  std::vector<std::pair<std::vector<int32_t>, std::vector<float>>> requests;
  int runner_rows = 0;
  int64_t accepted_drafts = 0;
};
SampledBatch RunSampledBatch(const EngineOptions& o, FakeModelOptions model, std::optional<int> runner_logprobs,
                             const std::vector<GenerateParams>& batch) {
  model.samples_rows_up_to_logprobs = runner_logprobs;
  auto t = StartEngine(o, model);
  std::vector<uint64_t> ids;
  for (const GenerateParams& p : batch) ids.push_back(SubmitOk(*t, p));
  SampledBatch out;
  for (uint64_t id : ids) {
    EXPECT_TRUE(t->events.WaitFinished(id));
    out.requests.emplace_back(t->events.Tokens(id), t->events.Logprobs(id));
  }
  EXPECT_EQ(t->fake->num_check_failures(), 0);
  out.runner_rows = t->fake->num_sampled_rows();
  out.accepted_drafts = t->engine->Stats().speculative.num_accepted_tokens;
  return out;
}

// Both runs' tokens and logprobs equal, request by request; the tokens of all.
int ExpectSameRequests(const SampledBatch& runner, const SampledBatch& host) {
  int tokens = 0;
  for (size_t i = 0; i < host.requests.size(); ++i) {
    EXPECT_EQ(runner.requests[i].first, host.requests[i].first) << "request " << i;
    EXPECT_EQ(runner.requests[i].second, host.requests[i].second) << "request " << i;
    tokens += static_cast<int>(host.requests[i].first.size());
  }
  return tokens;
}

// The runner samples (ModelRunner::ForwardSampled, as the GPU engine does) or the engine does:
// the same tokens and logprobs. Rows asking more top logprobs than the runner samples send their
// steps to the host path, so a run has both kinds of steps.
TEST(Engine, RunnerSamplingGivesTheSameTokensAsHostSampling) {
  std::vector<GenerateParams> batch = MixedBatch(kLengths);
  for (size_t i = 0; i < batch.size(); ++i) {
    SamplingParams& s = batch[i].sampling;
    if (i % 4 == 1) s.repetition_penalty = 1.3f;
    if (i % 4 == 3) {
      s.presence_penalty = 0.5f;
      s.frequency_penalty = 0.25f;
      s.top_k = 7;
      s.min_p = 0.05f;
    }
    if (i == 2) batch[i].min_tokens = 5;
    if (i % 3 == 0) s.logprobs = 2;
  }
  GenerateParams wide = Params(40, 9, 6, /*seeded_sampling=*/true);
  wide.sampling.logprobs = 5;  // more than the runner samples
  batch.push_back(wide);
  const SampledBatch host = RunSampledBatch(Options(), {}, std::nullopt, batch);
  const SampledBatch runner = RunSampledBatch(Options(), {}, 2, batch);
  EXPECT_EQ(host.runner_rows, 0);
  EXPECT_GT(runner.runner_rows, 0);
  const int total_tokens = ExpectSameRequests(runner, host);
  // The wide request's steps went to the host: fewer rows sampled on the runner than tokens.
  EXPECT_LT(runner.runner_rows, total_tokens);
}

// Speculative decoding's verify rows sampled by the runner (Scheduler::SamplingRows gives row j
// of a verify chunk the history with its drafts [0, j)) or by the engine on the host: the same
// tokens and logprobs, with penalties that read those histories and seeded sampling whose draw
// index is the row's position. The prompts repeat and the vocabulary is small, so the n-gram
// drafter proposes drafts that are accepted (rows after the first then count) and rejected.
TEST(Engine, RunnerSampledVerifyRowsGiveHostSamplingsTokens) {
  std::vector<GenerateParams> batch;
  for (int i = 0; i < 8; ++i) {
    GenerateParams p = Params(0, i, 48, /*seeded_sampling=*/i % 2 == 0);
    for (int r = 0; r < 6; ++r)
      for (int32_t t : {5, 9, 13, 2 + i}) p.prompt.push_back(t);
    if (i == 1) p.sampling.repetition_penalty = 1.3f;
    if (i == 2) {
      p.sampling.presence_penalty = 0.5f;
      p.sampling.frequency_penalty = 0.25f;
    }
    p.sampling.logprobs = 2;
    p.ignore_eos = true;
    batch.push_back(p);
  }
  EngineOptions o = Options();
  o.scheduler.speculative.method = SpeculativeMethod::kNgram;
  o.scheduler.speculative.num_speculative_tokens = 3;
  o.scheduler.speculative.prompt_lookup_min = 1;
  o.scheduler.speculative.prompt_lookup_max = 3;
  FakeModelOptions model;
  model.vocab_size = 16;
  const SampledBatch host = RunSampledBatch(o, model, std::nullopt, batch);
  const SampledBatch runner = RunSampledBatch(o, model, 2, batch);
  EXPECT_EQ(host.runner_rows, 0);
  EXPECT_GT(host.accepted_drafts, 8);
  EXPECT_EQ(runner.accepted_drafts, host.accepted_drafts);
  const int tokens = ExpectSameRequests(runner, host);
  // Every row went to the runner, verify rows among them: more rows than tokens.
  EXPECT_GT(runner.runner_rows, tokens);
}

TEST(Engine, PreemptedSequencesResumeWithTheSameTokens) {
  ExpectBatchMatchesSolo(Options(/*num_blocks=*/100, /*block_size=*/4), kPreemptionLengths,
                         /*expect_preemption=*/true);
}

TEST(Engine, PreemptionWithoutPrefixCacheGivesTheSameTokens) {
  EngineOptions o = Options(/*num_blocks=*/100, /*block_size=*/4);
  o.scheduler.enable_prefix_caching = false;
  ExpectBatchMatchesSolo(o, kPreemptionLengths, /*expect_preemption=*/true);
}

TEST(Engine, PrefixCacheHitGivesTheSameTokensAndReportsCachedTokens) {
  auto t = StartEngine();
  const GenerateParams p = Params(70, 3, 10, /*seeded_sampling=*/true);
  const uint64_t first = SubmitOk(*t, p);
  ASSERT_TRUE(t->events.WaitFinished(first));
  EXPECT_EQ(t->events.Finish(first).usage.cached_tokens, 0);
  const uint64_t second = SubmitOk(*t, p);
  ASSERT_TRUE(t->events.WaitFinished(second));
  EXPECT_EQ(t->events.Tokens(second), t->events.Tokens(first));
  EXPECT_EQ(t->events.Finish(second).usage.cached_tokens, 64);  // 4 of 16, under the 69 cap
  // A prompt that shares its first 40 tokens hits 2 blocks.
  GenerateParams fork = p;
  fork.prompt[40] = 0;
  const uint64_t third = SubmitOk(*t, fork);
  ASSERT_TRUE(t->events.WaitFinished(third));
  EXPECT_EQ(t->events.Finish(third).usage.cached_tokens, 32);
  EXPECT_EQ(t->events.Tokens(third), RunAlone(fork));
  const EngineStats s = t->engine->Stats();
  EXPECT_EQ(s.prefix_cache_queried_tokens, 210);
  EXPECT_EQ(s.prefix_cache_hit_tokens, 96);
  EXPECT_NEAR(s.prefix_cache_hit_rate, 96.0 / 210, 1e-9);
}

TEST(Engine, CancelEndsTheRequestAndFreesItsBlocksAtOnce) {
  const FakeModelOptions model = SlowModel(2ms);
  auto t = StartEngine(Options(), model);
  GenerateParams p = LongRun(100, 1, 1000);
  const uint64_t id = SubmitOk(*t, p);
  ASSERT_TRUE(t->events.WaitTokens(id, 3));
  EXPECT_GT(t->engine->Stats().kv_usage, 0.0);
  const auto cancel_time = std::chrono::steady_clock::now();
  ASSERT_TRUE(t->engine->Cancel(id).ok());
  ASSERT_TRUE(t->events.WaitFinished(id, 1s));
  const double latency_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - cancel_time).count();
  EXPECT_LT(latency_s, 0.5);  // within a step (2 ms) in practice
  EXPECT_EQ(t->events.Finish(id).reason, FinishReason::kAbort);
  EXPECT_TRUE(t->events.Finish(id).status.ok());
  const EngineStats s = IdleStats(*t);
  EXPECT_EQ(s.kv_usage, 0.0);
  EXPECT_EQ(s.running + s.waiting, 0);
  EXPECT_EQ(t->engine->Cancel(id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t->engine->Cancel(12345).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t->events.events_after_finish(), 0);
}

TEST(Engine, CancelOfAWaitingRequest) {
  const FakeModelOptions model = SlowModel(1ms);
  EngineOptions o = Options();
  o.scheduler.max_num_seqs = 1;
  auto t = StartEngine(o, model);
  GenerateParams p = LongRun(10, 1, 200);
  const uint64_t running = SubmitOk(*t, p);
  const uint64_t waiting = SubmitOk(*t, p);
  ASSERT_TRUE(t->events.WaitTokens(running, 1));
  ASSERT_TRUE(t->engine->Cancel(waiting).ok());
  ASSERT_TRUE(t->events.WaitFinished(waiting, 1s));
  EXPECT_EQ(t->events.Finish(waiting).reason, FinishReason::kAbort);
  EXPECT_FALSE(t->events.Finish(waiting).timings.queue_s.has_value());
  EXPECT_TRUE(t->events.Tokens(waiting).empty());
  ASSERT_TRUE(t->events.WaitFinished(running));
  EXPECT_EQ(t->events.Finish(running).reason, FinishReason::kLength);
}

TEST(Engine, DeadlineExpiry) {
  const FakeModelOptions model = SlowModel(1ms);
  auto t = StartEngine(Options(), model);
  GenerateParams slow = LongRun(10, 1, 2000);
  slow.deadline = std::chrono::steady_clock::now() + 30ms;
  GenerateParams past = Params(10, 2, 10, false);
  past.deadline = std::chrono::steady_clock::now() - 1ms;
  GenerateParams fine = LongRun(10, 3, 20);
  const uint64_t a = SubmitOk(*t, slow), b = SubmitOk(*t, past), c = SubmitOk(*t, fine);
  ASSERT_TRUE(t->events.WaitFinished(a));
  ASSERT_TRUE(t->events.WaitFinished(b));
  ASSERT_TRUE(t->events.WaitFinished(c));
  for (uint64_t id : {a, b}) {
    EXPECT_EQ(t->events.Finish(id).reason, FinishReason::kError);
    EXPECT_EQ(t->events.Finish(id).status.code(), absl::StatusCode::kDeadlineExceeded);
  }
  EXPECT_GT(t->events.Tokens(a).size(), 0u);
  EXPECT_LT(t->events.Tokens(a).size(), 2000u);
  EXPECT_TRUE(t->events.Tokens(b).empty());
  EXPECT_EQ(t->events.Finish(c).reason, FinishReason::kLength);
  EXPECT_EQ(IdleStats(*t).kv_usage, 0.0);
}

TEST(Engine, BadRequestsFailAlone) {
  FakeModelOptions model;
  model.vocab_size = 64;
  model.max_context = 300;
  auto t = StartEngine(Options(/*num_blocks=*/10, /*block_size=*/16), model);  // 160 tokens
  auto code = [&](GenerateParams p) {
    return t->engine->Submit(std::move(p), t->events.Callback()).status().code();
  };
  const GenerateParams good = Params(10, 1, 5, false);
  using C = absl::StatusCode;
  GenerateParams p = good;
  p.prompt.clear();
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.prompt[3] = 64;
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.prompt[3] = -1;
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.prompt = Prompt(301, 0);
  EXPECT_EQ(code(p), C::kInvalidArgument);  // longer than max_context
  p = good; p.prompt = Prompt(161, 0);
  EXPECT_EQ(code(p), C::kInvalidArgument);  // longer than the whole KV cache
  p = good; p.max_tokens = 0;
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.max_tokens = -3;
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.max_tokens = 291;
  EXPECT_EQ(code(p), C::kInvalidArgument);  // 10 + 291 > 300
  // Issue 28: what can never fit the KV cache is refused up front (it was accepted and failed
  // RESOURCE_EXHAUSTED after 151 tokens), and the context reported is the cache's 160 tokens.
  EXPECT_EQ(t->engine->model_info().max_context, 160);
  EXPECT_EQ(t->engine->model_max_context(), 300);
  p = good; p.max_tokens = 151; p.ignore_eos = true;
  EXPECT_EQ(code(p), C::kInvalidArgument);  // 10 + 151 > 160
  EXPECT_NE(t->engine->Submit(p, t->events.Callback()).status().message().find("KV cache"),
            std::string::npos);
  p = good; p.min_tokens = 6;
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.sampling.temperature = -0.1f;
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.sampling.temperature = std::nanf("");
  EXPECT_EQ(code(p), C::kInvalidArgument);
  // Issue 28: +inf was accepted for these two while other non-finite values were refused.
  p = good; p.sampling.temperature = std::numeric_limits<float>::infinity();
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.sampling.repetition_penalty = std::numeric_limits<float>::infinity();
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.sampling.repetition_penalty = std::nanf("");
  EXPECT_EQ(code(p), C::kInvalidArgument);
  for (float top_p : {0.0f, -0.5f, 1.01f}) {
    p = good; p.sampling.top_p = top_p;
    EXPECT_EQ(code(p), C::kInvalidArgument) << top_p;
  }
  p = good; p.sampling.top_k = -1;
  EXPECT_EQ(code(p), C::kInvalidArgument);
  for (float min_p : {-0.01f, 1.5f}) {
    p = good; p.sampling.min_p = min_p;
    EXPECT_EQ(code(p), C::kInvalidArgument) << min_p;
  }
  p = good; p.sampling.repetition_penalty = 0;
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.sampling.logprobs = -1;
  EXPECT_EQ(code(p), C::kInvalidArgument);
  p = good; p.stop_token_ids = {64};
  EXPECT_EQ(code(p), C::kInvalidArgument);
  EXPECT_EQ(t->engine->Submit(good, nullptr).status().code(), C::kInvalidArgument);
  // Limits that are still fine: the whole cache for one request.
  p = good; p.max_tokens = 150; p.ignore_eos = true;
  const uint64_t fills = SubmitOk(*t, p);
  p = good; p.prompt = Prompt(159, 0); p.max_tokens = 1;  // 160 tokens in all
  const uint64_t whole_cache = SubmitOk(*t, p);
  // The engine goes on serving.
  const uint64_t id = SubmitOk(*t, good);
  ASSERT_TRUE(t->events.WaitFinished(id));
  EXPECT_TRUE(t->events.Finish(id).status.ok());
  ASSERT_TRUE(t->events.WaitFinished(whole_cache));
  EXPECT_EQ(t->events.Finish(whole_cache).reason, FinishReason::kLength);
  ASSERT_TRUE(t->events.WaitFinished(fills));
  EXPECT_EQ(t->events.Finish(fills).reason, FinishReason::kLength);
  EXPECT_EQ(t->events.Tokens(fills).size(), 150u);
}

TEST(Engine, NotStartedAndBadOptions) {
  Engine idle(Options(), std::make_unique<FakeModelRunner>(FakeModelOptions{}));
  EXPECT_EQ(idle.Submit(Params(4, 1, 2, false), [](const GenerateEvent&) {}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EngineOptions zero = Options();
  zero.kv_capacity = {KvCacheCapacity::Unit::kTokens, 15};  // less than a block of 16
  Engine no_cache(zero, std::make_unique<FakeModelRunner>(FakeModelOptions{}));
  EXPECT_EQ(no_cache.Start().code(), absl::StatusCode::kInvalidArgument);
  // Bytes: 256 bytes a token (the fake's), 16-token blocks: 1 MiB is 256 blocks.
  EngineOptions bytes = Options();
  bytes.kv_capacity = {KvCacheCapacity::Unit::kBytes, 1 << 20};
  Engine by_bytes(bytes, std::make_unique<FakeModelRunner>(FakeModelOptions{}));
  ASSERT_TRUE(by_bytes.Start().ok());
  EXPECT_EQ(by_bytes.kv_cache_shape().num_blocks, 256);
  EXPECT_EQ(by_bytes.Start().code(), absl::StatusCode::kFailedPrecondition);
  Engine no_runner(Options(), nullptr);
  EXPECT_EQ(no_runner.Start().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Engine, TooManyPendingRequestsIsResourceExhausted) {
  const FakeModelOptions model = SlowModel(1ms);
  EngineOptions o = Options();
  o.max_pending_requests = 2;
  auto t = StartEngine(o, model);
  GenerateParams p = LongRun(10, 1, 30);
  const uint64_t a = SubmitOk(*t, p), b = SubmitOk(*t, p);
  EXPECT_EQ(t->engine->Submit(p, t->events.Callback()).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(t->events.WaitFinished(a));
  ASSERT_TRUE(t->events.WaitFinished(b));
  SubmitOk(*t, p);  // room again
}

TEST(Engine, RunnerErrorFailsOnlyThatStepsSequences) {
  EngineOptions o = Options();
  o.scheduler.max_num_seqs = 1;  // the second request waits outside the failing step
  auto t = StartEngine(o);
  std::atomic<bool> failed_once{false};
  t->fake->SetFault([&](int call, const StepBatch&) {
    if (call == 3 && !failed_once.exchange(true)) return absl::InternalError("device lost");
    return absl::OkStatus();
  });
  GenerateParams a = Params(10, 1, 20, false), b = Params(12, 2, 20, true);
  a.ignore_eos = b.ignore_eos = true;
  const uint64_t ia = SubmitOk(*t, a), ib = SubmitOk(*t, b);
  ASSERT_TRUE(t->events.WaitFinished(ia));
  ASSERT_TRUE(t->events.WaitFinished(ib));
  EXPECT_EQ(t->events.Finish(ia).reason, FinishReason::kError);
  EXPECT_EQ(t->events.Finish(ia).status, absl::InternalError("device lost"));
  EXPECT_EQ(t->events.Tokens(ia).size(), 3u);  // calls 0, 1, 2 gave a token each
  EXPECT_EQ(t->events.Finish(ib).reason, FinishReason::kLength);
  EXPECT_EQ(t->events.Tokens(ib), RunAlone(b));
  const EngineStats s = IdleStats(*t);
  EXPECT_EQ(s.failed_steps, 1);
  EXPECT_EQ(s.kv_usage, 0.0);
}

// The runner fails every step holding sequence a's chunks (as a MoE call fails for tokens routed
// to experts no worker serves); b shares the first failing step and goes on. Also with a runner
// that samples: the chunks run again alone through ForwardSampled.
void ExpectAFailedStepFailsOnlyTheSequenceThatFailsAlone(FakeModelOptions model) {
  auto t = StartEngine(Options(), model);
  std::atomic<int64_t> poisoned{-1};
  // No step runs before a's id is known (on a loaded machine a could otherwise decode past
  // position 14 first and never meet the fault).
  std::atomic<bool> armed{false};
  t->fake->SetFault([&](int, const StepBatch& batch) {
    while (!armed.load()) std::this_thread::yield();
    for (const SequenceChunk& c : batch.chunks)
      if (c.sequence_id == poisoned.load() && c.start_position >= 14)
        return absl::UnavailableError("no serving worker holds layer 1 experts 0-3");
    return absl::OkStatus();
  });
  GenerateParams a = Params(10, 1, 20, false), b = Params(12, 2, 20, true);
  a.ignore_eos = b.ignore_eos = true;
  const uint64_t ia = SubmitOk(*t, a);
  poisoned = static_cast<int64_t>(ia);
  armed = true;
  const uint64_t ib = SubmitOk(*t, b);
  ASSERT_TRUE(t->events.WaitFinished(ia));
  ASSERT_TRUE(t->events.WaitFinished(ib));
  EXPECT_EQ(t->events.Finish(ia).reason, FinishReason::kError);
  EXPECT_EQ(t->events.Finish(ia).status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(t->events.Finish(ib).reason, FinishReason::kLength);
  EXPECT_EQ(t->events.Tokens(ib), RunAlone(b));
  EXPECT_EQ(IdleStats(*t).kv_usage, 0.0);
  EXPECT_EQ(t->fake->num_check_failures(), 0);
  if (model.samples_rows_up_to_logprobs.has_value()) {
    EXPECT_GT(t->fake->num_sampled_rows(), 0);
  }
}

TEST(Engine, AFailedStepOfSeveralSequencesFailsOnlyTheSequenceThatFailsAlone) {
  ExpectAFailedStepFailsOnlyTheSequenceThatFailsAlone({});
  FakeModelOptions sampling;
  sampling.samples_rows_up_to_logprobs = 0;
  ExpectAFailedStepFailsOnlyTheSequenceThatFailsAlone(sampling);
}

// A runner that verifies drafts but has no MTP head (ModelRunner's default CheckMtpDrafting, as
// the GPU engine): speculative method mtp is refused at start, ngram is not.
TEST(Engine, MtpRefusedByARunnerWithoutAnMtpHead) {
  for (SpeculativeMethod method : {SpeculativeMethod::kMtp, SpeculativeMethod::kNgram}) {
    EngineOptions eo;
    eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 16};
    eo.scheduler.speculative.method = method;
    eo.scheduler.speculative.num_speculative_tokens = 2;
    Engine engine(eo, std::make_unique<FakeModelRunner>(FakeModelOptions{}));
    const absl::Status st = engine.Start();
    if (method == SpeculativeMethod::kNgram) {
      EXPECT_TRUE(st.ok()) << st;
      engine.Stop();
      continue;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("speculative method mtp refused"), std::string_view::npos) << st;
    EXPECT_NE(st.message().find("does not draft with an MTP head"), std::string_view::npos) << st;
  }
}

TEST(Engine, DrainFinishesWhatRunsAndRefusesNewWork) {
  auto t = StartEngine();
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    GenerateParams p = Params(20 + i, i, 30, i % 2 == 0);
    p.ignore_eos = true;
    ids.push_back(SubmitOk(*t, p));
  }
  t->engine->Drain();
  for (uint64_t id : ids) {
    ASSERT_TRUE(t->events.WaitFinished(id, 0ms));  // already finished when Drain returned
    EXPECT_EQ(t->events.Finish(id).reason, FinishReason::kLength);
    EXPECT_EQ(t->events.Tokens(id).size(), 30u);
  }
  EXPECT_EQ(t->engine->Submit(Params(4, 1, 2, false), t->events.Callback()).status().code(),
            absl::StatusCode::kUnavailable);
  t->engine->Stop();
  t->engine->Stop();
}

TEST(Engine, StopAbortsWhatIsLeft) {
  const FakeModelOptions model = SlowModel(1ms);
  auto t = StartEngine(Options(), model);
  GenerateParams p = LongRun(10, 1, 3000);
  const uint64_t a = SubmitOk(*t, p), b = SubmitOk(*t, p);
  ASSERT_TRUE(t->events.WaitTokens(a, 2));
  // Issue 28: they end UNAVAILABLE "server draining" (they were ended kAbort, which reads as
  // the client's cancel), and Stop says how many it ended.
  EXPECT_EQ(t->engine->Stop(), 2);
  EXPECT_EQ(t->engine->Stop(), 0);
  ASSERT_TRUE(t->events.WaitFinished(a, 0ms));
  ASSERT_TRUE(t->events.WaitFinished(b, 0ms));
  for (uint64_t id : {a, b}) {
    EXPECT_EQ(t->events.Finish(id).reason, FinishReason::kError);
    EXPECT_EQ(t->events.Finish(id).status.code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(t->events.Finish(id).status.message().find("draining"), std::string::npos);
  }
  EXPECT_EQ(t->engine->Submit(p, t->events.Callback()).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(Engine, EventsCarryLogprobsUsageTimingsAndTag) {
  auto t = StartEngine();
  GenerateParams p = Params(30, 4, 12, true);
  p.ignore_eos = true;
  p.sampling.logprobs = 3;
  p.tag = "req-7";
  const uint64_t id = SubmitOk(*t, p);
  ASSERT_TRUE(t->events.WaitFinished(id));
  const std::vector<int32_t> tokens = t->events.Tokens(id);
  const std::vector<float> logprobs = t->events.Logprobs(id);
  ASSERT_EQ(tokens.size(), 12u);
  ASSERT_EQ(logprobs.size(), 12u);
  // The first token's logprob is the raw log_softmax of the prompt's logits.
  std::vector<float> row(64);
  FakeModelRunner::HistoryLogits(p.prompt, row.data(), 64);
  double m = -INFINITY, z = 0;
  for (float l : row) m = std::max<double>(m, l);
  for (float l : row) z += std::exp(l - m);
  EXPECT_NEAR(logprobs[0], row[tokens[0]] - m - std::log(z), 1e-5);
  const FinishInfo f = t->events.Finish(id);
  EXPECT_EQ(t->events.Tag(id), "req-7");
  EXPECT_EQ(f.usage.prompt_tokens, 30);
  EXPECT_EQ(f.usage.completion_tokens, 12);
  ASSERT_TRUE(f.timings.queue_s.has_value());
  ASSERT_TRUE(f.timings.prefill_s.has_value());
  ASSERT_TRUE(f.timings.time_to_first_token_s.has_value());
  ASSERT_TRUE(f.timings.mean_inter_token_s.has_value());
  EXPECT_GE(*f.timings.max_inter_token_s, *f.timings.mean_inter_token_s);
  EXPECT_GE(f.timings.total_s, *f.timings.time_to_first_token_s);
}

TEST(Engine, AfterEventsComesOncePerPassAfterItsEvents) {
  // Each event records how many after_events calls preceded it; every event must be followed by
  // a call (the consumer's wake-up), and one call serves all the events of a step.
  std::atomic<int> calls{0};
  EngineOptions o = Options();
  o.after_events = [&] { calls.fetch_add(1); };
  std::mutex mu;
  std::vector<int> calls_at_event;
  int finished = 0;
  auto t = StartEngine(o, SlowModel(200us));
  // The first step waits until every request is in, so that the four decode together.
  std::promise<void> all_submitted = HoldFirstStep(*t->fake);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    auto id = t->engine->Submit(LongRun(8, i, 20), [&](const GenerateEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      calls_at_event.push_back(calls.load());
      if (e.finish.has_value()) ++finished;
    });
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  all_submitted.set_value();
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < until) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (finished == 4 && calls.load() > calls_at_event.back()) break;
    }
    std::this_thread::sleep_for(200us);
  }
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(finished, 4);
  EXPECT_EQ(calls_at_event.size(), 80u);  // 4 x 20 tokens, one event each
  EXPECT_GT(calls.load(), calls_at_event.back()) << "no after_events after the last event";
  // Batched: about one call per step of four tokens, never one per event.
  EXPECT_LE(calls.load(), 30);
  EXPECT_GE(calls.load(), 20);
  // A cancel delivers its abort outside a step: a call follows it too.
  const uint64_t late = SubmitOk(*t, LongRun(8, 9, 2000));
  ASSERT_TRUE(t->events.WaitTokens(late, 1));
  const int before = calls.load();
  ASSERT_TRUE(t->engine->Cancel(late).ok());
  ASSERT_TRUE(t->events.WaitFinished(late));
  for (int i = 0; i < 1000 && calls.load() == before; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_GT(calls.load(), before);
}

TEST(Engine, MinTokensSuppressesEos) {
  // A greedy prompt that reaches EOS (token 1) early.
  for (int salt = 0; salt < 200; ++salt) {
    GenerateParams p = Params(6, salt, 40, false);
    const std::vector<int32_t> free_run = RunAlone(p);
    if (free_run.size() >= 10 || free_run.back() != 1) continue;
    p.min_tokens = 20;
    const std::vector<int32_t> held = RunAlone(p);
    ASSERT_GE(held.size(), 20u);
    for (size_t i = 0; i < 20; ++i) EXPECT_NE(held[i], 1);
    return;
  }
  FAIL() << "no prompt reached EOS early";
}

class CountingObserver : public EngineObserver {
 public:
  void OnStep(const StepMetrics& m) override {
    ++steps;
    tokens += m.num_tokens;
    schedule_s += m.schedule_s;
    sample_s += m.sample_s;
    bookkeeping_s += m.bookkeeping_s;
    forward_s += m.forward_s;
  }
  void OnRequestFinished(std::string_view, const FinishInfo& finish) override {
    ++finished;
    completion_tokens += finish.usage.completion_tokens;
    if (finish.reason == FinishReason::kLength) ++length;
  }
  std::atomic<int> steps{0}, tokens{0}, finished{0}, completion_tokens{0}, length{0};
  // Loop thread only until the engine stops.
  double schedule_s = 0, sample_s = 0, bookkeeping_s = 0, forward_s = 0;
};

void RunObservedLoad(int sampling_threads) {
  CountingObserver observer;
  EngineOptions o = Options(/*num_blocks=*/8192);
  o.observer = &observer;
  o.sampling_threads = sampling_threads;
  FakeModelOptions model;
  model.vocab_size = 32000;
  auto t = StartEngine(o, model);
  constexpr int kRequests = 64, kTokens = 64;
  std::vector<uint64_t> ids;
  for (int i = 0; i < kRequests; ++i) {
    GenerateParams p = Params(100 + i, i, kTokens, i % 2 == 0);
    p.prompt[0] = i % 60;  // distinct prompts (no prefix sharing)
    p.ignore_eos = true;
    p.sampling.logprobs = i % 4 == 0 ? std::optional<int>(5) : std::nullopt;
    ids.push_back(SubmitOk(*t, p));
  }
  for (uint64_t id : ids) ASSERT_TRUE(t->events.WaitFinished(id, 60s));
  t->engine->Stop();
  EXPECT_EQ(observer.finished.load(), kRequests);
  EXPECT_EQ(observer.length.load(), kRequests);
  EXPECT_EQ(observer.completion_tokens.load(), kRequests * kTokens);
  EXPECT_EQ(observer.steps.load(), t->engine->Stats().steps);
  const double steps = observer.steps.load();
  std::printf("[engine overhead] %d steps, %d tokens, 64 sequences, vocab 32000, %d sampling "
              "thread(s), us/step: scheduling %.0f, sampling %.0f, bookkeeping %.0f (the fake "
              "Forward %.0f)\n",
              observer.steps.load(), observer.tokens.load(), sampling_threads,
              1e6 * observer.schedule_s / steps, 1e6 * observer.sample_s / steps,
              1e6 * observer.bookkeeping_s / steps, 1e6 * observer.forward_s / steps);
}

TEST(Engine, ObserverHooksAndEngineOverhead) {
  RunObservedLoad(/*sampling_threads=*/1);
  RunObservedLoad(/*sampling_threads=*/2);
}

}  // namespace
}  // namespace exl3::engine
