// The MoeRouter service: per MoE layer request, gate (or take the caller's logits/top-k), fan out
// to the workers owning the chosen experts (only the tokens each needs, with their local
// (expert, weight) pairs), combine the partial sums in fp32, add the shared expert, answer.
//
// Many requests are in flight per stream and answered as they complete. A request fails alone
// (in-band status); a worker that fails mid-request has its share re-sent to a replica within
// the request's deadline. docs/router.md describes the whole path; its pieces:
//   engine_stream.h   a Forward stream (gRPC reactor) and its answer sink (answer_sink.h)
//   layer_request.h   a request decoded and checked
//   gate.h            routing: top-k given, logits given, or logits computed here
//   layer_call.h      one request in flight: its state and lock order
//   dispatcher.h      worker choice, parts, failover, deadline, cancellation
//   combine.h         fp32 sums, the local shared expert, the answer
// This file holds admission (draining, --max-in-flight, duplicate ids), the order of those steps,
// Describe and the registry of streams.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "model/exl3_model.h"
#include "services/common/spare_buffers.h"
#include "services/common/task_queue.h"
#include "services/router/answer_sink.h"
#include "services/router/combine.h"
#include "services/router/dispatcher.h"
#include "services/router/engine_stream.h"
#include "services/router/gate.h"
#include "services/router/layer_call.h"
#include "services/router/router_metrics.h"
#include "services/router/worker_pool.h"

namespace exl3::router {

struct RouterOptions {
  bool shared_expert_local = true;  // run the shared expert on the router's CPU
  // --shared-expert worker:NAME: the shared expert runs on the workers the pool gives it (NAME and
  // its replicas), as one more sub-request part; shared_expert_local is then false.
  std::string shared_expert_worker;
  int64_t default_deadline_ms = 10000;  // for requests with timeout_us == 0 (0: none)
  int max_in_flight = 1024;             // layer requests across all streams
  int64_t max_tokens = 65536;           // per request
  int shared_expert_threads = 2;        // CPU threads of the local shared expert
  int gate_threads = 4;                 // CPU threads computing router logits (1: inline)
  // Requests of at most this many tokens are handled (gate, dispatch, local shared expert) on the
  // gRPC thread that read them; larger ones on the handler pool, so a long prefill never holds a
  // gRPC callback thread.
  int inline_max_tokens = 64;
  int handler_threads = 2;
  // --max-message-bytes: a request above it, or one whose answer would be, is refused in-band
  // with RESOURCE_EXHAUSTED (gRPC's own limit on the engine stream is twice this).
  int64_t max_message_bytes = 64 << 20;
};

// The MoeRouter service on gRPC's callback API: each Forward stream is a reactor (EngineStream)
// whose requests are handled on the thread that read them and whose answers are written by
// whichever thread completes them (a worker link's reaction, the deadline timer), with no thread
// of its own. Both methods read and write raw bytes (services/common/raw_message.h), so a message
// that does not parse is answered with INVALID_ARGUMENT instead of passing for the end of the
// stream.
class MoeRouterService final
    : public pb::MoeRouter::WithRawCallbackMethod_Forward<
          pb::MoeRouter::WithRawCallbackMethod_Describe<pb::MoeRouter::Service>>,
      public EngineStreamService {
 public:
  MoeRouterService(const Exl3Model& model, const RouterOptions& opt, RouterMetrics* metrics);
  ~MoeRouterService() override;

  // The workers new requests go to; requests in flight keep the pool they started with.
  void SetPool(std::shared_ptr<WorkerPool> pool);
  std::shared_ptr<WorkerPool> pool() const;
  // New requests are refused with UNAVAILABLE; in-flight ones go on.
  void StartDrain() { draining_ = true; }
  int in_flight() const { return in_flight_.load(); }
  // Waits until no request is in flight or the timeout passes; true when idle.
  bool WaitIdle(std::chrono::milliseconds timeout);

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Forward(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Describe(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                     grpc::ByteBuffer* resp) override;
  // What Describe answers.
  void FillDescribe(pb::RouterDescribeResponse* resp) const;

  void FillIdentity(pb::ModelIdentity* id) const;
  size_t max_message_bytes() const override { return static_cast<size_t>(opt_.max_message_bytes); }
  // RESOURCE_EXHAUSTED for an answer of `bytes` bytes (over max_message_bytes()).
  absl::Status AnswerTooLarge(size_t bytes) const override;
  // Hidden-state buffers kept between calls: an in-process caller encodes its request into one,
  // a call's parts are built in them, and both come back when written or done
  // (services/common/spare_buffers.h).
  const std::shared_ptr<svc::SpareBuffers>& spare_buffers() const { return spare_; }

  // One request (or a cancel message) of the stream whose answers go to `s`: what a Forward stream
  // does with each message it reads, also usable in-process. Requests of at most
  // inline_max_tokens tokens are handled on this thread (their answer may be delivered before this
  // returns), larger ones on the handler pool; `req` may be moved from. `out` (in process only):
  // the caller's fp32 [T, hidden] buffer, kept until the answer came; with an fp32 output_dtype
  // the sum is accumulated there and the answer carries no output tensor (else it is not used).
  void Submit(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req,
              float* out = nullptr);
  // The stream's caller is gone: marks `s` cancelled and ends its requests in flight (answered
  // CANCELLED, their work withdrawn from the workers).
  void CancelStream(AnswerSink& s) override;

 private:
  // EngineStreamService: a Forward stream's message goes to Submit; an ended stream leaves the
  // registry.
  void OnStreamRequest(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req) override {
    Submit(s, req);
  }
  void StreamEnded(EngineStream* s) override;
  // One request (or a cancel message) of stream `s`, on the thread that read it (small) or the
  // handler pool (large).
  void Handle(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req, float* out);
  // A cancel message: ends the request `id` of `s` if it is in flight.
  void CancelRequest(AnswerSink& s, uint64_t id);
  // Answers `req` with `st` without it ever being in flight (draining, over the limits).
  void Reject(AnswerSink& s, const pb::MoeLayerRequest& req, const absl::Status& st,
              Clock::time_point t0);
  // Registers the request in `s`'s in-flight map and the service's count; null when it was
  // rejected (answered) or the stream is gone.
  std::shared_ptr<LayerCall> Admit(const std::shared_ptr<AnswerSink>& s,
                                   const pb::MoeLayerRequest& req, Clock::time_point t0);
  // Decodes (taking the hidden bytes out of `req`), gates and sets the deadline of an admitted
  // call; `out` as Submit's.
  absl::Status Prepare(pb::MoeLayerRequest& req, LayerCall& c, float* out);
  // The dispatcher's end of a call: the answer, metrics, the in-flight count.
  void Finish(const std::shared_ptr<LayerCall>& c, const absl::Status& st);

  const Exl3Model& model_;
  const MoeConfig& cfg_;
  const RouterOptions opt_;
  RouterMetrics* metrics_;
  const std::shared_ptr<svc::SpareBuffers> spare_ = std::make_shared<svc::SpareBuffers>();
  mutable std::mutex pool_mu_;
  std::shared_ptr<WorkerPool> pool_;  // guarded by pool_mu_
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  Gate gate_;
  std::unique_ptr<LocalSharedExpert> local_shared_;  // --shared-expert local on a model with one
  Dispatcher dispatcher_;
  // Streams live here from their start until gRPC's OnDone (requests in flight may hold one longer).
  std::mutex streams_mu_;
  std::map<EngineStream*, std::shared_ptr<EngineStream>> streams_;
  std::unique_ptr<svc::TaskQueue> handlers_;  // large requests (inline_max_tokens)
};

}  // namespace exl3::router
