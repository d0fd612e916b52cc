// The engine's MoE blocks on expert workers: each call is one request through the router core in
// this process (services/router/in_process_router.h: gate, dispatch to the workers that own the
// chosen experts, failover, combine, shared expert), with the step's hidden states in fp32 (no
// serialisation in process) and the answer awaited within `timeout`.
#pragma once

#include <chrono>
#include <memory>

#include "engine/core/moe_executor.h"
#include "services/router/in_process_router.h"

namespace exl3::router {

class RouterMoeExecutor final : public engine::MoeExecutor {
 public:
  // `service` must outlive this executor.
  RouterMoeExecutor(MoeRouterService& service, int inline_max_tokens, int hidden_size,
                    std::chrono::milliseconds timeout);
  ~RouterMoeExecutor() override;
  bool remote() const override { return true; }
  absl::Status Forward(int layer, const float* x, int num_tokens, const int32_t* token_ids,
                       float* y) override;
  // Returns once the request is sent: the answer comes on the router's threads.
  std::unique_ptr<engine::MoeCall> Start(int layer, const float* x, int num_tokens,
                                         const int32_t* token_ids, float* y) override;
  // The request carries the caller's top-k (proto TopK): the router core dispatches it as given.
  std::unique_ptr<engine::MoeCall> StartRouted(int layer, const float* x, int num_tokens,
                                               const engine::MoeRouting& routing, float* y) override;

 private:
  // client::MakeLayerRequest's fp32 request, its hidden states written into one of the router's
  // kept buffers (MoeRouterService::spare_buffers; the call gives it back when done).
  pb::MoeLayerRequest Request(int layer, const float* x, int num_tokens) const;
  std::unique_ptr<engine::MoeCall> Send(pb::MoeLayerRequest req, int num_tokens, float* y);

  std::unique_ptr<InProcessStream> stream_;
  std::shared_ptr<svc::SpareBuffers> spare_;
  int hidden_;
  std::chrono::milliseconds timeout_;
};

}  // namespace exl3::router
