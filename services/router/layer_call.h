// One MoE layer request in flight in the router: what it asks (decoded, gated), where its answer
// goes, the work it has out at the workers and the fp32 sum of what came back. Created by the
// service (services/router/moe_router.h) once the request is admitted; driven by the dispatcher
// (services/router/dispatcher.h) until it ends; answered through the combine
// (services/router/combine.h).
//
// Life: running (the handler sends its parts and runs what it computes itself; workers answer
// parts, failed parts go to other workers) -> ended, exactly once, with OK when the handler is
// done and no part is out, or earlier with an error (deadline, cancel, a part that failed for
// good). An ended call sends nothing more, adds nothing to its sum, and withdraws what it still
// has out.
//
// Locks: `mu` is a leaf: nothing is called while it is held (no WorkerLink, AnswerSink, deadline
// timer, metrics or end callback). AnswerSink::mu (services/router/answer_sink.h) is taken with
// no LayerCall::mu held. Links call back with none of their own locks held, and so does the
// deadline timer; so the request path never holds two of these locks at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"
#include "services/common/deadline_timer.h"
#include "services/common/spare_buffers.h"
#include "services/router/answer_sink.h"
#include "services/router/gate.h"
#include "services/router/worker_link.h"
#include "services/router/worker_set.h"

namespace exl3::router {

namespace pb = ::exl3serve::v1;

using Clock = std::chrono::steady_clock;

// One routed expert of one token: the token's row in the request, the expert, its gate weight.
struct Assignment {
  int32_t row = 0;
  int32_t expert = 0;
  float weight = 0.0f;
};

// Work for the workers: routed assignments, and whether every row of the request also goes
// through the layer's shared expert (when it runs on workers, --shared-expert worker:NAME).
struct Work {
  std::vector<Assignment> routed;
  bool shared_expert = false;

  bool empty() const { return routed.empty() && !shared_expert; }
};

// One sub-request of a call, from just before its Send until its answer (to withdraw it when the
// call ends early).
struct SubRequest {
  enum class State {
    kSending,  // Send has not returned: no ticket yet; the sender withdraws it if the call ended
    kSent,     // the link accepted it: `ticket` names it
  };
  int worker = 0;  // index into the call's WorkerSet
  State state = State::kSending;
  WorkerLink::Ticket ticket;
};

struct LayerCall {
  // Gives hidden_bytes back to `spare`: nothing reads them any more.
  ~LayerCall();

  // ---- Set before dispatch; read-only afterwards (no lock). ----
  // Where the call's large buffers come from and go back to (none: fresh ones, freed).
  std::shared_ptr<svc::SpareBuffers> spare;
  std::shared_ptr<AnswerSink> sink;          // where the answer goes (none in the unit tests)
  std::shared_ptr<const WorkerSet> workers;  // the set it started with (kept until it ends)
  uint64_t id = 0;
  int layer = 0;
  int64_t num_tokens = 0;
  int hidden_size = 0;
  pb::DType in_dtype = pb::DTYPE_FP32;
  pb::DType out_dtype = pb::DTYPE_FP32;
  std::string hidden_bytes;  // the request's hidden rows as sent, sliced per worker
  size_t row_bytes = 0;
  std::vector<float> hidden;  // fp32 [T, H] (gate, local shared expert)
  bool include_shared_expert = false;
  Routing routing;                         // [T, k]
  std::optional<Clock::time_point> deadline;  // none: no deadline
  Clock::time_point t_start, t_gate_end, t_dispatch_end;

  // ---- Guarded by mu (see "Locks" above). ----
  std::mutex mu;
  bool ended = false;
  // The handler (MoeRouterService::Handle) is still sending parts or computing the local shared
  // expert: the call cannot end OK before it is done, even with no part out.
  bool handler_running = true;
  int parts_out = 0;        // parts sent (or being sent) and not yet answered or failed over
  std::vector<float> sum;   // [T, H] fp32: partial sums and the local shared expert
  // Set before dispatch when an in-process caller gave its own fp32 [T, H] buffer for the answer
  // (MoeRouterService::Submit's `out`): the sum is kept there instead of in `sum`, and the answer
  // carries no output tensor. The caller keeps the buffer until the answer came; an ended call
  // writes nothing more into it.
  float* sum_out = nullptr;
  float* sum_data() { return sum_out != nullptr ? sum_out : sum.data(); }
  // sum_out is not zero-filled up front: the first contribution that covers every row is copied
  // into it instead of added, one that does not zero-fills it first (`sum` starts zeroed: true).
  bool sum_written = true;
  // Zero-fills sum_out if nothing was written into it (an answer is about to be made).
  void ZeroSumIfUnwritten();
  std::set<int> fanout;     // workers sent to
  std::set<int> failed;     // workers whose part failed (not chosen again)
  std::string last_failure;  // the latest part failure, for the message if no worker is left
  std::map<uint64_t, SubRequest> subs;  // by key (next_sub_key), until answered
  uint64_t next_sub_key = 0;
  std::optional<svc::DeadlineTimer::Entry> deadline_entry;  // cancelled when the call ends
  pb::CancelReason end_reason = pb::CANCEL_REASON_FAILED;  // why it ended early (error ends)
  Clock::time_point t_first_send, t_last_answer;

  // ---- Transitions (each takes mu). ----

  // Records the call's deadline entry; false when the call has ended (the caller cancels it).
  bool SetDeadlineEntry(const svc::DeadlineTimer::Entry& entry);

  // A part is about to be sent to `worker`: registered (kSending) and counted. Its key, or none
  // when the call has ended.
  std::optional<uint64_t> BeginPart(int worker, Clock::time_point now);
  // Its Send returned `ticket`. When the call ended meanwhile (with an error: an OK end needs this
  // part's answer), the reason to withdraw it with; the caller withdraws it.
  std::optional<pb::CancelReason> PartSent(uint64_t key, const WorkerLink::Ticket& ticket);
  // Its answer (or failure) came: nothing to withdraw any more.
  void PartAnswered(uint64_t key);
  // `worker` failed the call's part: not chosen again; `why` is kept for the message should no
  // worker be left. False when the call has ended.
  bool NoteFailure(int worker, std::string why);
  // One part is no longer out (answered, or its work sent elsewhere). True when the call should
  // now end OK.
  bool PartFinished();
  // The handler is done. True when the call should now end OK.
  bool HandlerFinished();

  // What ending took from the call (see End).
  struct Ending {
    std::vector<SubRequest> withdraw;  // sent sub-requests to withdraw (error ends only)
    std::optional<svc::DeadlineTimer::Entry> deadline_entry;
  };
  // Marks the call ended; none when it had ended already. An error end (`ok` false, for `reason`)
  // takes the sub-requests sent (kSent) for withdrawal; those still kSending are withdrawn by their
  // sender (PartSent).
  std::optional<Ending> End(bool ok, pb::CancelReason reason);
  bool has_ended();
};

}  // namespace exl3::router
