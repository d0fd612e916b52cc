#include "services/expert_worker/worker_server.h"

#include <algorithm>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/command_line.h"
#include "grpcpp/grpcpp.h"
#include "model/config/read_moe_config.h"
#include "model/expert_map.h"
#include "base/logging.h"
#include "services/common/raw_message.h"
#include "services/common/shm_channel.h"
#include "services/expert_worker/worker_stream.h"
#include "services/common/status.h"
#include "services/common/wire.h"


namespace exl3::worker {

namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

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
    auto r = std::make_shared<WorkerStream>(w_, ctx);
    r->Start();
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
  // Opening the model reads the safetensors headers and checks that every held expert's tensors
  // exist with the right shapes; the bytes are read by Load. config.json is read once, here: the
  // share is resolved against it and the model (its fingerprint included) opened from it.
  absl::StatusOr<ConfigFile> config_file = ConfigFile::Read(opt.model_dir);
  if (!config_file.ok()) return config_file.status();
  {
    absl::StatusOr<MoeConfig> cfg = ReadMoeConfig(*config_file);
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
  absl::StatusOr<std::unique_ptr<Exl3Model>> model = Exl3Model::Open(opt.model_dir, *config_file, mo);
  if (!model.ok()) {
    return absl::Status(model.status().code(),
                        absl::StrCat("model ", opt.model_dir, " does not provide the experts asked for: ",
                                     std::string(model.status().message())));
  }
  w->model_ = std::move(*model);
  w->fingerprint_ = w->model_->fingerprint();
  if (!w->model_->fingerprint_covers_weights()) {
    exl3::LogWarning("%s", w->model_->UncoveredWeightsWarning().c_str());
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
      w->backend_->name(), w->backend_->device(), std::string(ProjectVersion()));
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
  exl3::LogInfo("loaded %zu experts over %zu layers%s: %.1f MB in %.3f s (%.2f GB/s read%s), "
               "%.1f MB pinned, backend %s (%s)",
               held, experts_.size(), shared_expert_ ? " and the shared experts" : "", st.bytes / 1e6, secs,
               st.read_seconds > 0 ? st.bytes / st.read_seconds / 1e9 : 0.0,
               st.baseline_gbps > 0
                   ? absl::StrCat("; plain parallel read ", st.baseline_gbps, " GB/s, ",
                                  static_cast<int>(100 * (st.bytes / st.read_seconds / 1e9) / st.baseline_gbps),
                                  "%").c_str()
                   : "",
               st.pinned_bytes / 1e6, backend_->name().c_str(), backend_->device().c_str());
  if (!st.note.empty()) exl3::LogWarning("%s", st.note.c_str());
  worker_metrics_->pinned_bytes().Set(static_cast<double>(st.pinned_bytes));
  worker_metrics_->load_seconds().Set(secs);
  file_watch_ = std::make_unique<ModelFileWatch>(FilesOf(HeldTensorRanges(*model_, shared_expert_)));
  watch_thread_ = std::thread([this] { WatchModelFiles(); });

  SchedulerOptions so;
  so.batch_window = std::chrono::microseconds(opt_.batch_window_us);
  so.inline_max_tokens = opt_.inline_max_tokens;
  so.max_batch_tokens = opt_.max_batch_tokens;
  so.long_prefill_tokens = opt_.long_prefill_token_threshold;
  so.max_queue = opt_.max_queue;
  so.prefill_chunk_us = opt_.prefill_chunk_us;
  so.on_backend_lost = [this](const absl::Status& why) {
    exl3::LogError("the %s backend cannot compute any more (%s): not serving; the process exits "
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
  exl3::LogInfo("serving on %s, metrics on %s", server_->address().c_str(), metrics_at.c_str());
  return absl::OkStatus();
}

void WorkerServer::WatchModelFiles() {
  std::unique_lock<std::mutex> l(watch_mu_);
  while (!watch_cv_.wait_for(l, std::chrono::seconds(1), [this] { return watch_stop_; })) {
    for (const ModelFileWatch::Change& c : file_watch_->Check()) {
      exl3::LogWarning("model file %s changed after the load: %s; %s", c.file.c_str(), c.what.c_str(),
                      backend_->name() == "cpu"
                          ? "the experts are served from the copy made at load (restart the worker "
                            "to load the new file)"
                          : "restart the worker to load the new file");
    }
    worker_metrics_->model_files_changed().Set(file_watch_->changed_files());
  }
}

absl::Status WorkerServer::Accept(pb::ExpertRequest&& msg, const std::shared_ptr<WorkerStream>& stream,
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
  (*r)->out_bytes = stream->TakeSpareOutput();  // resized by Submit: warm when reused
  *accepted = *r;
  return scheduler_->Submit(std::move(*r));
}

void WorkerServer::Cancel(const std::shared_ptr<WorkRequest>& r, int reason) {
  r->cancel_reason.store(reason);
  r->cancel_requested.store(true);
  if (scheduler_) scheduler_->Wake();
}

void WorkerServer::Register(const std::shared_ptr<WorkerStream>& s) {
  std::lock_guard<std::mutex> l(streams_mu_);
  streams_[s.get()] = s;
}

void WorkerServer::Unregister(WorkerStream* s) {
  std::shared_ptr<WorkerStream> keep;
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
    exl3::LogInfo("draining: health NOT_SERVING, new requests answered UNAVAILABLE");
  }
  server_->SetServing(false);
  worker_metrics_->ready().Set(0);
}

bool WorkerServer::Drain(absl::Duration timeout) {
  BeginDrain();
  const absl::Time until = absl::Now() + timeout;
  auto all_idle = [&] {
    if (scheduler_ && scheduler_->InFlight() > 0) return false;
    std::vector<std::shared_ptr<WorkerStream>> ss;
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
      exl3::LogWarning("drain timeout: %d requests still in flight",
                      scheduler_ ? scheduler_->InFlight() : 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Answer whatever is left (only after a timeout), then end the streams.
  if (scheduler_) scheduler_->Stop();
  {
    std::vector<std::shared_ptr<WorkerStream>> ss;
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
  exl3::LogInfo("drained%s", clean ? "" : " (timeout)");
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
  v->set_server(std::string(ProjectVersion()));
  v->set_protocol("exl3serve.v1");
  v->set_grpc(grpc::Version());
  v->set_git(std::string(GitDescribe()));
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
