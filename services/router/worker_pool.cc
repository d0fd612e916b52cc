#include "services/router/worker_pool.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "services/common/bidi_stream.h"
#include "base/logging.h"
#include "services/common/shm_channel.h"
#include "services/common/status.h"
#include "services/router/health_v1.grpc.pb.h"
#include "services/router/router_metrics.h"

namespace exl3::router {

using Clock = std::chrono::steady_clock;

// One Forward stream to a worker (the client end of services/common/bidi_stream.h) and the
// sub-requests waiting for their answers on it. Requests are queued and written one at a time, so
// no caller (an engine stream dispatching, a reaction failing over) ever blocks on a slow or frozen
// worker, and no thread of the router's own sits between the caller and the socket. Answers run
// their callbacks on the thread that read them (a gRPC reaction, or the shared-memory channel's
// reader). When the session ends, every sub-request still pending gets its callback with
// UNAVAILABLE.
//
// With a shared-memory channel attached (same-host worker, OfferShm), messages that fit go through
// it instead of the stream; the stream stays open as the channel's lifeline: the session ends when
// either ends or breaks.
struct WorkerConn::Session
    : svc::BidiStream<svc::ClientSide, pb::ExpertResponse, pb::ExpertRequest> {
  struct Pending {
    SubCallback cb;
    Clock::time_point sent;
  };

  Session(WorkerConn* c, std::shared_ptr<grpc::ClientContext> watch)
      : BidiStream(SessionOptions(*c)), conn(c), watch_ctx(std::move(watch)) {}

  WorkerConn* const conn;  // outlives the session's end (RunSession waits for it)
  const std::shared_ptr<grpc::ClientContext> watch_ctx;  // the health watch, woken when we end
  std::shared_ptr<Session> self;  // keeps the reactor alive until OnEnded
  uint64_t next_id = 1;                           // guarded by mutex()
  std::unordered_map<uint64_t, Pending> pending;  // guarded by mutex()
  bool done = false;  // guarded by mutex(): OnEnded ran (every pending callback has run)
  static constexpr size_t kMaxSpareBytes = 32u << 20;
  std::string spare_output;  // the side channel's reader thread only (OnMessage, BeforeSideRead)
  std::condition_variable done_cv;

  static svc::BidiStreamOptions SessionOptions(const WorkerConn& c) {
    svc::BidiStreamOptions o;
    // A worker that stopped reading (frozen) must not grow the router's memory without bound.
    o.max_unwritten_bytes = static_cast<size_t>(4) * c.opt_.max_message_bytes;
    o.name = absl::StrCat("worker ", c.spec_.name);
    return o;
  }

  bool IsOpen() {
    std::lock_guard<std::mutex> l(mutex());
    return WritableLocked();
  }
  void WaitDone() {
    std::unique_lock<std::mutex> l(mutex());
    done_cv.wait(l, [&] { return done; });
  }

  // Sends `m` under a new id whose answer goes to `cb` (mutex() held, the stream writable).
  uint64_t SendLocked(pb::ExpertRequest m, SubCallback cb) {
    const uint64_t id = next_id++;
    pending[id] = Pending{std::move(cb), Clock::now()};
    conn->outstanding_.fetch_add(1);
    m.set_id(id);
    WriteLocked(std::move(m), svc::Path::kSideChannel);
    return id;
  }
  // Takes sub-request `id` back if it is still waiting to be written (mutex() held).
  std::optional<Pending> TakeUnsentLocked(uint64_t id) {
    auto pit = pending.find(id);
    if (pit == pending.end()) return std::nullopt;
    const bool unsent = WithdrawLocked(
        [id](const pb::ExpertRequest& m) { return m.id() == id && !m.has_cancel(); });
    if (!unsent) return std::nullopt;
    Pending p = std::move(pit->second);
    pending.erase(pit);
    return p;
  }

  // One answer, from the stream or the channel: runs its sub-request's callback.
  void OnMessage(pb::ExpertResponse& r, svc::Path from) override {
    Pending p;
    {
      std::lock_guard<std::mutex> l(mutex());
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
    // The callback is done with the answer: its output buffer is the next channel answer's.
    if (from == svc::Path::kSideChannel && r.has_output() &&
        r.output().data().capacity() <= kMaxSpareBytes) {
      spare_output = std::move(*r.mutable_output()->mutable_data());
    }
  }

  // Written into the channel: its hidden states are the next part's buffer
  // (services/router/dispatcher.cc BuildPart).
  void SideWrittenLocked(pb::ExpertRequest& m) override {
    if (conn->opt_.spare_buffers && m.has_hidden()) {
      conn->opt_.spare_buffers->Give(std::move(*m.mutable_hidden()->mutable_data()));
    }
  }

  // A channel answer is parsed into the previous one's output buffer (a fresh 16 MB one costs a
  // page fault per 4 KiB under the router's 4 MiB mmap threshold).
  void BeforeSideRead(pb::ExpertResponse& m) override {
    if (spare_output.capacity() > 0) m.mutable_output()->mutable_data()->swap(spare_output);
  }

  void OnEnded(const grpc::Status& st) override {
    std::unordered_map<uint64_t, Pending> failed;
    {
      std::lock_guard<std::mutex> l(mutex());
      failed.swap(pending);
    }
    watch_ctx->TryCancel();
    if (conn->metrics_) conn->metrics_->WorkerShm(conn->spec_.name, false);
    const std::string reason = st.ok() ? std::string("closed by the worker") : st.error_message();
    conn->SetUp(false, absl::StrCat("Forward stream ended: ", reason));
    const absl::Status why = absl::UnavailableError(absl::StrCat(
        "worker ", conn->spec_.name, " (", conn->spec_.address, ") stream ended: ", reason));
    for (auto& [id, p] : failed) {
      conn->outstanding_.fetch_sub(1);
      p.cb(why, nullptr);
    }
    std::shared_ptr<Session> keep = std::move(self);  // RunSession still holds one
    {
      std::lock_guard<std::mutex> l(mutex());
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

namespace {

// The worker's channel: its own connection (even when two workers share an address: tests,
// replicas), reconnecting quickly, with keepalive.
std::shared_ptr<grpc::Channel> MakeWorkerChannel(const ExpertMapWorker& w,
                                                 const WorkerPoolOptions& opt) {
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
  args.SetInt("exl3.worker_channel", static_cast<int>(std::hash<std::string>()(w.name) & 0x7fffffff));
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (opt.tls.enabled) {
    auto c = svc::MakeChannelCredentials(opt.tls);
    if (c.ok()) {
      creds = *c;
    } else {
      exl3::LogError("worker %s: %s", w.name.c_str(), std::string(c.status().message()).c_str());
    }
  }
  return grpc::CreateCustomChannel(w.address, creds, args);
}

// The worker's Forward method, called through the generic stub: the session reads and writes raw
// bytes (services/common/bidi_stream.h).
const std::string& ForwardMethod() {
  static const std::string m = absl::StrCat("/", pb::ExpertWorker::service_full_name(), "/Forward");
  return m;
}

pb::ExpertRequest CancelMessage(uint64_t id, pb::CancelReason reason) {
  pb::ExpertRequest c;
  c.set_id(id);
  c.mutable_cancel()->set_reason(reason);
  return c;
}

}  // namespace

WorkerConn::WorkerConn(const ExpertMapWorker& w, const MoeConfig& cfg,
                       const WorkerPoolOptions& opt, RouterMetrics* metrics)
    : spec_(w),
      cfg_(cfg),
      opt_(opt),
      metrics_(metrics),
      channel_(MakeWorkerChannel(w, opt)),
      stub_(pb::ExpertWorker::NewStub(channel_)),
      forward_stub_(std::make_unique<grpc::GenericStub>(channel_)),
      serves_shared_(!opt.shared_expert_worker.empty() && w.shared_expert) {}

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
    if (session_) session_->context().TryCancel();
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

std::shared_ptr<WorkerConn::Session> WorkerConn::current_session() const {
  std::lock_guard<std::mutex> l(mu_);
  return session_;
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
    exl3::LogInfo("worker %s (%s) is up", spec_.name.c_str(), spec_.address.c_str());
  } else {
    exl3::LogWarning("worker %s (%s) is down: %s", spec_.name.c_str(), spec_.address.c_str(),
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
  return CheckExpertsHeld(d);
}

absl::Status WorkerConn::CheckExpertsHeld(const pb::DescribeResponse& d) const {
  std::vector<std::vector<int32_t>> held(cfg_.num_hidden_layers);
  for (const auto& le : d.experts()) {
    if (le.layer() >= 0 && le.layer() < cfg_.num_hidden_layers) {
      held[le.layer()].assign(le.experts().begin(), le.experts().end());
      std::sort(held[le.layer()].begin(), held[le.layer()].end());
    }
  }
  std::vector<std::string> gaps;
  for (int L = 0; L < cfg_.num_hidden_layers && gaps.size() < 4; ++L) {
    std::vector<int32_t> missing;
    for (int e : spec_.experts[L]) {
      if (!std::binary_search(held[L].begin(), held[L].end(), e)) missing.push_back(e);
    }
    if (!missing.empty()) gaps.push_back(absl::StrCat("layer ", L, " experts ", FormatIndexRanges(missing)));
  }
  if (gaps.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("does not hold experts the map assigns to it: ", absl::StrJoin(gaps, "; ")));
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
      exl3::LogInfo("worker %s (%s): %s; retrying", spec_.name.c_str(), spec_.address.c_str(),
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
  EXL3_ASSIGN_OR_RETURN(const pb::DescribeResponse d, Identify());
  auto watch_ctx = std::make_shared<grpc::ClientContext>();
  EXL3_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, OpenSession(watch_ctx));
  OfferShm(session, d);
  const std::string why = WatchSession(session, watch_ctx);
  CloseSession(*session, why);
  return absl::UnavailableError(why);
}

absl::StatusOr<pb::DescribeResponse> WorkerConn::Identify() {
  pb::DescribeResponse d;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  grpc::Status gs = stub_->Describe(&ctx, pb::DescribeRequest(), &d);
  if (!gs.ok()) return absl::UnavailableError(absl::StrCat("Describe failed: ", gs.error_message()));
  EXL3_RETURN_IF_ERROR(CheckDescribe(d));
  {
    std::lock_guard<std::mutex> l(mu_);
    backend_ = d.backend();
    device_ = d.device();
  }
  cancel_supported_ = d.cancel_supported();
  return d;
}

absl::StatusOr<std::shared_ptr<WorkerConn::Session>> WorkerConn::OpenSession(
    const std::shared_ptr<grpc::ClientContext>& watch_ctx) {
  auto session = std::make_shared<Session>(this, watch_ctx);
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stop_) return absl::CancelledError("stopped");
    watch_ctx_ = watch_ctx;
  }
  session->self = session;
  session->BeginCall(*forward_stub_, ForwardMethod());
  std::lock_guard<std::mutex> l(mu_);
  session_ = session;
  if (stop_) session->context().TryCancel();  // Stop ran in between: it did not see the session
  return session;
}

std::string WorkerConn::WatchSession(const std::shared_ptr<Session>& s,
                                     const std::shared_ptr<grpc::ClientContext>& watch_ctx) {
  // The watch runs until the connection is lost, the stream ends (its end cancels the watch) or
  // Stop cancels it.
  auto health = grpc::health::v1::Health::NewStub(channel_);
  auto watch = std::make_shared<HealthWatch>(this, watch_ctx, s);
  watch->self = watch;
  health->async()->Watch(watch_ctx.get(), &watch->req, watch.get());
  watch->StartRead(&watch->resp);
  watch->StartCall();
  return opt_.liveness_ms > 0 ? WatchLiveness(*s, *watch) : watch->Wait();
}

void WorkerConn::CloseSession(Session& s, const std::string& why) {
  SetUp(false, why);
  s.context().TryCancel();
  // Every pending sub-request has had its callback, and the channel's reader has returned.
  s.WaitDone();
  std::lock_guard<std::mutex> l(mu_);
  session_.reset();
  watch_ctx_.reset();
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
      s.End(grpc::Status(grpc::StatusCode::UNAVAILABLE, why));
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
    exl3::LogWarning("worker %s: no shared-memory channel (%s); using gRPC",
                    spec_.name.c_str(), std::string(made.status().message()).c_str());
    return;
  }
  std::shared_ptr<svc::ShmChannel> ch = std::move(*made);
  pb::ExpertRequest offer;
  offer.mutable_shm_offer()->set_name(ch->name());
  offer.mutable_shm_offer()->set_nonce(ch->nonce());
  Session* sp = s.get();  // alive until its end has run every pending callback
  SubCallback on_answer = [this, sp, ch](absl::Status st, pb::ExpertResponse* r) {
    ShmOfferAnswered(*sp, ch, st, r);
  };
  std::lock_guard<std::mutex> l(s->mutex());
  if (s->WritableLocked()) s->SendLocked(std::move(offer), std::move(on_answer));
}

void WorkerConn::ShmOfferAnswered(Session& s, const std::shared_ptr<svc::ShmChannel>& ch,
                                  const absl::Status& st, const pb::ExpertResponse* r) {
  ch->Unlink();  // both sides have it mapped, or the worker declined: the name is not needed
  if (!st.ok() || r == nullptr || !r->shm_attached()) {
    exl3::LogInfo("worker %s: shared memory not used (%s); using gRPC", spec_.name.c_str(),
                 !st.ok() ? std::string(st.message()).c_str()
                 : r != nullptr ? r->status().message().c_str() : "no answer");
    return;
  }
  {
    std::lock_guard<std::mutex> l(s.mutex());
    if (!s.AttachSideChannelLocked(ch)) return;  // the session is ending
  }
  if (metrics_) metrics_->WorkerShm(spec_.name, true);
  exl3::LogInfo("worker %s: shared-memory channel attached (%zu KiB each way)", spec_.name.c_str(),
               ch->ring_bytes() >> 10);
}

std::string WorkerConn::transport() const {
  std::shared_ptr<Session> s = current_session();
  if (!s) return "grpc";
  std::lock_guard<std::mutex> l(s->mutex());
  return s->SideChannelOpenLocked() ? "shm" : "grpc";
}

absl::StatusOr<WorkerLink::Ticket> WorkerConn::Send(pb::ExpertRequest req, size_t request_bytes,
                                                    SubCallback cb) {
  std::shared_ptr<Session> s = current_session();
  if (!up_ || !s) {
    return absl::UnavailableError(absl::StrCat("worker ", spec_.name, " (", spec_.address,
                                               ") is not serving: ", state_message()));
  }
  uint64_t id;
  {
    std::lock_guard<std::mutex> l(s->mutex());
    EXL3_RETURN_IF_ERROR(CanSendLocked(*s, request_bytes));
    id = s->SendLocked(std::move(req), std::move(cb));
  }
  if (metrics_) metrics_->Sent(request_bytes);
  return Ticket{s, id};
}

absl::Status WorkerConn::CanSendLocked(const Session& s, size_t request_bytes) const {
  if (!s.WritableLocked()) {
    return absl::UnavailableError(absl::StrCat("worker ", spec_.name, " stream closed"));
  }
  if (!s.HasRoomLocked(request_bytes)) {
    return absl::UnavailableError(absl::StrCat(
        "worker ", spec_.name, " (", spec_.address, ") is not reading: ",
        4 * static_cast<int64_t>(opt_.max_message_bytes), " bytes of requests already queued"));
  }
  return absl::OkStatus();
}

void WorkerConn::Cancel(const Ticket& ticket, pb::CancelReason reason) {
  // Tickets of this link name its sessions.
  std::shared_ptr<Session> s = std::static_pointer_cast<Session>(ticket.session.lock());
  if (!s) return;  // the session ended: its pending sub-requests have had their callbacks
  std::optional<Session::Pending> unsent;
  bool cancel_sent = false;
  {
    std::lock_guard<std::mutex> l(s->mutex());
    // Ending: its end fails what is pending. Not pending: answered (or failed) already.
    if (!s->WritableLocked() || s->pending.count(ticket.id) == 0) return;
    unsent = s->TakeUnsentLocked(ticket.id);
    if (!unsent && cancel_supported_) {
      s->WriteLocked(CancelMessage(ticket.id, reason), svc::Path::kSideChannel);
      cancel_sent = true;
    }
  }
  if (unsent) {
    // Never written: the worker knows nothing of it; answer it here.
    outstanding_.fetch_sub(1);
    unsent->cb(absl::CancelledError(absl::StrCat("withdrawn before it was sent to worker ", spec_.name)),
               nullptr);
  }
  if ((unsent || cancel_sent) && metrics_) metrics_->WorkerCancel(reason);
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
