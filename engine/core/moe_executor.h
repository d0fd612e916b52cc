// Where a model's MoE blocks run: in this process (engine/cpu/local_moe.h, the embedded default), or on
// expert workers through the router core (services/router/router_moe_executor.h). The engine's
// layer loop calls it once per MoE layer per step with all of the step's tokens.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"

namespace exl3::engine {

// One MoE call in flight (MoeExecutor::Start). Wait returns its status once y holds the answer;
// the caller waits before reading y or reusing x. Destroying a call waits for it too.
class MoeCall {
 public:
  virtual ~MoeCall() = default;
  virtual absl::Status Wait() = 0;
};

// The experts a call's tokens use, chosen by the caller's own gate (the GPU engine gates on the
// device): ids and weights [num_tokens, k], row-major, as the model's routing function gave them.
struct MoeRouting {
  int k = 0;
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
};

// Where an executor's time went since its last TakeStageTimes: choosing the experts (the gate's
// logits and routing) and running them (routed and shared experts, their weighted sum).
struct MoeStageTimes {
  double gate_s = 0, experts_s = 0;
};

class MoeExecutor {
 public:
  virtual ~MoeExecutor() = default;
  // y [T, hidden] = layer `layer`'s MoE block on x [T, hidden] (fp32): the router's choice of
  // experts, their weighted sum and the shared expert. token_ids [T]: the step's tokens (for
  // hash-routed layers).
  virtual absl::Status Forward(int layer, const float* x, int num_tokens, const int32_t* token_ids,
                               float* y) = 0;
  // Starts the same call and returns before its answer where the work is elsewhere (workers),
  // so the engine can run another micro-batch's attention meanwhile (engine/cpu/cpu_model.h). The
  // default runs Forward at once.
  virtual std::unique_ptr<MoeCall> Start(int layer, const float* x, int num_tokens,
                                         const int32_t* token_ids, float* y);
  // Start with the experts already chosen (`routing`, which must stay valid until the call is
  // waited for), so the executor runs no gate of its own. The default gates as Start does: the
  // executors in this process compute the same routing function on the same hidden states.
  virtual std::unique_ptr<MoeCall> StartRouted(int layer, const float* x, int num_tokens,
                                               const MoeRouting& routing, float* y);
  // A call already answered (the executors that run it on the caller's thread).
  static std::unique_ptr<MoeCall> Finished(absl::Status status);
  // The stage times since the last call, and zeros them. Executors whose stages run elsewhere
  // report none (the router core has its own per-stage metrics: docs/metrics.md, "Router").
  virtual MoeStageTimes TakeStageTimes() { return {}; }
  // Whether the calls run elsewhere (workers), so that waiting for them is the engine's to measure
  // (StepPhaseTimes::remote_moe_*).
  virtual bool remote() const { return false; }
};

}  // namespace exl3::engine
