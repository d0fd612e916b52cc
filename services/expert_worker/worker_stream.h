// One ExpertWorker.Forward stream of the worker, on the stream plumbing of
// services/common/bidi_stream.h (one write outstanding, back-pressure, finish when idle, the
// shared-memory side channel). Requests are read one after another, each validated and queued at
// once (many in flight), and answered in completion order. Owned by the server's stream registry
// until the stream ends; requests in flight hold it too (as their RequestSink), so it may outlive
// the end, answering nothing after that.
//
// When the caller offers a shared-memory channel (ExpertRequest.shm_offer, same host) and the
// worker accepts it, requests read from the channel are handled like the stream's, and their
// answers go back through the channel when they fit.
//
// The stream talks to the server through WorkerStreamService (below), which WorkerServer
// (worker_server.h) implements.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"
#include "grpcpp/support/server_callback.h"
#include "services/common/bidi_stream.h"
#include "services/expert_worker/request.h"
#include "services/expert_worker/worker_metrics.h"

namespace exl3::worker {

class WorkerStream;

// What a stream needs of the server that owns it.
class WorkerStreamService {
 public:
  virtual ~WorkerStreamService() = default;
  // Validates and queues one request of `stream`; on error the caller answers in-band.
  // On success *accepted is the queued request (for a later cancel).
  virtual absl::Status Accept(pb::ExpertRequest&& msg, const std::shared_ptr<WorkerStream>& stream,
                              Clock::time_point received, Clock::time_point stream_deadline,
                              std::shared_ptr<WorkRequest>* accepted) = 0;
  // A cancel for an accepted request: the scheduler drops it if it has not run yet.
  virtual void Cancel(const std::shared_ptr<WorkRequest>& r, int reason) = 0;
  // The registry of streams: a stream registers when it starts and leaves when it ends.
  virtual void Register(const std::shared_ptr<WorkerStream>& s) = 0;
  virtual void Unregister(WorkerStream* s) = 0;
  virtual WorkerMetrics* metrics() = 0;
  // Whether a same-host caller's shared-memory channel is accepted, and how long its reader spins.
  virtual bool shm_enabled() const = 0;
  virtual int shm_spin_us() const = 0;
};

class WorkerStream
    : public svc::BidiStream<svc::ServerSide, pb::ExpertRequest, pb::ExpertResponse>,
      public RequestSink,
      public std::enable_shared_from_this<WorkerStream> {
 public:
  // Answers not yet written, per stream, before reading pauses.
  static constexpr size_t kMaxBacklog = 4096;
  // The largest buffer kept for reuse (SideWrittenLocked, BeforeSideRead).
  static constexpr size_t kMaxSpareBytes = 32u << 20;

  WorkerStream(WorkerStreamService* w, grpc::CallbackServerContext* ctx);

  // Registers with the server and starts reading.
  void Start();

  // RequestSink
  bool Cancelled() const override { return cancelled_.load(); }
  void Complete(std::shared_ptr<WorkRequest> r, absl::Status status) override;

  // The buffer of an answer written through the shared-memory channel, for the output of the
  // next request (no capacity when there is none); its contents are stale bytes, to be
  // overwritten.
  std::string TakeSpareOutput();

  // Nothing in flight and nothing left to write.
  bool Idle() {
    std::lock_guard<std::mutex> l(mutex());
    return IdleLocked();
  }

 private:
  // A request in flight (accepted, not yet answered), with the queued request once the scheduler
  // has it, and where its answer goes.
  struct InFlight {
    std::weak_ptr<WorkRequest> r;
    svc::Path path = svc::Path::kStream;
  };

  // The plumbing's hooks.
  void OnMessage(pb::ExpertRequest& m, svc::Path from) override;
  bool OwesAnswersLocked() const override { return !ids_.empty(); }
  void OnAbandoned() override { cancelled_.store(true); }  // the scheduler drops what it holds
  void OnEnded(const grpc::Status& st) override;
  // Large buffers go round on the shared-memory path instead of being allocated per request (a
  // 16 MB buffer mapped afresh costs ~4096 page faults): an answer's output buffer, once written
  // into the channel, becomes the next request's (TakeSpareOutput); a finished side-channel
  // request's hidden states buffer is what the next request read from the channel is parsed
  // into. One of each per stream, of at most kMaxSpareBytes.
  void SideWrittenLocked(pb::ExpertResponse& m) override;
  void BeforeSideRead(pb::ExpertRequest& m) override;

  // One request: registered under its id, then validated and queued; answered in-band when that
  // fails.
  void HandleRequest(pb::ExpertRequest&& msg, Clock::time_point received, svc::Path from);
  // The caller withdraws request `id`: dropped by the scheduler unless already computing.
  void HandleCancel(uint64_t id, int reason);
  // The caller's shared-memory offer: attach (same host, same user) or say why not. Either way
  // the stream goes on.
  void AttachShm(uint64_t id, const pb::SharedMemoryOffer& offer);
  absl::Status TryAttachShm(const pb::SharedMemoryOffer& offer);
  // Answers a request that never reached the scheduler.
  void SendError(uint64_t id, int layer, const absl::Status& s, Clock::time_point received,
                 svc::Path path);
  // Queues `resp`; with `release_id` its id leaves ids_ and the answer takes the path its request
  // came by.
  void Send(pb::ExpertResponse resp, bool release_id, svc::Path path);
  void RecordMetrics(const WorkRequest& r, const absl::Status& status, Clock::time_point now);

  WorkerStreamService* const w_;
  grpc::CallbackServerContext* const ctx_;
  Clock::time_point stream_deadline_ = Clock::time_point::max();
  std::map<uint64_t, InFlight> ids_;  // guarded by mutex()
  std::string spare_output_;          // guarded by mutex()
  std::string spare_hidden_;          // guarded by mutex()
  std::atomic<bool> cancelled_{false};
};

}  // namespace exl3::worker
