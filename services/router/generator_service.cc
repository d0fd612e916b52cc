#include "services/router/generator_service.h"

#include <memory>
#include <mutex>

#include "grpcpp/grpcpp.h"
#include "services/common/status.h"
#include "services/router/generate_messages.h"

namespace exl3::router {
namespace {

namespace pb = ::exl3serve::v1;
using SteadyClock = std::chrono::steady_clock;

// One Generate call. Lives until OnDone, which comes after Finish, which is called only once the
// engine's final event for the request has arrived (or the request was never accepted), so the
// engine never calls back into a deleted reactor.
class GenerateReactor final : public grpc::ServerWriteReactor<pb::GenerateResponse> {
 public:
  GenerateReactor(engine::Engine& engine, svc::TaskQueue& writer, grpc::CallbackServerContext* ctx,
                  const pb::GenerateRequest& req, const GeneratorOptions& options)
      : engine_(engine), writer_(writer), first_write_started_(options.first_write_started),
        first_write_done_(options.first_write_done) {
    const SteadyClock::time_point deadline =
        RequestDeadline(req, options.default_timeout, ctx->deadline());
    auto id = engine_.Submit(ToGenerateParams(req, deadline),
                             [this](const engine::GenerateEvent& e) { OnEvent(e); });
    std::lock_guard<std::mutex> lock(mu_);
    if (!id.ok()) {
      finished_ = true;
      Finish(svc::ToGrpcStatus(id.status()));
      return;
    }
    request_id_ = *id;
    accepted_ = true;
    if (cancel_requested_) (void)engine_.Cancel(request_id_);
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_requested_ = true;
    if (accepted_) (void)engine_.Cancel(request_id_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (first_in_flight_) {
      first_in_flight_ = false;
      if (first_write_done_ != nullptr) first_write_done_->Observe(SecondsSince(first_at_));
    }
    if (!ok) client_gone_ = true;
    if (!ok && accepted_ && !final_seen_) (void)engine_.Cancel(request_id_);
    Advance();
  }

  void OnDone() override { delete this; }

 private:
  // On the engine's loop thread.
  void OnEvent(const engine::GenerateEvent& e) {
    std::lock_guard<std::mutex> lock(mu_);
    AddTokens(e.tokens, &pending_);
    has_pending_ = has_pending_ || !e.tokens.empty();
    bool first = false;  // this event brings the call's first tokens
    if (!tokens_seen_ && !e.tokens.empty()) {
      tokens_seen_ = first = first_pending_ = true;
      first_at_ = SteadyClock::now();
    }
    if (e.finish) {
      final_seen_ = true;
      SetFinish(*e.finish, &pending_);
      has_pending_ = true;
      final_status_ = FinalStatus(*e.finish);
    }
    // The write starts on the writer thread, woken once the engine has delivered all of this
    // pass's events (after_events); Advance waits for that task (write_scheduled_), so the call
    // cannot finish (and be deleted) while it is queued. A call's first tokens are written here,
    // on the loop, at once (generator_service.h says why).
    if (first) {
      Advance();
    } else if (!writing_ && !write_scheduled_ && !finished_) {
      write_scheduled_ = true;
      writer_.PostQuietly([this] {
        std::lock_guard<std::mutex> lock(mu_);
        write_scheduled_ = false;
        Advance();
      });
    }
  }

  // Under mu_: starts the next write, or finishes once the final event has been written.
  void Advance() {
    if (writing_ || finished_ || write_scheduled_) return;
    if (has_pending_ && !client_gone_) {
      current_.Swap(&pending_);
      pending_.Clear();
      has_pending_ = false;
      writing_ = true;
      if (first_pending_) {
        first_pending_ = false;
        first_in_flight_ = true;
        if (first_write_started_ != nullptr) first_write_started_->Observe(SecondsSince(first_at_));
      }
      StartWrite(&current_);
      return;
    }
    if (final_seen_) {
      finished_ = true;
      Finish(client_gone_ ? grpc::Status(grpc::StatusCode::CANCELLED, "client went away")
                          : final_status_);
    }
  }

  static double SecondsSince(SteadyClock::time_point t) {
    return std::chrono::duration<double>(SteadyClock::now() - t).count();
  }

  engine::Engine& engine_;
  svc::TaskQueue& writer_;
  prometheus::Histogram* const first_write_started_;
  prometheus::Histogram* const first_write_done_;
  std::mutex mu_;
  bool tokens_seen_ = false;      // an event with tokens has arrived
  bool first_pending_ = false;    // the first tokens are in pending_, not yet written
  bool first_in_flight_ = false;  // current_ (being written) carries the first tokens
  SteadyClock::time_point first_at_;  // the first tokens' event
  uint64_t request_id_ = 0;
  bool write_scheduled_ = false;
  bool accepted_ = false;
  bool cancel_requested_ = false;
  bool writing_ = false;
  bool final_seen_ = false;
  bool finished_ = false;
  bool client_gone_ = false;
  bool has_pending_ = false;
  pb::GenerateResponse pending_, current_;
  grpc::Status final_status_;
};

}  // namespace

GeneratorService::GeneratorService(engine::Engine& engine, GeneratorOptions options,
                                   svc::TaskQueue& writer, GenerateStreams& streams)
    : engine_(engine), options_(std::move(options)), writer_(writer), streams_(streams) {}

grpc::ServerWriteReactor<pb::GenerateResponse>* GeneratorService::Generate(
    grpc::CallbackServerContext* ctx, const pb::GenerateRequest* req) {
  return new GenerateReactor(engine_, writer_, ctx, *req, options_);
}

grpc::ServerBidiReactor<pb::GenerateStreamRequest, pb::GenerateStreamResponse>*
GeneratorService::GenerateStream(grpc::CallbackServerContext* ctx) {
  return streams_.Open(engine_, ctx);
}

grpc::ServerUnaryReactor* GeneratorService::DescribeModel(grpc::CallbackServerContext* ctx,
                                                          const pb::DescribeModelRequest*,
                                                          pb::DescribeModelResponse* resp) {
  const engine::ModelInfo& info = engine_.model_info();
  const engine::KvCacheShape shape = engine_.kv_cache_shape();
  resp->set_model(info.name);
  resp->set_architecture(info.architecture);
  resp->set_vocab_size(info.vocab_size);
  resp->set_max_context(info.max_context);
  for (int32_t e : info.eos_token_ids) resp->add_eos_token_ids(e);
  resp->set_kv_capacity_tokens(static_cast<uint64_t>(shape.num_blocks) * shape.block_size);
  resp->set_kv_block_size(shape.block_size);
  resp->set_experts(options_.experts);
  resp->set_max_num_seqs(options_.max_num_seqs);
  resp->mutable_versions()->set_server(EXL3_VERSION);
  resp->mutable_versions()->set_protocol("exl3serve.v1");
  resp->mutable_versions()->set_grpc(grpc::Version());
  resp->set_state(draining_ ? pb::STATE_DRAINING : pb::STATE_SERVING);
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(grpc::Status::OK);
  return r;
}

}  // namespace exl3::router
