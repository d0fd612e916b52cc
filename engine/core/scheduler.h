// Continuous batching: which tokens of which sequences run in the next step, and what the step's
// logits make of them. Pure logic, no clocks, no threads of its own (CompleteStep may sample on
// a caller's ParallelFor): the engine (engine/core/engine.h) owns the
// requests, this class owns their token histories, KV blocks and stop conditions.
//
//   Scheduler sched(options, runner.info(), {/*num_blocks=*/1024, /*block_size=*/16});
//   sched.Add(id, std::move(sequence_request));
//   ScheduledStep step = sched.Schedule();                    // step.batch goes to Forward
//   std::vector<float> logits(step.batch.NumLogitRows() * vocab);
//   if (runner.Forward(step.batch, logits.data()).ok()) {
//     for (const SequenceUpdate& u : sched.CompleteStep(step, logits)) ...  // tokens, finishes
//   } else {
//     for (int64_t id : sched.FailStep(step)) ...                            // removed sequences
//   }
//
// Each step, as vLLM's v1 scheduler does it:
//   1. every running sequence, oldest first, gets its uncomputed tokens: one decode token, or the
//      next chunk of a partially computed prompt (capped by long_prefill_token_threshold), while
//      the token budget (max_num_batched_tokens) lasts;
//   2. when a running sequence's KV blocks cannot grow, the NEWEST running sequence is preempted:
//      its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
//      later from its prompt plus the tokens generated so far (its output is unaffected: the
//      recomputation samples nothing until it reaches the end of what it had);
//   3. if nothing was preempted, waiting sequences are admitted in order (up to max_num_seqs
//      running) with a first chunk each; a prefix-cache hit skips the prompt's cached blocks.
// Every running sequence also holds a state slot of [0, max_num_seqs) (engine/core/model_runner.h),
// taken at admission and given back when it finishes or is preempted; a preempted sequence's
// recomputation starts at position 0, so its model state is rebuilt with its KV blocks.
// A sequence's uncomputed tokens are always its history from num_computed on: a prompt (chunk),
// a recomputation after preemption, or the one token sampled last step (decode).
//
// Speculative decoding (SchedulerOptions::speculative): a decoding sequence's chunk is its last
// sampled token followed by up to its draft length's limit of drafts (engine/speculative/draft_length.h:
// num_speculative_tokens, the request's own cap, or with the adaptive policy what its acceptance
// earned; drafts from engine/speculative/ngram_drafter.h, the MTP head or a provided proposer; fewer where
// the token budget, max_tokens or the context end), every position's logits wanted. With the
// goodput policy each step's drafts are chosen for all its decoding sequences at once, from the
// drafts each has, their acceptance and the step's cost learned from ObserveStepTime
// (engine/speculative/goodput_draft_choice.h); the engine reports every step's time, a test
// whatever times it likes, so the scheduler stays a function of its inputs. Drafts
// are added last, from the budget and free blocks that the steps above left (none in a step
// that preempted), so they never cost another sequence its place. Row j (0-based) is sampled as plain decoding would sample
// the sequence's next token had drafts [0, j) been accepted (same penalties, bans and draw
// index), and draft j is accepted while it equals row j's token; the tokens of the rows up to
// the first mismatch (its token is the correction, or after d accepted drafts the bonus) are
// appended, stopping at a stop condition. Every emitted token is thus exactly the token plain
// decoding would have produced from the same logits and seed, greedy or sampled: for a one-hot
// proposal this accept test (accept x when the draw gives x, probability p(x); otherwise the
// draw's token, distributed as p without x renormalised) is the standard rejection scheme.
// Positions past the accepted ones keep the values the verify step wrote until the sequence
// runs them again (attention reads only positions below its own), and the blocks holding only
// such positions are freed at once.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "engine/speculative/draft_length.h"
#include "engine/core/kv_block_manager.h"
#include "engine/core/model_runner.h"
#include "engine/core/parallel_for.h"
#include "engine/sampling/sampler.h"
#include "engine/speculative/speculative_options.h"
#include "engine/speculative/step_cost_model.h"
#include "engine/sampling/token_constraint.h"

namespace exl3::engine {

enum class FinishReason {
  kStop,    // an EOS token (ModelInfo::eos_token_ids) or one of the request's stop tokens
  kLength,  // max_tokens generated
  kAbort,   // cancelled
  kError,   // see the accompanying status
};

const char* FinishReasonName(FinishReason reason);

struct SchedulerOptions {
  int max_num_batched_tokens = 2048;  // tokens of all chunks of one step
  int max_num_seqs = 256;             // sequences running at once
  // The largest chunk one prompt gets in a step; unset: only the token budget limits it.
  std::optional<int> long_prefill_token_threshold = std::nullopt;
  // Applies only where PrefixCachingUsable(model) holds.
  bool enable_prefix_caching = true;
  // The most prompt-position logit rows (prompt logprobs) one step computes: each is a row of
  // vocabulary floats on the host, so a long prompt that wants them is prefilled in chunks of at
  // most this many tokens.
  int max_prompt_logit_rows = 512;
  // Drafting and verification; must pass ValidateSpeculativeOptions (Engine::Start checks it).
  SpeculativeOptions speculative = {};
};

// Speculative decoding's totals since the start (vLLM's spec_decode counters).
struct SpeculativeCounters {
  int64_t num_drafts = 0;           // verify chunks with at least one draft token
  int64_t num_draft_tokens = 0;     // draft tokens verified
  int64_t num_accepted_tokens = 0;  // of those, accepted
  // [num_speculative_tokens]: drafts accepted at each draft position (0: the first).
  std::vector<int64_t> num_accepted_tokens_per_pos;
};

// Whether a model can resume a sequence from cached KV blocks: not when it keeps a recurrent
// state per sequence (ModelInfo::state_bytes_per_sequence > 0), which no block holds.
bool PrefixCachingUsable(const ModelInfo& model);
// Whether the prefix cache may serve these speculative options: not with the MTP head, whose KV
// at a block's last position depends on the next block's first token (engine/cpu/mtp/mtp_head.h), so a
// block is not named by its own tokens there.
bool PrefixCachingUsable(const SpeculativeOptions& speculative);

// What the scheduler keeps of a request.
struct SequenceRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  uint64_t seed = 0;  // the sampler's counter-based stream (engine/sampling/sampler.h)
  int max_tokens = 1;
  int min_tokens = 0;  // EOS and stop tokens cannot be sampled before this many tokens
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // Unset: none. N: the logprob of every prompt token but the first, given the tokens before it,
  // and the top N of its position (vLLM's prompt_logprobs). Such a sequence skips the prefix
  // cache's lookup (cached positions have no logits) and runs its prompt chunks with every
  // position's logit row (LogitRowsUse::kPromptPositions).
  std::optional<int> prompt_logprobs;
  // Speculative decoding's cap for this request, 0..num_speculative_tokens (0: no drafts; the
  // engine checks the range). Unset: num_speculative_tokens.
  std::optional<int> num_speculative_tokens;
};

struct ScheduledStep {
  StepBatch batch;
  std::vector<int64_t> preempted;  // sequences preempted while building this step
  // Sequences removed because they alone do not fit in the whole KV cache (RESOURCE_EXHAUSTED).
  std::vector<int64_t> dropped;
};

struct SequenceProgress {
  int prompt_tokens = 0;
  int output_tokens = 0;
  int cached_prompt_tokens = 0;  // prefix-cache hit at its first admission
};

// A sequence that a step ended with an error of its own (its constraint allowed no token): it is
// still present, the engine finishes it with the status.
struct SequenceFailure {
  int64_t sequence_id = 0;
  absl::Status status;
};

// What one step did to one sequence: one update per token it appended (several after accepted
// drafts, in order; the finish, if any, on the last).
struct SequenceUpdate {
  int64_t sequence_id = 0;
  SampledToken token;                  // a token sampled this step
  // On the sequence's first token only, with SequenceRequest::prompt_logprobs: prompt tokens
  // 1.. (token: the prompt's token; logprob and top N of the position before it).
  std::vector<SampledToken> prompt_logprobs;
  std::optional<FinishReason> finish;  // kStop or kLength: the sequence is gone
  SequenceProgress progress;           // after this step
};

class Scheduler {
 public:
  // num_samplers: how many rows CompleteStep may sample at once (one Sampler each).
  Scheduler(const SchedulerOptions& options, const ModelInfo& model, const KvCacheShape& cache,
            int num_samplers = 1);

  // The request must be valid (the engine checks): non-empty prompt of in-vocabulary tokens that
  // fits in the cache, max_tokens >= 1.
  void Add(int64_t sequence_id, SequenceRequest request);
  // Removes a sequence, waiting or running, and frees its blocks. False when unknown.
  bool Abort(int64_t sequence_id);

  ScheduledStep Schedule();
  // Consumes the step's logits ([NumLogitRows, vocab], rows overwritten as scratch): advances
  // every sequence of the step, samples where the chunk wanted logits, and removes finished
  // sequences. Sequences aborted since Schedule are skipped. With `parallel` (at most
  // num_samplers workers) the rows are sampled on its workers; the result does not depend on it.
  std::vector<SequenceUpdate> CompleteStep(const ScheduledStep& step, std::span<float> logits,
                                           ParallelFor* parallel = nullptr);
  // What sampling each logit row of `step` takes (its chunks that want logits, in chunk order,
  // num_logit_rows each), for a runner that samples on its own device (ModelRunner::
  // ForwardSampled). Row j of a verify chunk sees the history with its drafts [0, j), as
  // CompleteStep samples it. A constrained row's allowed_tokens is its constraint's mask, whose
  // contents are current once FillConstraintMasks ran. The histories point into the scheduler's
  // sequences and, for verify rows, into copies of their outputs with the drafts: valid until the
  // next call that changes them. Not for steps with prompt-position rows (HasPromptPositionRows).
  std::vector<RowSampling> SamplingRows(const ScheduledStep& step);
  static bool HasVerifyChunks(const ScheduledStep& step);
  // Whether a chunk of the step wants its prompt positions' rows (prompt logprobs): such a step's
  // rows are made on the host (CompleteStep), never by a runner that samples.
  static bool HasPromptPositionRows(const ScheduledStep& step);
  // Speculative method mtp, after CompleteStep (or CompleteSampledStep) of `step`: per chunk
  // whose sequence is still running, the positions the step kept and the tokens after them,
  // with K drafts wanted from a sequence that is now decoding (fewer where max_tokens or the
  // context end, or the blocks for the MTP's chained positions cannot be had: it takes them
  // now, as the verify chunk will hold them). For ModelRunner::ProposeMtpDrafts.
  std::vector<MtpSpan> MtpSpans(const ScheduledStep& step);
  // The drafts ProposeMtpDrafts made for a sequence's current history: its next step proposes
  // them (as many as fit); any change to the history drops them.
  void SetMtpDrafts(int64_t sequence_id, std::vector<int32_t> drafts);
  // Row `row`'s logits after its constraint's mask (ModelRunner::MaskedRowLogits).
  using MaskedRowLogits = std::function<absl::Status(int row, std::span<float> logits)>;
  // CompleteStep for a step whose rows were sampled already: sampled[i] is row i's token. A
  // constrained row was sampled with its mask (SamplingRows gives it): its constraint takes the
  // token here, and in the rare case it refuses one its mask allowed, the row is drawn again on
  // the host from `masked_row_logits` as CompleteStep would (Sampler::SampleAccepted).
  // With `parallel` (at most num_samplers workers) the constraints take their tokens on its workers.
  std::vector<SequenceUpdate> CompleteSampledStep(const ScheduledStep& step,
                                                  std::span<const SampledToken> sampled,
                                                  const MaskedRowLogits& masked_row_logits,
                                                  ParallelFor* parallel = nullptr);
  // The sequences the last CompleteStep / CompleteSampledStep failed (SequenceFailure): they got
  // no update from it.
  const std::vector<SequenceFailure>& step_failures() const { return step_failures_; }

  // Constrained decoding (SamplingParams::grammar): whether any sequence of the step samples
  // under a constraint, and the masks of those rows (engine/sampling/token_constraint.h). The masks
  // depend only on tokens already accepted, so the engine fills them on another thread while
  // the step's forward pass runs; nothing else may touch the scheduler meanwhile but
  // SamplingRows. CompleteStep fills any mask still stale itself.
  bool HasConstrainedRows(const ScheduledStep& step) const;
  // With `parallel`, the masks fill on its workers (one sequence's mask per iteration).
  void FillConstraintMasks(const ScheduledStep& step, ParallelFor* parallel = nullptr);

  // The step failed: removes its sequences (those still present) and returns them.
  std::vector<int64_t> FailStep(const ScheduledStep& step);

  std::optional<SequenceProgress> Progress(int64_t sequence_id) const;
  bool Contains(int64_t sequence_id) const { return sequences_.contains(sequence_id); }
  int NumRunning() const { return static_cast<int>(running_.size()); }
  int NumWaiting() const { return static_cast<int>(waiting_.size()); }
  bool Empty() const { return sequences_.empty(); }
  int64_t NumPreemptions() const { return num_preemptions_; }
  const KvBlockManager& kv() const { return kv_; }
  const SpeculativeCounters& speculative_counters() const { return speculative_counters_; }
  // The drafts a present sequence may get in its next step (DraftLength::limit; 0 without
  // speculative decoding or where its request turned it off; with the goodput policy its cap, of
  // which each step's choice gives it 0..all).
  std::optional<int> DraftLimit(int64_t sequence_id) const;
  // The mean DraftLength::limit of the running sequences that draft (cap >= 1); 0 when none. With
  // the goodput policy, the mean of the drafts the choice gave them at their last decode step.
  double MeanDraftLimit() const;
  // The step `batch` took `seconds`, from Schedule to its tokens sampled: the goodput draft
  // length's cost model (engine/speculative/step_cost_model.h) learns from its shape and rows
  // (StepBatch::NumTokens: every chunk's tokens, drafts included). Steps that failed are not
  // reported.
  void ObserveStepTime(const StepBatch& batch, double seconds);
  const StepCostModel& step_cost() const { return step_cost_; }

 private:
  enum class SequenceState { kWaiting, kRunning };
  enum class PromptLogprobsState {
    kNotWanted,
    kComputing,  // prompt chunks want every row; prompt_logprobs grows with them
    kDelivered,  // handed over with the first token (a recomputation after preemption wants none)
  };
  struct Sequence {
    SequenceRequest request;
    std::vector<int32_t> tokens;  // prompt, then output
    int num_computed = 0;         // tokens whose keys and values are in the cache
    SequenceState state = SequenceState::kWaiting;
    bool admitted_before = false;
    int cached_prompt_tokens = 0;
    int state_slot = 0;  // while running
    std::vector<int32_t> min_tokens_banned;  // EOS (unless ignored) and stop tokens
    PromptLogprobsState prompt_logprobs_state = PromptLogprobsState::kNotWanted;
    std::vector<SampledToken> prompt_logprobs;  // kComputing: of prompt tokens 1.. so far
    // Speculative method mtp: the MTP head's drafts for the history of mtp_drafts_for tokens.
    std::vector<int32_t> mtp_drafts;
    size_t mtp_drafts_for = 0;
    // Set when the request has a grammar; a constrained sequence gets no drafts.
    std::unique_ptr<TokenConstraint> constraint;
    DraftLength draft_length;  // speculative decoding: its drafts per step

    int NumOutput() const { return static_cast<int>(tokens.size() - request.prompt.size()); }
    int NumUncomputed() const { return static_cast<int>(tokens.size()) - num_computed; }
  };

  // A present sequence's logit rows of a step: one, or 1 + drafts for a verify chunk.
  struct SampledRows {
    int64_t id;
    Sequence* seq;
    int first_row;   // index among the step's logit rows
    int num_drafts;  // the drafts sit at the end of seq->tokens until AppendTokens
  };
  // A prompt position's row of a step: its logprobs go to seq->prompt_logprobs[index].
  struct PromptRow {
    Sequence* seq;
    int row;        // index among the step's logit rows
    size_t index;   // the position's (its row predicts prompt token index + 1)
  };
  // The sampling of `seq`'s next token after its first `num_tokens` tokens.
  RowSampling RowSamplingOf(const Sequence& seq, size_t num_tokens) const;
  // With the output tokens `output` (the sequence's, or a verify row's with drafts after them).
  RowSampling RowSamplingOf(const Sequence& seq, std::span<const int32_t> output) const;
  RowSampling RowSamplingOf(const Sequence& seq) const { return RowSamplingOf(seq, seq.tokens.size()); }
  // Advances every present sequence of the step by its chunk's tokens (a verify chunk's drafts
  // are appended to its history for the rows' sampling, not counted computed); returns the rows
  // to sample, and into `prompt_rows` (when given) those of prompt positions (prompt logprobs).
  std::vector<SampledRows> AdvanceStep(const ScheduledStep& step,
                                       std::vector<PromptRow>* prompt_rows = nullptr);
  // row_tokens[r]: the token sampled from logit row r. Takes each sequence's drafts back off its
  // history, appends its accepted drafts and the next token (stopping at a stop condition), one
  // update per token, and removes the sequences that stop.
  // row_failed[r] set: row r failed (step_failures_ says why), its sequence takes nothing.
  // A constrained row's token (sampled with its mask) to its constraint: OK when taken, else the
  // row's error. A refused token is drawn again from `masked_row_logits` with samplers_[worker];
  // the redraw lands in `token`.
  absl::Status TakeConstrainedToken(Sequence& seq, int row, SampledToken& token,
                                    const MaskedRowLogits& masked_row_logits, int worker);
  std::vector<SequenceUpdate> AppendTokens(const std::vector<SampledRows>& rows,
                                           std::span<const SampledToken> row_tokens,
                                           const std::vector<uint8_t>& row_failed);
  // Uncomputed tokens of `seq` to run this step, within `budget`.
  int ChunkSize(const Sequence& seq, int budget) const;
  // Up to `max_drafts` drafts for a decoding sequence (one uncomputed token), fewer where its
  // max_tokens or the context end.
  std::vector<int32_t> ProposeDrafts(const Sequence& seq, int max_drafts) const;
  void AddChunk(int64_t id, const Sequence& seq, int num_tokens, StepBatch& batch) const;
  // Turns the batch's decode chunks into verify chunks, oldest first, while `budget` tokens and
  // free blocks last, each with as many drafts as fit (after everything else is scheduled:
  // drafts displace no one).
  void AddDrafts(int budget, StepBatch& batch);
  // The goodput policy's AddDrafts: each decoding sequence's drafts proposed first, then
  // ChooseDraftCounts says how many of them each verifies (KV blocks permitting, oldest first).
  void AddGoodputDrafts(int budget, StepBatch& batch);
  // Makes a decode chunk a verify chunk with these drafts, as far as the sequence's blocks and
  // the free ones hold them; returns the drafts added.
  int AppendDrafts(SequenceChunk& chunk, const Sequence& seq, std::vector<int32_t> drafts);
  // Frees the newest running sequence's blocks and puts it at the front of the waiting queue.
  int64_t PreemptNewest();
  std::optional<FinishReason> CheckStop(const Sequence& seq, int32_t token) const;
  static SequenceProgress ProgressOf(const Sequence& seq);
  void Remove(int64_t sequence_id);

  const SchedulerOptions options_;
  const ModelInfo model_;
  KvBlockManager kv_;
  std::vector<Sampler> samplers_;
  std::unordered_map<int64_t, Sequence> sequences_;
  std::deque<int64_t> waiting_;
  std::vector<int64_t> running_;  // admission order: oldest first
  std::vector<int> free_state_slots_;  // state slots no running sequence holds
  int64_t num_preemptions_ = 0;
  std::optional<NgramDrafter> drafter_;  // speculative method ngram
  std::vector<SequenceFailure> step_failures_;  // of the last CompleteStep
  std::vector<std::vector<int32_t>> verify_outputs_;  // SamplingRows' verify chunks: output + drafts
  std::vector<std::vector<float>> redraw_logits_;  // TakeConstrainedToken's row, per sampler
  SpeculativeCounters speculative_counters_;
  StepCostModel step_cost_;  // the goodput draft length's (ObserveStepTime)
  // The goodput draft length's decode steps so far; every DraftLength::kProbeInterval-th is a
  // probe step (probes of all due sequences in one step: one mixed step, not one per sequence).
  int64_t goodput_steps_ = 0;
};

}  // namespace exl3::engine
