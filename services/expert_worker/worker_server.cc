#include "services/expert_worker/worker_server.h"

#include <algorithm>
#include <deque>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "model/expert_map.h"
#include "services/common/logging.h"
#include "services/common/raw_message.h"
#include "services/common/shm_channel.h"
#include "services/common/status.h"
#include "services/common/wire.h"

#ifndef EXL3_VERSION
#define EXL3_VERSION "0.0.0"
#endif
#ifndef EXL3_GIT_DESCRIBE
#define EXL3_GIT_DESCRIBE ""
#endif

namespace exl3::worker {

using ResponsePtr = std::unique_ptr<pb::ExpertResponse>;

namespace {

int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

// ------------------------------------------------------------------------------------------------
// One Forward stream. Reads requests one after another (each validated and queued at once, so many
// are in flight), writes responses in completion order (one write outstanding at a time, the rest
// queued). Owned by the server's stream registry until gRPC calls OnDone; requests in flight hold
// it too (as their RequestSink), so it may outlive OnDone, answering nothing after that.
//
// When the caller offers a shared-memory channel (ExpertRequest.shm_offer, same host) and the
// worker accepts it, a reader thread of this stream takes requests from the channel as OnReadDone
// takes them from gRPC, and their answers go back through the channel when they fit. The channel
// and the stream share fate: when either ends or breaks, both end.
class StreamReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                      public RequestSink,
                      public std::enable_shared_from_this<StreamReactor> {
 public:
  StreamReactor(WorkerServer* w, grpc::CallbackServerContext* ctx) : w_(w), ctx_(ctx) {}
  ~StreamReactor() override { StopShm(); }

  void Begin() {
    w_->Register(shared_from_this());
    const auto dl = ctx_->deadline();
    if (dl != std::chrono::system_clock::time_point::max() &&
        dl < std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
      stream_deadline_ = Clock::now() + (dl - std::chrono::system_clock::now());
    }
    StartRead(&in_);
  }

  // RequestSink
  bool Cancelled() const override { return cancelled_.load(); }
  void Complete(std::shared_ptr<WorkRequest> r, absl::Status status) override {
    auto resp = std::make_unique<pb::ExpertResponse>();
    resp->set_id(r->id);
    resp->set_layer(r->layer);
    svc::SetRequestStatus(status, resp->mutable_status());
    const Clock::time_point now = Clock::now();
    pb::WorkerTimings* tm = resp->mutable_timings();
    tm->set_total_us(Micros(now - r->received));
    tm->set_chunks(r->chunks);
    if (r->started) tm->set_queue_us(Micros(r->start_time - r->received));
    tm->set_compute_us(r->compute_ns / 1000);
    tm->set_batch_tokens(r->batch_tokens);
    tm->set_batch_requests(r->batch_requests);
    WorkerMetrics* m = w_->metrics();
    if (m && r->cancel_requested.load()) {
      m->CountCancel(r->cancel_reason.load(),
                     status.code() == absl::StatusCode::kCancelled ? "dropped" : "completed");
    }
    if (status.ok()) {
      const int H = static_cast<int>(r->out_bytes.size() / sizeof(float) / std::max(1, r->tokens));
      pb::Tensor* out = resp->mutable_output();
      if (r->output_dtype == pb::DTYPE_FP32) {
        out->set_dtype(pb::DTYPE_FP32);
        out->add_shape(r->tokens);
        out->add_shape(H);
        out->set_data(std::move(r->out_bytes));
      } else {
        svc::EncodeTensor(r->out(), {r->tokens, H}, r->output_dtype, out);
      }
      if (m) {
        if (WorkerMetrics::Layer* lm = m->layer(r->layer)) {
          lm->queue->Observe(Seconds(r->start_time - r->received));
          lm->compute->Observe(r->compute_ns * 1e-9);
          lm->total->Observe(Seconds(now - r->received));
          lm->requests->Increment();
          lm->tokens->Increment(r->tokens);
        }
        for (const auto& [e, n] : r->expert_tokens) m->CountExpertTokens(e, n);
      }
    } else if (m) {
      m->CountError(status.code());
    }
    Send(std::move(resp), /*release_id=*/true);
  }

  // Answers a request that never reached the scheduler.
  void SendError(uint64_t id, int layer, const absl::Status& s, Clock::time_point received,
                 bool via_shm) {
    auto resp = std::make_unique<pb::ExpertResponse>();
    resp->set_id(id);
    resp->set_layer(layer);
    svc::SetRequestStatus(s, resp->mutable_status());
    resp->mutable_timings()->set_total_us(Micros(Clock::now() - received));
    if (WorkerMetrics* m = w_->metrics()) m->CountError(s.code());
    Send(std::move(resp), /*release_id=*/false, via_shm);
  }

  // Called by the server at the end of a drain: end the stream once its answers are written.
  void FinishWhenIdle(grpc::Status s) {
    std::unique_lock<std::mutex> l(mu_);
    drain_status_ = std::move(s);
    draining_ = true;
    MaybeFinish(l);
  }
  // Nothing in flight and nothing left to write.
  bool Idle() {
    std::lock_guard<std::mutex> l(mu_);
    return finished_ || (ids_.empty() && queue_.empty() && !writing_);
  }

  // grpc reactions
  void OnReadDone(bool ok) override {
    if (!ok) {
      std::unique_lock<std::mutex> l(mu_);
      reads_done_ = true;
      MaybeFinish(l);
      return;
    }
    if (absl::Status st = svc::ParseRaw(&in_, &req_); !st.ok()) {
      // Not a request: the stream is unusable. What it has in flight is dropped (the scheduler
      // sees Cancelled()) and the stream ends with the reason.
      std::unique_lock<std::mutex> l(mu_);
      reads_done_ = true;
      end_status_ = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 absl::StrCat(st.message(), "; the stream ends"));
      cancelled_.store(true);
      MaybeFinish(l);
      return;
    }
    if (req_.has_shm_offer()) {
      AttachShm(req_.id(), req_.shm_offer());
    } else {
      HandleMessage(std::move(req_), Clock::now(), /*via_shm=*/false);
    }
    req_.Clear();
    ContinueReading();
  }

  // One message from the caller, from the stream or the shared-memory channel.
  void HandleMessage(pb::ExpertRequest&& msg, Clock::time_point received, bool via_shm) {
    const uint64_t id = msg.id();
    const int layer = msg.layer();
    if (msg.has_cancel()) {
      // A control message, not a request: never answered itself.
      HandleCancel(id, msg.cancel().reason());
      return;
    }
    bool duplicate;
    {
      std::lock_guard<std::mutex> l(mu_);
      duplicate = !ids_.emplace(id, InFlight{{}, via_shm}).second;
    }
    if (duplicate) {
      SendError(id, layer,
                absl::InvalidArgumentError(absl::StrCat("duplicate in-flight id ", id,
                                                        " on this stream (the first one is still "
                                                        "being computed)")),
                received, via_shm);
      return;
    }
    std::shared_ptr<WorkRequest> accepted;
    absl::Status s = w_->Accept(std::move(msg), shared_from_this(), received, stream_deadline_, &accepted);
    if (!s.ok()) {
      {
        std::lock_guard<std::mutex> l(mu_);
        ids_.erase(id);
      }
      SendError(id, layer, s, received, via_shm);
    } else {
      // Only while still in flight: it may have been answered already (an id is only taken again
      // after its answer, by a later message).
      std::lock_guard<std::mutex> l(mu_);
      auto it = ids_.find(id);
      if (it != ids_.end()) it->second.r = accepted;
    }
  }

  // The caller's shared-memory offer: attach (same host, same user) and start reading it, or say
  // why not. Either way the stream goes on.
  void AttachShm(uint64_t id, const pb::SharedMemoryOffer& offer) {
    auto resp = std::make_unique<pb::ExpertResponse>();
    resp->set_id(id);
    absl::Status st;
    if (!w_->shm_enabled()) {
      st = absl::FailedPreconditionError("shared memory is off on this worker (--shm=false)");
    } else if (shm_ != nullptr) {
      st = absl::FailedPreconditionError("this stream already has a shared-memory channel");
    } else {
      absl::StatusOr<std::unique_ptr<svc::ShmChannel>> ch =
          svc::ShmChannel::Attach(offer.name(), offer.nonce(), w_->shm_spin_us());
      if (ch.ok()) {
        (*ch)->Unlink();  // mapped: the name is no longer needed (nothing leaks if the router dies)
        std::lock_guard<std::mutex> l(mu_);
        if (!finished_) {
          shm_ = std::move(*ch);
          shm_thread_ = std::thread([this] { ReadShm(); });
        } else {
          st = absl::CancelledError("stream ending");
        }
      } else {
        st = ch.status();
      }
    }
    svc::SetRequestStatus(st, resp->mutable_status());
    resp->set_shm_attached(st.ok());
    if (!st.ok()) svc::LogInfo("shared-memory offer declined: %s", std::string(st.message()).c_str());
    Send(std::move(resp), /*release_id=*/false, /*via_shm=*/false);
  }

  // The shared-memory reader thread: requests until the channel closes. A channel that breaks
  // (corrupt record) ends the stream, so the caller fails over what it had sent through it.
  void ReadShm() {
    pb::ExpertRequest msg;
    for (;;) {
      bool parsed = false;
      Clock::time_point received;
      if (!shm_->Read([&](const uint8_t* p, size_t n) {
            received = Clock::now();
            parsed = msg.ParseFromArray(p, static_cast<int>(n));
          })) {
        break;
      }
      if (!parsed) {
        shm_->Close();
        svc::LogWarning("shared-memory channel: a message that does not parse; ending the stream");
        break;
      }
      if (msg.has_shm_offer()) {
        msg.Clear();
        continue;  // only valid on the stream
      }
      HandleMessage(std::move(msg), received, /*via_shm=*/true);
      msg.Clear();
    }
    if (!shm_->error().ok()) {
      svc::LogWarning("shared-memory channel: %s; ending the stream",
                      std::string(shm_->error().message()).c_str());
    }
    // Whoever closed it, the stream ends too (unless it is ending already: OnDone closed it).
    if (!shm_stopping_.load()) ctx_->TryCancel();
  }

  void StopShm() {
    std::thread t;
    {
      std::lock_guard<std::mutex> l(mu_);
      shm_stopping_.store(true);
      if (shm_) shm_->Close();
      t = std::move(shm_thread_);
    }
    if (!t.joinable()) return;
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // the reader itself dropped the last reference: it is returning
    } else {
      t.join();
    }
  }

  void ContinueReading() {
    // Reads and writes never complete inline (gRPC runs their reactions later), so starting
    // them under mu_ is safe; it orders them against Finish.
    std::lock_guard<std::mutex> l(mu_);
    if (finished_) {
      reads_done_ = true;
    } else if (ids_.size() + queue_.size() >= kMaxBacklog) {
      // Backpressure: a client that does not read its answers stops being read from.
      read_paused_ = true;
    } else {
      StartRead(&in_);
    }
  }

  // The caller withdraws request `id`: dropped by the scheduler unless already computing.
  void HandleCancel(uint64_t id, int reason) {
    std::shared_ptr<WorkRequest> r;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = ids_.find(id);
      if (it != ids_.end()) r = it->second.r.lock();
    }
    if (r == nullptr) {
      // Already answered (or never sent): nothing to do, nothing to answer.
      if (WorkerMetrics* m = w_->metrics()) m->CountCancel(reason, "late");
      return;
    }
    w_->Cancel(r, reason);
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock<std::mutex> l(mu_);
    queue_.pop_front();
    wbuf_.Clear();  // its slices: a large answer's bytes would otherwise live until the next write
    if (ok && read_paused_ && !finished_ && ids_.size() + queue_.size() < kMaxBacklog / 2) {
      read_paused_ = false;
      StartRead(&in_);
    }
    if (!ok) {
      // The peer is gone: nothing more can be delivered.
      broken_ = true;
      cancelled_.store(true);
      queue_.clear();
      writing_ = false;
      MaybeFinish(l);
      return;
    }
    if (!queue_.empty() && !finished_) {
      pb::ExpertResponse* next = queue_.front().get();
      l.unlock();
      WriteOne(*next);
      return;
    }
    writing_ = false;
    MaybeFinish(l);
  }

  void OnCancel() override {
    std::unique_lock<std::mutex> l(mu_);
    cancelled_.store(true);
    MaybeFinish(l);
  }

  void OnDone() override {
    std::shared_ptr<StreamReactor> keep = shared_from_this();
    {
      std::lock_guard<std::mutex> l(mu_);
      finished_ = true;
      done_ = true;
      queue_.clear();
    }
    StopShm();
    w_->Unregister(this);
  }

 private:
  // `via_shm`: the request came through the shared-memory channel (release_id: taken from ids_).
  void Send(ResponsePtr resp, bool release_id, bool via_shm = false) {
    std::unique_lock<std::mutex> l(mu_);
    if (release_id) {
      auto it = ids_.find(resp->id());
      if (it != ids_.end()) {
        via_shm = it->second.shm;
        ids_.erase(it);
      }
    }
    if (finished_ || broken_ || cancelled_.load()) {
      MaybeFinish(l);
      return;  // nobody to answer
    }
    if (via_shm && shm_ != nullptr) {
      // Under mu_: the one writer of the channel's answer ring. What does not fit goes by gRPC.
      const size_t n = resp->ByteSizeLong();
      if (shm_->TryWrite(n, [&](uint8_t* dst) { resp->SerializeWithCachedSizesToArray(dst); })) {
        MaybeFinish(l);
        return;
      }
    }
    queue_.push_back(std::move(resp));
    if (writing_) return;
    writing_ = true;
    pb::ExpertResponse* first = queue_.front().get();
    l.unlock();
    WriteOne(*first);
  }

  // Starts writing `r`, the front of queue_ (by the one thread that set writing_).
  void WriteOne(const pb::ExpertResponse& r) {
    absl::Status st = svc::SerializeRaw(r, &wbuf_);
    if (!st.ok()) svc::LogError("answer not sent: %s", std::string(st.message()).c_str());
    StartWrite(&wbuf_);
  }

  // Calls Finish once the stream has nothing left to do. Unlocks `l` when it finishes.
  void MaybeFinish(std::unique_lock<std::mutex>& l) {
    if (finished_ || writing_) return;
    grpc::Status st;
    if (!end_status_.ok()) {
      st = end_status_;
    } else if (cancelled_.load() || broken_) {
      st = grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
    } else if (!ids_.empty() || !queue_.empty()) {
      return;  // answers still owed
    } else if (reads_done_) {
      st = grpc::Status::OK;
    } else if (draining_) {
      st = drain_status_;
    } else {
      return;
    }
    finished_ = true;
    l.unlock();
    Finish(st);
  }

  // Requests in flight plus answers not yet written, per stream, before reading pauses.
  static constexpr size_t kMaxBacklog = 4096;

  WorkerServer* w_;
  grpc::CallbackServerContext* ctx_;
  Clock::time_point stream_deadline_ = Clock::time_point::max();
  grpc::ByteBuffer in_;     // the read buffer
  pb::ExpertRequest req_;   // in_ parsed
  grpc::ByteBuffer wbuf_;   // the answer being written (queue_'s front), serialized
  grpc::Status end_status_;  // guarded by mu_: why the stream ends early (a bad message), or OK

  std::mutex mu_;
  // In flight (accepted, not yet answered), with the queued request once the scheduler has it.
  struct InFlight {
    std::weak_ptr<WorkRequest> r;
    bool shm = false;  // came through the shared-memory channel
  };
  std::map<uint64_t, InFlight> ids_;
  std::unique_ptr<svc::ShmChannel> shm_;  // guarded by mu_ (set once; its reader: shm_thread_)
  std::thread shm_thread_;
  std::atomic<bool> shm_stopping_{false};  // OnDone (or the destructor) is closing the channel
  std::deque<ResponsePtr> queue_;      // front is being written when writing_
  bool writing_ = false;
  bool reads_done_ = false;
  bool read_paused_ = false;
  bool broken_ = false;
  bool finished_ = false;
  bool done_ = false;
  bool draining_ = false;
  grpc::Status drain_status_;
  std::atomic<bool> cancelled_{false};
};

// ------------------------------------------------------------------------------------------------
// Both methods read and write raw bytes (services/common/raw_message.h): a message that does not
// parse is answered INVALID_ARGUMENT instead of passing for the end of the stream.
class WorkerServer::Service
    : public pb::ExpertWorker::WithRawCallbackMethod_Forward<
          pb::ExpertWorker::WithRawCallbackMethod_Describe<pb::ExpertWorker::Service>> {
 public:
  explicit Service(WorkerServer* w) : w_(w) {}

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Forward(
      grpc::CallbackServerContext* ctx) override {
    auto r = std::make_shared<StreamReactor>(w_, ctx);
    r->Begin();
    return r.get();
  }

  grpc::ServerUnaryReactor* Describe(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                     grpc::ByteBuffer* out) override {
    return svc::AnswerUnaryRaw<pb::DescribeRequest, pb::DescribeResponse>(
        ctx, in, out, [this](const pb::DescribeRequest&, pb::DescribeResponse* r) {
          w_->FillDescribe(r);
        });
  }

 private:
  WorkerServer* w_;
};

// ------------------------------------------------------------------------------------------------
absl::StatusOr<HeldShare> ResolveExperts(const WorkerOptions& opt, const MoeConfig& cfg) {
  HeldShare share;
  share.shared_expert = opt.shared_expert;
  std::map<int, std::vector<int>>& out = share.experts;
  const bool by_ranges = !opt.experts.empty();
  const bool by_map = !opt.expert_map.empty();
  if (opt.shared_expert && !cfg.has_shared_expert()) {
    return absl::InvalidArgumentError(absl::StrCat("--shared-expert: the model (", cfg.architecture,
                                                   ") has no shared expert"));
  }
  if (!by_ranges && !by_map && opt.shared_expert) return share;  // the shared expert alone
  if (by_ranges == by_map) {
    return absl::InvalidArgumentError(
        "give either --experts RANGES or --expert-map FILE --worker NAME (or --shared-expert alone)");
  }
  if (by_ranges) {
    absl::StatusOr<std::vector<int32_t>> ids = ParseIndexRanges(opt.experts, cfg.num_experts);
    if (!ids.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--experts '", opt.experts, "': ",
                                                     std::string(ids.status().message()),
                                                     " (the model has ", cfg.num_experts,
                                                     " routed experts per layer, ids 0-",
                                                     cfg.num_experts - 1, ")"));
    }
    for (int layer : cfg.MoeLayers()) out[layer] = std::vector<int>(ids->begin(), ids->end());
    return share;
  }
  if (opt.worker_name.empty()) return absl::InvalidArgumentError("--expert-map needs --worker NAME");
  absl::StatusOr<ExpertMap> map = LoadExpertMap(opt.expert_map, cfg);
  if (!map.ok()) return map.status();
  const ExpertMapWorker* w = map->Find(opt.worker_name);
  if (w == nullptr) {
    std::string names;
    for (const auto& x : map->workers) absl::StrAppend(&names, names.empty() ? "" : ", ", x.name);
    return absl::NotFoundError(absl::StrCat("--worker '", opt.worker_name, "' is not in ",
                                            opt.expert_map, " (workers: ", names, ")"));
  }
  for (int layer : cfg.MoeLayers()) {
    if (layer < static_cast<int>(w->experts.size()) && !w->experts[layer].empty()) {
      out[layer] = std::vector<int>(w->experts[layer].begin(), w->experts[layer].end());
    }
  }
  if (w->shared_expert) {
    if (!cfg.has_shared_expert()) {
      return absl::InvalidArgumentError(absl::StrCat("worker '", opt.worker_name, "' in ", opt.expert_map,
                                                     ": shared_expert, but the model (", cfg.architecture,
                                                     ") has no shared expert"));
    }
    share.shared_expert = true;
  }
  if (out.empty() && !share.shared_expert) {
    return absl::InvalidArgumentError(absl::StrCat("worker '", opt.worker_name, "' holds no experts in ",
                                                   opt.expert_map));
  }
  return share;
}

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Create(const WorkerOptions& opt) {
  std::unique_ptr<WorkerServer> w(new WorkerServer());
  w->opt_ = opt;
  if (opt.model_dir.empty()) return absl::InvalidArgumentError("--model DIR is required");
  if (opt.max_batch_tokens < 1 || opt.long_prefill_token_threshold < 1 || opt.max_queue < 1 ||
      opt.batch_window_us < 0 || opt.inline_max_tokens < 0 || opt.prefill_chunk_us < 0 || opt.max_message_bytes < 4096 || opt.load_threads < 1) {
    return absl::InvalidArgumentError(
        "--max-batch-tokens, --long-prefill-token-threshold, --max-queue and --load-threads must be "
        ">= 1, --batch-window-us and --inline-max-tokens >= 0, --max-message-bytes >= 4096");
  }
  // Opening the model reads config.json and the safetensors headers and checks that every held
  // expert's tensors exist with the right shapes; the bytes are read by Load.
  {
    absl::StatusOr<MoeConfig> cfg = LoadMoeConfig(opt.model_dir);
    if (!cfg.ok()) return cfg.status();
    w->config_ = *cfg;
  }
  absl::StatusOr<HeldShare> share = ResolveExperts(opt, w->config_);
  if (!share.ok()) return share.status();
  w->experts_ = share->experts;
  w->shared_expert_ = share->shared_expert;
  Exl3ModelOptions mo;
  mo.experts = w->experts_;
  mo.load_shared_experts = w->shared_expert_;
  mo.load_routers = false;
  absl::StatusOr<std::unique_ptr<Exl3Model>> model = Exl3Model::Open(opt.model_dir, mo);
  if (!model.ok()) {
    return absl::Status(model.status().code(),
                        absl::StrCat("model ", opt.model_dir, " does not provide the experts asked for: ",
                                     std::string(model.status().message())));
  }
  w->model_ = std::move(*model);
  w->fingerprint_ = w->model_->fingerprint();
  if (!w->model_->fingerprint_covers_weights()) {
    svc::LogWarning("%s", w->model_->UncoveredWeightsWarning().c_str());
  }

  const MoeConfig& c = w->config_;
  ModelShape& sh = w->shape_;
  sh.hidden_size = c.hidden_size;
  sh.num_layers = c.num_hidden_layers;
  sh.num_experts = c.num_experts;
  sh.top_k = c.top_k;
  sh.moe_layer = c.moe_layers;
  sh.held.assign(c.num_hidden_layers, std::vector<bool>(c.num_experts, false));
  sh.held_ranges.assign(c.num_hidden_layers, "none");
  sh.shared_expert = w->shared_expert_;
  std::set<int> all_experts;
  for (const auto& [layer, ids] : w->experts_) {
    for (int e : ids) {
      sh.held[layer][e] = true;
      all_experts.insert(e);
    }
    sh.held_ranges[layer] = FormatIndexRanges(std::vector<int32_t>(ids.begin(), ids.end()));
  }
  w->limits_.max_message_bytes = opt.max_message_bytes;

  absl::StatusOr<std::unique_ptr<MoeBackend>> be = CreateBackend(opt.backend, opt.device, opt.threads);
  if (!be.ok()) return be.status();
  w->backend_ = std::move(*be);

  absl::StatusOr<std::unique_ptr<svc::MetricsEndpoint>> ep = svc::MetricsEndpoint::Start(opt.metrics_listen);
  if (!ep.ok()) return ep.status();
  w->metrics_ = std::move(*ep);
  w->worker_metrics_ = std::make_unique<WorkerMetrics>(
      w->metrics_->registry(), c.MoeLayers(), std::vector<int>(all_experts.begin(), all_experts.end()),
      w->backend_->name(), w->backend_->device(), EXL3_VERSION);
  w->worker_metrics_->ready().Set(0);

  w->service_ = std::make_unique<Service>(w.get());
  svc::ServerConfig sc;
  sc.listen = opt.listen;
  sc.tls = opt.tls;
  // gRPC's own limit is twice ours, so requests between the two are answered in-band with
  // RESOURCE_EXHAUSTED and the stream lives on; only larger ones end the stream.
  const uint64_t hard = std::min<uint64_t>(2 * opt.max_message_bytes, INT32_MAX);
  sc.max_receive_bytes = static_cast<int>(hard);
  sc.max_send_bytes = static_cast<int>(hard);
  sc.services = {w->service_.get()};
  sc.health_names = {pb::ExpertWorker::service_full_name()};
  absl::StatusOr<std::unique_ptr<svc::GrpcServer>> server = svc::GrpcServer::Start(sc);
  if (!server.ok()) return server.status();
  w->server_ = std::move(*server);
  return w;
}

WorkerServer::~WorkerServer() {
  {
    std::lock_guard<std::mutex> l(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watch_thread_.joinable()) watch_thread_.join();
  if (server_) server_->Shutdown(absl::ZeroDuration());
  if (scheduler_) scheduler_->Stop();
  // Reactors unregistered in OnDone during Shutdown; drop any left.
  std::lock_guard<std::mutex> l(streams_mu_);
  streams_.clear();
}

absl::Status WorkerServer::Load() {
  const auto t0 = Clock::now();
  PrepareOptions po;
  absl::StatusOr<WeightResidency> residency = ParseWeightResidency(opt_.weights_residency);
  if (!residency.ok()) return residency.status();
  po.residency = *residency;
  po.load_threads = opt_.load_threads;
  po.lock_memory = opt_.lock_memory;
  po.progress = opt_.progress;
  po.benchmark = opt_.load_benchmark;
  po.max_batch_tokens = opt_.max_batch_tokens;
  po.shared_expert = shared_expert_;
  PrepareStats st;
  if (absl::Status s = backend_->Prepare(*model_, po, &st); !s.ok()) return s;
  const double secs = Seconds(Clock::now() - t0);
  size_t held = 0;
  for (const auto& [l, ids] : experts_) held += ids.size();
  svc::LogInfo("loaded %zu experts over %zu layers%s: %.1f MB in %.3f s (%.2f GB/s read%s), "
               "%.1f MB pinned, backend %s (%s)",
               held, experts_.size(), shared_expert_ ? " and the shared experts" : "", st.bytes / 1e6, secs,
               st.read_seconds > 0 ? st.bytes / st.read_seconds / 1e9 : 0.0,
               st.baseline_gbps > 0
                   ? absl::StrCat("; plain parallel read ", st.baseline_gbps, " GB/s, ",
                                  static_cast<int>(100 * (st.bytes / st.read_seconds / 1e9) / st.baseline_gbps),
                                  "%").c_str()
                   : "",
               st.pinned_bytes / 1e6, backend_->name().c_str(), backend_->device().c_str());
  if (!st.note.empty()) svc::LogWarning("%s", st.note.c_str());
  worker_metrics_->pinned_bytes().Set(static_cast<double>(st.pinned_bytes));
  worker_metrics_->load_seconds().Set(secs);
  file_watch_ = std::make_unique<ModelFileWatch>(HeldTensorRanges(*model_, shared_expert_));
  watch_thread_ = std::thread([this] { WatchModelFiles(); });

  SchedulerOptions so;
  so.batch_window = std::chrono::microseconds(opt_.batch_window_us);
  so.inline_max_tokens = opt_.inline_max_tokens;
  so.max_batch_tokens = opt_.max_batch_tokens;
  so.long_prefill_tokens = opt_.long_prefill_token_threshold;
  so.max_queue = opt_.max_queue;
  so.prefill_chunk_us = opt_.prefill_chunk_us;
  so.on_backend_lost = [this](const absl::Status& why) {
    svc::LogError("the %s backend cannot compute any more (%s): not serving; the process exits "
                  "after answering what it holds", backend_->name().c_str(),
                  std::string(why.message()).c_str());
    BeginDrain();
    if (opt_.on_fatal) opt_.on_fatal(why);
  };
  scheduler_ = std::make_unique<Scheduler>(so, backend_.get(), worker_metrics_.get(), config_.hidden_size);
  scheduler_->Start();
  pb::ServingState expected = pb::STATE_LOADING;
  if (!state_.compare_exchange_strong(expected, pb::STATE_SERVING)) {
    return absl::UnavailableError("worker started draining while loading");
  }
  worker_metrics_->ready().Set(1);
  server_->SetServing(true);
  // The bound metrics port, not the flag: with port 0 the log is how a supervisor finds it.
  const std::string metrics_at =
      metrics_->port() == 0 ? std::string("none")
                            : absl::StrCat(opt_.metrics_listen.substr(0, opt_.metrics_listen.rfind(':')),
                                           ":", metrics_->port());
  svc::LogInfo("serving on %s, metrics on %s", server_->address().c_str(), metrics_at.c_str());
  return absl::OkStatus();
}

void WorkerServer::WatchModelFiles() {
  std::unique_lock<std::mutex> l(watch_mu_);
  while (!watch_cv_.wait_for(l, std::chrono::seconds(1), [this] { return watch_stop_; })) {
    for (const ModelFileWatch::Change& c : file_watch_->Check()) {
      svc::LogWarning("model file %s changed after the load: %s; %s", c.file.c_str(), c.what.c_str(),
                      backend_->name() == "cpu"
                          ? "the experts are served from the copy made at load (restart the worker "
                            "to load the new file)"
                          : "restart the worker to load the new file");
    }
    worker_metrics_->model_files_changed().Set(file_watch_->changed_files());
  }
}

absl::Status WorkerServer::Accept(pb::ExpertRequest&& msg, const std::shared_ptr<StreamReactor>& stream,
                                  Clock::time_point received, Clock::time_point stream_deadline,
                                  std::shared_ptr<WorkRequest>* accepted) {
  const pb::ServingState st = state_.load();
  if (st == pb::STATE_LOADING) return absl::UnavailableError("worker is still loading its experts");
  if (st == pb::STATE_DRAINING) return absl::UnavailableError("worker is draining (shutting down)");
  const size_t bytes = msg.ByteSizeLong();
  if (bytes > opt_.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("request ", msg.id(), " is ", bytes,
                                                     " bytes, over --max-message-bytes ",
                                                     opt_.max_message_bytes,
                                                     " (split it into smaller requests)"));
  }
  absl::StatusOr<std::shared_ptr<WorkRequest>> r = DecodeExpertRequest(std::move(msg), shape_, limits_, received);
  if (!r.ok()) return r.status();
  (*r)->deadline = std::min((*r)->deadline, stream_deadline);
  (*r)->sink = stream;
  *accepted = *r;
  return scheduler_->Submit(std::move(*r));
}

void WorkerServer::Cancel(const std::shared_ptr<WorkRequest>& r, int reason) {
  r->cancel_reason.store(reason);
  r->cancel_requested.store(true);
  if (scheduler_) scheduler_->Wake();
}

void WorkerServer::Register(const std::shared_ptr<StreamReactor>& s) {
  std::lock_guard<std::mutex> l(streams_mu_);
  streams_[s.get()] = s;
}

void WorkerServer::Unregister(StreamReactor* s) {
  std::shared_ptr<StreamReactor> keep;
  std::lock_guard<std::mutex> l(streams_mu_);
  auto it = streams_.find(s);
  if (it != streams_.end()) {
    keep = std::move(it->second);  // destroyed after the lock is released
    streams_.erase(it);
  }
}

void WorkerServer::BeginDrain() {
  const pb::ServingState prev = state_.exchange(pb::STATE_DRAINING);
  if (prev != pb::STATE_DRAINING) {
    svc::LogInfo("draining: health NOT_SERVING, new requests answered UNAVAILABLE");
  }
  server_->SetServing(false);
  worker_metrics_->ready().Set(0);
}

bool WorkerServer::Drain(absl::Duration timeout) {
  BeginDrain();
  const absl::Time until = absl::Now() + timeout;
  auto all_idle = [&] {
    if (scheduler_ && scheduler_->InFlight() > 0) return false;
    std::vector<std::shared_ptr<StreamReactor>> ss;
    {
      std::lock_guard<std::mutex> l(streams_mu_);
      for (auto& [p, s] : streams_) ss.push_back(s);
    }
    for (auto& s : ss) {
      if (!s->Idle()) return false;
    }
    return true;
  };
  bool clean = true;
  while (!all_idle()) {
    if (absl::Now() >= until) {
      clean = false;
      svc::LogWarning("drain timeout: %d requests still in flight",
                      scheduler_ ? scheduler_->InFlight() : 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Answer whatever is left (only after a timeout), then end the streams.
  if (scheduler_) scheduler_->Stop();
  {
    std::vector<std::shared_ptr<StreamReactor>> ss;
    {
      std::lock_guard<std::mutex> l(streams_mu_);
      for (auto& [p, s] : streams_) ss.push_back(s);
    }
    for (auto& s : ss) {
      s->FinishWhenIdle(grpc::Status(grpc::StatusCode::UNAVAILABLE, "server draining"));
    }
  }
  // Give the final writes and Finish calls a moment, then stop the server.
  const absl::Time streams_until = std::min(until, absl::Now() + absl::Seconds(5));
  while (absl::Now() < streams_until) {
    {
      std::lock_guard<std::mutex> l(streams_mu_);
      if (streams_.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  server_->Shutdown(absl::Milliseconds(500));
  svc::LogInfo("drained%s", clean ? "" : " (timeout)");
  return clean;
}

void WorkerServer::FillDescribe(pb::DescribeResponse* out) const {
  const MoeConfig& c = config_;
  pb::ModelIdentity* m = out->mutable_model();
  m->set_fingerprint(fingerprint_);
  m->set_architecture(c.architecture);
  m->set_hidden_size(c.hidden_size);
  m->set_num_layers(c.num_hidden_layers);
  for (int l : c.MoeLayers()) m->add_moe_layers(l);
  m->set_num_experts(c.num_experts);
  m->set_top_k(c.top_k);
  m->set_moe_intermediate_size(c.moe_intermediate_size);
  m->set_bits(c.bits);
  for (const auto& [layer, ids] : experts_) {
    pb::LayerExperts* le = out->add_experts();
    le->set_layer(layer);
    for (int e : ids) le->add_experts(e);
  }
  out->set_worker_name(opt_.worker_name);
  out->set_backend(backend_->name());
  out->set_device(backend_->device());
  out->set_pinned_bytes(state_.load() == pb::STATE_LOADING ? 0 : backend_->pinned_bytes());
  pb::Versions* v = out->mutable_versions();
  v->set_server(EXL3_VERSION);
  v->set_protocol("exl3serve.v1");
  v->set_grpc(grpc::Version());
  v->set_git(EXL3_GIT_DESCRIBE);
  out->set_state(state_.load());
  out->set_max_message_bytes(opt_.max_message_bytes);
  out->set_max_batch_tokens(opt_.max_batch_tokens);
  out->set_long_prefill_token_threshold(opt_.long_prefill_token_threshold);
  out->set_max_queue(opt_.max_queue);
  out->set_cancel_supported(true);
  out->set_holds_shared_expert(shared_expert_);
  out->set_shm_supported(opt_.shm);
  out->set_host_id(svc::HostId());
}

}  // namespace exl3::worker
