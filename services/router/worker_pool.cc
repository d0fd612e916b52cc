#include "services/router/worker_pool.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/logging.h"
#include "services/common/status.h"
#include "services/router/health_v1.grpc.pb.h"
#include "services/router/router_metrics.h"

namespace exl3::router {

using Clock = std::chrono::steady_clock;

// One Forward stream to a worker and the sub-requests waiting for their answers on it.
struct WorkerConn::Session {
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<pb::ExpertRequest, pb::ExpertResponse>> stream;
  // Requests are written by the session's writer thread from `outq`, so that no caller (an engine
  // stream dispatching, a reader failing over) ever blocks on a slow or frozen worker.
  std::mutex write_mu;
  std::condition_variable write_cv;
  bool open = true;  // guarded by write_mu: writes allowed
  std::deque<pb::ExpertRequest> outq;  // guarded by write_mu
  size_t queued_bytes = 0;             // guarded by write_mu: bytes in outq
  std::thread writer;

  void RunWriter() {
    std::unique_lock<std::mutex> l(write_mu);
    while (true) {
      write_cv.wait(l, [&] { return !outq.empty() || !open; });
      if (!open) return;
      pb::ExpertRequest r = std::move(outq.front());
      outq.pop_front();
      if (!r.has_cancel()) queued_bytes -= std::min(queued_bytes, r.ByteSizeLong());
      l.unlock();
      const bool ok = stream->Write(r);
      l.lock();
      if (!ok) {
        open = false;  // the reader sees the stream end and fails what is pending
        return;
      }
    }
  }
  std::mutex pending_mu;
  bool closed = false;  // guarded by pending_mu: no new pending entries
  uint64_t next_id = 1;
  struct Pending {
    SubCallback cb;
    Clock::time_point sent;
  };
  std::unordered_map<uint64_t, Pending> pending;
};

absl::StatusOr<std::vector<std::string>> SharedExpertWorkers(const ExpertMap& map,
                                                             const std::string& name) {
  const ExpertMapWorker* named = map.Find(name);
  if (named == nullptr) {
    std::vector<std::string> names;
    for (const auto& w : map.workers) names.push_back(w.name);
    return absl::FailedPreconditionError(absl::StrCat(
        "--shared-expert worker:", name, ": no worker \"", name, "\" in the expert map ", map.source,
        " (workers: ", absl::StrJoin(names, ", "), ")"));
  }
  if (!named->shared_expert) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--shared-expert worker:", name, ": worker \"", name, "\" in ", map.source,
        " is not marked `shared_expert: true` (it would not load the shared expert)"));
  }
  std::vector<std::string> out = {name};
  for (const auto& w : map.workers) {
    if (w.shared_expert && w.name != name) out.push_back(w.name);
  }
  return out;
}

WorkerConn::WorkerConn(const ExpertMapWorker& w, const MoeConfig& cfg,
                       const WorkerPoolOptions& opt, RouterMetrics* metrics)
    : spec_(w),
      cfg_(cfg),
      opt_(opt),
      metrics_(metrics),
      serves_shared_(!opt.shared_expert_worker.empty() && w.shared_expert) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(opt.max_message_bytes);
  args.SetMaxSendMessageSize(opt.max_message_bytes);
  // A restarted worker must be found again within about a second, not after gRPC's default
  // reconnect backoff (up to 120 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, opt.backoff_initial_ms);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, opt.backoff_initial_ms);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, opt.backoff_max_ms);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Each worker gets its own connection even when two share an address (tests, replicas).
  args.SetInt("exl3.worker_channel", static_cast<int>(std::hash<std::string>()(w.name) & 0x7fffffff));
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (opt.tls.enabled) {
    auto c = svc::MakeChannelCredentials(opt.tls);
    if (c.ok()) {
      creds = *c;
    } else {
      svc::LogError("worker %s: %s", w.name.c_str(), std::string(c.status().message()).c_str());
    }
  }
  channel_ = grpc::CreateCustomChannel(w.address, creds, args);
  stub_ = pb::ExpertWorker::NewStub(channel_);
}

WorkerConn::~WorkerConn() { Stop(); }

void WorkerConn::Start() { supervisor_ = std::thread([this] { Supervise(); }); }

void WorkerConn::Stop() {
  if (stop_.exchange(true)) {
    if (supervisor_.joinable()) supervisor_.join();
    return;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    if (watch_ctx_) watch_ctx_->TryCancel();
    if (session_) session_->ctx->TryCancel();
  }
  cv_.notify_all();
  if (supervisor_.joinable()) supervisor_.join();
}

std::string WorkerConn::state_message() const {
  std::lock_guard<std::mutex> l(mu_);
  return up_ ? "" : why_down_;
}
std::string WorkerConn::backend() const {
  std::lock_guard<std::mutex> l(mu_);
  return backend_;
}
std::string WorkerConn::device() const {
  std::lock_guard<std::mutex> l(mu_);
  return device_;
}

void WorkerConn::SetUp(bool up, const std::string& why) {
  bool changed;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!up) why_down_ = why;
    changed = up_.exchange(up) != up;
  }
  if (!changed) return;
  if (up) {
    svc::LogInfo("worker %s (%s) is up", spec_.name.c_str(), spec_.address.c_str());
  } else {
    svc::LogWarning("worker %s (%s) is down: %s", spec_.name.c_str(), spec_.address.c_str(),
                    why.c_str());
  }
  if (metrics_) metrics_->WorkerUp(spec_.name, up);
  if (opt_.on_change) opt_.on_change();
}

absl::Status WorkerConn::CheckDescribe(const pb::DescribeResponse& d) const {
  if (!opt_.fingerprint.empty() && d.model().fingerprint() != opt_.fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model fingerprint ", d.model().fingerprint(), " (", d.model().architecture(),
        ") differs from the router's ", opt_.fingerprint, ": not the same model directory"));
  }
  if (serves_shared_ && !d.holds_shared_expert()) {
    return absl::FailedPreconditionError(
        "does not hold the shared expert the router's --shared-expert worker:NAME gives it (start "
        "it with --shared-expert, or with the expert map entry marked shared_expert: true)");
  }
  // Every expert the map assigns must be held.
  std::vector<std::vector<int32_t>> held(cfg_.num_hidden_layers);
  for (const auto& le : d.experts()) {
    if (le.layer() >= 0 && le.layer() < cfg_.num_hidden_layers) {
      held[le.layer()].assign(le.experts().begin(), le.experts().end());
      std::sort(held[le.layer()].begin(), held[le.layer()].end());
    }
  }
  std::vector<std::string> gaps;
  for (int L = 0; L < cfg_.num_hidden_layers; ++L) {
    std::vector<int32_t> missing;
    for (int e : spec_.experts[L]) {
      if (!std::binary_search(held[L].begin(), held[L].end(), e)) missing.push_back(e);
    }
    if (!missing.empty()) gaps.push_back(absl::StrCat("layer ", L, " experts ", FormatIndexRanges(missing)));
    if (gaps.size() >= 4) break;
  }
  if (!gaps.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "does not hold experts the map assigns to it: ", absl::StrJoin(gaps, "; ")));
  }
  return absl::OkStatus();
}

void WorkerConn::Supervise() {
  std::mt19937 rng(std::hash<std::string>()(spec_.name) ^ static_cast<unsigned>(
                       Clock::now().time_since_epoch().count()));
  int backoff_ms = opt_.backoff_initial_ms;
  std::string last_logged;
  while (!stop_) {
    const auto t0 = Clock::now();
    absl::Status st = RunSession();
    if (stop_) break;
    const std::string msg = std::string(st.message());
    SetUp(false, msg);
    if (msg != last_logged) {
      svc::LogInfo("worker %s (%s): %s; retrying", spec_.name.c_str(), spec_.address.c_str(),
                   msg.c_str());
      last_logged = msg;
    }
    // A session that lasted resets the backoff: the next failure is a new incident.
    if (Clock::now() - t0 > std::chrono::seconds(5)) backoff_ms = opt_.backoff_initial_ms;
    std::uniform_real_distribution<double> jitter(0.8, 1.2);
    const int wait_ms = static_cast<int>(backoff_ms * jitter(rng));
    backoff_ms = std::min(backoff_ms * 2, opt_.backoff_max_ms);
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, std::chrono::milliseconds(wait_ms), [&] { return stop_.load(); });
  }
  SetUp(false, "stopped");
}

absl::Status WorkerConn::RunSession() {
  // 1. Identity.
  pb::DescribeResponse d;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    grpc::Status gs = stub_->Describe(&ctx, pb::DescribeRequest(), &d);
    if (!gs.ok()) return absl::UnavailableError(absl::StrCat("Describe failed: ", gs.error_message()));
  }
  absl::Status ident = CheckDescribe(d);
  if (!ident.ok()) return ident;
  {
    std::lock_guard<std::mutex> l(mu_);
    backend_ = d.backend();
    device_ = d.device();
  }
  cancel_supported_ = d.cancel_supported();
  // 2. Health watch and the Forward stream.
  auto health = grpc::health::v1::Health::NewStub(channel_);
  auto watch_ctx = std::make_shared<grpc::ClientContext>();
  auto session = std::make_shared<Session>();
  session->ctx = std::make_unique<grpc::ClientContext>();
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stop_) return absl::CancelledError("stopped");
    watch_ctx_ = watch_ctx;
  }
  grpc::health::v1::HealthCheckRequest hreq;  // service "": the whole server
  auto watch = health->Watch(watch_ctx.get(), hreq);
  session->stream = stub_->Forward(session->ctx.get());
  session->writer = std::thread([session] { session->RunWriter(); });
  {
    std::lock_guard<std::mutex> l(mu_);
    session_ = session;
    if (stop_) session->ctx->TryCancel();
  }
  std::thread reader([this, session, watch_ctx] {
    ReadLoop(session);
    watch_ctx->TryCancel();  // wakes the health read below
  });
  grpc::health::v1::HealthCheckResponse h;
  std::string why = "health watch ended";
  while (watch->Read(&h)) {
    const bool serving = h.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    bool open;
    {
      std::lock_guard<std::mutex> l(session->write_mu);
      open = session->open;
    }
    SetUp(serving && open, serving ? "Forward stream closed" : "health NOT_SERVING");
  }
  grpc::Status ws = watch->Finish();
  if (!ws.ok()) why = absl::StrCat("connection lost: ", ws.error_message());
  SetUp(false, why);
  session->ctx->TryCancel();
  reader.join();
  {
    std::lock_guard<std::mutex> l(mu_);
    session_.reset();
    watch_ctx_.reset();
  }
  return absl::UnavailableError(why);
}

void WorkerConn::ReadLoop(std::shared_ptr<Session> s) {
  pb::ExpertResponse resp;
  while (s->stream->Read(&resp)) {
    Session::Pending p;
    {
      std::lock_guard<std::mutex> l(s->pending_mu);
      auto it = s->pending.find(resp.id());
      if (it == s->pending.end()) continue;  // unknown id: ignore (should not happen)
      p = std::move(it->second);
      s->pending.erase(it);
    }
    if (metrics_) {
      metrics_->Received(resp.ByteSizeLong());
      metrics_->WorkerRpc(spec_.name,
                          std::chrono::duration<double>(Clock::now() - p.sent).count());
    }
    outstanding_.fetch_sub(1);
    p.cb(absl::OkStatus(), &resp);
  }
  {
    std::lock_guard<std::mutex> l(s->write_mu);
    s->open = false;
  }
  s->write_cv.notify_all();
  s->ctx->TryCancel();  // unblocks a writer stuck in Write; no-op when the call already ended
  s->writer.join();     // no Write may run concurrently with Finish
  grpc::Status st = s->stream->Finish();
  std::unordered_map<uint64_t, Session::Pending> failed;
  {
    std::lock_guard<std::mutex> l(s->pending_mu);
    s->closed = true;
    failed.swap(s->pending);
  }
  SetUp(false, absl::StrCat("Forward stream ended: ", st.error_message()));
  const absl::Status why = absl::UnavailableError(absl::StrCat(
      "worker ", spec_.name, " (", spec_.address, ") stream ended: ",
      st.ok() ? std::string("closed by the worker") : st.error_message()));
  for (auto& [id, p] : failed) {
    outstanding_.fetch_sub(1);
    p.cb(why, nullptr);
  }
}

absl::Status WorkerConn::Send(pb::ExpertRequest* req, size_t request_bytes, SubCallback cb,
                              SubHandle* handle) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> l(mu_);
    s = session_;
  }
  if (!up_ || !s) {
    return absl::UnavailableError(absl::StrCat("worker ", spec_.name, " (", spec_.address,
                                               ") is not serving: ", state_message()));
  }
  uint64_t id;
  {
    std::lock_guard<std::mutex> l(s->pending_mu);
    if (s->closed) {
      return absl::UnavailableError(absl::StrCat("worker ", spec_.name, " stream closed"));
    }
    id = s->next_id++;
    s->pending[id] = Session::Pending{std::move(cb), Clock::now()};
  }
  outstanding_.fetch_add(1);
  req->set_id(id);
  bool ok;
  bool full = false;
  {
    std::lock_guard<std::mutex> l(s->write_mu);
    // A worker that stopped reading (frozen) must not grow the router's memory without bound.
    full = s->queued_bytes + request_bytes > static_cast<size_t>(4) * opt_.max_message_bytes;
    ok = s->open && !full;
    if (ok) {
      s->queued_bytes += request_bytes;
      s->outq.push_back(std::move(*req));
    }
  }
  if (ok) {
    s->write_cv.notify_one();
    if (metrics_) metrics_->Sent(request_bytes);
    if (handle != nullptr) *handle = SubHandle{s, id};
    return absl::OkStatus();
  }
  // Not written: take the entry back unless the stream's teardown already answered it.
  std::lock_guard<std::mutex> l(s->pending_mu);
  if (s->pending.erase(id) == 1) {
    outstanding_.fetch_sub(1);
    if (full) {
      return absl::UnavailableError(absl::StrCat(
          "worker ", spec_.name, " (", spec_.address, ") is not reading: ",
          4 * static_cast<int64_t>(opt_.max_message_bytes), " bytes of requests already queued"));
    }
    return absl::UnavailableError(absl::StrCat("worker ", spec_.name, " (", spec_.address,
                                               "): write to the Forward stream failed"));
  }
  return absl::OkStatus();
}

void WorkerConn::Cancel(const SubHandle& h, pb::CancelReason reason) {
  std::shared_ptr<Session> s = h.session.lock();
  if (!s || h.id == 0) return;
  {
    std::lock_guard<std::mutex> l(s->pending_mu);
    if (s->pending.count(h.id) == 0) return;  // answered (or failed with the stream) already
  }
  bool withdrawn = false, sent = false;
  {
    std::lock_guard<std::mutex> l(s->write_mu);
    if (!s->open) return;  // the stream is ending: the reader fails what is pending
    for (auto it = s->outq.begin(); it != s->outq.end(); ++it) {
      if (it->id() == h.id && !it->has_cancel()) {
        s->queued_bytes -= std::min(s->queued_bytes, it->ByteSizeLong());
        s->outq.erase(it);
        withdrawn = true;
        break;
      }
    }
    if (!withdrawn && cancel_supported_) {
      pb::ExpertRequest c;
      c.set_id(h.id);
      c.mutable_cancel()->set_reason(reason);
      s->outq.push_back(std::move(c));
      sent = true;
    }
  }
  if (sent) s->write_cv.notify_one();
  if (withdrawn) {
    // Never written: the worker knows nothing of it; answer it here.
    Session::Pending p;
    {
      std::lock_guard<std::mutex> l(s->pending_mu);
      auto it = s->pending.find(h.id);
      if (it == s->pending.end()) return;
      p = std::move(it->second);
      s->pending.erase(it);
    }
    outstanding_.fetch_sub(1);
    p.cb(absl::CancelledError(absl::StrCat("withdrawn before it was sent to worker ", spec_.name)),
         nullptr);
  }
  if ((withdrawn || sent) && metrics_) metrics_->WorkerCancel(reason);
}

// ---- WorkerPool ----

std::shared_ptr<WorkerPool> WorkerPool::Create(const ExpertMap& map, const MoeConfig& cfg,
                                               const WorkerPoolOptions& opt,
                                               const WorkerPool* reuse, RouterMetrics* metrics) {
  std::shared_ptr<WorkerPool> p(new WorkerPool());
  p->moe_layers_ = cfg.MoeLayers();
  p->num_experts_ = cfg.num_experts;
  // One more holder list per layer: the shared expert's (pseudo expert id num_experts).
  p->holders_.assign(cfg.num_hidden_layers, std::vector<std::vector<int>>(cfg.num_experts + 1));
  p->shared_on_workers_ = !opt.shared_expert_worker.empty();
  for (const ExpertMapWorker& w : map.workers) {
    std::shared_ptr<WorkerConn> conn;
    if (reuse) {
      for (const auto& old : reuse->workers_) {
        if (old->name() == w.name && old->address() == w.address &&
            old->spec().experts == w.experts && old->spec().shared_expert == w.shared_expert) {
          conn = old;
        }
      }
    }
    if (!conn) {
      if (metrics) metrics->AddWorker(w.name);
      conn = std::make_shared<WorkerConn>(w, cfg, opt, metrics);
      conn->Start();
    }
    const int idx = static_cast<int>(p->workers_.size());
    p->workers_.push_back(conn);
    for (int L = 0; L < cfg.num_hidden_layers; ++L) {
      for (int e : w.experts[L]) p->holders_[L][e].push_back(idx);
    }
  }
  if (p->shared_on_workers_) {
    // The named worker first, then its replicas (SharedExpertWorkers' order).
    auto names = SharedExpertWorkers(map, opt.shared_expert_worker);
    for (const std::string& n : names.ok() ? *names : std::vector<std::string>{}) {
      for (int i = 0; i < p->num_workers(); ++i) {
        if (p->workers_[i]->name() != n) continue;
        for (int L : p->moe_layers_) p->holders_[L][cfg.num_experts].push_back(i);
      }
    }
  }
  return p;
}

WorkerPool::~WorkerPool() = default;

void WorkerPool::StopUnshared(const WorkerPool& next) {
  for (const auto& w : workers_) {
    bool shared = false;
    for (const auto& n : next.workers_) shared |= n == w;
    if (!shared) w->Stop();
  }
}

int WorkerPool::UnservedExperts() const {
  int n = 0;
  for (int L : moe_layers_) {
    for (int e = 0; e < num_experts_ + (shared_on_workers_ ? 1 : 0); ++e) {
      bool served = false;
      for (int i : holders_[L][e]) served |= workers_[i]->up();
      n += served ? 0 : 1;
    }
  }
  return n;
}

}  // namespace exl3::router
