#include "services/router/worker_pool.h"

#include <algorithm>
#include <chrono>
#include <list>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/logging.h"
#include "services/common/shm_channel.h"
#include "services/common/status.h"
#include "services/router/health_v1.grpc.pb.h"
#include "services/router/router_metrics.h"

namespace exl3::router {

using Clock = std::chrono::steady_clock;

// One Forward stream to a worker (a gRPC callback reactor) and the sub-requests waiting for their
// answers on it. Requests are queued and written one at a time, the next write started by
// OnWriteDone, so no caller (an engine stream dispatching, a reaction failing over) ever blocks on a
// slow or frozen worker, and no thread of the router's own sits between the caller and the socket.
// Answers run their callbacks on the reaction's thread. The session ends (OnDone) when the stream
// does: every sub-request still pending then gets its callback with UNAVAILABLE.
//
// gRPC's Start* calls never run reactions inline, so they are made under `mu`; `open` (cleared
// under `mu` by the reaction that sees the stream end) keeps any operation from being started
// after the last one completed.
//
// With a shared-memory channel attached (same-host worker, OfferShm), messages that fit go through
// it instead of the stream and a reader thread of the session takes the answers from it, running
// their callbacks there. The stream stays open as the channel's lifeline: the session ends when
// either ends or breaks.
struct WorkerConn::Session : grpc::ClientBidiReactor<pb::ExpertRequest, pb::ExpertResponse> {
  Session(WorkerConn* c, std::shared_ptr<grpc::ClientContext> watch)
      : conn(c), watch_ctx(std::move(watch)) {}

  WorkerConn* const conn;  // outlives the session's OnDone (RunSession waits for it)
  grpc::ClientContext ctx;
  const std::shared_ptr<grpc::ClientContext> watch_ctx;  // the health watch, woken when we end
  std::shared_ptr<Session> self;  // keeps the reactor alive until OnDone

  std::mutex mu;
  bool open = true;  // guarded by mu: writes allowed
  struct Out {
    pb::ExpertRequest msg;
    size_t bytes;  // counted in queued_bytes (0 for cancel messages)
  };
  // guarded by mu: the front is being written while `writing`. A list: Cancel erases from the
  // middle without moving the message being written.
  std::list<Out> outq;
  bool writing = false;     // guarded by mu
  size_t queued_bytes = 0;  // guarded by mu: request bytes in outq
  bool closed = false;      // guarded by mu: no new pending entries
  uint64_t next_id = 1;     // guarded by mu
  struct Pending {
    SubCallback cb;
    Clock::time_point sent;
  };
  std::unordered_map<uint64_t, Pending> pending;  // guarded by mu
  bool done = false;                              // guarded by mu: OnDone ran
  std::condition_variable done_cv;
  pb::ExpertResponse resp;  // the read buffer
  std::shared_ptr<svc::ShmChannel> shm;  // guarded by mu: set once attached
  std::thread shm_reader;                // joined by RunSession after WaitDone
  std::atomic<bool> ending{false};       // OnDone ran or is running
  std::string end_reason;                // guarded by mu: why the router ended it (End), or ""

  // The router ends the session (the worker is silent): the pending sub-requests fail with `why`.
  void End(const std::string& why) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (end_reason.empty()) end_reason = why;
    }
    ctx.TryCancel();
  }

  bool IsOpen() {
    std::lock_guard<std::mutex> l(mu);
    return open;
  }
  // Queues `m` under mu and starts writing when idle; through the shared-memory channel instead
  // when one is attached and has room (under mu: its one writer).
  void QueueLocked(pb::ExpertRequest m, size_t bytes) {
    if (shm != nullptr) {
      const size_t n = m.ByteSizeLong();
      if (shm->TryWrite(n, [&](uint8_t* dst) { m.SerializeWithCachedSizesToArray(dst); })) return;
    }
    queued_bytes += bytes;
    outq.push_back(Out{std::move(m), bytes});
    if (!writing) {
      writing = true;
      StartWrite(&outq.front().msg);
    }
  }
  void WaitDone() {
    std::unique_lock<std::mutex> l(mu);
    done_cv.wait(l, [&] { return done; });
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      {
        std::lock_guard<std::mutex> l(mu);
        open = false;
      }
      ctx.TryCancel();         // the call ends now even if a write is stuck
      watch_ctx->TryCancel();  // wakes the supervisor's health read
      return;
    }
    Deliver(resp);
    resp.Clear();
    std::lock_guard<std::mutex> l(mu);
    if (open) StartRead(&resp);
  }

  // One answer, from the stream or the channel: runs its sub-request's callback.
  void Deliver(pb::ExpertResponse& r) {
    Pending p;
    {
      std::lock_guard<std::mutex> l(mu);
      auto it = pending.find(r.id());
      if (it == pending.end()) return;  // unknown id: ignore (should not happen)
      p = std::move(it->second);
      pending.erase(it);
    }
    conn->Heard();
    if (conn->metrics_) {
      conn->metrics_->Received(r.ByteSizeLong());
      conn->metrics_->WorkerRpc(conn->spec_.name,
                                std::chrono::duration<double>(Clock::now() - p.sent).count());
    }
    conn->outstanding_.fetch_sub(1);
    p.cb(absl::OkStatus(), &r);
  }

  // The channel's reader thread: answers until the channel closes; then the session ends too.
  void ReadShm(std::shared_ptr<svc::ShmChannel> ch) {
    pb::ExpertResponse r;
    for (;;) {
      bool parsed = false;
      if (!ch->Read([&](const uint8_t* p, size_t n) { parsed = r.ParseFromArray(p, static_cast<int>(n)); })) {
        break;
      }
      if (!parsed) {
        ch->Close();
        svc::LogWarning("worker %s: an answer in shared memory does not parse; ending the session",
                        conn->spec_.name.c_str());
        break;
      }
      Deliver(r);
      r.Clear();
    }
    if (!ch->error().ok()) {
      svc::LogWarning("worker %s: shared-memory channel: %s; ending the session",
                      conn->spec_.name.c_str(), std::string(ch->error().message()).c_str());
    }
    if (!ending.load()) ctx.TryCancel();  // pending answers fail over with the stream's end
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> l(mu);
    queued_bytes -= std::min(queued_bytes, outq.front().bytes);
    outq.pop_front();
    if (!ok || !open) {
      // The stream is ending: what was not written is failed with the pending entries in OnDone.
      if (!ok) ctx.TryCancel();
      open = false;
      writing = false;
      for (const Out& o : outq) queued_bytes -= std::min(queued_bytes, o.bytes);
      outq.clear();
      return;
    }
    if (outq.empty()) {
      writing = false;
      return;
    }
    StartWrite(&outq.front().msg);
  }

  void OnDone(const grpc::Status& st) override {
    ending.store(true);
    std::unordered_map<uint64_t, Pending> failed;
    std::string reason;
    {
      std::lock_guard<std::mutex> l(mu);
      reason = end_reason;
      if (shm) shm->Close();  // wakes its reader, which returns
      open = false;
      closed = true;
      outq.clear();
      queued_bytes = 0;
      writing = false;
      failed.swap(pending);
    }
    watch_ctx->TryCancel();
    if (conn->metrics_) conn->metrics_->WorkerShm(conn->spec_.name, false);
    if (reason.empty()) {
      reason = st.ok() ? std::string("closed by the worker") : st.error_message();
    }
    conn->SetUp(false, absl::StrCat("Forward stream ended: ", reason));
    const absl::Status why = absl::UnavailableError(absl::StrCat(
        "worker ", conn->spec_.name, " (", conn->spec_.address, ") stream ended: ", reason));
    for (auto& [id, p] : failed) {
      conn->outstanding_.fetch_sub(1);
      p.cb(why, nullptr);
    }
    std::shared_ptr<Session> keep = std::move(self);  // RunSession still holds one
    {
      std::lock_guard<std::mutex> l(mu);
      done = true;
    }
    done_cv.notify_all();
  }
};

// The worker's gRPC health Watch as a callback reactor: its answers update the worker's up state
// on gRPC's threads. (A thread blocked in a synchronous Read would take part in gRPC's polling and
// pass every other stream's events on, one more wake-up per message.)
struct WorkerConn::HealthWatch : grpc::ClientReadReactor<grpc::health::v1::HealthCheckResponse> {
  HealthWatch(WorkerConn* c, std::shared_ptr<grpc::ClientContext> context,
              std::shared_ptr<Session> s)
      : conn(c), ctx(std::move(context)), session(std::move(s)) {}

  WorkerConn* const conn;  // outlives OnDone (RunSession waits for it)
  const std::shared_ptr<grpc::ClientContext> ctx;
  const std::shared_ptr<Session> session;
  grpc::health::v1::HealthCheckRequest req;  // service "": the whole server
  grpc::health::v1::HealthCheckResponse resp;
  std::shared_ptr<HealthWatch> self;  // keeps the reactor alive until OnDone has returned
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // guarded by mu
  std::string why;    // guarded by mu: why the watch ended

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    const bool serving = resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    conn->SetUp(serving && session->IsOpen(), serving ? "Forward stream closed" : "health NOT_SERVING");
    StartRead(&resp);
  }
  void OnDone(const grpc::Status& st) override {
    std::shared_ptr<HealthWatch> keep = std::move(self);
    std::lock_guard<std::mutex> l(mu);
    why = st.ok() ? std::string("health watch ended")
                  : absl::StrCat("connection lost: ", st.error_message());
    done = true;
    cv.notify_all();
  }
  // Returns why the watch ended.
  std::string Wait() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
    return why;
  }
  // Waits at most `d` for the watch to end: true (and *out = why) when it has.
  bool WaitFor(Clock::duration d, std::string* out) {
    std::unique_lock<std::mutex> l(mu);
    if (!cv.wait_for(l, d, [&] { return done; })) return false;
    *out = why;
    return true;
  }
};

// The liveness probe of one session: at most one grpc.health.v1 Check out at a time, on the
// worker's channel (the connection the Forward stream uses), with the liveness bound as its
// deadline. Any reply, SERVING or not, shows the worker's process runs and its connection carries
// data; a frozen process or a lost network answers nothing.
struct WorkerConn::Probe {
  struct Call {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;  // service "": the whole server
    grpc::health::v1::HealthCheckResponse resp;
  };
  Probe(WorkerConn* c, grpc::health::v1::Health::Stub* h) : conn(c), health(h) {}
  WorkerConn* const conn;  // outlives the probe's callback (Finish waits for it)
  grpc::health::v1::Health::Stub* const health;
  std::mutex mu;
  std::condition_variable cv;
  std::shared_ptr<Call> out;  // guarded by mu: the Check in flight, or null
  bool finished = false;      // guarded by mu: no new Check

  // Sends a Check unless one is still out.
  void Start(Clock::duration bound) {
    std::shared_ptr<Call> call;
    {
      std::lock_guard<std::mutex> l(mu);
      if (finished || out) return;
      out = call = std::make_shared<Call>();
    }
    call->ctx.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::duration_cast<std::chrono::system_clock::duration>(bound));
    // Outside mu: the callback takes it (and a context cancelled before its call starts ends it).
    health->async()->Check(&call->ctx, &call->req, &call->resp, [this, call](grpc::Status st) {
      if (st.ok()) conn->Heard();
      std::lock_guard<std::mutex> l2(mu);
      out.reset();
      cv.notify_all();
    });
  }
  // Withdraws the Check out, if any, and waits for its callback.
  void Finish() {
    std::unique_lock<std::mutex> l(mu);
    finished = true;
    if (out) out->ctx.TryCancel();
    cv.wait(l, [&] { return out == nullptr; });
  }
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
    if (session_) session_->ctx.TryCancel();
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
  // 2. Health watch and the Forward stream (a reactor: no thread of ours reads or writes it).
  auto health = grpc::health::v1::Health::NewStub(channel_);
  auto watch_ctx = std::make_shared<grpc::ClientContext>();
  auto session = std::make_shared<Session>(this, watch_ctx);
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stop_) return absl::CancelledError("stopped");
    watch_ctx_ = watch_ctx;
  }
  session->self = session;
  stub_->async()->Forward(&session->ctx, session.get());
  session->StartRead(&session->resp);
  session->StartCall();
  {
    std::lock_guard<std::mutex> l(mu_);
    session_ = session;
    if (stop_) session->ctx.TryCancel();
  }
  OfferShm(session, d);
  // The watch runs until the connection is lost, the stream ends (its OnReadDone cancels the
  // watch) or Stop cancels it.
  auto watch = std::make_shared<HealthWatch>(this, watch_ctx, session);
  watch->self = watch;
  health->async()->Watch(watch_ctx.get(), &watch->req, watch.get());
  watch->StartRead(&watch->resp);
  watch->StartCall();
  const std::string why = opt_.liveness_ms > 0 ? WatchLiveness(*session, *watch) : watch->Wait();
  SetUp(false, why);
  session->ctx.TryCancel();
  session->WaitDone();  // every pending sub-request has had its callback
  if (session->shm_reader.joinable()) session->shm_reader.join();
  {
    std::lock_guard<std::mutex> l(mu_);
    session_.reset();
    watch_ctx_.reset();
  }
  return absl::UnavailableError(why);
}

std::string WorkerConn::WatchLiveness(Session& s, HealthWatch& watch) {
  const auto bound = std::chrono::milliseconds(opt_.liveness_ms);
  const auto tick = std::max<Clock::duration>(bound / 4, std::chrono::milliseconds(5));
  auto health = grpc::health::v1::Health::NewStub(channel_);
  Probe probe(this, health.get());
  Heard();  // Describe has just answered
  std::string why;
  while (!watch.WaitFor(tick, &why)) {
    const Clock::duration silent =
        Clock::now() - Clock::time_point(Clock::duration(last_heard_ns_.load()));
    if (silent > bound) {
      why = absl::StrCat("no answer to liveness probes or requests for ",
                         std::chrono::duration_cast<std::chrono::milliseconds>(silent).count(),
                         " ms (worker frozen or unreachable; --worker-liveness-ms ",
                         opt_.liveness_ms, ")");
      // Down before the stream ends: the failovers of its sub-requests must not choose it again.
      SetUp(false, why);
      s.End(why);
      watch.ctx->TryCancel();
      watch.Wait();
      break;
    }
    probe.Start(bound);
  }
  probe.Finish();
  return why;
}

void WorkerConn::OfferShm(const std::shared_ptr<Session>& s, const pb::DescribeResponse& d) {
  const std::string host = svc::HostId();
  if (opt_.shm_ring_bytes == 0 || !d.shm_supported() || host.empty() || d.host_id() != host) return;
  absl::StatusOr<std::unique_ptr<svc::ShmChannel>> made =
      svc::ShmChannel::Create(opt_.shm_ring_bytes, opt_.shm_spin_us);
  if (!made.ok()) {
    svc::LogWarning("worker %s: no shared-memory channel (%s); using gRPC",
                    spec_.name.c_str(), std::string(made.status().message()).c_str());
    return;
  }
  std::shared_ptr<svc::ShmChannel> ch = std::move(*made);
  pb::ExpertRequest offer;
  offer.mutable_shm_offer()->set_name(ch->name());
  offer.mutable_shm_offer()->set_nonce(ch->nonce());
  Session* sp = s.get();  // alive until OnDone has run every pending callback
  const std::string name = spec_.name;
  SubCallback on_answer = [sp, ch, name](absl::Status st, pb::ExpertResponse* r) {
    ch->Unlink();  // both sides have it mapped, or the worker declined: the name is not needed
    if (st.ok() && r != nullptr && r->shm_attached()) {
      std::lock_guard<std::mutex> l(sp->mu);
      if (!sp->open) return;
      sp->shm = ch;
      sp->shm_reader = std::thread([sp, ch] { sp->ReadShm(ch); });
      if (sp->conn->metrics_) sp->conn->metrics_->WorkerShm(name, true);
      svc::LogInfo("worker %s: shared-memory channel attached (%zu KiB each way)", name.c_str(),
                   ch->ring_bytes() >> 10);
      return;
    }
    svc::LogInfo("worker %s: shared memory not used (%s); using gRPC", name.c_str(),
                 !st.ok() ? std::string(st.message()).c_str()
                 : r != nullptr ? r->status().message().c_str() : "no answer");
  };
  std::lock_guard<std::mutex> l(s->mu);
  if (s->closed || !s->open) return;
  const uint64_t id = s->next_id++;
  s->pending[id] = Session::Pending{std::move(on_answer), Clock::now()};
  outstanding_.fetch_add(1);
  offer.set_id(id);
  s->QueueLocked(std::move(offer), 0);
}

std::string WorkerConn::transport() const {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> l(mu_);
    s = session_;
  }
  if (!s) return "grpc";
  std::lock_guard<std::mutex> l(s->mu);
  return s->shm != nullptr && !s->shm->closed() ? "shm" : "grpc";
}

absl::StatusOr<WorkerLink::Ticket> WorkerConn::Send(pb::ExpertRequest req, size_t request_bytes,
                                                    SubCallback cb) {
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
    std::lock_guard<std::mutex> l(s->mu);
    if (s->closed || !s->open) {
      return absl::UnavailableError(absl::StrCat("worker ", spec_.name, " stream closed"));
    }
    // A worker that stopped reading (frozen) must not grow the router's memory without bound.
    if (s->queued_bytes + request_bytes > static_cast<size_t>(4) * opt_.max_message_bytes) {
      return absl::UnavailableError(absl::StrCat(
          "worker ", spec_.name, " (", spec_.address, ") is not reading: ",
          4 * static_cast<int64_t>(opt_.max_message_bytes), " bytes of requests already queued"));
    }
    id = s->next_id++;
    s->pending[id] = Session::Pending{std::move(cb), Clock::now()};
    outstanding_.fetch_add(1);
    req.set_id(id);
    s->QueueLocked(std::move(req), request_bytes);
  }
  if (metrics_) metrics_->Sent(request_bytes);
  return Ticket{s, id};
}

void WorkerConn::Cancel(const Ticket& ticket, pb::CancelReason reason) {
  // Tickets of this link name its sessions.
  std::shared_ptr<Session> s = std::static_pointer_cast<Session>(ticket.session.lock());
  if (!s) return;  // the session ended: its pending sub-requests have had their callbacks
  const uint64_t id = ticket.id;
  bool withdrawn = false, sent = false;
  Session::Pending p;
  {
    std::lock_guard<std::mutex> l(s->mu);
    if (!s->open) return;  // the stream is ending: OnDone fails what is pending
    auto pit = s->pending.find(id);
    if (pit == s->pending.end()) return;  // answered (or failed with the stream) already
    // Still queued (not the one being written): never reaches the worker.
    for (auto it = s->outq.begin(); it != s->outq.end(); ++it) {
      if (s->writing && it == s->outq.begin()) continue;
      if (it->msg.id() == id && !it->msg.has_cancel()) {
        s->queued_bytes -= std::min(s->queued_bytes, it->bytes);
        s->outq.erase(it);
        withdrawn = true;
        break;
      }
    }
    if (withdrawn) {
      p = std::move(pit->second);
      s->pending.erase(pit);
    } else if (cancel_supported_) {
      pb::ExpertRequest c;
      c.set_id(id);
      c.mutable_cancel()->set_reason(reason);
      s->QueueLocked(std::move(c), 0);
      sent = true;
    }
  }
  if (withdrawn) {
    // Never written: the worker knows nothing of it; answer it here.
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
  std::vector<std::shared_ptr<WorkerConn>> conns;
  for (const ExpertMapWorker& w : map.workers) {
    std::shared_ptr<WorkerConn> conn;
    if (reuse) {
      for (const auto& old : reuse->conns_) {
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
    conns.push_back(std::move(conn));
  }
  const bool shared_on_workers = !opt.shared_expert_worker.empty();
  std::vector<std::string> shared_names;
  if (shared_on_workers) {
    // The router checked the map (SharedExpertWorkers) before building the pool; a map that fails
    // it here leaves the shared expert without holders (every request asking for it fails).
    absl::StatusOr<std::vector<std::string>> names =
        SharedExpertWorkers(map, opt.shared_expert_worker);
    if (names.ok()) shared_names = std::move(*names);
  }
  return std::shared_ptr<WorkerPool>(new WorkerPool(
      std::move(conns), ExpertHolders::FromMap(map, cfg, shared_on_workers, shared_names)));
}

namespace {
std::vector<std::shared_ptr<WorkerLink>> AsLinks(const std::vector<std::shared_ptr<WorkerConn>>& c) {
  return std::vector<std::shared_ptr<WorkerLink>>(c.begin(), c.end());
}
}  // namespace

WorkerPool::WorkerPool(std::vector<std::shared_ptr<WorkerConn>> conns, ExpertHolders holders)
    : WorkerSet(AsLinks(conns), std::move(holders)), conns_(std::move(conns)) {}

WorkerPool::~WorkerPool() = default;

}  // namespace exl3::router
