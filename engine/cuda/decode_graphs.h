// CUDA graphs of decode and verify steps, replayed as one launch instead of a few hundred:
//  - decode (one token per sequence, up to 64 sequences): one graph per batch-size bucket (1, 2,
//    4, 8, 16, 24, 32, 48, 64; a step is padded to its bucket with one-token padding rows);
//  - verify (speculative decoding: every sequence's chunk of n = 2..kMaxVerifyTokens tokens, all
//    of whose logits are wanted, up to kMaxVerifySequences sequences): one graph per (sequences,
//    n), unpadded, since the recurrent layers launch per chunk and a padded step would have more.
// Each graph keeps its own step-facts array (its launches hold that array's addresses; it is
// rewritten before each replay) and the phase times of the eager run before its capture, by which
// a replay's time is apportioned. A graph is stale, and dropped, when a sequence's block table
// outgrows the stride it was captured with or the kernels' workspace was reallocated since; a
// failed capture turns graphs off with a warning.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/core/model_runner.h"

namespace exl3::engine::cuda {

struct DecodeGraph {
  int rows = 0;          // the step's rows: a decode step's bucket, a verify step's tokens
  int table_stride = 0;  // block-table ints per row in its facts
  DeviceArray<int32_t> facts;  // the step's facts (engine/cuda/step_facts.h), rewritten before each replay
  void* exec = nullptr;        // cudaGraphExec_t; null until captured
  StepPhaseTimes phases;       // of the eager run before the capture
  uint64_t workspace_allocations = 0;  // the kernels' workspace it was captured with
};

class DecodeGraphs {
 public:
  static constexpr int kMaxRows = 64;
  static constexpr int kMaxVerifyTokens = 8;     // a verify chunk's tokens: k ≤ 7 drafts
  static constexpr int kMaxVerifySequences = 8;  // above, a verify step runs eagerly

  // verify_steps: verify steps too (CudaModelOptions::verify_graphs).
  DecodeGraphs(bool enabled, bool verify_steps) : enabled_(enabled), verify_steps_(verify_steps) {}
  ~DecodeGraphs() { Drop(); }
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;

  bool enabled() const { return enabled_; }
  // The rows of a step of `sequences` chunks of `tokens_per_sequence` tokens each: a decode step's
  // bucket (the smallest of at least `sequences` rows), a verify step's tokens; 0 when no graph
  // runs such a step.
  int GraphRows(int sequences, int tokens_per_sequence) const;
  // The graph of such a step for block tables of up to `table_ints` ints: a stale one dropped, an
  // empty (uncaptured) one made where there is none. GraphRows must be above 0.
  DecodeGraph& Get(int sequences, int tokens_per_sequence, int table_ints, uint64_t workspace_allocations);
  // Captures `launches` (queued on `stream`) into g; a failure turns graphs off (logged), not an error.
  absl::Status Capture(DecodeGraph& g, StreamHandle stream, const std::function<absl::Status()>& launches);
  absl::Status Replay(const DecodeGraph& g, StreamHandle stream);
  int64_t replays() const { return replays_; }  // steps run by replaying a graph, ever
  // Every graph (they hold addresses that are about to change).
  void Drop();

 private:
  bool enabled_;
  bool verify_steps_;
  int64_t replays_ = 0;
  // By (rows, tokens per sequence).
  std::map<std::pair<int, int>, std::unique_ptr<DecodeGraph>> graphs_;
};

// A replay's GPU time `total`, apportioned as the graph's eager run spent it (sampling timed apart).
StepPhaseTimes ApportionReplay(const StepPhaseTimes& eager, double total, double sample_s);

}  // namespace exl3::engine::cuda
