// A ModelRunner for the scheduling tests: no model, but logits that are a pure function of the
// sequence's token history read back from its KV cache, so any scheduling or block-table mistake
// changes the generated tokens or fails the step.
//
//   FakeModelOptions opt; opt.vocab_size = 64;
//   auto runner = std::make_unique<FakeModelRunner>(opt);
//   FakeModelRunner* fake = runner.get();                  // keep for fault injection, counters
//   fake->SetFault([](int call, const StepBatch&) { return call == 3 ? absl::InternalError("x") : absl::OkStatus(); });
//   std::vector<float> row(64);
//   FakeModelRunner::HistoryLogits(tokens, row.data(), 64);  // what a sequence's last token gives
//
// The "cache" keeps, per slot (block * block_size + offset), the token and position written
// there. Forward checks, for every chunk, that the block table covers the chunk, that every
// earlier position's slot holds that position (written by an earlier step), and that no two
// chunks of one step write the same slot; it then writes the chunk's tokens and returns, per
// chunk that wants logits, HistoryLogits of the history it read plus the chunk's tokens (a
// verify chunk: one row per trailing position, of the history up to it). A
// failed check is an INTERNAL error naming it (and is counted in num_check_failures).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/core/model_runner.h"
#include "engine/sampling/sampler.h"

namespace exl3::engine::testing {

struct FakeModelOptions {
  int vocab_size = 64;
  int max_context = 4096;
  std::vector<int32_t> eos_token_ids = {1};
  int64_t kv_bytes_per_token = 256;
  std::chrono::microseconds step_delay{0};  // sleep in every Forward
  // Set: the runner samples rows asking at most this many top logprobs itself (SamplesRows,
  // ForwardSampled: a Sampler of its own over the logits Forward makes, as a device sampler
  // would), so steps of other rows take the engine's host path. Unset: it never samples.
  std::optional<int> samples_rows_up_to_logprobs;
  // Added to this token's logit in every row (a model that favours it), when set.
  std::optional<TokenBias> favoured_token;
};

class FakeModelRunner : public ModelRunner {
 public:
  // Called at the start of each Forward (call index from 0); an error fails that step.
  using Fault = std::function<absl::Status(int call, const StepBatch& batch)>;

  explicit FakeModelRunner(FakeModelOptions options);

  const ModelInfo& info() const override { return info_; }
  absl::Status AllocateKvCache(const KvCacheShape& shape) override;
  absl::Status Forward(const StepBatch& batch, float* logits) override;
  StepPhaseTimes LastPhaseTimes() const override;
  // It keeps nothing per sequence but each position's slot: drafts are verified as by the CPU
  // model.
  absl::Status CheckDraftVerification() const override { return absl::OkStatus(); }
  absl::Status CheckPromptLogitRows() const override { return absl::OkStatus(); }
  bool SamplesRows(const SamplingParams& params) const override;
  // Applies a row's constraint mask (history.allowed_tokens) as a device sampler does, keeping the
  // masked row for MaskedRowLogits.
  absl::Status ForwardSampled(const StepBatch& batch, std::span<const RowSampling> rows,
                              std::span<SampledToken> tokens, const std::function<void()>& masks_ready) override;
  absl::Status MaskedRowLogits(int row, std::span<float> logits) override;
  int num_masked_row_reads() const { return num_masked_row_reads_.load(); }
  int num_sampled_rows() const { return num_sampled_rows_.load(); }

  void SetFault(Fault fault);
  int num_forward_calls() const { return num_forward_calls_.load(); }
  int num_check_failures() const { return num_check_failures_.load(); }
  int max_tokens_in_a_step() const { return max_tokens_in_a_step_.load(); }

  // Pseudo-random logits in [-4, 4) that depend on every token of `history` and its length.
  static void HistoryLogits(std::span<const int32_t> history, float* row, int vocab_size);

 private:
  struct Slot {
    bool written = false;
    int32_t token = 0;
    int position = 0;
  };
  absl::Status CheckFailed(std::string message);

  const FakeModelOptions options_;
  ModelInfo info_;
  KvCacheShape shape_;
  std::vector<Slot> slots_;
  std::vector<int> slot_written_in_step_;  // step index + 1 of the last write
  std::mutex fault_mu_;
  Fault fault_;
  std::atomic<int> num_forward_calls_{0};
  std::atomic<int> num_check_failures_{0};
  std::atomic<int> max_tokens_in_a_step_{0};
  std::atomic<int> num_sampled_rows_{0};
  Sampler sampler_;
  std::vector<float> sampled_logits_;
  std::vector<float> masked_logits_;  // the last ForwardSampled's rows after their masks
  std::atomic<int> num_masked_row_reads_{0};
};

// Holds the runner's first step (through its fault hook) until the returned promise is set, so a
// test's requests are all in before the first batch forms: its batches and preemptions then do
// not depend on how fast the engine's loop picks up submissions.
std::promise<void> HoldFirstStep(FakeModelRunner& runner);

}  // namespace exl3::engine::testing
