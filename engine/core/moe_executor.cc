#include "engine/core/moe_executor.h"

namespace exl3::engine {
namespace {

class FinishedCall final : public MoeCall {
 public:
  explicit FinishedCall(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }

 private:
  absl::Status status_;
};

}  // namespace

std::unique_ptr<MoeCall> MoeExecutor::Start(int layer, const float* x, int num_tokens,
                                            const int32_t* token_ids, float* y) {
  return Finished(Forward(layer, x, num_tokens, token_ids, y));
}

std::unique_ptr<MoeCall> MoeExecutor::Finished(absl::Status status) {
  return std::make_unique<FinishedCall>(std::move(status));
}

std::unique_ptr<MoeCall> MoeExecutor::StartRouted(int layer, const float* x, int num_tokens,
                                                  const MoeRouting& /*routing*/, float* y) {
  return Start(layer, x, num_tokens, /*token_ids=*/nullptr, y);
}

}  // namespace exl3::engine
