// The expert worker process in one object: model config and expert selection, backend, gRPC
// server (ExpertWorker service + health + reflection), metrics endpoint, batcher, drain.
// main.cc turns flags into WorkerOptions; tests start it in-process on loopback.
//
//   auto w = WorkerServer::Create(opts);     // config + experts resolved, gRPC up, NOT_SERVING
//   if (!w.ok()) { fprintf(stderr, "%s\n", ...); return 1; }
//   absl::Status s = (*w)->Load();           // experts resident -> SERVING
//   ...
//   (*w)->Drain(absl::Seconds(30));          // NOT_SERVING, answer everything accepted, stop
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "model/exl3_model.h"
#include "model/model_file_watch.h"
#include "services/common/metrics.h"
#include "services/common/server.h"
#include "services/expert_worker/backend.h"
#include "services/expert_worker/loader.h"
#include "services/expert_worker/request.h"
#include "services/expert_worker/scheduler.h"
#include "services/expert_worker/worker_metrics.h"
#include "services/expert_worker/worker_stream.h"

namespace exl3::worker {

struct WorkerOptions {
  std::string model_dir;
  std::string experts;       // ranges for every MoE layer ("0-7,12", "all"); or
  std::string expert_map;    // YAML file (docs/expert-map.md) with
  std::string worker_name;   // this worker's entry
  bool shared_expert = false;  // also hold the shared expert of every MoE layer (or: the map says so)
  std::string listen = "127.0.0.1:50061";
  std::string metrics_listen = "127.0.0.1:9461";  // "" = no HTTP endpoint
  std::string backend = "auto";
  std::string weights_residency = "auto";  // CUDA: auto, device or host (ParseWeightResidency)
  int device = 0;
  int threads = 0;        // CPU compute threads (0: all)
  int load_threads = 8;
  bool lock_memory = true;
  bool progress = true;
  bool load_benchmark = false;
  int batch_window_us = 0;    // 0: work-conserving batching (scheduler.h)
  int inline_max_tokens = 64;  // lone small requests computed on the receiving thread (0: never)
  int max_batch_tokens = 4096;
  int max_queue = 1024;
  int long_prefill_token_threshold = 1024;
  int prefill_chunk_us = 0;  // 0: auto (see scheduler.h)
  uint64_t max_message_bytes = 64u << 20;
  svc::ServerTls tls;
  // Called once when the backend can no longer compute (MoeBackend::Health after a failed batch),
  // after the worker stopped serving; the binary then drains and exits non-zero.
  std::function<void(const absl::Status&)> on_fatal;
  bool shm = true;      // accept a same-host caller's shared-memory channel (SharedMemoryOffer)
  int shm_spin_us = 500;  // how long its reader spins before sleeping
};

// What a worker holds: routed experts per MoE layer, and whether the shared experts.
struct HeldShare {
  std::map<int, std::vector<int>> experts;
  bool shared_expert = false;
};

// Resolves the share from `experts` (+ `shared_expert`) or `expert_map`+`worker_name` (the map
// entry's `shared_expert: true`, or the flag). A worker holding only the shared expert needs no
// routed experts.
absl::StatusOr<HeldShare> ResolveExperts(const WorkerOptions& opt, const MoeConfig& cfg);

class WorkerServer : public WorkerStreamService {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Create(const WorkerOptions& opt);
  ~WorkerServer();

  // Opens the model (only the held experts), makes them resident, starts the batcher, then
  // reports SERVING. An error leaves the server NOT_SERVING.
  absl::Status Load();
  // NOT_SERVING; new requests are answered UNAVAILABLE.
  void BeginDrain();
  // BeginDrain, then waits (up to `timeout`) until every accepted request is answered and its
  // response written, ends every stream (UNAVAILABLE "server draining"), stops the server.
  // Returns false when the timeout cut it short.
  bool Drain(absl::Duration timeout);

  int port() const { return server_->port(); }
  const std::string& address() const { return server_->address(); }
  int metrics_port() const { return metrics_->port(); }
  pb::ServingState state() const { return state_.load(); }
  const MoeConfig& config() const { return config_; }
  const std::map<int, std::vector<int>>& experts() const { return experts_; }
  bool holds_shared_expert() const { return shared_expert_; }
  std::string ScrapeMetrics() const { return metrics_->Scrape(); }

  // WorkerStreamService (services/expert_worker/worker_stream.h): used by the streams.
  absl::Status Accept(pb::ExpertRequest&& msg, const std::shared_ptr<WorkerStream>& stream,
                      Clock::time_point received, Clock::time_point stream_deadline,
                      std::shared_ptr<WorkRequest>* accepted) override;
  void Cancel(const std::shared_ptr<WorkRequest>& r, int reason) override;
  void Register(const std::shared_ptr<WorkerStream>& s) override;
  void Unregister(WorkerStream* s) override;
  WorkerMetrics* metrics() override { return worker_metrics_.get(); }
  bool shm_enabled() const override { return opt_.shm; }
  int shm_spin_us() const override { return opt_.shm_spin_us; }

  uint64_t max_message_bytes() const { return opt_.max_message_bytes; }
  void FillDescribe(pb::DescribeResponse* out) const;

 private:
  class Service;
  WorkerServer() = default;

  WorkerOptions opt_;
  MoeConfig config_;
  std::map<int, std::vector<int>> experts_;
  bool shared_expert_ = false;
  ModelShape shape_;
  RequestLimits limits_;
  std::string fingerprint_;

  std::unique_ptr<MoeBackend> backend_;
  std::unique_ptr<svc::MetricsEndpoint> metrics_;
  std::unique_ptr<WorkerMetrics> worker_metrics_;
  std::unique_ptr<Exl3Model> model_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<svc::GrpcServer> server_;
  std::atomic<pb::ServingState> state_{pb::STATE_LOADING};

  std::mutex streams_mu_;
  std::map<WorkerStream*, std::shared_ptr<WorkerStream>> streams_;

  // Watches the held experts' files after the load (ModelFileWatch): logs each change, sets
  // exl3_worker_model_files_changed.
  void WatchModelFiles();
  std::unique_ptr<ModelFileWatch> file_watch_;
  std::thread watch_thread_;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;  // guarded by watch_mu_
};

}  // namespace exl3::worker
