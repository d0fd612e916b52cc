// The generation engine: requests in, token events out, one loop thread that schedules a step
// (engine/core/scheduler.h), runs it on the model (engine/core/model_runner.h), samples and reports.
//
//   EngineOptions opt;
//   opt.kv_capacity = {KvCacheCapacity::Unit::kBytes, 8ll << 30};
//   Engine engine(opt, std::move(runner));
//   EXL3_RETURN_IF_ERROR(engine.Start());                  // allocates the KV cache, starts the loop
//   GenerateParams p; p.prompt = ids; p.max_tokens = 128; p.sampling.temperature = 0.7f;
//   EXL3_ASSIGN_OR_RETURN(uint64_t id, engine.Submit(std::move(p), [](const GenerateEvent& e) {
//     // on the loop thread; must not block: hand e.tokens / e.finish to the caller's stream
//   }));
//   engine.Cancel(id);                                       // final event kAbort within a step
//   engine.Drain();                                          // refuse new work, finish what runs
//   engine.Stop();                                           // abort the rest, join the loop
//
// Every accepted request gets exactly one final event (GenerateEvent::finish set), after which
// its callback is never called again. Start fails INVALID_ARGUMENT on bad options, and
// FAILED_PRECONDITION for a speculative method the model runner cannot verify
// (engine/core/model_runner.h CheckDraftVerification), or mtp where it has no MTP head
// (CheckMtpDrafting), naming why. Submit's errors are the request's
// alone:
//   INVALID_ARGUMENT    empty prompt, token id outside [0, vocab), prompt longer than
//                       max_context or than the whole KV cache, max_tokens <= 0 or prompt +
//                       max_tokens > max_context, min_tokens outside [0, max_tokens],
//                       temperature < 0, top_k < 0, top_p outside (0, 1], min_p outside [0, 1],
//                       repetition_penalty <= 0, logprobs or prompt_logprobs outside [0, vocab],
//                       a logit_bias token outside [0, vocab) or bias outside [-100, 100], a
//                       grammar compiled for another vocabulary size, no callback,
//                       num_speculative_tokens outside [0, the server's
//                       num_speculative_tokens], or above 0 on an engine without speculative
//                       decoding (never ignored);
//   FAILED_PRECONDITION prompt_logprobs on a runner that cannot return them
//                       (ModelRunner::CheckPromptLogitRows names why);
//   RESOURCE_EXHAUSTED  max_pending_requests requests already in the engine;
//   UNAVAILABLE         draining or stopped;
//   FAILED_PRECONDITION Start has not succeeded.
// Final events with kError carry DEADLINE_EXCEEDED (the request's deadline passed; checked at
// every step), the runner's status (the step that held the request failed; the engine goes on
// with the other requests; a failed step of several sequences runs each alone once more, so only
// the sequences whose own tokens fail end), RESOURCE_EXHAUSTED (the sequence outgrew the whole
// KV cache), or INVALID_ARGUMENT when the request's constraint allows no token at some step (its
// only continuations are banned, e.g. end-of-sequence before min_tokens).
//
// Constrained decoding (SamplingParams::grammar, engine/sampling/token_constraint.h): each step the masks
// of the constrained sequences are computed on a second thread while the forward pass runs, and
// a runner that samples (the GPU's) applies them where the logits are; the constraint takes the
// token on the host, which draws the row again there in the rare case it refuses one its mask
// allowed. A constrained sequence ends (kStop) when its grammar is complete and took a stop token.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/core/model_runner.h"
#include "engine/core/parallel_for.h"
#include "engine/sampling/sampler.h"
#include "engine/core/scheduler.h"

namespace exl3::engine {

using SteadyTime = std::chrono::steady_clock::time_point;

struct GenerateParams {
  std::vector<int32_t> prompt;  // token ids
  SamplingParams sampling;
  int max_tokens = 16;
  int min_tokens = 0;                   // EOS and stop tokens are suppressed before this many
  std::vector<int32_t> stop_token_ids;  // end the request like EOS
  bool ignore_eos = false;              // ModelInfo::eos_token_ids do not end the request
  std::optional<SteadyTime> deadline;
  // Unset: none. N: every prompt token's logprob but the first's, and the top N of its position
  // (vLLM's prompt_logprobs; log_softmax of the raw logits, as SamplingParams::logprobs), in the
  // event of the first token. The request skips the prefix cache's lookup (engine/core/scheduler.h).
  std::optional<int> prompt_logprobs;
  // Speculative decoding for this request: unset, the engine's num_speculative_tokens drafts per
  // step at most; 0, none (a large batch may not want to pay for them); 1..K, at most that many.
  std::optional<int> num_speculative_tokens;
  std::string tag;                      // the caller's label (e.g. the gRPC request id), echoed
};

struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;  // includes the EOS / stop token that ended the request
  int cached_tokens = 0;      // prompt tokens served by the prefix cache
};

// Seconds. Phases the request never reached are unset.
struct RequestTimings {
  std::optional<double> queue_s;              // Submit to first scheduled step
  std::optional<double> prefill_s;            // first scheduled step to first token
  std::optional<double> time_to_first_token_s;  // Submit to first token
  std::optional<double> mean_inter_token_s;   // between consecutive tokens (two or more tokens)
  std::optional<double> max_inter_token_s;
  double total_s = 0;                         // Submit to the final event
};

struct FinishInfo {
  FinishReason reason = FinishReason::kStop;
  absl::Status status;  // OK unless reason is kError
  Usage usage;
  RequestTimings timings;
};

struct GenerateEvent {
  uint64_t request_id = 0;
  std::string_view tag;              // GenerateParams::tag; valid during the callback only
  std::vector<SampledToken> tokens;  // new tokens (with logprobs when asked); may be empty
  // With GenerateParams::prompt_logprobs, on the event of the first token: prompt tokens 1..
  // (prompt.size() - 1 entries; token is the prompt's, logprob and top_logprobs its position's).
  std::vector<SampledToken> prompt_logprobs;
  std::optional<FinishInfo> finish;  // set on the request's last event
};

// Called on the engine's loop thread; must not block (queue the event and return).
using EventCallback = std::function<void(const GenerateEvent&)>;

// One step, for metrics.
struct StepMetrics {
  StepPhaseTimes phases;  // ModelRunner::LastPhaseTimes of this step's Forward
  int num_sequences = 0;
  int num_tokens = 0;
  int num_prefill_tokens = 0;  // tokens of chunks that sample nothing or start a sequence
  // One per sequence that had a token sampled last step, plus its drafts (verify chunks).
  int num_decode_tokens = 0;
  int num_preempted = 0;
  // Speculative decoding: chunks of this step that verified drafts.
  int num_verify_chunks = 0;
  bool failed = false;     // Forward returned an error
  double schedule_s = 0;   // Scheduler::Schedule
  double forward_s = 0;    // ModelRunner::Forward (ForwardSampled: less its phases.sample_s)
  double sample_s = 0;     // sampling (host, or the runner's phases.sample_s), sequence updates
  double bookkeeping_s = 0;  // intake, cancels, deadlines, events
  // The engine after the step.
  int num_running = 0;
  int num_waiting = 0;
  double kv_usage = 0;
};

// Hooks for the service's metrics; called on the loop thread, must not block.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  virtual void OnStep(const StepMetrics& /*step*/) {}
  // After the request's final event, with the same FinishInfo.
  virtual void OnRequestFinished(std::string_view /*tag*/, const FinishInfo& /*finish*/) {}
};

struct KvCacheCapacity {
  enum class Unit { kBytes, kTokens, kBlocks };
  Unit unit = Unit::kBlocks;
  int64_t amount = 0;
};

// Threads a server samples with: half the cores, at most 8. A row of a 150k-token vocabulary
// takes about half a millisecond on one core (bench/results/structured-output.md), so a batch of
// host-sampled rows on one thread outlasts a GPU step.
int DefaultSamplingThreads();

struct EngineOptions {
  // Includes speculative decoding (scheduler.speculative); Start refuses a method the runner's
  // CheckDraftVerification refuses.
  SchedulerOptions scheduler;
  int block_size = 16;  // tokens per KV block
  // Bytes use ModelInfo::kv_bytes_per_token; the count is rounded down to whole blocks.
  KvCacheCapacity kv_capacity;
  int max_pending_requests = 1024;   // accepted and not yet finished
  // Threads that sample a step's rows (the loop thread is one of them); sampling reads the whole
  // vocabulary per row, so large batches want several.
  int sampling_threads = 1;  // servers: DefaultSamplingThreads()
  EngineObserver* observer = nullptr;  // not owned; must outlive the engine
  // Called on the loop thread after each pass of the loop that delivered request events (a
  // step's tokens, cancels, expired deadlines, the aborts of Stop), once for all of them: a
  // consumer that hands events to its own threads can wake them once per step instead of once
  // per event (services/router/generator_service.h). Empty: not called.
  std::function<void()> after_events;
};

struct EngineStats {
  int running = 0;
  int waiting = 0;
  int64_t preemptions = 0;  // total
  double kv_usage = 0;      // fraction of blocks in use
  int64_t prefix_cache_queried_tokens = 0;
  int64_t prefix_cache_hit_tokens = 0;
  double prefix_cache_hit_rate = 0;  // hit / queried tokens; 0 before any query
  int64_t steps = 0;
  int64_t failed_steps = 0;
  int64_t requests_finished = 0;
  SpeculativeCounters speculative;  // totals; zero without a speculative method
  // The running sequences' mean draft limit (Scheduler::MeanDraftLimit: the adaptive K, else
  // their cap); 0 when none drafts.
  double speculative_mean_draft_length = 0;
};

class Engine {
 public:
  Engine(EngineOptions options, std::unique_ptr<ModelRunner> runner);
  ~Engine();  // Stop()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Checks the options, sizes and allocates the KV cache (and, for models with recurrent layers,
  // max_num_seqs per-sequence state slots; their prefix caching is off: PrefixCachingUsable),
  // starts the loop thread. Once.
  absl::Status Start();
  absl::StatusOr<uint64_t> Submit(GenerateParams params, EventCallback on_event);
  // Ends a request: its final event (kAbort) and the release of its KV blocks happen at the next
  // step boundary (at once when idle, else when the running step returns). NOT_FOUND when the
  // request is unknown or already finished.
  absl::Status Cancel(uint64_t request_id);
  // Refuses new requests from now on and returns once every accepted request has finished.
  // Not from an event callback (it would wait for itself); likewise Stop.
  void Drain();
  // Refuses new requests, ends those left with kError UNAVAILABLE ("server draining": they did not
  // ask to end, and a retry elsewhere may succeed) and joins the loop thread. Returns how many it
  // ended that way (0 on later calls). Idempotent.
  int Stop();

  EngineStats Stats() const;
  // After Start, max_context is what a request can use: the model's context, or the KV cache's
  // size where that is smaller (a prompt + max_tokens beyond it could never finish).
  const ModelInfo& model_info() const { return info_; }
  int model_max_context() const { return model_max_context_; }  // the model's own
  KvCacheShape kv_cache_shape() const { return shape_; }  // valid after Start

 private:
  struct Request {
    uint64_t id = 0;
    std::string tag;
    EventCallback on_event;
    std::optional<SteadyTime> deadline;
    SteadyTime arrival;
    std::optional<SteadyTime> first_scheduled;
    std::optional<SteadyTime> first_token;
    SteadyTime last_token;
    double inter_token_sum_s = 0;
    double inter_token_max_s = 0;
    SequenceProgress progress;
  };
  struct Incoming {
    Request request;
    SequenceRequest sequence;
  };

  absl::Status Validate(const GenerateParams& params) const;
  void Loop();
  // Takes new requests and cancels from the submitting threads. False once Stop was called.
  bool Intake();
  void RunStep();
  // Tokens of a completed step (or chunk) to their requests: events, finishes, timings.
  void Deliver(const std::vector<SequenceUpdate>& updates, SteadyTime now);
  void RetryChunksAlone(const ScheduledStep& step);
  // Speculative method mtp, after a step's tokens were delivered: the MTP head runs over the
  // step's kept positions and drafts for the decoding sequences (engine/cpu/mtp/mtp_head.h).
  void DraftWithMtp(const ScheduledStep& step);
  // Runs the step's forward pass. The one place that decides where its rows are sampled: on the
  // runner (ModelRunner::ForwardSampled, into sampled_) when it can sample every one of them,
  // else here (the logits into logits_, sampled by CompleteStep).
  absl::Status RunForward(const ScheduledStep& step);
  // The scheduler's CompleteStep for what the last RunForward left.
  std::vector<SequenceUpdate> CompleteStep(const ScheduledStep& step);
  void ApplyCancels(std::vector<uint64_t> cancels);
  // Ends the sequences a step failed alone (Scheduler::step_failures) with their status.
  void FailSequences(std::vector<SequenceFailure> failures);
  void ExpireDeadlines(SteadyTime now);
  // Removes the request everywhere and sends its final event.
  void Finish(uint64_t id, FinishReason reason, absl::Status status,
              std::vector<SampledToken> last_tokens = {},
              std::vector<SampledToken> prompt_logprobs = {});
  void PublishStats();
  // Calls options_.after_events if events were delivered since the last call.
  void AfterEvents();

  const EngineOptions options_;
  const std::unique_ptr<ModelRunner> runner_;
  ModelInfo info_;  // max_context set by Start
  const int model_max_context_;
  int ended_by_stop_ = 0;  // written by the loop thread as it ends, read by Stop after the join
  KvCacheShape shape_;

  // Loop thread only.
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ParallelFor> sampling_pool_;
  std::unordered_map<uint64_t, Request> requests_;
  std::vector<float> logits_;
  std::vector<SampledToken> sampled_;
  bool runner_sampled_ = false;  // the last RunForward sampled on the runner
  int64_t steps_ = 0;
  int64_t failed_steps_ = 0;
  int64_t requests_finished_ = 0;
  bool events_since_after_events_ = false;  // a request event was delivered since AfterEvents

  mutable std::mutex mu_;
  std::condition_variable wake_;     // new work, cancels, Stop
  std::condition_variable drained_;  // live_ became empty
  bool started_ = false;
  bool draining_ = false;
  bool stopping_ = false;
  uint64_t next_id_ = 1;
  std::mt19937_64 seed_source_;  // seeds requests that bring none; seeded from a random device
  std::vector<Incoming> incoming_;
  std::vector<uint64_t> cancels_;
  std::unordered_set<uint64_t> live_;  // accepted and not finished
  EngineStats stats_;
  std::thread loop_;
};

}  // namespace exl3::engine
