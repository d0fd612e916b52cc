// One accepted ExpertRequest, decoded and validated, as the scheduler and backends see it; and the
// validation itself (DecodeExpertRequest), kept free of gRPC so it can be fuzzed.
//
//   ModelShape shape = ...;                       // from the loaded model and the held experts
//   absl::StatusOr<std::shared_ptr<WorkRequest>> r = DecodeExpertRequest(std::move(msg), shape, limits);
//   // error codes: INVALID_ARGUMENT (malformed), NOT_FOUND (layer / expert not here),
//   // RESOURCE_EXHAUSTED (output over the message limit)
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "exl3serve/v1/exl3serve.pb.h"

namespace exl3::worker {

namespace pb = ::exl3serve::v1;
using Clock = std::chrono::steady_clock;

// What a request is checked against.
struct ModelShape {
  int hidden_size = 0;
  int num_layers = 0;
  int num_experts = 0;
  int top_k = 0;
  std::vector<bool> moe_layer;            // [num_layers]
  std::vector<std::vector<bool>> held;    // [num_layers][num_experts]
  std::vector<std::string> held_ranges;   // [num_layers] "0-7,12" for messages
  bool shared_expert = false;             // the shared expert is loaded (ExpertRequest.shared_expert)
};

struct RequestLimits {
  uint64_t max_message_bytes = 64u << 20;
  int max_slots = 64;
  int64_t max_tokens = 1 << 20;
};

class WorkRequest;

// Where a finished request goes (the stream it came from). Complete is called exactly once per
// submitted request, from any thread.
class RequestSink {
 public:
  virtual ~RequestSink() = default;
  virtual bool Cancelled() const = 0;
  virtual void Complete(std::shared_ptr<WorkRequest> r, absl::Status status) = 0;
};

class WorkRequest {
 public:
  uint64_t id = 0;
  int layer = 0;
  int tokens = 0;  // T
  int slots = 0;   // S (0 only for a shared-expert-only request)
  bool shared = false;  // add the shared expert for every token (ExpertRequest.shared_expert)
  pb::DType output_dtype = pb::DTYPE_FP32;
  Clock::time_point received{};
  Clock::time_point deadline = Clock::time_point::max();

  const float* x = nullptr;  // [T, hidden]: into x_bytes (fp32 input, no copy) or x_f32
  std::string x_bytes;
  std::vector<float> x_f32;
  std::vector<int32_t> ids;      // [T, S], -1 = empty slot
  std::vector<float> weights;    // [T, S]
  // [T, hidden] fp32 output, written by the batches; a string so that an fp32 answer moves it
  // into the response without a copy.
  std::string out_bytes;
  float* out() { return reinterpret_cast<float*>(out_bytes.data()); }

  std::shared_ptr<RequestSink> sink;

  // Set (from the stream's reader thread) when the caller cancels this request; the scheduler's
  // executor drops it at its next look at the queues if it has not finished by then.
  std::atomic<bool> cancel_requested{false};
  std::atomic<int> cancel_reason{0};  // pb::CancelReason

  // Scheduling state (owned by the scheduler's executor thread).
  int chunks = 0;       // batches (chunks) it has run in so far
  int tokens_done = 0;  // tokens computed so far
  bool failed = false;
  bool started = false;
  Clock::time_point start_time{};
  int64_t compute_ns = 0;
  int batch_tokens = 0;
  int batch_requests = 0;

  // Routed (token, expert) pairs per expert, for metrics: (expert, count).
  std::vector<std::pair<int, int>> expert_tokens;
};

// Checks and decodes `msg` (moved from: its hidden bytes are taken over without a copy when fp32).
// `received` is the arrival time (deadline base).
absl::StatusOr<std::shared_ptr<WorkRequest>> DecodeExpertRequest(pb::ExpertRequest&& msg,
                                                                 const ModelShape& shape,
                                                                 const RequestLimits& limits,
                                                                 Clock::time_point received);

}  // namespace exl3::worker
