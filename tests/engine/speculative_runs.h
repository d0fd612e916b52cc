// What the speculative-decoding tests share (tests/engine/speculative/speculative_decoding_test.cc,
// mtp_speculative_decoding_test.cc and tests/engine/cuda/speculative_decoding_test.cc): the
// engine they run, prompts built to repeat, and a run of every request at once.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/engine_requests.h"

namespace exl3::engine::testing {

inline std::unique_ptr<CpuModel> OpenCpuFixtureModel(const std::string& dir, int micro_batches = 1) {
  CpuModelOptions mo;
  mo.num_threads = 2;
  mo.micro_batches = micro_batches;
  auto model = CpuModel::Open(dir, mo);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

// Blocks of `block_size`, a 24-token step budget: chunked prefill beside decode and verify chunks.
inline EngineOptions SpeculativeEngineOptions(const SpeculativeOptions& speculative, int kv_blocks = 256,
                                              int block_size = 4) {
  EngineOptions eo;
  eo.block_size = block_size;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, kv_blocks};
  eo.scheduler.max_num_batched_tokens = 24;
  eo.scheduler.speculative = speculative;
  return eo;
}

// A prompt built to repeat: a fixture prompt, the model's greedy continuation of it, then that
// continuation's first 4 tokens again. The tiny random models pick the next token mostly by the
// current one, so they go on repeating their continuation, which a drafter finds earlier in the
// prompt.
inline std::vector<int32_t> Repeating(const std::vector<int32_t>& prompt, const std::vector<int32_t>& greedy) {
  std::vector<int32_t> p = prompt;
  p.insert(p.end(), greedy.begin(), greedy.end());
  p.insert(p.end(), greedy.begin(), greedy.begin() + 4);
  return p;
}

inline std::vector<int32_t> Ids(const std::vector<SampledToken>& tokens) {
  std::vector<int32_t> ids;
  for (const SampledToken& t : tokens) ids.push_back(t.token);
  return ids;
}

inline int64_t Sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

// For each prompt and seed, a request sampled at temperature 0.3 (seeds 1, 2: low enough that the
// model repeats itself and drafts land) or 1 (the others), top-p 0.95 and repetition penalty 1.05
// (the history with drafts matters to each row).
inline std::vector<GenerateParams> SeededSamplingRequests(const std::vector<std::vector<int32_t>>& prompts,
                                                          std::initializer_list<uint64_t> seeds) {
  std::vector<GenerateParams> params;
  for (const std::vector<int32_t>& prompt : prompts) {
    for (uint64_t seed : seeds) {
      GenerateParams g = Greedy32(prompt);
      g.sampling.temperature = seed <= 2 ? 0.3f : 1.0f;
      g.sampling.top_p = 0.95f;
      g.sampling.repetition_penalty = 1.05f;
      g.sampling.seed = seed;
      params.push_back(g);
    }
  }
  return params;
}

struct SpeculativeRun {
  std::vector<std::vector<SampledToken>> tokens;  // per request, in submission order
  std::vector<FinishInfo> finish;
  EngineStats stats;  // after Stop
  double seconds = 0;  // from the first submission to the last request's end
};

// An MTP run at draft cap k against plain decoding's: prints "`what` K=k: ..." (verify chunks,
// drafts, accepted in all and per position, steps against plain's) and expects drafts, accepted
// ones, at most k a verify chunk, per-position counts that add up, and the cache back to idle.
inline void ExpectMtpRunCounts(const SpeculativeRun& spec, const SpeculativeRun& plain, int k, const std::string& what) {
  const SpeculativeCounters& c = spec.stats.speculative;
  std::printf("%s K=%d: %lld verify chunks, %lld draft tokens, %lld accepted (per position:", what.c_str(), k,
              static_cast<long long>(c.num_drafts), static_cast<long long>(c.num_draft_tokens),
              static_cast<long long>(c.num_accepted_tokens));
  for (int64_t a : c.num_accepted_tokens_per_pos) std::printf(" %lld", static_cast<long long>(a));
  std::printf("); %lld steps vs %lld plain\n", static_cast<long long>(spec.stats.steps),
              static_cast<long long>(plain.stats.steps));
  EXPECT_GT(c.num_drafts, 0) << what << " K " << k;
  EXPECT_GT(c.num_accepted_tokens, 0) << what << " K " << k;
  EXPECT_LE(c.num_draft_tokens, c.num_drafts * k) << what;
  ASSERT_EQ(c.num_accepted_tokens_per_pos.size(), static_cast<size_t>(k)) << what;
  EXPECT_EQ(Sum(c.num_accepted_tokens_per_pos), c.num_accepted_tokens) << what;
  EXPECT_DOUBLE_EQ(spec.stats.kv_usage, 0.0) << what;
}

// Every request at once through a fresh engine over `runner`.
inline SpeculativeRun RunOnce(const EngineOptions& eo, std::unique_ptr<ModelRunner> runner,
                              const std::vector<GenerateParams>& params) {
  Engine engine(eo, std::move(runner));
  const absl::Status started = engine.Start();
  EXPECT_TRUE(started.ok()) << started;
  SpeculativeRun out;
  const auto t0 = std::chrono::steady_clock::now();
  out.tokens = RunAllAtOnce(engine, params, &out.finish);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  engine.Stop();
  out.stats = engine.Stats();
  return out;
}

// A GPU verify row runs other kernels than a decode row (or sums in another order), so where
// plain decoding's top two logprobs are closer than this, either may come out.
inline constexpr float kVerifyNearTie = 1e-2f;

// A speculative run's tokens of one request against `want`: with `greedy` (a fixture prompt's
// reference tokens) those, else plain decoding's of the same request (asked for the top-2
// logprobs). Equal until a token where plain decoding gave `want`'s token at a top-2 gap within
// kVerifyNearTie and the speculative run took its runner-up, after which the histories differ
// (reported, not compared): glm5_next_release_mtp on an H100 (session 28), K = 1, prompt 0,
// token 19, gap 8.0e-3. `where` names the request in failures.
inline void ExpectTokensOfPlainDecoding(const std::vector<SampledToken>& spec, const std::vector<SampledToken>& plain,
                                        const std::vector<int32_t>* greedy, const std::string& where) {
  ASSERT_EQ(spec.size(), plain.size()) << where;
  for (size_t t = 0; t < spec.size(); ++t) {
    const int32_t want = greedy != nullptr ? (*greedy)[t] : plain[t].token;
    if (spec[t].token == want) continue;
    ASSERT_EQ(plain[t].token, want) << where << ", token " << t << ": the speculative run gave " << spec[t].token
                                    << ", plain decoding " << plain[t].token << ", the reference " << want;
    const std::vector<TokenLogprob>& top = plain[t].top_logprobs;
    ASSERT_EQ(top.size(), 2u);
    const float gap = top[0].logprob - top[1].logprob;
    std::printf("%s: token %zu differs from plain decoding's at a top-2 gap of %.2e\n", where.c_str(), t, gap);
    EXPECT_LT(gap, kVerifyNearTie) << where << ", token " << t;
    EXPECT_EQ(spec[t].token, top[1].token) << where << ", token " << t << ": not plain decoding's runner-up";
    break;  // later tokens continue from different histories
  }
}

// MTP drafting at K = 1 of each fixture prompt alone (32 greedy tokens), simulated from the
// fixture's reference (reference.safetensors: mtp_logits.i [positions, vocab 128], teacher-forced
// on prompt + greedy): every draft is the MTP head's argmax at the sequence's last kept position
// p, predicting position p + 2; a hit keeps two tokens, a miss one, until 32 are out (the first by
// the prefill). One MtpDraftCounts per prompt into *counts.
struct MtpDraftCounts {
  int64_t drafts = 0, accepted = 0;
};
inline void SimulateMtpDraftsAtK1(const std::string& fixture_dir, const std::vector<std::vector<int32_t>>& prompts,
                                  const std::vector<std::vector<int32_t>>& greedy,
                                  std::vector<MtpDraftCounts>* counts) {
  auto ref = TensorSource::Open(fixture_dir + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const int V = 128, max_tokens = 32;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<float> mtp = *ToFloat32(*(*ref)->Get("mtp_logits." + std::to_string(i)));
    ASSERT_EQ(mtp.size() % V, 0u);
    std::vector<int32_t> ids = prompts[i];
    ids.insert(ids.end(), greedy[i].begin(), greedy[i].end());
    const int P = static_cast<int>(prompts[i].size());
    MtpDraftCounts& n = counts->emplace_back();
    for (int p = P - 1, out = 1; max_tokens - out - 1 > 0;) {  // after the prefill: 1 token out
      const float* row = &mtp[static_cast<size_t>(p) * V];
      const int32_t draft = static_cast<int32_t>(std::max_element(row, row + V) - row);
      ++n.drafts;
      const bool hit = draft == ids[p + 2];
      n.accepted += hit;
      p += hit ? 2 : 1;
      out += hit ? 2 : 1;
    }
  }
}

// The CPU speculative tests' fixture (parameter: a fixture directory): its prompts, their greedy
// continuations, prompts built to repeat from the first `num_repeating`, and runs of every request
// at once through a fresh CPU engine.
class CpuSpeculativeFixtureTest : public ::testing::TestWithParam<const char*> {
 protected:
  void LoadFixture(size_t num_repeating) {
    auto ref = TensorSource::Open(std::string(GetParam()) + "/reference.safetensors");
    ASSERT_TRUE(ref.ok()) << ref.status();
    prompts_ = Int32Rows(**ref, "prompt.");
    greedy_ = Int32Rows(**ref, "greedy.");
    for (size_t i = 0; i < num_repeating && i < prompts_.size(); ++i)
      repeating_.push_back(Repeating(prompts_[i], greedy_[i]));
  }

  EngineOptions Options(const SpeculativeOptions& speculative, int kv_blocks = 256) const {
    return SpeculativeEngineOptions(speculative, kv_blocks);
  }

  SpeculativeRun Run(const EngineOptions& eo, const std::vector<GenerateParams>& params, int micro_batches = 1) {
    return RunOnce(eo, OpenCpuFixtureModel(GetParam(), micro_batches), params);
  }

  // Every fixture prompt and every repeating one: greedy, 32 tokens, top-2 logprobs.
  std::vector<GenerateParams> GreedyRequests() const {
    std::vector<GenerateParams> params;
    for (const auto& p : prompts_) params.push_back(Greedy32(p, /*logprobs=*/2));
    for (const auto& p : repeating_) params.push_back(Greedy32(p, /*logprobs=*/2));
    return params;
  }

  std::vector<std::vector<int32_t>> prompts_, greedy_, repeating_;
};

}  // namespace exl3::engine::testing
