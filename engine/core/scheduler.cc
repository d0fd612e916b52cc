#include "engine/core/scheduler.h"

#include <algorithm>
#include <cassert>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/speculative/goodput_draft_choice.h"

namespace exl3::engine {
namespace {

// Tokens a constrained row may draw that its constraint then refuses before the row fails
// (Sampler::SampleAccepted): each is a disagreement between xgrammar's mask and its matcher.
constexpr int kMaxConstraintRefusals = 8;

// A constrained row's errors, sampled on the host or by the runner.
absl::Status NoAllowedTokenError() {
  return absl::InvalidArgumentError(
      "the output's constraint allows no token here (its only continuations are banned: "
      "end-of-sequence before min_tokens, or stop tokens)");
}
absl::Status EveryDrawRefusedError() {
  return absl::InternalError(absl::StrCat("the output's constraint refused all ", kMaxConstraintRefusals + 1,
                                          " tokens drawn from its own mask (or its mask ran out)"));
}

}  // namespace

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
  }
  return "unknown";
}

bool PrefixCachingUsable(const ModelInfo& model) { return model.state_bytes_per_sequence == 0; }
bool PrefixCachingUsable(const SpeculativeOptions& speculative) {
  return speculative.method != SpeculativeMethod::kMtp;
}

Scheduler::Scheduler(const SchedulerOptions& options, const ModelInfo& model,
                     const KvCacheShape& cache, int num_samplers)
    : options_(options),
      model_(model),
      kv_(cache.num_blocks, cache.block_size,
          options.enable_prefix_caching && PrefixCachingUsable(model) &&
              PrefixCachingUsable(options.speculative)) {
  // Highest first, so slot 0 is handed out first.
  for (int slot = std::max(1, options.max_num_seqs) - 1; slot >= 0; --slot)
    free_state_slots_.push_back(slot);
  samplers_.reserve(std::max(1, num_samplers));
  for (int i = 0; i < std::max(1, num_samplers); ++i) samplers_.emplace_back(model.vocab_size);
  redraw_logits_.resize(samplers_.size());
  assert(ValidateSpeculativeOptions(options.speculative).ok());
  if (options.speculative.method == SpeculativeMethod::kNgram) drafter_.emplace(*NgramOptionsOf(options.speculative));
  if (options.speculative.enabled())
    speculative_counters_.num_accepted_tokens_per_pos.assign(options.speculative.num_speculative_tokens, 0);
}

void Scheduler::Add(int64_t sequence_id, SequenceRequest request) {
  Sequence seq;
  seq.tokens = request.prompt;
  seq.tokens.reserve(request.prompt.size() + request.max_tokens);
  if (request.min_tokens > 0) {
    seq.min_tokens_banned = request.stop_token_ids;
    if (!request.ignore_eos) {
      seq.min_tokens_banned.insert(seq.min_tokens_banned.end(), model_.eos_token_ids.begin(),
                                   model_.eos_token_ids.end());
    }
  }
  if (request.prompt_logprobs.has_value())
    seq.prompt_logprobs_state = PromptLogprobsState::kComputing;
  if (options_.speculative.enabled()) {
    seq.draft_length = DraftLength(options_.speculative.draft_length,
                                   request.num_speculative_tokens.value_or(options_.speculative.num_speculative_tokens));
  }
  seq.request = std::move(request);
  if (seq.request.sampling.grammar != nullptr) {
    seq.constraint = std::make_unique<TokenConstraint>(seq.request.sampling.grammar);
  }
  sequences_.emplace(sequence_id, std::move(seq));
  waiting_.push_back(sequence_id);
}

bool Scheduler::Abort(int64_t sequence_id) {
  if (!sequences_.contains(sequence_id)) return false;
  Remove(sequence_id);
  return true;
}

void Scheduler::Remove(int64_t sequence_id) {
  auto it = sequences_.find(sequence_id);
  if (it->second.state == SequenceState::kRunning) {
    running_.erase(std::find(running_.begin(), running_.end(), sequence_id));
    free_state_slots_.push_back(it->second.state_slot);
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), sequence_id));
  }
  kv_.Free(sequence_id);
  sequences_.erase(it);
}

int Scheduler::ChunkSize(const Sequence& seq, int budget) const {
  int n = std::min(seq.NumUncomputed(), budget);
  if (options_.long_prefill_token_threshold.has_value()) {
    n = std::min(n, *options_.long_prefill_token_threshold);
  }
  return n;
}

std::vector<int32_t> Scheduler::ProposeDrafts(const Sequence& seq, int max_drafts) const {
  // A constrained sequence's drafts would each need the mask after the ones before them.
  if (!options_.speculative.enabled() || seq.NumUncomputed() != 1 || seq.constraint != nullptr) return {};
  const int len = static_cast<int>(seq.tokens.size());
  // A step emits up to 1 + drafts tokens: none past max_tokens or the context.
  const int room = std::min({max_drafts,
                             seq.request.max_tokens - seq.NumOutput() - 1,
                             model_.max_context - len - 1});
  if (room <= 0) return {};
  if (options_.speculative.method == SpeculativeMethod::kMtp) {
    if (seq.mtp_drafts_for != seq.tokens.size()) return {};  // made for another history
    return std::vector<int32_t>(seq.mtp_drafts.begin(),
                                seq.mtp_drafts.begin() + std::min<size_t>(room, seq.mtp_drafts.size()));
  }
  if (options_.speculative.method == SpeculativeMethod::kProvided) {
    const std::span<const int32_t> tokens(seq.tokens);
    const size_t prompt_len = seq.request.prompt.size();
    std::vector<int32_t> drafts =
        options_.speculative.proposer->Propose(tokens.first(prompt_len), tokens.subspan(prompt_len), room);
    if (static_cast<int>(drafts.size()) > room) drafts.resize(room);
    return drafts;
  }
  return drafter_->Propose(seq.tokens, room);
}

std::vector<MtpSpan> Scheduler::MtpSpans(const ScheduledStep& step) {
  std::vector<MtpSpan> spans;
  for (size_t c = 0; c < step.batch.chunks.size(); ++c) {
    const SequenceChunk& chunk = step.batch.chunks[c];
    auto it = sequences_.find(chunk.sequence_id);
    if (it == sequences_.end() || it->second.state != SequenceState::kRunning) continue;  // finished, aborted
    Sequence& seq = it->second;
    const int kept = std::min(static_cast<int>(chunk.tokens.size()), seq.num_computed - chunk.start_position);
    // The token after the last kept position exists: the rest of the prompt or a sampled token.
    if (kept <= 0 || seq.num_computed >= static_cast<int>(seq.tokens.size())) continue;
    MtpSpan& s = spans.emplace_back();
    s.sequence_id = chunk.sequence_id;
    s.chunk_index = static_cast<int>(c);
    s.start_position = chunk.start_position;
    s.num_positions = kept;
    s.next_tokens.assign(seq.tokens.begin() + chunk.start_position + 1,
                         seq.tokens.begin() + chunk.start_position + 1 + kept);
    s.state_slot = seq.state_slot;
    if (seq.NumUncomputed() == 1) {
      const int len = static_cast<int>(seq.tokens.size());
      int drafts = std::min({seq.draft_length.chained_draft_limit(),
                             seq.request.max_tokens - seq.NumOutput() - 1, model_.max_context - len - 1});
      // Drafts after the first run the MTP at positions num_computed .. num_computed + drafts - 2.
      while (drafts > 1 && !kv_.Allocate(chunk.sequence_id, seq.num_computed + drafts - 1)) --drafts;
      s.num_drafts = std::max(drafts, 0);
    }
    const std::span<const int32_t> table = kv_.BlockTable(chunk.sequence_id);
    s.block_table.assign(table.begin(), table.end());
  }
  return spans;
}

void Scheduler::SetMtpDrafts(int64_t sequence_id, std::vector<int32_t> drafts) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return;
  it->second.mtp_drafts = std::move(drafts);
  it->second.mtp_drafts_for = it->second.tokens.size();
}

void Scheduler::AddChunk(int64_t id, const Sequence& seq, int num_tokens, StepBatch& batch) const {
  SequenceChunk& chunk = batch.chunks.emplace_back();
  chunk.sequence_id = id;
  chunk.start_position = seq.num_computed;
  chunk.tokens.assign(seq.tokens.begin() + seq.num_computed,
                      seq.tokens.begin() + seq.num_computed + num_tokens);
  std::span<const int32_t> table = kv_.BlockTable(id);
  chunk.block_table.assign(table.begin(), table.end());
  // Only a chunk that reaches the end of the history produces the next token.
  chunk.wants_logits = seq.num_computed + num_tokens == static_cast<int>(seq.tokens.size());
  if (seq.prompt_logprobs_state == PromptLogprobsState::kComputing) {
    chunk.wants_logits = true;
    chunk.num_logit_rows = num_tokens;
    chunk.logit_rows_use = LogitRowsUse::kPromptPositions;
  }
  chunk.state_slot = seq.state_slot;
}

int64_t Scheduler::PreemptNewest() {
  const int64_t id = running_.back();
  running_.pop_back();
  Sequence& seq = sequences_.at(id);
  kv_.Free(id);
  free_state_slots_.push_back(seq.state_slot);
  seq.num_computed = 0;
  seq.prompt_logprobs.clear();  // kComputing: recomputed with the prompt
  seq.state = SequenceState::kWaiting;
  waiting_.push_front(id);
  ++num_preemptions_;
  return id;
}

ScheduledStep Scheduler::Schedule() {
  ScheduledStep step;
  int budget = options_.max_num_batched_tokens;
  // A chunk that wants its prompt positions' rows takes at most what is left of these.
  int prompt_rows_left = options_.max_prompt_logit_rows;
  auto chunk_size = [&](const Sequence& s, int budget_left) {
    const int n = ChunkSize(s, budget_left);
    return s.prompt_logprobs_state == PromptLogprobsState::kComputing ? std::min(n, prompt_rows_left) : n;
  };
  auto took_chunk = [&](const Sequence& s, int n) {
    budget -= n;
    if (s.prompt_logprobs_state == PromptLogprobsState::kComputing) prompt_rows_left -= n;
  };

  // 1. Running sequences, oldest first. Preemption takes the newest, which are not scheduled yet.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    const int64_t id = running_[i];
    Sequence& seq = sequences_.at(id);
    const int n = chunk_size(seq, budget);
    if (n == 0) {  // its prompt rows wait for the next step
      ++i;
      continue;
    }
    bool scheduled = true;
    while (!kv_.Allocate(id, seq.num_computed + n)) {
      if (running_.size() == 1) {
        // Alone with the whole cache and still short of blocks: it can never run.
        Remove(id);
        step.dropped.push_back(id);
        scheduled = false;
        break;
      }
      const int64_t victim = PreemptNewest();
      step.preempted.push_back(victim);
      if (victim == id) {
        scheduled = false;
        break;
      }
    }
    if (!scheduled) continue;  // running_[i] is now the next sequence, or past the end
    AddChunk(id, seq, n, step.batch);
    took_chunk(seq, n);
    ++i;
  }

  // 2. Waiting sequences, front first, unless this step had to preempt.
  while (step.preempted.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int>(running_.size()) < options_.max_num_seqs) {
    const int64_t id = waiting_.front();
    Sequence& seq = sequences_.at(id);
    // Cached positions have no logits: a sequence that wants its prompt's rows computes them all.
    const PrefixMatch hit = seq.prompt_logprobs_state == PromptLogprobsState::kComputing
                                ? PrefixMatch{}
                                : kv_.FindCachedPrefix(seq.tokens);
    seq.num_computed = hit.num_tokens;
    const int n = chunk_size(seq, budget);
    if (n == 0) break;  // the step's prompt rows are taken; keep the queue's order
    if (!kv_.Allocate(id, seq.num_computed + n, hit)) {
      seq.num_computed = 0;
      if (running_.empty()) {
        // Nothing running will free blocks: it does not fit the whole cache.
        Remove(id);
        step.dropped.push_back(id);
        continue;
      }
      break;  // wait for running sequences to free blocks; keep the queue's order
    }
    waiting_.pop_front();
    seq.state = SequenceState::kRunning;
    running_.push_back(id);
    // Fewer than max_num_seqs run, so a slot is free.
    seq.state_slot = free_state_slots_.back();
    free_state_slots_.pop_back();
    if (!seq.admitted_before) {
      seq.admitted_before = true;
      seq.cached_prompt_tokens = std::min<int>(hit.num_tokens, seq.request.prompt.size());
    }
    AddChunk(id, seq, n, step.batch);
    took_chunk(seq, n);
  }

  // 3. Drafts for the decoding sequences, oldest first, from what budget and blocks are left.
  const int draft_limit = options_.speculative.disable_by_batch_size;
  if (options_.speculative.enabled() && step.preempted.empty() && (draft_limit == 0 || NumRunning() <= draft_limit))
    AddDrafts(budget, step.batch);
  step.batch.keep_hidden_states = options_.speculative.method == SpeculativeMethod::kMtp;
  return step;
}

void Scheduler::AddDrafts(int budget, StepBatch& batch) {
  if (options_.speculative.draft_length == DraftLengthPolicy::kGoodput) {
    AddGoodputDrafts(budget, batch);
    return;
  }
  for (SequenceChunk& chunk : batch.chunks) {
    if (budget <= 0) return;
    const Sequence& seq = sequences_.at(chunk.sequence_id);
    if (chunk.tokens.size() != 1 || !chunk.wants_logits || seq.NumUncomputed() != 1) continue;
    budget -= AppendDrafts(chunk, seq, ProposeDrafts(seq, std::min(seq.draft_length.limit(), budget)));
  }
}

namespace {

StepShape ShapeOf(const StepBatch& batch) {
  for (const SequenceChunk& chunk : batch.chunks)
    if (chunk.tokens.size() != 1) return StepShape::kMixed;
  return StepShape::kDecodeOnly;
}

}  // namespace

void Scheduler::ObserveStepTime(const StepBatch& batch, double seconds) {
  step_cost_.Observe(ShapeOf(batch), batch.NumTokens(), seconds);
}

void Scheduler::AddGoodputDrafts(int budget, StepBatch& batch) {
  struct Proposal {
    SequenceChunk* chunk;
    Sequence* seq;
    std::vector<int32_t> drafts;
  };
  std::vector<Proposal> proposals;
  std::vector<DraftCandidate> candidates;
  DraftStep step{.shape = ShapeOf(batch), .base_rows = batch.NumTokens(), .base_tokens = 0, .max_drafts = budget};
  const bool probe_step = goodput_steps_++ % DraftLength::kProbeInterval == 0;
  for (SequenceChunk& chunk : batch.chunks) {
    Sequence& seq = sequences_.at(chunk.sequence_id);
    // A chunk that reaches the end of its history samples the next token (a prompt's last chunk
    // or a decode token).
    if (chunk.wants_logits &&
        chunk.start_position + static_cast<int>(chunk.tokens.size()) == static_cast<int>(seq.tokens.size()))
      ++step.base_tokens;
    if (chunk.tokens.size() != 1 || !chunk.wants_logits || seq.NumUncomputed() != 1 || seq.draft_length.cap() < 1)
      continue;
    Proposal& p = proposals.emplace_back(
        Proposal{&chunk, &seq, ProposeDrafts(seq, std::min(seq.draft_length.limit(), budget))});
    candidates.push_back({.acceptance = seq.draft_length.draft_acceptance(),
                          .limit = static_cast<int>(p.drafts.size()),
                          .probe = probe_step && seq.draft_length.probe_due()});
  }
  const std::vector<int> counts = ChooseDraftCounts(step_cost_, step, candidates);
  for (size_t i = 0; i < proposals.size(); ++i) {
    Proposal& p = proposals[i];
    p.drafts.resize(counts[i]);
    const int added = AppendDrafts(*p.chunk, *p.seq, std::move(p.drafts));
    p.seq->draft_length.set_chosen(added);
    if (added == 0) p.seq->draft_length.ObserveStepWithoutDrafts();
  }
}

int Scheduler::AppendDrafts(SequenceChunk& chunk, const Sequence& seq, std::vector<int32_t> drafts) {
  // As many as the sequence's blocks and the free ones hold.
  const int64_t room = (static_cast<int64_t>(kv_.BlockTable(chunk.sequence_id).size()) + kv_.NumFreeBlocks()) *
                           kv_.block_size() - (seq.num_computed + 1);
  if (static_cast<int64_t>(drafts.size()) > room) drafts.resize(std::max<int64_t>(room, 0));
  if (drafts.empty()) return 0;
  const int end = seq.num_computed + 1 + static_cast<int>(drafts.size());
  if (!kv_.Allocate(chunk.sequence_id, end)) return 0;  // not reached: they fit
  chunk.tokens.insert(chunk.tokens.end(), drafts.begin(), drafts.end());
  chunk.num_logit_rows = 1 + static_cast<int>(drafts.size());
  const std::span<const int32_t> table = kv_.BlockTable(chunk.sequence_id);
  chunk.block_table.assign(table.begin(), table.end());
  return static_cast<int>(drafts.size());
}

std::optional<FinishReason> Scheduler::CheckStop(const Sequence& seq, int32_t token) const {
  const auto& eos = model_.eos_token_ids;
  const auto& stop = seq.request.stop_token_ids;
  if (!seq.request.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) {
    return FinishReason::kStop;
  }
  if (std::find(stop.begin(), stop.end(), token) != stop.end()) return FinishReason::kStop;
  if (seq.NumOutput() >= seq.request.max_tokens) return FinishReason::kLength;
  if (static_cast<int>(seq.tokens.size()) >= model_.max_context) return FinishReason::kLength;
  return std::nullopt;
}

RowSampling Scheduler::RowSamplingOf(const Sequence& seq, size_t num_tokens) const {
  const size_t prompt_len = seq.request.prompt.size();
  return RowSamplingOf(seq, std::span<const int32_t>(seq.tokens).first(num_tokens).subspan(prompt_len));
}

RowSampling Scheduler::RowSamplingOf(const Sequence& seq, std::span<const int32_t> output) const {
  RowSampling r;
  r.params = seq.request.sampling;
  r.seed = seq.request.seed;
  r.history.prompt = std::span<const int32_t>(seq.tokens).first(seq.request.prompt.size());
  r.history.output = output;
  if (static_cast<int>(r.history.output.size()) < seq.request.min_tokens)
    r.history.banned_tokens = seq.min_tokens_banned;
  if (seq.constraint != nullptr) r.history.allowed_tokens = seq.constraint->next_token_mask();
  return r;
}

bool Scheduler::HasVerifyChunks(const ScheduledStep& step) {
  return std::any_of(step.batch.chunks.begin(), step.batch.chunks.end(), [](const SequenceChunk& c) {
    return c.wants_logits && c.num_logit_rows > 1 && c.logit_rows_use == LogitRowsUse::kNextTokens;
  });
}

bool Scheduler::HasPromptPositionRows(const ScheduledStep& step) {
  return std::any_of(step.batch.chunks.begin(), step.batch.chunks.end(), [](const SequenceChunk& c) {
    return c.wants_logits && c.logit_rows_use == LogitRowsUse::kPromptPositions;
  });
}

std::vector<RowSampling> Scheduler::SamplingRows(const ScheduledStep& step) {
  std::vector<RowSampling> rows;
  // The rows' spans point into these copies' buffers, which stay put as the outer vector grows.
  verify_outputs_.clear();
  for (const SequenceChunk& chunk : step.batch.chunks) {
    if (!chunk.wants_logits) continue;
    auto it = sequences_.find(chunk.sequence_id);
    // Schedule only names present sequences; an absent one (aborted since) samples defaults,
    // which CompleteStep then skips.
    if (it == sequences_.end()) {
      rows.insert(rows.end(), chunk.num_logit_rows, RowSampling{});
      continue;
    }
    const Sequence& seq = it->second;
    if (chunk.num_logit_rows == 1) {
      rows.push_back(RowSamplingOf(seq));
      continue;
    }
    // A verify chunk: its last num_logit_rows - 1 tokens are the drafts.
    std::vector<int32_t>& output = verify_outputs_.emplace_back();
    output.assign(seq.tokens.begin() + static_cast<std::ptrdiff_t>(seq.request.prompt.size()), seq.tokens.end());
    const size_t base = output.size();
    output.insert(output.end(), chunk.tokens.end() - (chunk.num_logit_rows - 1), chunk.tokens.end());
    for (int j = 0; j < chunk.num_logit_rows; ++j)
      rows.push_back(RowSamplingOf(seq, std::span<const int32_t>(output).first(base + j)));
  }
  return rows;
}

std::vector<Scheduler::SampledRows> Scheduler::AdvanceStep(const ScheduledStep& step,
                                                           std::vector<PromptRow>* prompt_rows) {
  std::vector<SampledRows> rows;
  int row = 0;
  for (const SequenceChunk& chunk : step.batch.chunks) {
    const int first_row = row;
    const bool prompt_positions = chunk.wants_logits && chunk.logit_rows_use == LogitRowsUse::kPromptPositions;
    const int num_drafts = chunk.wants_logits && !prompt_positions ? chunk.num_logit_rows - 1 : 0;
    if (chunk.wants_logits) row += chunk.num_logit_rows;
    auto it = sequences_.find(chunk.sequence_id);
    if (it == sequences_.end()) continue;  // aborted during the step
    Sequence& seq = it->second;
    seq.num_computed += static_cast<int>(chunk.tokens.size()) - num_drafts;
    kv_.CacheFullBlocks(chunk.sequence_id, seq.tokens, seq.num_computed);
    if (!chunk.wants_logits) continue;
    if (prompt_positions) {
      // Row k is position start + k's: it predicts the token after it, a prompt token but at the
      // history's end, where it is the next token's row.
      const int n = static_cast<int>(chunk.tokens.size());
      const int last_prompt_row = static_cast<int>(seq.request.prompt.size()) - 1;  // exclusive
      const int end = std::min(chunk.start_position + n, last_prompt_row);
      if (end > chunk.start_position) seq.prompt_logprobs.resize(end);
      for (int p = chunk.start_position; p < end && prompt_rows != nullptr; ++p)
        prompt_rows->push_back({&seq, first_row + (p - chunk.start_position), static_cast<size_t>(p)});
      if (seq.num_computed == static_cast<int>(seq.tokens.size()))
        rows.push_back({chunk.sequence_id, &seq, first_row + n - 1, 0});
      continue;
    }
    seq.tokens.insert(seq.tokens.end(), chunk.tokens.end() - num_drafts, chunk.tokens.end());
    rows.push_back({chunk.sequence_id, &seq, first_row, num_drafts});
  }
  return rows;
}

std::vector<SequenceUpdate> Scheduler::AppendTokens(const std::vector<SampledRows>& rows,
                                                    std::span<const SampledToken> row_tokens,
                                                    const std::vector<uint8_t>& row_failed) {
  std::vector<SequenceUpdate> updates;
  for (const SampledRows& r : rows) {
    Sequence& seq = *r.seq;
    if (!row_failed.empty() && row_failed[r.first_row]) {
      seq.tokens.resize(seq.tokens.size() - r.num_drafts);
      continue;
    }
    const size_t base = seq.tokens.size() - r.num_drafts;
    const std::vector<int32_t> drafts(seq.tokens.begin() + base, seq.tokens.end());
    seq.tokens.resize(base);
    int accepted = 0;
    std::optional<FinishReason> finish;
    for (int j = 0; j <= r.num_drafts; ++j) {
      const SampledToken& t = row_tokens[r.first_row + j];
      seq.tokens.push_back(t.token);
      finish = CheckStop(seq, t.token);
      // A terminated constraint took a stop token (EOS, even with ignore_eos): the output is done.
      if (seq.constraint != nullptr && seq.constraint->state() == TokenConstraint::State::kTerminated) {
        finish = FinishReason::kStop;
      }
      SequenceUpdate& u = updates.emplace_back();
      u.sequence_id = r.id;
      u.token = t;
      u.finish = finish;
      u.progress = ProgressOf(seq);
      if (j == 0 && seq.prompt_logprobs_state == PromptLogprobsState::kComputing) {
        u.prompt_logprobs = std::move(seq.prompt_logprobs);
        seq.prompt_logprobs_state = PromptLogprobsState::kDelivered;
      }
      if (j == r.num_drafts || t.token != drafts[j]) break;
      ++accepted;  // draft j was right: row j + 1 saw the true history
      if (finish.has_value()) break;
    }
    if (r.num_drafts > 0) {
      SpeculativeCounters& c = speculative_counters_;
      ++c.num_drafts;
      c.num_draft_tokens += r.num_drafts;
      c.num_accepted_tokens += accepted;
      for (int j = 0; j < accepted; ++j) ++c.num_accepted_tokens_per_pos[j];
      seq.draft_length.Observe(r.num_drafts, accepted);
    }
    if (finish.has_value()) {
      Remove(r.id);
    } else if (r.num_drafts > 0) {
      // The accepted drafts' positions hold their true keys and values; the rest are rolled
      // back: uncomputed again, and the blocks beyond the computed positions given back.
      seq.num_computed += accepted;
      kv_.CacheFullBlocks(r.id, seq.tokens, seq.num_computed);
      kv_.Truncate(r.id, seq.num_computed);
    }
  }
  return updates;
}

std::vector<SequenceUpdate> Scheduler::CompleteStep(const ScheduledStep& step,
                                                    std::span<float> logits,
                                                    ParallelFor* parallel) {
  // 1. Advance every chunk's sequence; collect the rows to sample and the prompt rows.
  step_failures_.clear();
  std::vector<PromptRow> prompt_rows;
  const std::vector<SampledRows> rows = AdvanceStep(step, &prompt_rows);
  const size_t vocab = model_.vocab_size;
  // Why a row's constraint took no token (e.g. it allows only EOS, banned before min_tokens).
  std::vector<absl::Status> row_errors(step.batch.NumLogitRows());

  // 2. Sample; rows are independent and only read the sequences. Row j of a verify chunk sees
  // the history with drafts [0, j) (as if accepted).
  // The prompt rows' logprobs come first: sampling overwrites its rows (never a prompt row).
  struct Task {
    const SampledRows* rows;
    int j;
  };
  std::vector<Task> tasks;
  for (const SampledRows& r : rows)
    for (int j = 0; j <= r.num_drafts; ++j) tasks.push_back({&r, j});
  std::vector<SampledToken> row_tokens(step.batch.NumLogitRows());
  const int num_prompt_rows = static_cast<int>(prompt_rows.size());
  auto sample = [&](int worker, int i) {
    if (i < num_prompt_rows) {
      const PromptRow& p = prompt_rows[i];
      const int32_t token = p.seq->request.prompt[p.index + 1];
      p.seq->prompt_logprobs[p.index] = samplers_[worker].PromptLogprobs(
          logits.subspan(static_cast<size_t>(p.row) * vocab, vocab), token, *p.seq->request.prompt_logprobs);
      return;
    }
    i -= num_prompt_rows;
    const SampledRows& r = *tasks[i].rows;
    const int row = r.first_row + tasks[i].j;
    const size_t history = r.seq->tokens.size() - r.num_drafts + tasks[i].j;
    RowSampling s = RowSamplingOf(*r.seq, history);
    const std::span<float> row_logits = logits.subspan(static_cast<size_t>(row) * vocab, vocab);
    TokenConstraint* c = r.seq->constraint.get();
    if (c == nullptr) {
      row_tokens[row] = samplers_[worker].Sample(row_logits, s.params, s.seed, s.history);
      return;
    }
    // No drafts (ProposeDrafts): one token, which the constraint takes here.
    c->FillNextTokenMask();  // a no-op where the engine filled it during the forward pass
    s.history.allowed_tokens = c->next_token_mask();
    if (!TokenConstraint::AllowsAnyToken(s.history.allowed_tokens, s.history.banned_tokens)) {
      row_errors[row] = NoAllowedTokenError();
      return;
    }
    const std::optional<SampledToken> token = samplers_[worker].SampleAccepted(
        row_logits, s.params, s.seed, s.history, [c](int32_t t) { return c->Accept(t).ok(); },
        kMaxConstraintRefusals);
    if (!token.has_value()) {
      row_errors[row] = EveryDrawRefusedError();
      return;
    }
    row_tokens[row] = *token;
  };
  if (parallel != nullptr && parallel->num_workers() <= static_cast<int>(samplers_.size())) {
    parallel->Run(num_prompt_rows + static_cast<int>(tasks.size()), sample);
  } else {
    for (int i = 0; i < num_prompt_rows + static_cast<int>(tasks.size()); ++i) sample(0, i);
  }

  // 3. Append the tokens and end the sequences that stop.
  std::vector<uint8_t> row_failed(row_errors.size(), 0);
  for (const SampledRows& r : rows) {
    if (row_errors[r.first_row].ok()) continue;
    row_failed[r.first_row] = 1;
    step_failures_.push_back({r.id, std::move(row_errors[r.first_row])});
  }
  return AppendTokens(rows, row_tokens, row_failed);
}

bool Scheduler::HasConstrainedRows(const ScheduledStep& step) const {
  for (const SequenceChunk& chunk : step.batch.chunks) {
    if (!chunk.wants_logits) continue;
    auto it = sequences_.find(chunk.sequence_id);
    if (it != sequences_.end() && it->second.constraint != nullptr) return true;
  }
  return false;
}

void Scheduler::FillConstraintMasks(const ScheduledStep& step, ParallelFor* parallel) {
  std::vector<TokenConstraint*> constraints;
  for (const SequenceChunk& chunk : step.batch.chunks) {
    if (!chunk.wants_logits) continue;
    auto it = sequences_.find(chunk.sequence_id);
    if (it != sequences_.end() && it->second.constraint != nullptr) constraints.push_back(it->second.constraint.get());
  }
  const int n = static_cast<int>(constraints.size());
  if (parallel != nullptr && n > 1) {
    parallel->Run(n, [&](int, int i) { constraints[i]->FillNextTokenMask(); });
  } else {
    for (TokenConstraint* c : constraints) c->FillNextTokenMask();
  }
}

std::vector<SequenceUpdate> Scheduler::CompleteSampledStep(const ScheduledStep& step,
                                                           std::span<const SampledToken> sampled,
                                                           const MaskedRowLogits& masked_row_logits,
                                                           ParallelFor* parallel) {
  assert(!HasPromptPositionRows(step));
  step_failures_.clear();
  const std::vector<SampledRows> rows = AdvanceStep(step);
  std::vector<SampledToken> row_tokens(sampled.begin(), sampled.end());
  std::vector<const SampledRows*> constrained;
  for (const SampledRows& r : rows) {
    if (r.seq->constraint != nullptr) constrained.push_back(&r);
  }
  // Each row touches only its own sequence and its worker's sampler.
  std::vector<absl::Status> taken(constrained.size());
  auto take = [&](int worker, int i) {
    const SampledRows& r = *constrained[i];
    taken[i] = TakeConstrainedToken(*r.seq, r.first_row, row_tokens[r.first_row], masked_row_logits, worker);
  };
  const int n = static_cast<int>(constrained.size());
  if (parallel != nullptr && n > 1 && parallel->num_workers() <= static_cast<int>(samplers_.size())) {
    parallel->Run(n, take);
  } else {
    for (int i = 0; i < n; ++i) take(0, i);
  }
  std::vector<uint8_t> row_failed;
  for (int i = 0; i < n; ++i) {
    if (taken[i].ok()) continue;
    row_failed.resize(row_tokens.size(), 0);
    row_failed[constrained[i]->first_row] = 1;
    step_failures_.push_back({constrained[i]->id, std::move(taken[i])});
  }
  return AppendTokens(rows, row_tokens, row_failed);
}

absl::Status Scheduler::TakeConstrainedToken(Sequence& seq, int row, SampledToken& token,
                                             const MaskedRowLogits& masked_row_logits, int worker) {
  TokenConstraint& c = *seq.constraint;
  // The runner sampled with this mask: it was filled before the step's rows were read.
  if (c.state() != TokenConstraint::State::kMaskReady)
    return absl::InternalError("a constrained row was sampled before its mask was filled");
  const RowSampling s = RowSamplingOf(seq);  // no drafts: the row's history is the sequence's
  if (!TokenConstraint::AllowsAnyToken(s.history.allowed_tokens, s.history.banned_tokens)) {
    return NoAllowedTokenError();
  }
  if (c.Accept(token.token).ok()) return absl::OkStatus();
  // The mask allowed a token the matcher refuses (Sampler::SampleAccepted says when): the row is
  // drawn again on the host without it, from its masked logits.
  std::vector<uint32_t> allowed(s.history.allowed_tokens.begin(), s.history.allowed_tokens.end());
  const size_t word = static_cast<size_t>(token.token) / 32;
  if (word < allowed.size()) allowed[word] &= ~(1u << (token.token % 32));
  SequenceHistory history = s.history;
  history.allowed_tokens = allowed;
  std::vector<float>& logits = redraw_logits_[worker];
  logits.resize(model_.vocab_size);
  EXL3_RETURN_IF_ERROR(masked_row_logits(row, std::span<float>(logits)));
  const std::optional<SampledToken> redrawn = samplers_[worker].SampleAccepted(
      logits, s.params, s.seed, history, [&c](int32_t t) { return c.Accept(t).ok(); },
      kMaxConstraintRefusals - 1);
  if (!redrawn.has_value()) {
    return EveryDrawRefusedError();
  }
  token = *redrawn;
  return absl::OkStatus();
}

std::vector<int64_t> Scheduler::FailStep(const ScheduledStep& step) {
  std::vector<int64_t> failed;
  for (const SequenceChunk& chunk : step.batch.chunks) {
    if (!sequences_.contains(chunk.sequence_id)) continue;
    Remove(chunk.sequence_id);
    failed.push_back(chunk.sequence_id);
  }
  return failed;
}

SequenceProgress Scheduler::ProgressOf(const Sequence& seq) {
  return SequenceProgress{static_cast<int>(seq.request.prompt.size()), seq.NumOutput(),
                          seq.cached_prompt_tokens};
}

std::optional<int> Scheduler::DraftLimit(int64_t sequence_id) const {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return std::nullopt;
  return it->second.draft_length.limit();
}

double Scheduler::MeanDraftLimit() const {
  int64_t sum = 0;
  int count = 0;
  const bool goodput = options_.speculative.draft_length == DraftLengthPolicy::kGoodput;
  for (int64_t id : running_) {
    const DraftLength& d = sequences_.at(id).draft_length;
    if (d.cap() < 1) continue;
    sum += goodput ? d.chosen() : d.limit();
    ++count;
  }
  return count > 0 ? static_cast<double>(sum) / count : 0.0;
}

std::optional<SequenceProgress> Scheduler::Progress(int64_t sequence_id) const {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return std::nullopt;
  return ProgressOf(it->second);
}

}  // namespace exl3::engine
