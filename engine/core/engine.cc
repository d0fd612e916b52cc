#include "engine/core/engine.h"

#include <algorithm>
#include <thread>
#include <cmath>
#include <future>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3::engine {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

absl::Status CheckTokenIds(const std::vector<int32_t>& ids, int vocab_size, const char* what) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(what, " token ", i, " is ", ids[i],
                                                     ", outside the vocabulary [0, ",
                                                     vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

// A multimodal checkpoint's image / video placeholder in the prompt: the engine runs the text model.
absl::Status RefuseMediaPlaceholders(const std::vector<int32_t>& prompt, const ModelInfo& info) {
  for (size_t i = 0; i < prompt.size(); ++i)
    for (const MediaPlaceholder& m : info.media_placeholders)
      if (prompt[i] == m.token_id)
        return absl::InvalidArgumentError(absl::StrCat(
            "prompt token ", i, " is ", m.token_id, ", ", info.architecture, "'s ", m.kind,
            " placeholder: image and video inputs are not supported (the engine runs the text model only)"));
  return absl::OkStatus();
}

absl::StatusOr<int> NumKvBlocks(const KvCacheCapacity& capacity, int block_size,
                                int64_t kv_bytes_per_token) {
  int64_t blocks = 0;
  switch (capacity.unit) {
    case KvCacheCapacity::Unit::kBlocks: blocks = capacity.amount; break;
    case KvCacheCapacity::Unit::kTokens: blocks = capacity.amount / block_size; break;
    case KvCacheCapacity::Unit::kBytes:
      if (kv_bytes_per_token <= 0) {
        return absl::InvalidArgumentError(
            "KV capacity in bytes needs the model's kv_bytes_per_token, which is not set");
      }
      blocks = capacity.amount / (kv_bytes_per_token * block_size);
      break;
  }
  if (blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the KV cache capacity (", capacity.amount, ") is less than one block"));
  }
  if (blocks > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(absl::StrCat("too many KV blocks: ", blocks));
  }
  return static_cast<int>(blocks);
}

}  // namespace

int DefaultSamplingThreads() {
  return std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 2, 1, 8);
}

Engine::Engine(EngineOptions options, std::unique_ptr<ModelRunner> runner)
    : options_(std::move(options)),
      runner_(std::move(runner)),
      info_(runner_ != nullptr ? runner_->info() : ModelInfo{}),
      model_max_context_(info_.max_context) {
  std::random_device device;
  seed_source_.seed((static_cast<uint64_t>(device()) << 32) ^ device());
}

Engine::~Engine() { Stop(); }

absl::Status Engine::Start() {
  if (runner_ == nullptr) return absl::InvalidArgumentError("no model runner");
  const SchedulerOptions& s = options_.scheduler;
  if (options_.block_size < 1) return absl::InvalidArgumentError("block_size must be >= 1");
  if (s.max_num_batched_tokens < 1 || s.max_num_seqs < 1 ||
      (s.long_prefill_token_threshold.has_value() && *s.long_prefill_token_threshold < 1)) {
    return absl::InvalidArgumentError(
        "max_num_batched_tokens, max_num_seqs and long_prefill_token_threshold must be >= 1");
  }
  if (s.max_prompt_logit_rows < 1) {
    return absl::InvalidArgumentError("max_prompt_logit_rows must be >= 1");
  }
  if (options_.sampling_threads < 1) {
    return absl::InvalidArgumentError("sampling_threads must be >= 1");
  }
  if (info_.vocab_size < 1 || info_.max_context < 1) {
    return absl::InvalidArgumentError("the model reports no vocabulary or no context length");
  }
  EXL3_RETURN_IF_ERROR(ValidateSpeculativeOptions(s.speculative));
  if (s.speculative.enabled()) {
    if (const absl::Status verify = runner_->CheckDraftVerification(); !verify.ok()) {
      return absl::Status(verify.code(),
                          absl::StrCat("speculative method ", SpeculativeMethodName(s.speculative.method),
                                       " refused for ", info_.architecture, ": ", verify.message()));
    }
  }
  if (s.speculative.method == SpeculativeMethod::kMtp) {
    // The MTP layer's KV is one more cache layer: the runner's bytes per token grow.
    if (const absl::Status mtp = runner_->EnableMtpDrafting(); !mtp.ok()) {
      return absl::Status(mtp.code(), absl::StrCat("speculative method mtp refused for ", info_.architecture,
                                                   ": ", mtp.message()));
    }
    info_.kv_bytes_per_token = runner_->info().kv_bytes_per_token;
  }
  EXL3_ASSIGN_OR_RETURN(const int num_blocks,
                        NumKvBlocks(options_.kv_capacity, options_.block_size,
                                    info_.kv_bytes_per_token));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_ || stopping_) return absl::FailedPreconditionError("the engine was started");
  }
  info_.max_context = static_cast<int>(
      std::min<int64_t>(model_max_context_, int64_t{num_blocks} * options_.block_size));
  // One state slot per sequence that may run (models with recurrent layers use them), each with
  // room for a verify chunk's states.
  const KvCacheShape shape{num_blocks, options_.block_size, s.max_num_seqs,
                           /*max_logit_rows_per_chunk=*/1 + (s.speculative.enabled() ? s.speculative.num_speculative_tokens : 0)};
  EXL3_RETURN_IF_ERROR(runner_->AllocateKvCache(shape));
  shape_ = shape;
  scheduler_ = std::make_unique<Scheduler>(s, info_, shape_, options_.sampling_threads);
  sampling_pool_ = std::make_unique<ParallelFor>(options_.sampling_threads);
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = true;
  }
  loop_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

absl::Status Engine::Validate(const GenerateParams& p) const {
  const int64_t prompt_len = p.prompt.size();
  if (p.prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  EXL3_RETURN_IF_ERROR(CheckTokenIds(p.prompt, info_.vocab_size, "prompt"));
  EXL3_RETURN_IF_ERROR(RefuseMediaPlaceholders(p.prompt, info_));
  EXL3_RETURN_IF_ERROR(CheckTokenIds(p.stop_token_ids, info_.vocab_size, "stop_token_ids"));
  // The context a request can use, and why it is that long.
  const std::string context = absl::StrCat(
      "the context of ", info_.max_context, " tokens",
      info_.max_context < model_max_context_
          ? absl::StrCat(" (the whole KV cache; the model's is ", model_max_context_, ")")
          : "");
  if (prompt_len > info_.max_context) {
    return absl::InvalidArgumentError(
        absl::StrCat("the prompt has ", prompt_len, " tokens, more than ", context));
  }
  if (p.max_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, not ", p.max_tokens));
  }
  if (prompt_len + p.max_tokens > info_.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt (", prompt_len, " tokens) + max_tokens (", p.max_tokens, ") exceeds ", context));
  }
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("min_tokens must be in [0, max_tokens], not ",
                                                   p.min_tokens));
  }
  const SamplingParams& s = p.sampling;
  // Written so that NaN fails every check.
  if (!(s.temperature >= 0) || !std::isfinite(s.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be finite and >= 0, not ", s.temperature));
  }
  if (s.top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, not ", s.top_k));
  if (!(s.top_p > 0 && s.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], not ", s.top_p));
  }
  if (!(s.min_p >= 0 && s.min_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], not ", s.min_p));
  }
  if (!(s.repetition_penalty > 0) || !std::isfinite(s.repetition_penalty)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be finite and > 0, not ", s.repetition_penalty));
  }
  if (!std::isfinite(s.presence_penalty) || !std::isfinite(s.frequency_penalty)) {
    return absl::InvalidArgumentError("presence_penalty and frequency_penalty must be finite");
  }
  if (s.logprobs.has_value() && (*s.logprobs < 0 || *s.logprobs > info_.vocab_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("logprobs must be in [0, ", info_.vocab_size, "], not ", *s.logprobs));
  }
  for (const TokenBias& b : s.logit_bias) {
    if (b.token < 0 || b.token >= info_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias token ", b.token,
                                                     " is outside the vocabulary [0, ",
                                                     info_.vocab_size, ")"));
    }
    if (!(std::abs(b.bias) <= kMaxLogitBias)) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias of token ", b.token, " is ",
                                                     b.bias, ", outside [-100, 100]"));
    }
  }
  if (s.grammar != nullptr && s.grammar->vocab_size() != info_.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the constraint was compiled for a vocabulary of ", s.grammar->vocab_size(),
        " tokens, the model's has ", info_.vocab_size));
  }
  if (p.num_speculative_tokens.has_value()) {
    const SpeculativeOptions& spec = options_.scheduler.speculative;
    if (!spec.enabled() && *p.num_speculative_tokens != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "num_speculative_tokens is ", *p.num_speculative_tokens,
          " but this server runs without speculative decoding (speculative method off): only 0 is allowed"));
    }
    if (spec.enabled() && (*p.num_speculative_tokens < 0 || *p.num_speculative_tokens > spec.num_speculative_tokens)) {
      return absl::InvalidArgumentError(absl::StrCat("num_speculative_tokens must be in [0, ",
                                                     spec.num_speculative_tokens, "] (the server's), not ",
                                                     *p.num_speculative_tokens));
    }
  }
  if (p.prompt_logprobs.has_value()) {
    if (*p.prompt_logprobs < 0 || *p.prompt_logprobs > info_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_logprobs must be in [0, ", info_.vocab_size,
                                                     "], not ", *p.prompt_logprobs));
    }
    if (const absl::Status rows = runner_->CheckPromptLogitRows(); !rows.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("prompt_logprobs refused for ", info_.architecture, ": ", rows.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Engine::Submit(GenerateParams params, EventCallback on_event) {
  if (!on_event) return absl::InvalidArgumentError("no event callback");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || draining_) return absl::UnavailableError("the engine is draining or stopped");
    if (!started_) return absl::FailedPreconditionError("the engine is not started");
  }
  EXL3_RETURN_IF_ERROR(Validate(params));

  Incoming in;
  in.request.tag = std::move(params.tag);
  in.request.on_event = std::move(on_event);
  in.request.deadline = params.deadline;
  in.request.arrival = Clock::now();
  in.sequence.prompt = std::move(params.prompt);
  in.sequence.sampling = params.sampling;
  in.sequence.max_tokens = params.max_tokens;
  in.sequence.min_tokens = params.min_tokens;
  in.sequence.stop_token_ids = std::move(params.stop_token_ids);
  in.sequence.ignore_eos = params.ignore_eos;
  in.sequence.prompt_logprobs = params.prompt_logprobs;
  in.sequence.num_speculative_tokens = params.num_speculative_tokens;

  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || draining_) return absl::UnavailableError("the engine is draining or stopped");
  if (static_cast<int>(live_.size()) >= options_.max_pending_requests) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the engine already holds ", live_.size(), " requests (max_pending_requests)"));
  }
  const uint64_t id = next_id_++;
  in.request.id = id;
  in.sequence.seed = params.sampling.seed.has_value() ? *params.sampling.seed : seed_source_();
  live_.insert(id);
  incoming_.push_back(std::move(in));
  wake_.notify_one();
  return id;
}

absl::Status Engine::Cancel(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!live_.contains(request_id)) {
    return absl::NotFoundError(absl::StrCat("no running request ", request_id));
  }
  cancels_.push_back(request_id);
  wake_.notify_one();
  return absl::OkStatus();
}

void Engine::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  draining_ = true;
  drained_.wait(lock, [&] { return live_.empty(); });
}

int Engine::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
    stopping_ = true;
    wake_.notify_one();
  }
  if (!loop_.joinable()) return 0;
  loop_.join();
  return ended_by_stop_;
}

EngineStats Engine::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Engine::Loop() {
  while (Intake()) {
    ExpireDeadlines(Clock::now());
    if (!scheduler_->Empty()) RunStep();
    PublishStats();
    AfterEvents();
  }
  // Stop: every request left ends UNAVAILABLE (kAbort would read as the client's own cancel).
  std::vector<uint64_t> left;
  for (const auto& [id, request] : requests_) left.push_back(id);
  std::sort(left.begin(), left.end());
  for (uint64_t id : left) {
    Finish(id, FinishReason::kError,
           absl::UnavailableError("server draining: it stopped before the request finished"));
  }
  ended_by_stop_ = static_cast<int>(left.size());
  PublishStats();
  AfterEvents();
}

void Engine::AfterEvents() {
  if (!events_since_after_events_) return;
  events_since_after_events_ = false;
  if (options_.after_events) options_.after_events();
}

bool Engine::Intake() {
  std::vector<Incoming> incoming;
  std::vector<uint64_t> cancels;
  bool stopping;
  {
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait(lock, [&] {
      return stopping_ || !incoming_.empty() || !cancels_.empty() || !scheduler_->Empty();
    });
    incoming.swap(incoming_);
    cancels.swap(cancels_);
    stopping = stopping_;
  }
  for (Incoming& in : incoming) {
    const uint64_t id = in.request.id;
    in.request.progress.prompt_tokens = static_cast<int>(in.sequence.prompt.size());
    requests_.emplace(id, std::move(in.request));
    scheduler_->Add(static_cast<int64_t>(id), std::move(in.sequence));
  }
  ApplyCancels(std::move(cancels));
  return !stopping;
}

void Engine::Deliver(const std::vector<SequenceUpdate>& updates, SteadyTime now) {
  // A sequence's tokens of one step (several after accepted drafts) are consecutive: one event.
  for (size_t i = 0; i < updates.size();) {
    const int64_t id = updates[i].sequence_id;
    size_t end = i;
    std::vector<SampledToken> tokens;
    for (; end < updates.size() && updates[end].sequence_id == id; ++end) tokens.push_back(updates[end].token);
    std::vector<SampledToken> prompt_logprobs = updates[i].prompt_logprobs;  // the first token's
    const SequenceUpdate& last = updates[end - 1];
    Request& r = requests_.at(id);
    r.progress = last.progress;
    for (size_t k = i; k < end; ++k) {
      if (!r.first_token.has_value()) {
        r.first_token = now;
      } else {
        const double gap = Seconds(now - r.last_token);
        r.inter_token_sum_s += gap;
        r.inter_token_max_s = std::max(r.inter_token_max_s, gap);
      }
      r.last_token = now;
    }
    i = end;
    if (last.finish.has_value()) {
      Finish(id, *last.finish, absl::OkStatus(), std::move(tokens), std::move(prompt_logprobs));
    } else {
      GenerateEvent e;
      e.request_id = id;
      e.tag = r.tag;
      e.tokens = std::move(tokens);
      e.prompt_logprobs = std::move(prompt_logprobs);
      r.on_event(e);
      events_since_after_events_ = true;
    }
  }
}

// A failed step of several sequences: each chunk runs again alone, so only the sequences whose
// own tokens fail (e.g. routed to experts no worker serves) fail. The chunks' earlier writes to
// the cache are rewritten with the same values.
void Engine::RetryChunksAlone(const ScheduledStep& step) {
  for (const SequenceChunk& chunk : step.batch.chunks) {
    if (!requests_.contains(chunk.sequence_id)) continue;  // cancelled during the step
    ScheduledStep alone;
    alone.batch.chunks.push_back(chunk);
    alone.batch.keep_hidden_states = step.batch.keep_hidden_states;
    const absl::Status st = RunForward(alone);
    if (st.ok()) {
      Deliver(CompleteStep(alone), Clock::now());
      FailSequences(scheduler_->step_failures());
      DraftWithMtp(alone);
    } else {
      for (int64_t id : scheduler_->FailStep(alone)) Finish(id, FinishReason::kError, st);
    }
  }
}

absl::Status Engine::RunForward(const ScheduledStep& step) {
  // A step without logit rows (prompt chunks only) has nothing to sample: plain Forward. Prompt
  // positions' rows (prompt logprobs) need the logits here. Verify chunks' rows go to the runner
  // with their drafts in their histories, constrained rows with their masks (Scheduler::SamplingRows).
  std::vector<RowSampling> rows;
  if (!Scheduler::HasPromptPositionRows(step)) rows = scheduler_->SamplingRows(step);
  runner_sampled_ = !rows.empty() && std::all_of(rows.begin(), rows.end(), [&](const RowSampling& r) {
    return runner_->SamplesRows(r.params);
  });
  // The constrained rows' masks depend only on tokens already accepted: they are filled on
  // another thread while the forward pass runs, and joined before anything reads them or touches
  // the scheduler (CompleteStep would fill any it missed).
  std::future<void> masks;
  if (scheduler_->HasConstrainedRows(step)) {
    // The sampling threads are idle until the step's rows come back.
    masks = std::async(std::launch::async,
                       [this, &step] { scheduler_->FillConstraintMasks(step, sampling_pool_.get()); });
  }
  auto masks_ready = [&masks] {
    if (masks.valid()) masks.get();
  };
  absl::Status forward;
  if (runner_sampled_) {
    sampled_.assign(rows.size(), SampledToken{});
    forward = runner_->ForwardSampled(step.batch, rows, std::span<SampledToken>(sampled_), masks_ready);
  } else {
    logits_.resize(static_cast<size_t>(step.batch.NumLogitRows()) * info_.vocab_size);
    forward = runner_->Forward(step.batch, logits_.data());
  }
  masks_ready();  // where the runner did not call it (or failed first)
  return forward;
}

void Engine::DraftWithMtp(const ScheduledStep& step) {
  if (!step.batch.keep_hidden_states) return;
  const std::vector<MtpSpan> spans = scheduler_->MtpSpans(step);
  if (spans.empty()) return;
  absl::StatusOr<std::vector<std::vector<int32_t>>> drafts = runner_->ProposeMtpDrafts(spans);
  if (!drafts.ok()) {
    // The MTP layer's KV of these sequences is incomplete now: they cannot draft on.
    for (const MtpSpan& s : spans) {
      if (requests_.contains(s.sequence_id)) Finish(s.sequence_id, FinishReason::kError, drafts.status());
    }
    return;
  }
  for (size_t i = 0; i < spans.size(); ++i) scheduler_->SetMtpDrafts(spans[i].sequence_id, std::move((*drafts)[i]));
}

std::vector<SequenceUpdate> Engine::CompleteStep(const ScheduledStep& step) {
  if (runner_sampled_) {
    return scheduler_->CompleteSampledStep(
        step, sampled_, [this](int row, std::span<float> logits) { return runner_->MaskedRowLogits(row, logits); },
        sampling_pool_.get());
  }
  return scheduler_->CompleteStep(step, logits_, sampling_pool_.get());
}

void Engine::ApplyCancels(std::vector<uint64_t> cancels) {
  if (cancels.empty()) return;
  for (uint64_t id : cancels) {
    if (requests_.contains(id)) Finish(id, FinishReason::kAbort, absl::OkStatus());
  }
  PublishStats();  // the freed blocks show at once
}

void Engine::ExpireDeadlines(SteadyTime now) {
  std::vector<uint64_t> expired;
  for (const auto& [id, request] : requests_) {
    if (request.deadline.has_value() && *request.deadline <= now) expired.push_back(id);
  }
  std::sort(expired.begin(), expired.end());
  for (uint64_t id : expired) {
    Finish(id, FinishReason::kError, absl::DeadlineExceededError("the request's deadline passed"));
  }
}

void Engine::RunStep() {
  StepMetrics m;
  const SteadyTime t0 = Clock::now();
  ScheduledStep step = scheduler_->Schedule();
  const SteadyTime t1 = Clock::now();
  m.schedule_s = Seconds(t1 - t0);
  m.num_preempted = static_cast<int>(step.preempted.size());
  for (int64_t id : step.dropped) {
    Finish(id, FinishReason::kError,
           absl::ResourceExhaustedError("the sequence outgrew the whole KV cache"));
  }
  if (step.batch.chunks.empty()) return;

  for (const SequenceChunk& chunk : step.batch.chunks) {
    Request& r = requests_.at(chunk.sequence_id);
    if (!r.first_scheduled.has_value()) r.first_scheduled = t0;
    // A decode token, or a verify chunk (that token and its drafts).
    const bool decode = chunk.wants_logits && chunk.num_logit_rows == static_cast<int>(chunk.tokens.size()) &&
                        r.first_token.has_value();
    (decode ? m.num_decode_tokens : m.num_prefill_tokens) += static_cast<int>(chunk.tokens.size());
    if (decode && chunk.num_logit_rows > 1 && chunk.logit_rows_use == LogitRowsUse::kNextTokens) ++m.num_verify_chunks;
  }
  m.num_sequences = static_cast<int>(step.batch.chunks.size());
  m.num_tokens = step.batch.NumTokens();

  const SteadyTime t2 = Clock::now();
  const absl::Status forward = RunForward(step);
  const SteadyTime t3 = Clock::now();
  m.forward_s = Seconds(t3 - t2);
  m.phases = runner_->LastPhaseTimes();
  ++steps_;

  // Cancels that came during the step win over its tokens.
  std::vector<uint64_t> cancels;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancels.swap(cancels_);
  }
  ApplyCancels(std::move(cancels));

  double sample_s = 0;
  if (forward.ok()) {
    const std::vector<SequenceUpdate> updates = CompleteStep(step);
    const SteadyTime t4 = Clock::now();
    sample_s = Seconds(t4 - t3);
    // What the step's rows cost, for the goodput draft length: scheduling, the forward pass and
    // sampling, all of which grow with verify rows (not the MTP drafting below, whose chained
    // positions follow each sequence's last choice: DraftLength::chained_draft_limit).
    scheduler_->ObserveStepTime(step.batch, Seconds(t4 - t0));
    if (runner_sampled_) {
      // The runner sampled inside its forward pass: that time counts as sampling.
      const double device_sample_s = std::min(m.phases.sample_s, m.forward_s);
      m.forward_s -= device_sample_s;
      sample_s += device_sample_s;
    }
    Deliver(updates, t4);
    FailSequences(scheduler_->step_failures());
    DraftWithMtp(step);
  } else {
    m.failed = true;
    ++failed_steps_;
    if (step.batch.chunks.size() > 1) {
      RetryChunksAlone(step);
    } else {
      for (int64_t id : scheduler_->FailStep(step)) Finish(id, FinishReason::kError, forward);
    }
  }
  m.sample_s = sample_s;
  m.bookkeeping_s = Seconds(Clock::now() - t0) - m.schedule_s - m.forward_s - m.sample_s;
  m.num_running = scheduler_->NumRunning();
  m.num_waiting = scheduler_->NumWaiting();
  m.kv_usage = scheduler_->kv().Usage();
  if (options_.observer != nullptr) options_.observer->OnStep(m);
}

void Engine::FailSequences(std::vector<SequenceFailure> failures) {
  for (SequenceFailure& f : failures) {
    if (requests_.contains(f.sequence_id)) {
      Finish(f.sequence_id, FinishReason::kError, std::move(f.status));
    }
  }
}

void Engine::Finish(uint64_t id, FinishReason reason, absl::Status status,
                    std::vector<SampledToken> last_tokens, std::vector<SampledToken> prompt_logprobs) {
  auto it = requests_.find(id);
  Request& r = it->second;
  if (std::optional<SequenceProgress> p = scheduler_->Progress(id); p.has_value()) {
    r.progress = *p;
    scheduler_->Abort(id);
  }
  const SteadyTime now = Clock::now();

  GenerateEvent e;
  e.request_id = id;
  e.tag = r.tag;
  e.tokens = std::move(last_tokens);
  e.prompt_logprobs = std::move(prompt_logprobs);
  FinishInfo& f = e.finish.emplace();
  f.reason = reason;
  f.status = std::move(status);
  f.usage.prompt_tokens = r.progress.prompt_tokens;
  f.usage.completion_tokens = r.progress.output_tokens;
  f.usage.cached_tokens = r.progress.cached_prompt_tokens;
  RequestTimings& t = f.timings;
  t.total_s = Seconds(now - r.arrival);
  if (r.first_scheduled.has_value()) t.queue_s = Seconds(*r.first_scheduled - r.arrival);
  if (r.first_token.has_value()) {
    t.time_to_first_token_s = Seconds(*r.first_token - r.arrival);
    t.prefill_s = Seconds(*r.first_token - *r.first_scheduled);
    if (r.progress.output_tokens >= 2) {
      t.mean_inter_token_s = r.inter_token_sum_s / (r.progress.output_tokens - 1);
      t.max_inter_token_s = r.inter_token_max_s;
    }
  }
  r.on_event(e);
  events_since_after_events_ = true;
  if (options_.observer != nullptr) options_.observer->OnRequestFinished(r.tag, f);
  requests_.erase(it);
  ++requests_finished_;
  std::lock_guard<std::mutex> lock(mu_);
  live_.erase(id);
  if (live_.empty()) drained_.notify_all();
}

void Engine::PublishStats() {
  const KvBlockManager& kv = scheduler_->kv();
  EngineStats s;
  s.running = scheduler_->NumRunning();
  s.waiting = scheduler_->NumWaiting();
  s.preemptions = scheduler_->NumPreemptions();
  s.kv_usage = kv.Usage();
  s.prefix_cache_queried_tokens = kv.counters().queried_tokens;
  s.prefix_cache_hit_tokens = kv.counters().hit_tokens;
  s.prefix_cache_hit_rate = s.prefix_cache_queried_tokens > 0
                                ? static_cast<double>(s.prefix_cache_hit_tokens) /
                                      s.prefix_cache_queried_tokens
                                : 0.0;
  s.steps = steps_;
  s.failed_steps = failed_steps_;
  s.requests_finished = requests_finished_;
  s.speculative = scheduler_->speculative_counters();
  s.speculative_mean_draft_length = scheduler_->MeanDraftLimit();
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = s;
}

}  // namespace exl3::engine
