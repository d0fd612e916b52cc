// Submitting requests to an Engine (engine/core/engine.h) and collecting their answers, for the tests
// that run the engine over a real model: fixture prompts read from a reference file, greedy
// requests, every event's tokens (with their logprobs) and finish per request id.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"

namespace exl3::engine::testing {

// Int32 tensors prefix0, prefix1, ... of a reference file (the fixtures' prompts and tokens).
inline std::vector<std::vector<int32_t>> Int32Rows(const TensorSource& src, const std::string& prefix) {
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; src.Has(prefix + std::to_string(i)); ++i) {
    TensorView t = *src.Get(prefix + std::to_string(i));
    out.emplace_back(t.as<int32_t>(), t.as<int32_t>() + t.info->num_elements());
  }
  return out;
}

// A logits row's log-probabilities, in double.
inline std::vector<double> LogSoftmax(const float* row, int vocab) {
  const float m = *std::max_element(row, row + vocab);
  double sum = 0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - m);
  std::vector<double> lp;
  for (int v = 0; v < vocab; ++v) lp.push_back(row[v] - m - std::log(sum));
  return lp;
}

// 32 greedy tokens (ignoring end of sequence) of `prompt`, with the top `logprobs` of each.
inline GenerateParams Greedy32(const std::vector<int32_t>& prompt, int logprobs = 0) {
  GenerateParams g;
  g.prompt = prompt;
  g.max_tokens = 32;
  g.ignore_eos = true;
  g.sampling.temperature = 0;
  g.sampling.logprobs = logprobs;
  return g;
}

// What the engine sent for each request, by request id.
struct RequestResults {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::vector<SampledToken>> sampled;
  std::map<uint64_t, FinishInfo> finish;
  std::map<uint64_t, std::vector<SampledToken>> prompt_logprobs;  // GenerateEvent::prompt_logprobs
  std::map<uint64_t, int> prompt_logprobs_events;                  // events that carried some

  EventCallback Callback() {
    return [this](const GenerateEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      for (const SampledToken& t : e.tokens) sampled[e.request_id].push_back(t);
      if (!e.prompt_logprobs.empty()) {
        prompt_logprobs[e.request_id] = e.prompt_logprobs;
        ++prompt_logprobs_events[e.request_id];
      }
      if (e.finish) {
        finish[e.request_id] = *e.finish;
        cv.notify_all();
      }
    };
  }
  // Until n requests have finished (a test failure after 120 s).
  void Wait(size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return finish.size() >= n; }));
  }
  // Until request `id` has at least n tokens, or about 4 s have passed (the caller checks what it needs).
  void WaitForTokens(uint64_t id, size_t n) {
    for (int i = 0; i < 2000; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (sampled[id].size() >= n) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  std::vector<int32_t> TokenIds(uint64_t id) {
    std::vector<int32_t> ids;
    for (const SampledToken& t : sampled[id]) ids.push_back(t.token);
    return ids;
  }
};

// Whether the engine's published stats show no running request and no KV block in use within about
// 1 s (they are published after the step that finished the last request).
inline bool WaitUntilIdle(Engine& engine) {
  for (int i = 0; i < 500; ++i) {
    if (engine.Stats().kv_usage == 0.0 && engine.Stats().running == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// Submits every params at once to a started engine, waits for all, expects each to finish OK;
// returns each request's sampled tokens in submission order (and, with `finish`, how each ended).
inline std::vector<std::vector<SampledToken>> RunAllAtOnce(Engine& engine, const std::vector<GenerateParams>& params,
                                                           std::vector<FinishInfo>* finish = nullptr) {
  RequestResults r;
  std::vector<uint64_t> ids;
  for (const GenerateParams& p : params) {
    auto id = engine.Submit(p, r.Callback());
    EXPECT_TRUE(id.ok()) << id.status();
    if (id.ok()) ids.push_back(*id);
  }
  r.Wait(ids.size());
  std::vector<std::vector<SampledToken>> out;
  for (uint64_t id : ids) {
    EXPECT_TRUE(r.finish[id].status.ok()) << r.finish[id].status;
    out.push_back(r.sampled[id]);
    if (finish != nullptr) finish->push_back(r.finish[id]);
  }
  return out;
}

// Submits `params` twice, the second once the first has ended (the second can find the first's
// blocks in the prefix cache); the two request ids.
inline std::pair<uint64_t, uint64_t> SubmitTwiceInTurn(Engine& engine, const GenerateParams& params,
                                                        RequestResults& r) {
  auto first = engine.Submit(params, r.Callback());
  EXPECT_TRUE(first.ok()) << first.status();
  r.Wait(1);
  auto second = engine.Submit(params, r.Callback());
  EXPECT_TRUE(second.ok()) << second.status();
  r.Wait(2);
  return {first.value_or(0), second.value_or(0)};
}

// Every prompt at once (Greedy32, with the top `logprobs`) through an engine over `model` with
// `kv_blocks` KV blocks of 4 tokens and chunked prefill (24 tokens a step: several steps, prefill
// chunks beside decode tokens); each request's tokens in prompt order, and the engine's stats at
// the end in `stats` where given.
inline std::vector<std::vector<SampledToken>> RunPromptsChunked(std::unique_ptr<ModelRunner> model, int kv_blocks,
                                                                const std::vector<std::vector<int32_t>>& prompts,
                                                                int logprobs, EngineStats* stats = nullptr) {
  EngineOptions eo;
  eo.block_size = 4;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, kv_blocks};
  eo.scheduler.max_num_batched_tokens = 24;
  Engine engine(eo, std::move(model));
  EXPECT_TRUE(engine.Start().ok());
  std::vector<GenerateParams> params;
  for (const std::vector<int32_t>& p : prompts) params.push_back(Greedy32(p, logprobs));
  std::vector<std::vector<SampledToken>> out = RunAllAtOnce(engine, params);
  if (stats != nullptr) *stats = engine.Stats();
  engine.Stop();
  return out;
}

}  // namespace exl3::engine::testing
