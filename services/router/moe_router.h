// The MoeRouter service: per MoE layer request, gate (or take the caller's logits/top-k), fan out
// to the workers owning the chosen experts (only the tokens each needs, with their local
// (expert, weight) pairs), combine the partial sums in fp32, add the shared expert, answer.
//
// Many requests are in flight per stream and answered as they complete. A request fails alone
// (in-band status); a worker that fails mid-request has its share re-sent to a replica within
// the request's deadline. See docs/expert-map.md and services/router/README.md.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/exl3_model.h"
#include "services/router/router_metrics.h"
#include "kernels/cpu/thread_pool.h"
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

// A few threads running queued tasks in order of arrival.
class TaskQueue {
 public:
  explicit TaskQueue(int threads);
  ~TaskQueue();  // runs what is queued, then joins
  void Post(std::function<void()> fn);

 private:
  void Run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Runs callbacks at deadlines on one thread. A request that completes in time cancels its entry,
// so the thread wakes only for deadlines that really pass.
class DeadlineTimer {
 public:
  using Key = std::pair<std::chrono::steady_clock::time_point, uint64_t>;
  DeadlineTimer();
  ~DeadlineTimer();
  Key At(std::chrono::steady_clock::time_point when, std::function<void()> fn);
  // Drops the entry unless it has run (or is running) already.
  void Cancel(const Key& k);

 private:
  void Run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, std::function<void()>> q_;
  uint64_t next_seq_ = 0;
  // When the thread wakes next (guarded by mu_; max until it first sleeps).
  std::chrono::steady_clock::time_point wake_at_ = std::chrono::steady_clock::time_point::max();
  bool stop_ = false;
  std::thread thread_;
};

struct LayerCall;
class StreamState;

// Where the answers of one stream of layer requests go: a gRPC Forward stream (StreamState) or an
// in-process caller (InProcessRouter). The request path (MoeRouterService::Submit) sees only this.
class AnswerSink {
 public:
  virtual ~AnswerSink() = default;
  // Queues or delivers an answer (any thread). With `erase_id`, the request also leaves `inflight`
  // in the same step: the caller may reuse the id once it has the answer.
  virtual void Answer(pb::MoeLayerResponse r, bool erase_id) = 0;
  // A request handed to the handler pool: the sink must not end before it is handled.
  virtual void BeginHandling() {}
  virtual void EndHandling() {}

  std::atomic<bool> cancelled{false};  // the caller cancelled (or left): nothing is answered
  std::mutex mu;
  std::unordered_map<uint64_t, std::shared_ptr<LayerCall>> inflight;  // guarded by mu
};

// The MoeRouter service on gRPC's callback API: each Forward stream is a reactor (StreamState) whose
// requests are handled on the thread that read them and whose answers are written by whichever
// thread completes them (a worker stream's reaction, the deadline timer), with no thread of its own.
// Both methods read and write raw bytes (services/common/raw_message.h), so a message that does
// not parse is answered with INVALID_ARGUMENT instead of passing for the end of the stream.
class MoeRouterService final
    : public pb::MoeRouter::WithRawCallbackMethod_Forward<
          pb::MoeRouter::WithRawCallbackMethod_Describe<pb::MoeRouter::Service>> {
 public:
  MoeRouterService(const Exl3Model& model, const RouterOptions& opt, RouterMetrics* metrics);
  ~MoeRouterService() override;

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
  size_t max_message_bytes() const { return static_cast<size_t>(opt_.max_message_bytes); }
  // RESOURCE_EXHAUSTED for an answer of `bytes` bytes (over max_message_bytes()).
  absl::Status AnswerTooLarge(size_t bytes) const;

  // One request (or a cancel message) of the stream whose answers go to `s`: what a Forward stream
  // does with each message it reads, also usable in-process. Requests of at most
  // inline_max_tokens tokens are handled on this thread (their answer may be delivered before this
  // returns), larger ones on the handler pool; `req` may be moved from.
  void Submit(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req);
  // The stream's caller is gone: marks `s` cancelled and ends its requests in flight (answered
  // CANCELLED, their work withdrawn from the workers).
  void CancelStream(AnswerSink& s);

 private:
  friend class StreamState;
  // One request (or a cancel message) of stream `s`, on the thread that read it (small) or the
  // handler pool (large).
  void Handle(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req);
  void Unregister(StreamState* s);
  absl::Status Route(const pb::MoeLayerRequest& req, LayerCall& c);
  // logits [T, E] = x [T, hidden] · router_w^T, split over the gate pool by blocks of experts.
  void ComputeLogits(const float* router_w, const float* x, int num_tokens, float* logits);
  // Groups (row, expert, weight) triples by chosen worker and sends; failures fail over.
  // `failed_worker` >= 0: the triples are the share that worker failed (a failover, counted when
  // other workers take all of it).
  void Dispatch(const std::shared_ptr<LayerCall>& c, std::vector<int32_t> rows,
                std::vector<int32_t> experts, std::vector<float> weights, int failed_worker = -1);
  void OnPart(const std::shared_ptr<LayerCall>& c, int worker, uint64_t sub,
              std::vector<int32_t> rows, std::vector<int32_t> experts,
              std::vector<float> weights, absl::Status st, pb::ExpertResponse* resp);
  void PartDone(const std::shared_ptr<LayerCall>& c);
  // Answers the request (once). When it ends with an error, the sub-requests still out at the
  // workers are withdrawn with `reason`.
  void Complete(const std::shared_ptr<LayerCall>& c, const absl::Status& st,
                pb::CancelReason reason = pb::CANCEL_REASON_FAILED);
  // "experts 1-2", "shared expert", "experts 1-2 and the shared expert" (pseudo id num_experts).
  std::string ExpertsText(std::vector<int32_t> experts) const;

  const Exl3Model& model_;
  const MoeConfig& cfg_;
  const RouterOptions opt_;
  RouterMetrics* metrics_;
  mutable std::mutex pool_mu_;
  std::shared_ptr<WorkerPool> pool_;
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  DeadlineTimer timer_;
  std::unique_ptr<cpu::CpuBackend> shared_cpu_;  // local shared expert (fast CPU backend)
  // The gate reads the layer's whole router weight (4.7 MB at 288 x 4096 fp32), usually cold in
  // cache: one thread is bound by its own memory bandwidth, several split it.
  std::mutex gate_mu_;  // held while the pool computes one gate (ParallelFor: one call at a time)
  std::unique_ptr<cpu::ThreadPool> gate_pool_;
  // Streams live here from their start until gRPC's OnDone (requests in flight may hold one longer).
  std::mutex streams_mu_;
  std::map<StreamState*, std::shared_ptr<StreamState>> streams_;
  std::unique_ptr<TaskQueue> handlers_;  // large requests (inline_max_tokens)
};

}  // namespace exl3::router
