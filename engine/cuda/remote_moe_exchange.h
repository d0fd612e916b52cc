// The GPU engine's exchange with remote experts (engine/cuda/cuda_model.h with a MoeExecutor):
// per MoE layer and micro-batch, the hidden states go from the device to a pinned staging buffer
// on a copy stream, out through MoeExecutor::Start, and the answer comes back from another pinned
// buffer on a second copy stream, which the compute stream waits for on the device. The host waits
// for a micro-batch's copy to the host before it starts the call, and for the call before it queues
// the copy back; nothing else of a step waits on the host. Two micro-batches (ping-pong) each have
// their own staging, streams' events and call, so one's exchange runs while the other's attention
// runs on the compute stream.
//
//   EXL3_ASSIGN_OR_RETURN(auto ex, RemoteMoeExchange::Create(executor, /*micro_batches=*/2, hidden));
//   ex->BeginStep({rows0, rows1});                 // grows the staging (never inside the layers)
//   ex->Send(0, layer, d_x0, host_ids0, stream);   // after micro-batch 0's attention is queued:
//                                                  // copies out, waits for the copy, starts the call
//   ex->Finish(0, d_y0, stream);                   // waits for the call, copies back, stream waits
//
// The two copy streams are separate so that a copy back never queues behind a copy out that still
// waits for the other micro-batch's attention.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/pinned_buffer.h"
#include "engine/core/moe_executor.h"

namespace exl3::engine::cuda {

// Where the exchanges of a step spent their time, summed over its MoE layers and micro-batches.
struct RemoteExchangeTimes {
  int exchanges = 0;       // (MoE layer, micro-batch) pairs
  double to_host_s = 0;    // device-to-host copies (copy stream, device events)
  double call_s = 0;       // MoeExecutor::Start to its MoeCall::Wait returning (host clock)
  double wait_s = 0;       // of call_s, the host blocked in Wait (the rest overlapped other work)
  double to_device_s = 0;  // host-to-device copies (copy stream, device events)
};

class RemoteMoeExchange {
 public:
  // `executor` must outlive the exchange. micro_batches: 1 or 2.
  // top_k: the model's experts per token (the routing staging's width; 0 when never routed here).
  static absl::StatusOr<std::unique_ptr<RemoteMoeExchange>> Create(MoeExecutor* executor, int micro_batches,
                                                                   int hidden_size, int top_k);
  ~RemoteMoeExchange();  // waits for calls and copies in flight
  RemoteMoeExchange(const RemoteMoeExchange&) = delete;
  RemoteMoeExchange& operator=(const RemoteMoeExchange&) = delete;

  int micro_batches() const { return static_cast<int>(slots_.size()); }
  // A step's start: rows[m] of micro-batch m (at most micro_batches() entries); grows its staging
  // to hold them (pinned memory is allocated only here, when a step is larger than any before),
  // clears the step's times. A previous step that failed midway is waited out first.
  absl::Status BeginStep(const std::vector<int>& rows);
  // Micro-batch m's layer `layer`: copies x [rows, hidden] (device memory, written by work already
  // queued on `compute`) to its staging, waits for that copy (and so for the work before it) and
  // starts the call. With `device_routing` (the device gate's top-k of these rows, device memory)
  // its ids and weights come along in the same copy and the call is MoeExecutor::StartRouted (the
  // executor gates nothing); without, MoeExecutor::Start with host_token_ids [rows] (or null),
  // which must stay valid until Finish.
  absl::Status Send(int m, int layer, const float* device_x, const MoeRouting* device_routing,
                    const int32_t* host_token_ids, void* compute);
  // Waits for m's call, queues the copy of its answer to device_y [rows, hidden] and makes
  // `compute` wait for that copy (device-side).
  absl::Status Finish(int m, float* device_y, void* compute);
  bool in_flight(int m) const { return slots_[m]->state == State::kInFlight; }
  // The step's times so far; complete once the step's work is done (after the engine's final
  // synchronisation).
  absl::StatusOr<RemoteExchangeTimes> StepTimes();

 private:
  enum class State { kIdle, kInFlight };
  struct Slot {
    State state = State::kIdle;
    int layer = -1, rows = 0;
    PinnedBuffer x, y;  // staging: out [rows, hidden], answer [rows, hidden]
    // The routing's staging: ids [rows, k] (int32 bits), then weights [rows, k]; its host view.
    PinnedBuffer routing;
    MoeRouting host_routing;
    // cudaEvent_t: x ready on the compute stream; the copies' ends (the host and the compute
    // stream wait on these) and starts (timing only).
    void* x_ready = nullptr;
    void* to_host_begin = nullptr;
    void* to_host_end = nullptr;
    void* to_device_begin = nullptr;
    void* to_device_end = nullptr;
    bool to_device_untimed = false;  // a copy back queued whose time is not collected yet
    std::unique_ptr<MoeCall> call;
    double started_at = 0;  // host clock, seconds
  };

  RemoteMoeExchange(MoeExecutor* executor, int hidden, int top_k)
      : executor_(executor), hidden_(hidden), top_k_(top_k) {}
  absl::Status CheckMicroBatch(int m) const;
  absl::Status CollectToDeviceTime(Slot& s);

  MoeExecutor* executor_;
  int hidden_;
  int top_k_;
  std::vector<std::unique_ptr<Slot>> slots_;  // by micro-batch (a Slot does not move: pinned buffers)
  void* to_host_stream_ = nullptr;    // cudaStream_t
  void* to_device_stream_ = nullptr;  // cudaStream_t
  RemoteExchangeTimes times_;
};

}  // namespace exl3::engine::cuda
