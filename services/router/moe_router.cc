#include "services/router/moe_router.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/command_line.h"
#include "base/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "services/common/raw_message.h"
#include "services/common/status.h"
#include "services/common/wire.h"
#include "services/router/layer_request.h"

namespace exl3::router {

namespace {
double Secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
uint64_t Micros(Clock::time_point a, Clock::time_point b) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(b - a).count());
}
}  // namespace

MoeRouterService::MoeRouterService(const Exl3Model& model, const RouterOptions& opt,
                                   RouterMetrics* metrics)
    : model_(model),
      cfg_(model.config()),
      opt_(opt),
      metrics_(metrics),
      gate_(model, opt.gate_threads),
      dispatcher_(metrics, [this](const std::shared_ptr<LayerCall>& c, const absl::Status& st) {
        Finish(c, st);
      }) {
  if (opt.shared_expert_local && cfg_.has_shared_expert()) {
    local_shared_ = std::make_unique<LocalSharedExpert>(model, opt.shared_expert_threads);
  }
  handlers_ = std::make_unique<svc::TaskQueue>(std::max(1, opt.handler_threads));
}

MoeRouterService::~MoeRouterService() = default;

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

// ---- Describe ----

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
      const WorkerConn& w = p->conn(i);
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
  resp->mutable_versions()->set_server(std::string(ProjectVersion()));
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

// ---- streams ----

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* MoeRouterService::Forward(
    grpc::CallbackServerContext*) {
  auto s = std::make_shared<EngineStream>(this);
  {
    std::lock_guard<std::mutex> l(streams_mu_);
    streams_[s.get()] = s;
  }
  s->Begin();
  return s.get();
}

void MoeRouterService::StreamEnded(EngineStream* s) {
  std::shared_ptr<EngineStream> keep;  // destroyed after the lock is released
  std::lock_guard<std::mutex> l(streams_mu_);
  auto it = streams_.find(s);
  if (it != streams_.end()) {
    keep = std::move(it->second);
    streams_.erase(it);
  }
}

void MoeRouterService::Submit(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req,
                              float* out) {
  int64_t tokens = 0;
  if (req.has_hidden() && req.hidden().shape_size() > 0) tokens = req.hidden().shape(0);
  if (req.has_cancel() || tokens <= opt_.inline_max_tokens) return Handle(s, req, out);
  // Large: gate, dispatch and the local shared expert run on the handler pool; the calling
  // thread (a gRPC thread reading the stream) goes back to its work.
  auto r = std::make_shared<pb::MoeLayerRequest>(std::move(req));
  s->BeginHandling();
  handlers_->Post([this, s, r, out] {
    Handle(s, *r, out);
    s->EndHandling();
  });
}

void MoeRouterService::CancelStream(AnswerSink& s) {
  s.cancelled = true;
  std::vector<std::shared_ptr<LayerCall>> calls;
  {
    std::lock_guard<std::mutex> l(s.mu);
    for (auto& [id, c] : s.inflight) calls.push_back(c);
  }
  for (auto& c : calls) {
    dispatcher_.End(c, absl::CancelledError("the client cancelled the stream"),
                    pb::CANCEL_REASON_STREAM_CLOSED);
  }
}

// ---- one request ----

void MoeRouterService::Handle(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req,
                              float* out) {
  const Clock::time_point t0 = Clock::now();
  if (req.has_cancel()) return CancelRequest(*s, req.id());
  if (draining_) {
    return Reject(*s, req, absl::UnavailableError("router is draining (shutting down)"), t0);
  }
  std::shared_ptr<LayerCall> c = Admit(s, req, t0);
  if (!c) return;
  if (absl::Status st = Prepare(req, *c, out); !st.ok()) return dispatcher_.End(c, st);
  c->t_gate_end = Clock::now();
  if (metrics_) metrics_->ObserveStage(c->layer, Stage::kGate, Secs(t0, c->t_gate_end));

  dispatcher_.Start(c, RoutedWork(*c, c->workers->shared_on_workers() && cfg_.has_shared_expert()));
  c->t_dispatch_end = Clock::now();
  if (metrics_) {
    metrics_->ObserveStage(c->layer, Stage::kDispatch, Secs(c->t_gate_end, c->t_dispatch_end));
  }
  // The shared expert runs here while the workers compute.
  if (c->include_shared_expert && local_shared_) {
    if (absl::Status st = local_shared_->AddTo(*c); !st.ok()) return dispatcher_.End(c, st);
  }
  dispatcher_.HandlerDone(c);
}

void MoeRouterService::CancelRequest(AnswerSink& s, uint64_t id) {
  // Not a request: withdraws the in-flight request `id` (answered CANCELLED); an id that is not
  // in flight is ignored. Never answered itself.
  std::shared_ptr<LayerCall> c;
  {
    std::lock_guard<std::mutex> l(s.mu);
    auto it = s.inflight.find(id);
    if (it != s.inflight.end()) c = it->second;
  }
  if (!c) return;
  dispatcher_.End(c,
                  absl::CancelledError(absl::StrCat("layer ", c->layer, " request ", c->id,
                                                    " cancelled by the client")),
                  pb::CANCEL_REASON_CLIENT);
}

void MoeRouterService::Reject(AnswerSink& s, const pb::MoeLayerRequest& req,
                              const absl::Status& st, Clock::time_point t0) {
  pb::MoeLayerResponse r;
  r.set_id(req.id());
  r.set_layer(req.layer());
  svc::SetRequestStatus(st, r.mutable_status());
  r.mutable_timings()->set_total_us(Micros(t0, Clock::now()));
  if (metrics_) metrics_->Error(svc::StatusCodeName(st.code()));
  s.Answer(std::move(r), /*erase_id=*/false);
}

std::shared_ptr<LayerCall> MoeRouterService::Admit(const std::shared_ptr<AnswerSink>& s,
                                                   const pb::MoeLayerRequest& req,
                                                   Clock::time_point t0) {
  auto c = std::make_shared<LayerCall>();
  c->spare = spare_;
  c->sink = s;
  c->id = req.id();
  c->layer = req.layer();
  c->t_start = t0;
  c->workers = pool();
  {
    std::unique_lock<std::mutex> l(s->mu);
    if (s->inflight.count(req.id())) {
      l.unlock();
      Reject(*s, req,
             absl::InvalidArgumentError(
                 absl::StrCat("duplicate in-flight id ", req.id(), " on this stream")),
             t0);
      return nullptr;
    }
    if (in_flight_.load() >= opt_.max_in_flight) {
      l.unlock();
      Reject(*s, req,
             absl::ResourceExhaustedError(absl::StrCat("router has ", opt_.max_in_flight,
                                                       " layer requests in flight (--max-in-flight)")),
             t0);
      return nullptr;
    }
    if (s->cancelled) return nullptr;  // the stream ended: nobody to answer
    s->inflight[req.id()] = c;
    in_flight_.fetch_add(1);
  }
  if (metrics_) metrics_->in_flight().Increment();
  return c;
}

absl::Status MoeRouterService::Prepare(pb::MoeLayerRequest& req, LayerCall& c, float* out) {
  const LayerRequestLimits limits{opt_.max_tokens, opt_.max_message_bytes};
  const bool local_shared = local_shared_ != nullptr;
  EXL3_ASSIGN_OR_RETURN(LayerRequest r, TakeLayerRequest(req, cfg_, limits, local_shared));
  c.num_tokens = r.num_tokens;
  c.hidden_size = r.hidden_size;
  c.in_dtype = r.in_dtype;
  c.out_dtype = r.out_dtype;
  c.hidden_bytes = std::move(r.hidden_bytes);
  c.row_bytes = r.row_bytes;
  c.hidden = std::move(r.hidden);
  c.include_shared_expert = r.include_shared_expert;
  EXL3_ASSIGN_OR_RETURN(c.routing, gate_.Route(std::move(r.gate), c.hidden.data()));
  const size_t answer_bytes = AnswerBytesBound(c.num_tokens, c.hidden_size, c.out_dtype, c.routing.k);
  if (answer_bytes > max_message_bytes()) return AnswerTooLarge(answer_bytes);
  if (!c.workers) return absl::UnavailableError("the router has no worker pool yet");
  if (req.timeout_us() > 0) {
    c.deadline = c.t_start + svc::RequestTimeout(req.timeout_us());
  } else if (opt_.default_deadline_ms > 0) {
    c.deadline = c.t_start + std::chrono::milliseconds(opt_.default_deadline_ms);
  }
  const size_t n = static_cast<size_t>(c.num_tokens) * c.hidden_size;
  if (out != nullptr && c.out_dtype == pb::DTYPE_FP32) {
    c.sum_out = out;
    c.sum_written = false;  // zero-filled or copied into by the first contribution
  } else {
    c.sum.assign(n, 0.0f);
  }
  return absl::OkStatus();
}

void MoeRouterService::Finish(const std::shared_ptr<LayerCall>& c, const absl::Status& st) {
  if (st.ok() && c->sum_out != nullptr) c->ZeroSumIfUnwritten();  // no contribution came
  LayerAnswer a = MakeAnswer(*c, st);
  // Leave `inflight` and queue the answer in one step: the client may reuse the id once it reads
  // the answer, and the stream does not end between the two.
  if (c->sink) c->sink->Answer(std::move(a.response), /*erase_id=*/true);
  if (metrics_) {
    if (st.ok()) {
      metrics_->RequestOk(c->layer, static_cast<int>(c->num_tokens));
      metrics_->Fanout(static_cast<int>(c->fanout.size()));
      if (!c->fanout.empty()) {
        metrics_->ObserveStage(c->layer, Stage::kWorkers, Secs(c->t_first_send, c->t_last_answer));
      }
      metrics_->ObserveStage(c->layer, Stage::kCombine, Secs(a.t_combine, a.t_end));
      metrics_->ObserveStage(c->layer, Stage::kTotal, Secs(c->t_start, a.t_end));
    } else {
      metrics_->Error(svc::StatusCodeName(st.code()));
    }
    metrics_->in_flight().Decrement();
  }
  if (in_flight_.fetch_sub(1) == 1) {
    std::lock_guard<std::mutex> l(idle_mu_);
    idle_cv_.notify_all();
  }
}

}  // namespace exl3::router
