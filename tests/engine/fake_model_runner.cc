#include "tests/engine/fake_model_runner.h"

#include <algorithm>
#include <limits>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/mix64.h"

namespace exl3::engine::testing {

FakeModelRunner::FakeModelRunner(FakeModelOptions options)
    : options_(std::move(options)), sampler_(options_.vocab_size) {
  info_.name = "fake";
  info_.architecture = "FakeForCausalLM";
  info_.vocab_size = options_.vocab_size;
  info_.max_context = options_.max_context;
  info_.eos_token_ids = options_.eos_token_ids;
  info_.kv_bytes_per_token = options_.kv_bytes_per_token;
}

void FakeModelRunner::HistoryLogits(std::span<const int32_t> history, float* row,
                                    int vocab_size) {
  uint64_t h = Mix64(history.size() + kGoldenGamma);
  for (int32_t t : history) h = Mix64(h ^ (static_cast<uint64_t>(t) + kGoldenGamma));
  for (int v = 0; v < vocab_size; ++v) {
    const uint64_t bits = Mix64(h ^ Mix64(static_cast<uint64_t>(v) * kGoldenGamma + 7));
    row[v] = static_cast<float>(bits >> 40) * (8.0f / (1 << 24)) - 4.0f;
  }
}

absl::Status FakeModelRunner::AllocateKvCache(const KvCacheShape& shape) {
  if (shape.num_blocks < 1 || shape.block_size < 1) {
    return absl::InvalidArgumentError("bad KV cache shape");
  }
  shape_ = shape;
  slots_.assign(static_cast<size_t>(shape.num_blocks) * shape.block_size, Slot{});
  slot_written_in_step_.assign(slots_.size(), 0);
  return absl::OkStatus();
}

void FakeModelRunner::SetFault(Fault fault) {
  std::lock_guard<std::mutex> lock(fault_mu_);
  fault_ = std::move(fault);
}

absl::Status FakeModelRunner::CheckFailed(std::string message) {
  ++num_check_failures_;
  return absl::InternalError(absl::StrCat("fake runner check failed: ", message));
}

StepPhaseTimes FakeModelRunner::LastPhaseTimes() const {
  StepPhaseTimes t;
  t.attention_s = 1e-6;
  return t;
}

bool FakeModelRunner::SamplesRows(const SamplingParams& params) const {
  return options_.samples_rows_up_to_logprobs.has_value() &&
         params.logprobs.value_or(0) <= *options_.samples_rows_up_to_logprobs;
}

absl::Status FakeModelRunner::ForwardSampled(const StepBatch& batch,
                                             std::span<const RowSampling> rows,
                                             std::span<SampledToken> tokens,
                                             const std::function<void()>& masks_ready) {
  const size_t vocab = info_.vocab_size;
  if (rows.size() != static_cast<size_t>(batch.NumLogitRows()) || tokens.size() != rows.size()) {
    return CheckFailed("ForwardSampled: rows and tokens do not match the step's logit rows");
  }
  for (const RowSampling& r : rows) {
    if (!SamplesRows(r.params)) return CheckFailed("ForwardSampled with a row it does not sample");
  }
  sampled_logits_.resize(rows.size() * vocab);
  EXL3_RETURN_IF_ERROR(Forward(batch, sampled_logits_.data()));
  masks_ready();
  masked_logits_ = sampled_logits_;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::span<const uint32_t> allowed = rows[i].history.allowed_tokens;
    if (allowed.empty()) continue;
    for (size_t t = 0; t < vocab; ++t) {
      const bool ok = t / 32 < allowed.size() && ((allowed[t / 32] >> (t % 32)) & 1u);
      if (!ok) masked_logits_[i * vocab + t] = -std::numeric_limits<float>::infinity();
    }
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    tokens[i] = sampler_.Sample(std::span<float>(sampled_logits_).subspan(i * vocab, vocab),
                                rows[i].params, rows[i].seed, rows[i].history);
  }
  num_sampled_rows_ += static_cast<int>(rows.size());
  return absl::OkStatus();
}

absl::Status FakeModelRunner::MaskedRowLogits(int row, std::span<float> logits) {
  const size_t vocab = info_.vocab_size;
  if (row < 0 || (static_cast<size_t>(row) + 1) * vocab > masked_logits_.size() || logits.size() != vocab)
    return CheckFailed(absl::StrCat("MaskedRowLogits: row ", row, " of the last sampled step"));
  std::copy_n(masked_logits_.begin() + static_cast<std::ptrdiff_t>(row * vocab), vocab, logits.begin());
  ++num_masked_row_reads_;
  return absl::OkStatus();
}

absl::Status FakeModelRunner::Forward(const StepBatch& batch, float* logits) {
  const int call = num_forward_calls_++;
  const int step_mark = call + 1;
  {
    std::lock_guard<std::mutex> lock(fault_mu_);
    if (fault_) {
      absl::Status s = fault_(call, batch);
      if (!s.ok()) return s;
    }
  }
  if (slots_.empty()) return CheckFailed("Forward before AllocateKvCache");
  if (options_.step_delay.count() > 0) std::this_thread::sleep_for(options_.step_delay);
  max_tokens_in_a_step_ = std::max(max_tokens_in_a_step_.load(), batch.NumTokens());

  const int bs = shape_.block_size;
  std::vector<int32_t> history;
  int row = 0;
  for (const SequenceChunk& c : batch.chunks) {
    const int end = c.start_position + static_cast<int>(c.tokens.size());
    if (c.tokens.empty()) return CheckFailed(absl::StrCat("seq ", c.sequence_id, ": empty chunk"));
    if (static_cast<int64_t>(c.block_table.size()) * bs < end) {
      return CheckFailed(absl::StrCat("seq ", c.sequence_id, ": block table of ",
                                      c.block_table.size(), " blocks does not cover ", end));
    }
    auto slot_of = [&](int p) -> int64_t {
      const int32_t block = c.block_table[p / bs];
      if (block < 0 || block >= shape_.num_blocks) return -1;
      return static_cast<int64_t>(block) * bs + p % bs;
    };
    history.clear();
    for (int p = 0; p < c.start_position; ++p) {
      const int64_t s = slot_of(p);
      if (s < 0) return CheckFailed(absl::StrCat("seq ", c.sequence_id, ": bad block id"));
      const Slot& slot = slots_[s];
      if (!slot.written || slot.position != p) {
        return CheckFailed(absl::StrCat("seq ", c.sequence_id, ": position ", p,
                                        " read before it was written"));
      }
      if (slot_written_in_step_[s] == step_mark) {
        return CheckFailed(absl::StrCat("seq ", c.sequence_id, ": position ", p,
                                        " read in the step that writes it"));
      }
      history.push_back(slot.token);
    }
    for (int i = 0; i < static_cast<int>(c.tokens.size()); ++i) {
      const int p = c.start_position + i;
      const int64_t s = slot_of(p);
      if (s < 0) return CheckFailed(absl::StrCat("seq ", c.sequence_id, ": bad block id"));
      if (slot_written_in_step_[s] == step_mark) {
        return CheckFailed(absl::StrCat("seq ", c.sequence_id, ": slot ", s,
                                        " written twice in one step"));
      }
      if (c.tokens[i] < 0 || c.tokens[i] >= info_.vocab_size) {
        return CheckFailed(absl::StrCat("seq ", c.sequence_id, ": token out of range"));
      }
      slots_[s] = Slot{true, c.tokens[i], p};
      slot_written_in_step_[s] = step_mark;
      history.push_back(c.tokens[i]);
    }
    if (c.wants_logits) {
      // One row per trailing position (a verify chunk's drafts), each from the history up to it.
      if (c.num_logit_rows < 1 || c.num_logit_rows > static_cast<int>(c.tokens.size()))
        return CheckFailed(absl::StrCat("seq ", c.sequence_id, ": ", c.num_logit_rows, " logit rows"));
      for (int j = 0; j < c.num_logit_rows; ++j) {
        const size_t len = history.size() - c.num_logit_rows + 1 + j;
        float* out = logits + static_cast<size_t>(row) * info_.vocab_size;
        HistoryLogits(std::span<const int32_t>(history).first(len), out, info_.vocab_size);
        if (options_.favoured_token.has_value()) out[options_.favoured_token->token] += options_.favoured_token->bias;
        ++row;
      }
    }
  }
  return absl::OkStatus();
}

std::promise<void> HoldFirstStep(FakeModelRunner& runner) {
  std::promise<void> released;
  std::shared_future<void> gate = released.get_future().share();
  runner.SetFault([gate](int call, const StepBatch&) {
    if (call == 0) gate.wait();
    return absl::OkStatus();
  });
  return released;
}

}  // namespace exl3::engine::testing
