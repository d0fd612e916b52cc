// A MoeExecutor whose calls complete later, on a thread of their own, as a worker's answer does:
// another executor's arithmetic (LocalMoe standing in for the workers), answered after `delay`.
// It counts how many calls were in flight at once, so a test can see two micro-batches' exchanges
// overlap. The inner executor runs one call at a time (LocalMoe's CpuCompute is not shared
// between threads); the delays overlap.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/core/moe_executor.h"

namespace exl3::engine::testing {

class DelayedMoe final : public MoeExecutor {
 public:
  DelayedMoe(std::unique_ptr<MoeExecutor> inner, std::chrono::microseconds delay)
      : inner_(std::move(inner)), delay_(delay) {}

  absl::Status Forward(int layer, const float* x, int num_tokens, const int32_t* token_ids, float* y) override {
    return Start(layer, x, num_tokens, token_ids, y)->Wait();
  }

  std::unique_ptr<MoeCall> Start(int layer, const float* x, int num_tokens, const int32_t* token_ids,
                                 float* y) override {
    const int now = ++in_flight_;
    int seen = max_in_flight_.load();
    while (now > seen && !max_in_flight_.compare_exchange_weak(seen, now)) {
    }
    ++calls_;
    auto call = std::make_unique<Call>();
    // The token ids are read at Start (as the router's executor copies them into its request).
    std::vector<int32_t> ids;
    if (token_ids != nullptr) ids.assign(token_ids, token_ids + num_tokens);
    call->thread = std::thread([this, c = call.get(), layer, x, num_tokens, ids = std::move(ids), y] {
      std::this_thread::sleep_for(delay_);
      {
        std::lock_guard<std::mutex> lock(inner_mu_);
        c->status = inner_->Forward(layer, x, num_tokens, ids.empty() ? nullptr : ids.data(), y);
      }
      --in_flight_;
    });
    return call;
  }

  int max_in_flight() const { return max_in_flight_.load(); }
  int calls() const { return calls_.load(); }

 private:
  struct Call final : MoeCall {
    std::thread thread;
    absl::Status status;
    ~Call() override { (void)Wait(); }
    absl::Status Wait() override {
      if (thread.joinable()) thread.join();
      return status;
    }
  };

  std::unique_ptr<MoeExecutor> inner_;
  std::chrono::microseconds delay_;
  std::mutex inner_mu_;
  std::atomic<int> in_flight_{0}, max_in_flight_{0}, calls_{0};
};

}  // namespace exl3::engine::testing
