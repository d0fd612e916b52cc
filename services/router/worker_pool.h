// The router's connections to its expert workers: one persistent channel and one long-lived
// ExpertWorker.Forward stream per worker, followed by the gRPC health Watch, re-established with
// exponential backoff plus jitter, and checked with Describe (model fingerprint, experts held)
// before any work is sent.
//
//   WorkerPool::Options opt; opt.fingerprint = model.fingerprint(); opt.on_change = [&]{...};
//   auto pool = WorkerPool::Create(map, cfg, opt, /*reuse=*/nullptr, &metrics);
//   const std::vector<int>& who = pool->Holders(layer, expert);   // indices into workers
//   WorkerConn::SubHandle h;
//   pool->worker(i).Send(request, bytes, [](absl::Status s, ExpertResponse* r) {...}, &h);
//   pool->worker(i).Cancel(h, pb::CANCEL_REASON_DEADLINE);   // no longer needed
//
// A worker is "up" while its Describe matched, its health is SERVING, its Forward stream is open
// and it keeps answering: a liveness probe (a grpc.health.v1 Check with a short deadline, on the
// worker's channel) runs every liveness_ms / 4 whatever the traffic and the transport, and a
// worker from which neither a probe reply nor an answer came for liveness_ms (a frozen process, a
// lost network) is marked down and its session ended. When the session ends, every sub-request
// in flight on it gets its callback with UNAVAILABLE (the router then fails over); the worker
// rejoins once its Describe answers again.
//
// With --shared-expert worker:NAME the shared expert is a pseudo expert of every MoE layer, id
// num_experts (WorkerPool::shared_expert_id), held by NAME and by the other map workers marked
// shared_expert (replicas).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "model/expert_map.h"
#include "model/moe_config.h"
#include "services/common/server.h"

namespace exl3::router {

namespace pb = ::exl3serve::v1;

class RouterMetrics;

// Called exactly once per accepted sub-request: OK with the worker's response (whose in-band
// status may still be an error), UNAVAILABLE when the stream broke before the answer came, or
// CANCELLED when Cancel withdrew it before it was written.
using SubCallback = std::function<void(absl::Status, pb::ExpertResponse*)>;

struct WorkerPoolOptions {
  std::string fingerprint;  // the router's model; empty: not checked
  svc::ClientTls tls;
  int max_message_bytes = 64 << 20;
  int backoff_initial_ms = 100;
  int backoff_max_ms = 2000;
  std::function<void()> on_change;  // any worker's up state changed
  std::string shared_expert_worker;  // --shared-expert worker:NAME, else empty
  // Same-host workers: a shared-memory channel (services/common/shm_channel.h) of this many bytes
  // per direction carries the Forward stream's messages; 0: gRPC only.
  size_t shm_ring_bytes = 8 << 20;
  int shm_spin_us = 200;  // how long the channel's reader spins for an answer before sleeping
  // A worker silent this long (no liveness probe reply, no answer) is marked down; 0: no probes
  // (only the stream, the health watch and gRPC keepalive detect a lost worker).
  int liveness_ms = 1500;
};

// The map's workers that serve the shared expert under --shared-expert worker:NAME: NAME first,
// then the others marked shared_expert (replicas). Error (naming the problem) when NAME is not in
// the map or its entry lacks `shared_expert: true`.
absl::StatusOr<std::vector<std::string>> SharedExpertWorkers(const ExpertMap& map,
                                                             const std::string& name);

class WorkerConn {
 public:
  WorkerConn(const ExpertMapWorker& w, const MoeConfig& cfg, const WorkerPoolOptions& opt,
             RouterMetrics* metrics);
  ~WorkerConn();
  void Start();
  void Stop();

  // Identifies one sent sub-request (its stream and id), for Cancel.
  struct Session;
  struct HealthWatch;
  struct Probe;
  struct SubHandle {
    std::weak_ptr<Session> session;
    uint64_t id = 0;  // 0: none
  };

  // Sends `req` (its id is overwritten). On OK, `cb` will be called exactly once, from another
  // thread, and *handle (when given) identifies the sub-request. On error (worker not up, write
  // failed) `cb` is not called.
  absl::Status Send(pb::ExpertRequest* req, size_t request_bytes, SubCallback cb,
                    SubHandle* handle = nullptr);
  // Withdraws a sub-request whose answer is no longer needed: one still waiting to be written is
  // dropped here (its callback runs with CANCELLED); one already written gets a cancel message on
  // the stream when the worker's Describe says it accepts them (its answer, CANCELLED or the
  // result, still comes and runs the callback). A sub-request already answered: nothing happens.
  void Cancel(const SubHandle& h, pb::CancelReason reason);

  const std::string& name() const { return spec_.name; }
  const std::string& address() const { return spec_.address; }
  const ExpertMapWorker& spec() const { return spec_; }
  bool up() const { return up_.load(); }
  int outstanding() const { return outstanding_.load(); }
  std::string state_message() const;  // why it is not up, or "" while up
  std::string backend() const;
  std::string device() const;
  // Serves the shared expert (--shared-expert worker:NAME and the map marks it shared_expert).
  bool serves_shared() const { return serves_shared_; }
  bool cancel_supported() const { return cancel_supported_.load(); }
  // "shm" while the current session's messages go through shared memory, else "grpc".
  std::string transport() const;

 private:
  using Clock = std::chrono::steady_clock;
  void Supervise();
  absl::Status RunSession();
  void SetUp(bool up, const std::string& why);
  // While the health watch runs: probes the worker every liveness_ms / 4 and ends `s` when it has
  // been silent for liveness_ms. Returns why the session ended.
  std::string WatchLiveness(Session& s, HealthWatch& watch);
  // The worker answered something (a probe, a sub-request): it is alive now.
  void Heard() { last_heard_ns_.store(Clock::now().time_since_epoch().count()); }
  absl::Status CheckDescribe(const pb::DescribeResponse& d) const;
  // Offers `s` a shared-memory channel when the worker is on this host and takes it (see
  // SharedMemoryOffer); the stream works the same either way.
  void OfferShm(const std::shared_ptr<Session>& s, const pb::DescribeResponse& d);

  const ExpertMapWorker spec_;
  const MoeConfig& cfg_;
  const WorkerPoolOptions opt_;
  RouterMetrics* metrics_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::ExpertWorker::Stub> stub_;

  const bool serves_shared_;
  std::atomic<bool> cancel_supported_{false};  // from Describe
  std::atomic<bool> up_{false};
  std::atomic<int> outstanding_{0};
  std::atomic<Clock::rep> last_heard_ns_{0};  // Heard(): steady clock ticks
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Session> session_;                 // guarded by mu_
  std::shared_ptr<grpc::ClientContext> watch_ctx_;   // guarded by mu_
  std::string why_down_ = "not connected yet";       // guarded by mu_
  std::string backend_, device_;                     // guarded by mu_
  std::thread supervisor_;
};

class WorkerPool {
 public:
  // Connections whose name, address and experts are unchanged are taken over from `reuse`
  // (SIGHUP reload); the others are new and started here.
  static std::shared_ptr<WorkerPool> Create(const ExpertMap& map, const MoeConfig& cfg,
                                            const WorkerPoolOptions& opt,
                                            const WorkerPool* reuse, RouterMetrics* metrics);
  ~WorkerPool();

  int num_workers() const { return static_cast<int>(workers_.size()); }
  WorkerConn& worker(int i) const { return *workers_[i]; }
  std::shared_ptr<WorkerConn> worker_ptr(int i) const { return workers_[i]; }
  // Workers holding (layer, expert), in map order; expert shared_expert_id(): the shared expert's
  // holders (empty unless it runs on workers).
  const std::vector<int>& Holders(int layer, int expert) const {
    return holders_[layer][expert];
  }
  int shared_expert_id() const { return num_experts_; }
  bool shared_on_workers() const { return shared_on_workers_; }
  // Routed experts (all layers) without any up worker, plus one per MoE layer whose shared expert
  // has none when it runs on workers.
  int UnservedExperts() const;
  // Stops the connections not shared with `next` (after a reload swapped pools).
  void StopUnshared(const WorkerPool& next);

 private:
  WorkerPool() = default;
  std::vector<std::shared_ptr<WorkerConn>> workers_;
  std::vector<std::vector<std::vector<int>>> holders_;  // [layer][expert or shared] -> workers
  std::vector<int> moe_layers_;
  int num_experts_ = 0;
  bool shared_on_workers_ = false;
};

}  // namespace exl3::router
