// In-process experts (engine/cpu/local_moe.h) whose first call of `fail_tokens` tokens fails with
// UNAVAILABLE, as a lost expert worker would: for tests of a step that fails and runs again.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/local_moe.h"
#include "engine/core/moe_executor.h"
#include "gtest/gtest.h"

namespace exl3::engine::testing {

class FailingOnceMoe final : public MoeExecutor {
 public:
  FailingOnceMoe(const std::string& dir, int fail_tokens) : compute_(2), fail_tokens_(fail_tokens) {
    auto local = LocalMoe::Open(dir, compute_);
    EXPECT_TRUE(local.ok()) << local.status();
    local_ = std::move(*local);
  }
  absl::Status Forward(int layer, const float* x, int T, const int32_t* ids, float* y) override {
    if (T == fail_tokens_ && !failed_) {
      failed_ = true;
      return absl::UnavailableError("injected: the experts' worker is gone");
    }
    return local_->Forward(layer, x, T, ids, y);
  }
  bool failed() const { return failed_; }

 private:
  CpuCompute compute_;
  std::unique_ptr<LocalMoe> local_;
  int fail_tokens_;
  bool failed_ = false;
};

}  // namespace exl3::engine::testing
