#include "services/router/moe_router.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <set>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "kernels/moe_cpu.h"
#include "model/expert_map.h"
#include "model/routing.h"
#include "services/common/logging.h"
#include "services/common/raw_message.h"
#include "services/common/status.h"
#include "services/common/wire.h"

namespace exl3::router {

using Clock = std::chrono::steady_clock;

namespace {
double Secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
uint64_t Micros(Clock::time_point a, Clock::time_point b) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(b - a).count());
}
}  // namespace

// ---- DeadlineTimer ----

DeadlineTimer::DeadlineTimer() : thread_([this] { Run(); }) {}

DeadlineTimer::~DeadlineTimer() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

DeadlineTimer::Key DeadlineTimer::At(Clock::time_point when, std::function<void()> fn) {
  bool earliest;
  Key k;
  {
    std::lock_guard<std::mutex> l(mu_);
    k = Key{when, next_seq_++};
    earliest = when < wake_at_;
    q_.emplace(k, std::move(fn));
  }
  // Only a deadline before the timer thread's wake-up changes what it waits for.
  if (earliest) cv_.notify_all();
  return k;
}

void DeadlineTimer::Cancel(const Key& k) {
  std::function<void()> fn;  // destroyed outside the lock
  std::lock_guard<std::mutex> l(mu_);
  auto it = q_.find(k);
  if (it == q_.end()) return;
  fn = std::move(it->second);
  q_.erase(it);
}

void DeadlineTimer::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    const Clock::time_point now = Clock::now();
    auto first = q_.begin();
    if (first == q_.end() || first->first.first > now) {
      // Sleep until the first deadline, or a second at most: most entries are cancelled before
      // they are due, and At need not wake the thread for one due after wake_at_ (with one request
      // at a time the queue empties after each, and waking per request would cost a context
      // switch each).
      wake_at_ = now + std::chrono::seconds(1);
      if (first != q_.end()) wake_at_ = std::min(wake_at_, first->first.first);
      cv_.wait_until(l, wake_at_);
      continue;
    }
    std::function<void()> fn = std::move(first->second);
    q_.erase(first);
    l.unlock();
    fn();
    l.lock();
  }
}

// ---- TaskQueue ----

TaskQueue::TaskQueue(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Run(); });
}

TaskQueue::~TaskQueue() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void TaskQueue::Post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> l(mu_);
    q_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

void TaskQueue::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    cv_.wait(l, [&] { return stop_ || !q_.empty(); });
    if (q_.empty()) return;  // stopping and nothing left
    std::function<void()> fn = std::move(q_.front());
    q_.pop_front();
    l.unlock();
    fn();
    l.lock();
  }
}

// ---- per-stream and per-request state ----

// One engine Forward stream (a gRPC callback reactor). Requests are read one after another and
// handled as they arrive (many in flight); answers are queued and written one at a time, the next
// write started by OnWriteDone, so whichever thread completes a request only queues (and at most
// starts a write), never waits. A client that stops reading its answers stops being read from
// (kMaxQueued). Owned by the service's registry until OnDone; requests in flight hold it too, and
// answers completed after the stream ended are dropped.
//
// gRPC's Start* calls never run reactions inline, so they are made under `mu`: that orders them
// against Finish (no operation is started after it).
class StreamState : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                    public AnswerSink,
                    public std::enable_shared_from_this<StreamState> {
 public:
  static constexpr size_t kMaxQueued = 256;  // answers waiting for a slow reader

  explicit StreamState(MoeRouterService* svc) : svc_(svc) {}

  void Begin() {
    std::lock_guard<std::mutex> l(mu);
    StartRead(&in_);
  }

  // Queues an answer (any thread). With `erase_id`, the request also leaves `inflight` in the same
  // step: the client may reuse the id once it reads the answer.
  void Answer(pb::MoeLayerResponse r, bool erase_id) override {
    std::unique_lock<std::mutex> l(mu);
    if (erase_id) inflight.erase(r.id());
    if (cancelled || broken_ || finished_) {
      MaybeFinish(l);
      return;
    }
    // gRPC would end the whole stream for an answer over its send limit.
    if (const size_t n = r.ByteSizeLong(); n > svc_->max_message_bytes()) {
      pb::MoeLayerResponse e;
      e.set_id(r.id());
      e.set_layer(r.layer());
      svc::SetRequestStatus(svc_->AnswerTooLarge(n), e.mutable_status());
      r = std::move(e);
    }
    out_.push_back(std::move(r));
    if (!writing_) {
      writing_ = true;
      WriteFrontLocked();
    }
  }

  // A request handed to the handler pool: the stream does not end before it is handled.
  void BeginHandling() override {
    std::lock_guard<std::mutex> l(mu);
    ++handling_;
  }
  void EndHandling() override {
    std::unique_lock<std::mutex> l(mu);
    --handling_;
    MaybeFinish(l);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // Half-close (or the stream is gone): answer what is in flight, then end.
      std::unique_lock<std::mutex> l(mu);
      reads_done_ = true;
      MaybeFinish(l);
      return;
    }
    if (absl::Status st = svc::ParseRaw(&in_, &req_); !st.ok()) {
      // Not a request: the stream is unusable (its ids can no longer be trusted). Its requests in
      // flight end (their work withdrawn) and the stream ends with the reason.
      {
        std::lock_guard<std::mutex> l(mu);
        reads_done_ = true;
        end_status_ = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   absl::StrCat(st.message(), "; the stream ends"));
      }
      svc_->CancelStream(*this);
      std::unique_lock<std::mutex> l(mu);
      MaybeFinish(l);
      return;
    }
    svc_->Submit(shared_from_this(), req_);
    req_.Clear();
    std::lock_guard<std::mutex> l(mu);
    if (finished_) {
      reads_done_ = true;
    } else if (out_.size() >= kMaxQueued) {
      read_paused_ = true;  // resumed by OnWriteDone
    } else {
      StartRead(&in_);
    }
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock<std::mutex> l(mu);
    out_.pop_front();
    if (!ok) {
      // The client is gone: later answers are dropped.
      broken_ = true;
      out_.clear();
      writing_ = false;
      MaybeFinish(l);
      return;
    }
    if (read_paused_ && !finished_ && out_.size() < kMaxQueued / 2) {
      read_paused_ = false;
      StartRead(&in_);
    }
    if (!out_.empty() && !finished_) {
      WriteFrontLocked();
      return;
    }
    writing_ = false;
    MaybeFinish(l);
  }

  void OnCancel() override {
    // Nobody is left to answer (also after a half-close): end the requests in flight now, which
    // withdraws their work from the workers.
    svc_->CancelStream(*this);
    std::unique_lock<std::mutex> l(mu);
    MaybeFinish(l);
  }

  void OnDone() override {
    {
      std::lock_guard<std::mutex> l(mu);
      finished_ = true;
      out_.clear();
    }
    svc_->Unregister(this);  // may drop the last reference: nothing after this
  }

 private:
  // Calls Finish once nothing is left to do.
  void MaybeFinish(std::unique_lock<std::mutex>& l) {
    (void)l;
    if (finished_ || writing_) return;
    if (cancelled || broken_) {
      finished_ = true;
      Finish(!end_status_.ok() ? end_status_
                               : grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
      return;
    }
    if (!reads_done_ || handling_ > 0 || !inflight.empty() || !out_.empty()) return;
    finished_ = true;
    Finish(grpc::Status::OK);
  }

  // Starts writing out_.front() (under mu, writing_ set).
  void WriteFrontLocked() {
    absl::Status st = svc::SerializeRaw(out_.front(), &wbuf_);
    if (!st.ok()) svc::LogError("answer not sent: %s", std::string(st.message()).c_str());
    StartWrite(&wbuf_);
  }

  MoeRouterService* const svc_;
  grpc::ByteBuffer in_;                      // the read buffer
  pb::MoeLayerRequest req_;                  // in_ parsed
  grpc::ByteBuffer wbuf_;                    // guarded by mu: out_.front() serialized
  grpc::Status end_status_;                  // guarded by mu: why the stream ends early, or OK
  std::deque<pb::MoeLayerResponse> out_;     // guarded by mu: front is being written while writing_
  bool writing_ = false;                     // guarded by mu
  bool reads_done_ = false;                  // guarded by mu
  bool read_paused_ = false;                 // guarded by mu
  bool broken_ = false;                      // guarded by mu: a write failed
  bool finished_ = false;                    // guarded by mu: Finish called (or OnDone)
  int handling_ = 0;                         // guarded by mu: requests on the handler pool
};

struct LayerCall {
  std::shared_ptr<AnswerSink> stream;
  std::shared_ptr<WorkerPool> pool;
  uint64_t id = 0;
  int layer = 0;
  int64_t T = 0;
  int H = 0;
  pb::DType out_dtype = pb::DTYPE_FP32;
  pb::DType in_dtype = pb::DTYPE_FP32;
  std::string hidden;  // the request's raw hidden bytes, sliced per worker
  size_t row_bytes = 0;
  bool include_shared = false;
  std::vector<float> x;  // fp32 hidden (gate, shared expert)
  int k = 0;
  std::vector<int32_t> ids;  // [T, k]
  std::vector<float> w;      // [T, k]

  Clock::time_point t_start, t_gate_end, t_dispatch_end, t_first_send, t_last_answer;
  bool has_deadline = false;
  Clock::time_point deadline;

  std::mutex mu;
  bool done = false;
  int outstanding = 1;  // parts in flight + 1 for the dispatching thread
  std::vector<float> acc;  // [T, H] fp32
  std::set<int> failed_workers;
  std::set<int> fanout;
  std::string last_failure;
  // Sub-requests sent and not yet answered (to withdraw them when the request ends early). The
  // handle's id is 0 while its Send is still running; that Send then checks `done` itself.
  struct SubRef {
    std::shared_ptr<WorkerConn> conn;
    WorkerConn::SubHandle h;
  };
  std::map<uint64_t, SubRef> subs;
  uint64_t next_sub = 0;
  pb::CancelReason cancel_reason = pb::CANCEL_REASON_FAILED;  // why it ended early
  bool has_timer = false;  // its deadline entry, cancelled when it completes
  DeadlineTimer::Key timer_key;
};

MoeRouterService::MoeRouterService(const Exl3Model& model, const RouterOptions& opt,
                                   RouterMetrics* metrics)
    : model_(model), cfg_(model.config()), opt_(opt), metrics_(metrics) {
  if (opt.shared_expert_local && cfg_.has_shared_expert()) {
    shared_cpu_ = std::make_unique<cpu::CpuBackend>(opt.shared_expert_threads);
  }
  if (opt.gate_threads > 1) gate_pool_ = std::make_unique<cpu::ThreadPool>(opt.gate_threads);
  handlers_ = std::make_unique<TaskQueue>(std::max(1, opt.handler_threads));
}

MoeRouterService::~MoeRouterService() = default;

void MoeRouterService::ComputeLogits(const float* router_w, const float* x, int num_tokens,
                                     float* logits) {
  const int E = cfg_.num_experts, H = cfg_.hidden_size;
  constexpr int kExpertsPerItem = 16;
  // A small gate (decode on a small model) is cheaper on this thread than the pool's hand-off.
  constexpr int64_t kPoolMinMacs = 256 * 1024;
  const int items = (E + kExpertsPerItem - 1) / kExpertsPerItem;
  if (!gate_pool_ || items < 2 || static_cast<int64_t>(num_tokens) * E * H < kPoolMinMacs) {
    ComputeRouterLogits(router_w, x, num_tokens, E, H, logits);
    return;
  }
  // The pool serves one gate at a time; while it is busy (many streams at once) a gate runs on its
  // own request thread instead of queueing, so concurrency keeps its throughput.
  std::unique_lock<std::mutex> l(gate_mu_, std::try_to_lock);
  if (!l.owns_lock()) {
    ComputeRouterLogits(router_w, x, num_tokens, E, H, logits);
    return;
  }
  gate_pool_->ParallelFor(items, [&](int item, int) {
    const int e0 = item * kExpertsPerItem, n = std::min(kExpertsPerItem, E - e0);
    const float* w = router_w + static_cast<size_t>(e0) * H;
    for (int t = 0; t < num_tokens; ++t) {  // each token's logits of experts e0..e0+n
      ComputeRouterLogits(w, x + static_cast<size_t>(t) * H, 1, n, H,
                          logits + static_cast<size_t>(t) * E + e0);
    }
  });
}

void MoeRouterService::SetPool(std::shared_ptr<WorkerPool> pool) {
  std::lock_guard<std::mutex> l(pool_mu_);
  pool_ = std::move(pool);
}

std::shared_ptr<WorkerPool> MoeRouterService::pool() const {
  std::lock_guard<std::mutex> l(pool_mu_);
  return pool_;
}

bool MoeRouterService::WaitIdle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(idle_mu_);
  return idle_cv_.wait_for(l, timeout, [&] { return in_flight_.load() == 0; });
}

void MoeRouterService::FillIdentity(pb::ModelIdentity* id) const {
  id->set_fingerprint(model_.fingerprint());
  id->set_architecture(cfg_.architecture);
  id->set_hidden_size(cfg_.hidden_size);
  id->set_num_layers(cfg_.num_hidden_layers);
  for (int L : cfg_.MoeLayers()) id->add_moe_layers(L);
  id->set_num_experts(cfg_.num_experts);
  id->set_top_k(cfg_.top_k);
  id->set_moe_intermediate_size(cfg_.moe_intermediate_size);
  id->set_bits(cfg_.bits);
}

grpc::ServerUnaryReactor* MoeRouterService::Describe(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* req,
                                                     grpc::ByteBuffer* out) {
  return svc::AnswerUnaryRaw<pb::RouterDescribeRequest, pb::RouterDescribeResponse>(
      ctx, req, out,
      [this](const pb::RouterDescribeRequest&, pb::RouterDescribeResponse* r) { FillDescribe(r); });
}

void MoeRouterService::FillDescribe(pb::RouterDescribeResponse* resp) const {
  FillIdentity(resp->mutable_model());
  auto p = pool();
  if (p) {
    for (int i = 0; i < p->num_workers(); ++i) {
      const WorkerConn& w = p->worker(i);
      pb::WorkerInfo* wi = resp->add_workers();
      wi->set_name(w.name());
      wi->set_address(w.address());
      wi->set_up(w.up());
      wi->set_backend(w.backend());
      wi->set_device(w.device());
      wi->set_shared_expert(w.serves_shared());
      wi->set_transport(w.transport());
      for (int L = 0; L < cfg_.num_hidden_layers; ++L) {
        if (w.spec().experts[L].empty()) continue;
        pb::LayerExperts* le = wi->add_experts();
        le->set_layer(L);
        for (int e : w.spec().experts[L]) le->add_experts(e);
      }
    }
    resp->set_unserved_experts(p->UnservedExperts());
  }
  resp->mutable_versions()->set_server(EXL3_VERSION);
  resp->mutable_versions()->set_protocol("exl3serve.v1");
  resp->mutable_versions()->set_grpc(grpc::Version());
  resp->set_cancel_supported(true);
  resp->set_shared_expert(!opt_.shared_expert_worker.empty()
                              ? absl::StrCat("worker:", opt_.shared_expert_worker)
                              : opt_.shared_expert_local ? "local" : "none");
  resp->set_state(draining_ ? pb::STATE_DRAINING
                  : (p && p->UnservedExperts() == 0) ? pb::STATE_SERVING
                                                     : pb::STATE_LOADING);
}

absl::Status MoeRouterService::AnswerTooLarge(size_t bytes) const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "the answer (up to ", bytes, " bytes) is over --max-message-bytes ", opt_.max_message_bytes,
      ": split the request (fewer tokens) or ask for fp16/bf16 output"));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* MoeRouterService::Forward(
    grpc::CallbackServerContext*) {
  auto s = std::make_shared<StreamState>(this);
  {
    std::lock_guard<std::mutex> l(streams_mu_);
    streams_[s.get()] = s;
  }
  s->Begin();
  return s.get();
}

void MoeRouterService::Unregister(StreamState* s) {
  std::shared_ptr<StreamState> keep;  // destroyed after the lock is released
  std::lock_guard<std::mutex> l(streams_mu_);
  auto it = streams_.find(s);
  if (it != streams_.end()) {
    keep = std::move(it->second);
    streams_.erase(it);
  }
}

void MoeRouterService::Submit(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req) {
  int64_t tokens = 0;
  if (req.has_hidden() && req.hidden().shape_size() > 0) tokens = req.hidden().shape(0);
  if (!req.has_cancel() && tokens > opt_.inline_max_tokens && handlers_) {
    // Large: gate, dispatch and the local shared expert run on the handler pool; the calling
    // thread (a gRPC thread reading the stream) goes back to its work.
    auto r = std::make_shared<pb::MoeLayerRequest>(std::move(req));
    s->BeginHandling();
    handlers_->Post([this, s, r] {
      Handle(s, *r);
      s->EndHandling();
    });
  } else {
    Handle(s, req);
  }
}

void MoeRouterService::CancelStream(AnswerSink& s) {
  s.cancelled = true;
  std::vector<std::shared_ptr<LayerCall>> calls;
  {
    std::lock_guard<std::mutex> l(s.mu);
    for (auto& [id, c] : s.inflight) calls.push_back(c);
  }
  for (auto& c : calls) {
    Complete(c, absl::CancelledError("the client cancelled the stream"),
             pb::CANCEL_REASON_STREAM_CLOSED);
  }
}

void MoeRouterService::Handle(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req) {
  const Clock::time_point t0 = Clock::now();
  auto reject = [&](const absl::Status& st) {
    pb::MoeLayerResponse r;
    r.set_id(req.id());
    r.set_layer(req.layer());
    svc::SetRequestStatus(st, r.mutable_status());
    r.mutable_timings()->set_total_us(Micros(t0, Clock::now()));
    if (metrics_) metrics_->Error(svc::StatusCodeName(st.code()));
    s->Answer(std::move(r), /*erase_id=*/false);
  };
  if (req.has_cancel()) {
    // Not a request: withdraws the in-flight request `id` (answered CANCELLED); an id that is
    // not in flight is ignored. Never answered itself.
    std::shared_ptr<LayerCall> c;
    {
      std::lock_guard<std::mutex> l(s->mu);
      auto it = s->inflight.find(req.id());
      if (it != s->inflight.end()) c = it->second;
    }
    if (c) {
      Complete(c, absl::CancelledError(absl::StrCat("layer ", c->layer, " request ", c->id,
                                                    " cancelled by the client")),
               pb::CANCEL_REASON_CLIENT);
    }
    return;
  }
  if (draining_) return reject(absl::UnavailableError("router is draining (shutting down)"));
  auto c = std::make_shared<LayerCall>();
  c->stream = s;
  c->id = req.id();
  c->layer = req.layer();
  c->t_start = t0;
  {
    std::unique_lock<std::mutex> l(s->mu);
    if (s->inflight.count(req.id())) {
      l.unlock();
      return reject(absl::InvalidArgumentError(
          absl::StrCat("duplicate in-flight id ", req.id(), " on this stream")));
    }
    if (in_flight_.load() >= opt_.max_in_flight) {
      l.unlock();
      return reject(absl::ResourceExhaustedError(absl::StrCat(
          "router has ", opt_.max_in_flight, " layer requests in flight (--max-in-flight)")));
    }
    if (s->cancelled) return;  // the stream ended: nobody to answer
    s->inflight[req.id()] = c;
    in_flight_.fetch_add(1);
  }
  if (metrics_) metrics_->in_flight().Increment();
  c->pool = pool();

  absl::Status st = Route(req, *c);
  if (!st.ok()) return Complete(c, st);
  // An upper bound of the answer's size: output, top-k ids (varints of at most 5 bytes) and
  // weights, and 256 bytes for id, layer, status and timings.
  const size_t answer_bytes = static_cast<size_t>(c->T) * c->H * svc::WireDTypeSize(c->out_dtype) +
                              static_cast<size_t>(c->T) * c->k * 9 + 256;
  if (answer_bytes > max_message_bytes()) return Complete(c, AnswerTooLarge(answer_bytes));
  c->t_gate_end = Clock::now();
  if (metrics_) metrics_->ObserveStage(c->layer, Stage::kGate, Secs(t0, c->t_gate_end));

  if (req.timeout_us() > 0 || opt_.default_deadline_ms > 0) {
    c->has_deadline = true;
    c->deadline = t0 + (req.timeout_us() > 0
                            ? svc::RequestTimeout(req.timeout_us())
                            : std::chrono::microseconds(opt_.default_deadline_ms * 1000));
    std::weak_ptr<LayerCall> weak = c;
    const uint64_t budget_ms = Micros(t0, c->deadline) / 1000;
    const DeadlineTimer::Key key = timer_.At(c->deadline, [this, weak, budget_ms] {
      if (auto cc = weak.lock()) {
        std::string waiting;
        {
          std::lock_guard<std::mutex> l(cc->mu);
          if (cc->done) return;
          std::vector<std::string> names;
          if (cc->pool) {
            for (int w : cc->fanout) names.push_back(cc->pool->worker(w).name());
          }
          waiting = absl::StrJoin(names, ", ");
        }
        Complete(cc, absl::DeadlineExceededError(absl::StrCat(
                         "layer ", cc->layer, " request ", cc->id, " exceeded its deadline of ",
                         budget_ms, " ms (workers involved: ", waiting.empty() ? "none" : waiting,
                         ")")),
                 pb::CANCEL_REASON_DEADLINE);
      }
    });
    bool ended;
    {
      std::lock_guard<std::mutex> l(c->mu);
      ended = c->done;
      if (!ended) {
        c->timer_key = key;
        c->has_timer = true;
      }
    }
    if (ended) timer_.Cancel(key);  // completed meanwhile (e.g. the stream was cancelled)
  }

  c->acc.assign(static_cast<size_t>(c->T) * c->H, 0.0f);
  {
    const size_t n = static_cast<size_t>(c->T) * c->k;
    std::vector<int32_t> rows(n);
    for (size_t i = 0; i < n; ++i) rows[i] = static_cast<int32_t>(i / c->k);
    std::vector<int32_t> experts = c->ids;
    std::vector<float> weights = c->w;
    if (c->include_shared && c->pool->shared_on_workers() && cfg_.has_shared_expert()) {
      // --shared-expert worker:NAME: the shared expert is one more (pseudo) expert of every
      // token, weight 1; its worker applies the family's gate exactly as the local path does.
      for (int64_t t = 0; t < c->T; ++t) {
        rows.push_back(static_cast<int32_t>(t));
        experts.push_back(c->pool->shared_expert_id());
        weights.push_back(1.0f);
      }
    }
    Dispatch(c, std::move(rows), std::move(experts), std::move(weights));
  }
  c->t_dispatch_end = Clock::now();
  if (metrics_) {
    metrics_->ObserveStage(c->layer, Stage::kDispatch, Secs(c->t_gate_end, c->t_dispatch_end));
  }

  // The shared expert runs here while the workers compute.
  if (c->include_shared && opt_.shared_expert_local) {
    absl::StatusOr<MoeLayerView> view = model_.LayerView(c->layer);
    if (view.ok() && view->shared != nullptr) {
      std::vector<float> y(c->acc.size());
      const MoeAssignments none = MoeAssignments::Fixed(static_cast<int>(c->T), 0, nullptr, nullptr);
      absl::Status ss = shared_cpu_ ? shared_cpu_->Moe(*view, c->x.data(), none, true, y.data())
                                    : MoeForwardReference(*view, c->x.data(), none, true, y.data());
      if (!ss.ok()) return Complete(c, absl::InternalError(absl::StrCat("shared expert: ", ss.message())));
      std::lock_guard<std::mutex> l(c->mu);
      for (size_t i = 0; i < y.size(); ++i) c->acc[i] += y[i];
    }
  }
  PartDone(c);
}

absl::Status MoeRouterService::Route(const pb::MoeLayerRequest& req, LayerCall& c) {
  if (const size_t n = req.ByteSizeLong(); n > max_message_bytes()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request is ", n, " bytes, over --max-message-bytes ", opt_.max_message_bytes,
        ": split it into requests of fewer tokens"));
  }
  if (!cfg_.IsMoeLayer(req.layer())) {
    const std::vector<int> ml = cfg_.MoeLayers();
    return absl::NotFoundError(absl::StrCat(
        "layer ", req.layer(), " is not an MoE layer of this model (MoE layers: ",
        FormatIndexRanges(std::vector<int32_t>(ml.begin(), ml.end())), ")"));
  }
  if (!req.has_hidden()) return absl::InvalidArgumentError("empty request: no hidden tensor");
  pb::DType out;
  absl::Status st = svc::ResolveOutputDType(req.output_dtype(), "output_dtype", &out);
  if (!st.ok()) return st;
  c.out_dtype = out;
  int64_t T = 0;
  st = svc::DecodeMatrix(req.hidden(), "hidden", cfg_.hidden_size, &c.x, &T);
  if (!st.ok()) return st;
  if (T > opt_.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("request has ", T, " tokens; the router accepts at most ",
                                                     opt_.max_tokens, " (--max-tokens)"));
  }
  c.T = T;
  c.H = cfg_.hidden_size;
  c.in_dtype = req.hidden().dtype();
  c.row_bytes = static_cast<size_t>(c.H) * svc::WireDTypeSize(c.in_dtype);
  c.hidden = req.hidden().data();
  c.include_shared = req.include_shared_expert();

  const int L = req.layer();
  const int E = cfg_.num_experts;
  const bool has_logits = req.has_router_logits();
  const bool has_topk = req.has_topk();
  const bool has_tokens = req.token_ids_size() > 0;
  if (static_cast<int>(has_logits) + has_topk + has_tokens > 1) {
    return absl::InvalidArgumentError("give at most one of router_logits, topk and token_ids");
  }
  if (has_tokens && req.token_ids_size() != T) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids has ", req.token_ids_size(),
                                                   " entries, hidden has ", T, " rows"));
  }
  if (has_topk) {
    const pb::TopK& tk = req.topk();
    // A token may use at most the model's top_k experts (the workers refuse more).
    if (tk.k() < 1 || tk.k() > cfg_.top_k) {
      return absl::InvalidArgumentError(absl::StrCat("topk.k is ", tk.k(), ", not in 1..",
                                                     cfg_.top_k, " (the model's top_k)"));
    }
    const int64_t n = T * tk.k();
    if (tk.ids_size() != n || tk.weights_size() != n) {
      return absl::InvalidArgumentError(absl::StrCat("topk.ids and topk.weights must have T*k = ", n,
                                                     " entries (have ", tk.ids_size(), " and ",
                                                     tk.weights_size(), ")"));
    }
    c.k = tk.k();
    c.ids.assign(tk.ids().begin(), tk.ids().end());
    c.w.assign(tk.weights().begin(), tk.weights().end());
    for (int64_t t = 0; t < T; ++t) {
      for (int j = 0; j < c.k; ++j) {
        const int32_t e = c.ids[t * c.k + j];
        if (e < 0 || e >= E) {
          return absl::InvalidArgumentError(absl::StrCat("topk.ids[", t, ", ", j, "] = ", e,
                                                         " is not an expert (0..", E - 1, ")"));
        }
        for (int j2 = 0; j2 < j; ++j2) {
          if (c.ids[t * c.k + j2] == e) {
            return absl::InvalidArgumentError(absl::StrCat("topk.ids: expert ", e,
                                                           " repeated for token ", t));
          }
        }
        if (!std::isfinite(c.w[t * c.k + j])) {
          return absl::InvalidArgumentError(absl::StrCat("topk.weights[", t, ", ", j, "] is not finite"));
        }
      }
    }
    return absl::OkStatus();
  }
  c.k = cfg_.top_k;
  c.ids.resize(static_cast<size_t>(T) * c.k);
  c.w.resize(static_cast<size_t>(T) * c.k);
  const float* bias = model_.CorrectionBias(L);
  if (has_logits) {
    std::vector<float> logits;
    int64_t rows = 0;
    st = svc::DecodeMatrix(req.router_logits(), "router_logits", E, &logits, &rows);
    if (!st.ok()) return st;
    if (rows != T) {
      return absl::InvalidArgumentError(absl::StrCat("router_logits has ", rows, " rows, hidden has ", T));
    }
    return RouteFromLogits(cfg_, L, logits.data(), bias, static_cast<int>(T), c.ids.data(), c.w.data());
  }
  const float* router_w = model_.RouterWeight(L);
  if (router_w == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", L, ": the router holds no gate weight; send router_logits or topk"));
  }
  if (cfg_.IsHashRoutedLayer(L)) {
    if (!has_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", L, " is hash-routed: token_ids required"));
    }
    int64_t vocab = 0;
    const int32_t* table = model_.HashTable(L, &vocab);
    if (table == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("layer ", L, ": hash table not loaded"));
    }
    std::vector<float> logits(static_cast<size_t>(T) * E);
    ComputeLogits(router_w, c.x.data(), static_cast<int>(T), logits.data());
    std::vector<int64_t> tok(req.token_ids().begin(), req.token_ids().end());
    return RouteHashed(cfg_, L, logits.data(), table, vocab, tok.data(), static_cast<int>(T),
                       c.ids.data(), c.w.data());
  }
  std::vector<float> logits(static_cast<size_t>(T) * E);  // hidden states were checked finite
  ComputeLogits(router_w, c.x.data(), static_cast<int>(T), logits.data());
  return RouteFromLogits(cfg_, L, logits.data(), bias, static_cast<int>(T), c.ids.data(),
                         c.w.data());
}

void MoeRouterService::Dispatch(const std::shared_ptr<LayerCall>& c, std::vector<int32_t> rows,
                                std::vector<int32_t> experts, std::vector<float> weights,
                                int failed_worker) {
  WorkerPool& pool = *c->pool;
  std::set<int> failed, already;
  {
    std::lock_guard<std::mutex> l(c->mu);
    if (c->done) return;
    failed = c->failed_workers;
    already = c->fanout;
  }
  // Choose one worker per distinct expert: least outstanding among the serving holders, preferring
  // workers this request already uses (fewer sub-requests).
  std::map<int32_t, int> choice;
  std::vector<int32_t> missing;
  for (int32_t e : experts) {
    if (choice.count(e)) continue;
    int best = -1;
    bool best_used = false;
    for (int wi : pool.Holders(c->layer, e)) {
      const WorkerConn& w = pool.worker(wi);
      if (!w.up() || failed.count(wi)) continue;
      const bool used = already.count(wi) > 0;
      if (best < 0 || (used && !best_used) ||
          (used == best_used && w.outstanding() < pool.worker(best).outstanding())) {
        best = wi;
        best_used = used;
      }
    }
    if (best < 0) {
      missing.push_back(e);
      continue;
    }
    choice[e] = best;
    already.insert(best);
  }
  if (!missing.empty()) {
    std::sort(missing.begin(), missing.end());
    missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
    std::string why;
    {
      std::lock_guard<std::mutex> l(c->mu);
      why = c->last_failure;
    }
    std::vector<std::string> down;
    for (int e : missing) {
      for (int wi : pool.Holders(c->layer, e)) {
        const std::string n = pool.worker(wi).name();
        if (std::find(down.begin(), down.end(), n) == down.end()) down.push_back(n);
      }
    }
    return Complete(c, absl::UnavailableError(absl::StrCat(
                           why.empty() ? "" : why + "; ", "no serving worker holds layer ", c->layer,
                           " ", ExpertsText(missing), " (held by: ",
                           down.empty() ? "none" : absl::StrJoin(down, ", "), ")")));
  }
  // Every expert of the failed share has another serving holder: a failover.
  if (failed_worker >= 0 && metrics_) metrics_->Failover(pool.worker(failed_worker).name());
  // Group by worker: the rows each needs, and per row its (expert, weight) pairs.
  struct Part {
    std::vector<int32_t> rows, experts;
    std::vector<float> weights;
  };
  std::map<int, Part> parts;
  for (size_t i = 0; i < experts.size(); ++i) {
    Part& p = parts[choice[experts[i]]];
    p.rows.push_back(rows[i]);
    p.experts.push_back(experts[i]);
    p.weights.push_back(weights[i]);
  }
  const auto now = Clock::now();
  const int32_t shared_id = pool.shared_expert_id();
  for (auto& [wi, p] : parts) {
    // Distinct rows in order of first use; slots = most routed pairs of any row (the shared
    // expert takes no slot: it is a flag of the whole request).
    std::vector<int32_t> urows;
    std::vector<int32_t> slot_of(c->T, -1);  // request row -> index in urows
    std::vector<int> count;
    bool shared = false;
    for (size_t i = 0; i < p.rows.size(); ++i) {
      const int32_t r = p.rows[i];
      if (slot_of[r] < 0) {
        slot_of[r] = static_cast<int32_t>(urows.size());
        urows.push_back(r);
        count.push_back(0);
      }
      if (p.experts[i] == shared_id) {
        shared = true;
      } else {
        ++count[slot_of[r]];
      }
    }
    const int S = *std::max_element(count.begin(), count.end());
    pb::ExpertRequest req;
    req.set_layer(c->layer);
    req.set_slots(S);
    req.set_shared_expert(shared);
    req.set_output_dtype(pb::DTYPE_FP32);
    pb::Tensor* h = req.mutable_hidden();
    h->set_dtype(c->in_dtype);
    h->add_shape(static_cast<int64_t>(urows.size()));
    h->add_shape(c->H);
    std::string* data = h->mutable_data();
    data->resize(urows.size() * c->row_bytes);
    for (size_t r = 0; r < urows.size(); ++r) {
      std::memcpy(data->data() + r * c->row_bytes, c->hidden.data() + urows[r] * c->row_bytes,
                  c->row_bytes);
    }
    std::vector<int32_t> ids(urows.size() * S, -1);
    std::vector<float> ws(urows.size() * S, 0.0f);
    std::vector<int> fill(urows.size(), 0);
    for (size_t i = 0; i < p.rows.size(); ++i) {
      if (p.experts[i] == shared_id) continue;
      const size_t r = slot_of[p.rows[i]];
      ids[r * S + fill[r]] = p.experts[i];
      ws[r * S + fill[r]] = p.weights[i];
      ++fill[r];
    }
    *req.mutable_expert_ids() = {ids.begin(), ids.end()};
    *req.mutable_expert_weights() = {ws.begin(), ws.end()};
    if (c->has_deadline) {
      if (c->deadline <= now) {
        return Complete(c,
                        absl::DeadlineExceededError(absl::StrCat(
                            "layer ", c->layer, " request ", c->id, ": deadline passed")),
                        pb::CANCEL_REASON_DEADLINE);
      }
      req.set_timeout_us(std::max<uint64_t>(1, Micros(now, c->deadline)));
    }
    uint64_t sub;
    {
      std::lock_guard<std::mutex> l(c->mu);
      if (c->done) return;
      ++c->outstanding;
      if (c->fanout.empty()) c->t_first_send = now;
      c->fanout.insert(wi);
      sub = c->next_sub++;
      c->subs[sub] = LayerCall::SubRef{pool.worker_ptr(wi), {}};
    }
    const size_t bytes = req.ByteSizeLong();
    auto prows = std::make_shared<Part>(std::move(p));
    std::shared_ptr<LayerCall> cc = c;
    WorkerConn::SubHandle handle;
    absl::Status st = pool.worker(wi).Send(
        &req, bytes,
        [this, cc, wi, sub, prows](absl::Status s, pb::ExpertResponse* resp) {
          OnPart(cc, wi, sub, std::move(prows->rows), std::move(prows->experts),
                 std::move(prows->weights), s, resp);
        },
        &handle);
    if (!st.ok()) {
      OnPart(c, wi, sub, std::move(prows->rows), std::move(prows->experts),
             std::move(prows->weights), st, nullptr);
      continue;
    }
    // Record the handle while the part is unanswered; when the request ended meanwhile (with an
    // error: an OK end needs this part's answer), withdraw it now.
    bool withdraw = false;
    pb::CancelReason why = pb::CANCEL_REASON_FAILED;
    {
      std::lock_guard<std::mutex> l(c->mu);
      auto it = c->subs.find(sub);
      if (it != c->subs.end()) {
        if (c->done) {
          c->subs.erase(it);
          withdraw = true;
          why = c->cancel_reason;
        } else {
          it->second.h = handle;
        }
      }
    }
    if (withdraw) pool.worker(wi).Cancel(handle, why);
  }
}

void MoeRouterService::OnPart(const std::shared_ptr<LayerCall>& c, int wi, uint64_t sub,
                              std::vector<int32_t> rows, std::vector<int32_t> experts,
                              std::vector<float> weights, absl::Status st,
                              pb::ExpertResponse* resp) {
  const WorkerConn& w = c->pool->worker(wi);
  {
    std::lock_guard<std::mutex> l(c->mu);
    c->subs.erase(sub);  // answered: nothing to withdraw any more
  }
  if (st.ok() && resp->status().code() == pb::OK) {
    // Distinct rows in order of first use: the order they were sent in.
    std::vector<int32_t> urows;
    std::vector<bool> seen(c->T, false);
    for (int32_t r : rows) {
      if (!seen[r]) {
        seen[r] = true;
        urows.push_back(r);
      }
    }
    absl::Status v = svc::ValidateTensor(resp->output(), "worker output",
                                         {static_cast<int64_t>(urows.size()), c->H});
    std::vector<float> out(urows.size() * c->H);
    if (v.ok()) v = svc::TensorToFloat(resp->output(), "worker output", false, out.data());
    if (!v.ok()) {
      return Complete(c, absl::InternalError(absl::StrCat("worker ", w.name(), " sent a bad answer: ",
                                                          v.message())));
    }
    {
      std::lock_guard<std::mutex> l(c->mu);
      if (c->done) return;
      for (size_t r = 0; r < urows.size(); ++r) {
        float* dst = c->acc.data() + static_cast<size_t>(urows[r]) * c->H;
        const float* src = out.data() + r * c->H;
        for (int i = 0; i < c->H; ++i) dst[i] += src[i];
      }
      c->t_last_answer = Clock::now();
    }
    return PartDone(c);
  }
  absl::Status err = st.ok() ? svc::FromRequestStatus(resp->status()) : st;
  const absl::StatusCode code = err.code();
  if (!svc::IsRetryable(code)) {
    if (code == absl::StatusCode::kDeadlineExceeded) {
      return Complete(c,
                      absl::DeadlineExceededError(absl::StrCat("layer ", c->layer, " request ",
                                                               c->id, ": worker ", w.name(), ": ",
                                                               err.message())),
                      pb::CANCEL_REASON_DEADLINE);
    }
    return Complete(c, absl::Status(code, absl::StrCat("worker ", w.name(), ": ", err.message())));
  }
  if (c->has_deadline && Clock::now() >= c->deadline) {
    return Complete(c,
                    absl::DeadlineExceededError(absl::StrCat(
                        "layer ", c->layer, " request ", c->id, ": worker ", w.name(),
                        " failed and the deadline passed: ", err.message())),
                    pb::CANCEL_REASON_DEADLINE);
  }
  {
    std::lock_guard<std::mutex> l(c->mu);
    if (c->done) return;
    c->failed_workers.insert(wi);
    c->last_failure = absl::StrCat("worker ", w.name(), " (", w.address(), ") failed with layer ",
                                   c->layer, " ", ExpertsText(experts), ": ", err.message());
  }
  Dispatch(c, std::move(rows), std::move(experts), std::move(weights), wi);
  PartDone(c);
}

void MoeRouterService::PartDone(const std::shared_ptr<LayerCall>& c) {
  {
    std::lock_guard<std::mutex> l(c->mu);
    if (c->done || --c->outstanding > 0) return;
  }
  Complete(c, absl::OkStatus());
}

std::string MoeRouterService::ExpertsText(std::vector<int32_t> ex) const {
  std::sort(ex.begin(), ex.end());
  ex.erase(std::unique(ex.begin(), ex.end()), ex.end());
  const bool shared = !ex.empty() && ex.back() == cfg_.num_experts;  // the pseudo id sorts last
  if (shared) ex.pop_back();
  if (!shared) return absl::StrCat("experts ", FormatIndexRanges(ex));
  if (ex.empty()) return "shared expert";
  return absl::StrCat("experts ", FormatIndexRanges(ex), " and the shared expert");
}

void MoeRouterService::Complete(const std::shared_ptr<LayerCall>& c, const absl::Status& st,
                                pb::CancelReason reason) {
  std::vector<LayerCall::SubRef> withdraw;
  bool cancel_timer;
  {
    std::lock_guard<std::mutex> l(c->mu);
    if (c->done) return;
    c->done = true;
    cancel_timer = c->has_timer;
    c->has_timer = false;
    if (!st.ok()) {
      // The workers' share is no longer needed. Parts whose Send is still running (id 0) are
      // withdrawn by that Send when it sees `done`.
      c->cancel_reason = reason;
      for (auto it = c->subs.begin(); it != c->subs.end();) {
        if (it->second.h.id != 0) {
          withdraw.push_back(std::move(it->second));
          it = c->subs.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  const Clock::time_point t_combine = Clock::now();
  pb::MoeLayerResponse r;
  r.set_id(c->id);
  r.set_layer(c->layer);
  svc::SetRequestStatus(st, r.mutable_status());
  pb::RouterTimings* tm = r.mutable_timings();
  if (st.ok()) {
    svc::EncodeTensor(c->acc.data(), {c->T, c->H}, c->out_dtype, r.mutable_output());
    pb::TopK* tk = r.mutable_topk();
    tk->set_k(c->k);
    *tk->mutable_ids() = {c->ids.begin(), c->ids.end()};
    *tk->mutable_weights() = {c->w.begin(), c->w.end()};
    tm->set_gate_us(Micros(c->t_start, c->t_gate_end));
    tm->set_dispatch_us(Micros(c->t_gate_end, c->t_dispatch_end));
    if (!c->fanout.empty()) tm->set_workers_us(Micros(c->t_first_send, c->t_last_answer));
    tm->set_fanout(static_cast<uint32_t>(c->fanout.size()));
  }
  const Clock::time_point t_end = Clock::now();
  tm->set_combine_us(Micros(t_combine, t_end));
  tm->set_total_us(Micros(c->t_start, t_end));
  // Leave `inflight` and queue the answer in one step: the client may reuse the id once it reads
  // the answer, and the stream does not end between the two.
  c->stream->Answer(std::move(r), /*erase_id=*/true);
  if (metrics_) {
    if (st.ok()) {
      metrics_->RequestOk(c->layer, static_cast<int>(c->T));
      metrics_->Fanout(static_cast<int>(c->fanout.size()));
      if (!c->fanout.empty()) {
        metrics_->ObserveStage(c->layer, Stage::kWorkers, Secs(c->t_first_send, c->t_last_answer));
      }
      metrics_->ObserveStage(c->layer, Stage::kCombine, Secs(t_combine, t_end));
      metrics_->ObserveStage(c->layer, Stage::kTotal, Secs(c->t_start, t_end));
    } else {
      metrics_->Error(svc::StatusCodeName(st.code()));
    }
    metrics_->in_flight().Decrement();
  }
  for (LayerCall::SubRef& sr : withdraw) sr.conn->Cancel(sr.h, reason);
  // A no-op when the deadline itself completed it (the entry is gone once it runs).
  if (cancel_timer) timer_.Cancel(c->timer_key);
  if (in_flight_.fetch_sub(1) == 1) {
    std::lock_guard<std::mutex> l(idle_mu_);
    idle_cv_.notify_all();
  }
}

}  // namespace exl3::router
