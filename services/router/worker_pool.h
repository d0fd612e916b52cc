// The router's connections to its expert workers: one persistent channel and one long-lived
// ExpertWorker.Forward stream per worker, followed by the gRPC health Watch, re-established with
// exponential backoff plus jitter, and checked with Describe (model fingerprint, experts held)
// before any work is sent. WorkerConn is the real WorkerLink (services/router/worker_link.h);
// WorkerPool is the WorkerSet (services/router/worker_set.h) of one expert map's connections.
//
//   WorkerPoolOptions opt; opt.fingerprint = model.fingerprint(); opt.on_change = [&]{...};
//   auto pool = WorkerPool::Create(map, cfg, opt, /*reuse=*/nullptr, &metrics);
//   const std::vector<int>& who = pool->holders().Routed(layer, expert);  // indices into workers
//   absl::StatusOr<WorkerLink::Ticket> t =
//       pool->link(i).Send(std::move(request), bytes, [](absl::Status s, ExpertResponse* r) {...});
//   pool->link(i).Cancel(*t, pb::CANCEL_REASON_DEADLINE);   // no longer needed
//
// A worker is "up" while its Describe matched, its health is SERVING, its Forward stream is open
// and it keeps answering: a liveness probe (a grpc.health.v1 Check with a short deadline, on the
// worker's channel) runs every liveness_ms / 4 whatever the traffic and the transport, and a
// worker from which neither a probe reply nor an answer came for liveness_ms (a frozen process, a
// lost network) is marked down and its session ended. When the session ends, every sub-request
// in flight on it gets its callback with UNAVAILABLE (the router then fails over); the worker
// rejoins once its Describe answers again.
//
// With --shared-expert worker:NAME the shared expert of every MoE layer is held by NAME and by the
// other map workers marked shared_expert (replicas): ExpertHolders::Shared.
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
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "model/expert_map.h"
#include "model/moe_config.h"
#include "services/common/server.h"
#include "services/common/spare_buffers.h"
#include "services/router/worker_link.h"
#include "services/router/worker_set.h"

namespace exl3::svc {
class ShmChannel;
}  // namespace exl3::svc

namespace exl3::router {

namespace pb = ::exl3serve::v1;

class RouterMetrics;

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
  // Where a request's hidden-state buffer goes once it is written into the shared-memory
  // channel (the router's services/router/moe_router.h spare_buffers()); none: freed.
  std::shared_ptr<svc::SpareBuffers> spare_buffers;
};

// The map's workers that serve the shared expert under --shared-expert worker:NAME: NAME first,
// then the others marked shared_expert (replicas). Error (naming the problem) when NAME is not in
// the map or its entry lacks `shared_expert: true`.
absl::StatusOr<std::vector<std::string>> SharedExpertWorkers(const ExpertMap& map,
                                                             const std::string& name);

class WorkerConn final : public WorkerLink {
 public:
  WorkerConn(const ExpertMapWorker& w, const MoeConfig& cfg, const WorkerPoolOptions& opt,
             RouterMetrics* metrics);
  ~WorkerConn() override;
  void Start();
  void Stop() override;

  struct Session;
  struct HealthWatch;
  struct Probe;

  // WorkerLink. Send queues the request on the session's stream (or its shared-memory channel);
  // UNAVAILABLE when the worker is not up or has 4 x max_message_bytes of requests unwritten.
  absl::StatusOr<Ticket> Send(pb::ExpertRequest req, size_t request_bytes,
                              SubCallback cb) override;
  // A sub-request still waiting to be written is dropped here (its callback runs with
  // CANCELLED); one already written gets a cancel message on the stream when the worker's
  // Describe says it accepts them (its answer, CANCELLED or the result, still comes and runs the
  // callback).
  void Cancel(const Ticket& ticket, pb::CancelReason reason) override;
  const std::string& name() const override { return spec_.name; }
  const std::string& address() const override { return spec_.address; }
  bool up() const override { return up_.load(); }
  int outstanding() const override { return outstanding_.load(); }

  const ExpertMapWorker& spec() const { return spec_; }
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
  // One session: Identify, OpenSession, OfferShm, WatchSession until it ends, CloseSession.
  // Returns why it ended.
  absl::Status RunSession();
  // Describe, checked (CheckDescribe); records the backend, device and cancel support.
  absl::StatusOr<pb::DescribeResponse> Identify();
  // Starts the Forward stream; the health watch's context is cancelled when the session ends.
  absl::StatusOr<std::shared_ptr<Session>> OpenSession(
      const std::shared_ptr<grpc::ClientContext>& watch_ctx);
  // Runs the health watch (and the liveness probes) until the session or the watch ends.
  std::string WatchSession(const std::shared_ptr<Session>& s,
                           const std::shared_ptr<grpc::ClientContext>& watch_ctx);
  // Ends `s` and waits until every sub-request pending on it has had its callback.
  void CloseSession(Session& s, const std::string& why);
  std::shared_ptr<Session> current_session() const;
  void SetUp(bool up, const std::string& why);
  // While the health watch runs: probes the worker every liveness_ms / 4 and ends `s` when it has
  // been silent for liveness_ms. Returns why the session ended.
  std::string WatchLiveness(Session& s, HealthWatch& watch);
  // The worker answered something (a probe, a sub-request): it is alive now.
  void Heard() { last_heard_ns_.store(Clock::now().time_since_epoch().count()); }
  absl::Status CheckDescribe(const pb::DescribeResponse& d) const;
  // Every expert the map assigns is held.
  absl::Status CheckExpertsHeld(const pb::DescribeResponse& d) const;
  // Offers `s` a shared-memory channel when the worker is on this host and takes it (see
  // SharedMemoryOffer); the stream works the same either way.
  void OfferShm(const std::shared_ptr<Session>& s, const pb::DescribeResponse& d);
  // The worker's answer to the offer of `ch`: attached to `s`, or declined.
  void ShmOfferAnswered(Session& s, const std::shared_ptr<svc::ShmChannel>& ch,
                        const absl::Status& st, const pb::ExpertResponse* r);
  // Send's refusals: the stream is ending, or the worker is not reading (s's mutex held).
  absl::Status CanSendLocked(const Session& s, size_t request_bytes) const;

  const ExpertMapWorker spec_;
  const MoeConfig& cfg_;
  const WorkerPoolOptions opt_;
  RouterMetrics* metrics_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::ExpertWorker::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> forward_stub_;  // Forward, as raw bytes

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

// One expert map's worker connections (worker i is map.workers[i]).
class WorkerPool final : public WorkerSet {
 public:
  // Connections whose name, address and experts are unchanged are taken over from `reuse`
  // (SIGHUP reload); the others are new and started here.
  static std::shared_ptr<WorkerPool> Create(const ExpertMap& map, const MoeConfig& cfg,
                                            const WorkerPoolOptions& opt,
                                            const WorkerPool* reuse, RouterMetrics* metrics);
  ~WorkerPool() override;

  // What Describe reports of worker i.
  const WorkerConn& conn(int i) const { return *conns_[i]; }

 private:
  WorkerPool(std::vector<std::shared_ptr<WorkerConn>> conns, ExpertHolders holders);
  const std::vector<std::shared_ptr<WorkerConn>> conns_;  // the same objects as links()
};

}  // namespace exl3::router
