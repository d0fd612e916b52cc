#include "services/router/generator_service.h"

#include <memory>
#include <mutex>

#include "base/command_line.h"
#include "grpcpp/grpcpp.h"
#include "services/common/status.h"
#include "services/router/generate_messages.h"
#include "services/router/request_log.h"

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
    const SteadyClock::time_point taken = SteadyClock::now();
    const std::string id = RequestIdOf(req, ctx);
    LogRequestStart(id, req);  // before Submit: its end may be logged before Submit returns
    const SteadyClock::time_point deadline =
        RequestDeadline(req, options.default_timeout, ctx->deadline());
    absl::StatusOr<engine::GenerateParams> params = ToGenerateParams(req, deadline, options);
    if (params.ok()) params->tag = id;  // the end event's id: request_id or x-request-id
    absl::StatusOr<uint64_t> engine_id =
        params.ok() ? engine_.Submit(*std::move(params),
                                     [this](const engine::GenerateEvent& e) { OnEvent(e); })
                    : params.status();
    std::lock_guard<std::mutex> lock(mu_);
    if (!engine_id.ok()) {
      LogRequestRefused(id, req, engine_id.status(), taken);
      write_ = WriteState::kFinished;
      Finish(svc::ToGrpcStatus(engine_id.status()));
      return;
    }
    request_id_ = *engine_id;
    // The engine's events may have come (even the final one) before this lock.
    if (request_ == RequestState::kCancelledWhileSubmitting) (void)engine_.Cancel(request_id_);
    if (request_ != RequestState::kEnded) request_ = RequestState::kRunning;
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (request_ == RequestState::kSubmitting) request_ = RequestState::kCancelledWhileSubmitting;
    if (request_ == RequestState::kRunning) (void)engine_.Cancel(request_id_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    write_ = WriteState::kIdle;
    if (first_tokens_ == FirstTokens::kWriting) {
      first_tokens_ = FirstTokens::kWritten;
      if (first_write_done_ != nullptr) first_write_done_->Observe(SecondsSince(first_at_));
    }
    if (!ok) {
      client_gone_ = true;
      if (request_ == RequestState::kRunning) (void)engine_.Cancel(request_id_);
    }
    Advance();
  }

  void OnDone() override { delete this; }

 private:
  // The request as the engine has it.
  enum class RequestState {
    kSubmitting,                // Submit has not returned
    kCancelledWhileSubmitting,  // the client cancelled before Submit returned: cancelled once it does
    kRunning,                   // accepted, its final event not yet here
    kEnded,                     // its final event has arrived
  };
  // The call's writes (one at a time).
  enum class WriteState {
    kIdle,
    kScheduled,  // Advance queued on the writer thread
    kWriting,    // current_ being written
    kFinished,   // Finish called
  };
  // The call's first tokens, for the time-to-first-write histograms.
  enum class FirstTokens { kNotYet, kPending, kWriting, kWritten };

  // On the engine's loop thread.
  void OnEvent(const engine::GenerateEvent& e) {
    std::lock_guard<std::mutex> lock(mu_);
    AddTokens(e.tokens, &pending_);
    AddPromptLogprobs(e.prompt_logprobs, &pending_);
    const bool first = first_tokens_ == FirstTokens::kNotYet && !e.tokens.empty();  // the call's first tokens
    if (first) {
      first_tokens_ = FirstTokens::kPending;
      first_at_ = SteadyClock::now();
    }
    if (e.finish) {
      LogRequestEnd(e.tag, *e.finish);
      request_ = RequestState::kEnded;
      SetFinish(*e.finish, &pending_);
      final_status_ = FinalStatus(*e.finish);
    }
    // The write starts on the writer thread, woken once the engine has delivered all of this
    // pass's events (after_events); Advance waits for that task (kScheduled), so the call cannot
    // finish (and be deleted) while it is queued. A call's first tokens are written here, on the
    // loop, at once (generator_service.h says why).
    if (first) {
      Advance();
    } else if (write_ == WriteState::kIdle) {
      write_ = WriteState::kScheduled;
      writer_.PostQuietly([this] {
        std::lock_guard<std::mutex> lock(mu_);
        write_ = WriteState::kIdle;
        Advance();
      });
    }
  }

  // Under mu_: starts the next write, or finishes once the final event has been written.
  void Advance() {
    if (write_ != WriteState::kIdle) return;
    const bool has_pending = pending_.tokens_size() > 0 || pending_.has_usage();  // usage: the final message
    if (has_pending && !client_gone_) {
      current_.Swap(&pending_);
      pending_.Clear();
      write_ = WriteState::kWriting;
      if (first_tokens_ == FirstTokens::kPending) {
        first_tokens_ = FirstTokens::kWriting;
        if (first_write_started_ != nullptr) first_write_started_->Observe(SecondsSince(first_at_));
      }
      StartWrite(&current_);
      return;
    }
    if (request_ == RequestState::kEnded) {
      write_ = WriteState::kFinished;
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
  uint64_t request_id_ = 0;
  RequestState request_ = RequestState::kSubmitting;
  WriteState write_ = WriteState::kIdle;
  FirstTokens first_tokens_ = FirstTokens::kNotYet;
  SteadyClock::time_point first_at_;  // the first tokens' event
  bool client_gone_ = false;          // a write failed: nothing more is written
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
  resp->mutable_versions()->set_server(std::string(ProjectVersion()));
  resp->mutable_versions()->set_protocol("exl3serve.v1");
  resp->mutable_versions()->set_grpc(grpc::Version());
  resp->set_state(draining_ ? pb::STATE_DRAINING : pb::STATE_SERVING);
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(grpc::Status::OK);
  return r;
}

grpc::ServerUnaryReactor* GeneratorService::EngineStats(grpc::CallbackServerContext* ctx,
                                                        const pb::EngineStatsRequest*,
                                                        pb::EngineStatsResponse* resp) {
  const engine::EngineStats s = engine_.Stats();
  resp->set_num_requests_running(static_cast<uint32_t>(s.running));
  resp->set_num_requests_waiting(static_cast<uint32_t>(s.waiting));
  resp->set_kv_cache_usage(s.kv_usage);
  resp->set_num_preemptions(static_cast<uint64_t>(s.preemptions));
  resp->set_prefix_cache_queried_tokens(static_cast<uint64_t>(s.prefix_cache_queried_tokens));
  resp->set_prefix_cache_hit_tokens(static_cast<uint64_t>(s.prefix_cache_hit_tokens));
  const engine::SpeculativeCounters& spec = s.speculative;
  resp->set_num_speculative_tokens(static_cast<uint32_t>(spec.num_accepted_tokens_per_pos.size()));
  resp->set_spec_decode_num_drafts(static_cast<uint64_t>(spec.num_drafts));
  resp->set_spec_decode_num_draft_tokens(static_cast<uint64_t>(spec.num_draft_tokens));
  resp->set_spec_decode_num_accepted_tokens(static_cast<uint64_t>(spec.num_accepted_tokens));
  for (int64_t n : spec.num_accepted_tokens_per_pos) {
    resp->add_spec_decode_num_accepted_tokens_per_pos(static_cast<uint64_t>(n));
  }
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(grpc::Status::OK);
  return r;
}

}  // namespace exl3::router
