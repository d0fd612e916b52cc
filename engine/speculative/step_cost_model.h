// What one engine step costs, in seconds, by its shape and its rows, learned from the steps that
// ran: one StepCostCurve (engine/speculative/step_cost_curve.h) per shape. The goodput draft
// choice (engine/speculative/goodput_draft_choice.h) asks it what the step it is building would
// cost with verify rows added. No clocks: the caller passes each step's shape, rows and time
// (Scheduler::ObserveStepTime).
//
// Shapes, since an engine may run them differently at the same rows:
//   - kDecodeOnly: every chunk is one token (a plain decode step). The GPU engine replays these
//     from a CUDA graph captured per batch size (engine/cuda/decode_graphs.h);
//   - kMixed: some chunk has more (a verify chunk's drafts, a prompt chunk), run eagerly there.
// One curve over rows alone would average a batch's graph-replayed steps with the eager ones one
// draft more makes, and see neither: each draft would look as cheap as a row, while the first
// costs the whole step's launches.
//
// Every step counts on one clock: a row count of a shape not measured in the last
// kMaxAgeSteps steps (of any shape) is untrusted again, so a cost measured once (or drifted since)
// cannot keep the choice from trying that step for good; its next step measures it anew.
//
// Seconds(shape, rows) is the shape's curve's estimate (unknown where it has none).
// Guess(shape, rows) is never unknown once any step was measured: the shape's estimate, else that of a
// curve over every step of either shape, else that curve's nearest point. A drafted step's rows
// below every mixed step seen thus count as the line from the plain steps up to the mixed ones:
// optimistic (it leaves out the jump), so the choice explores such a step once, and then its
// own shape's curve knows.
//
//   StepCostModel cost;  // (each bucket's first step is a warm-up, StepCostCurve: twice each)
//   cost.Observe(StepShape::kDecodeOnly, /*rows=*/64, /*seconds=*/0.007);
//   cost.Observe(StepShape::kMixed, 192, 0.012);
//   cost.Seconds(StepShape::kMixed, 64);  // unknown: no mixed step near 64 rows was observed
//   cost.Guess(StepShape::kMixed, 64);    // 0.007, the curve over every step there
#pragma once

#include <array>
#include <cstdint>
#include <optional>

#include "engine/speculative/step_cost_curve.h"

namespace exl3::engine {

enum class StepShape { kDecodeOnly, kMixed };

class StepCostModel {
 public:
  // About 5 s of batch-64 decode steps on an H100 (9 ms each), 1 s at batch 1.
  static constexpr int64_t kMaxAgeSteps = 512;

  // A step of this shape and `rows` (>= 1) rows took `seconds` (> 0); anything else is ignored.
  void Observe(StepShape shape, int rows, double seconds);
  std::optional<double> Seconds(StepShape shape, int rows) const { return curves_[Index(shape)].Seconds(rows); }
  std::optional<double> Guess(StepShape shape, int rows) const;
  const StepCostCurve& curve(StepShape shape) const { return curves_[Index(shape)]; }
  bool empty() const { return every_step_.empty(); }

 private:
  static int Index(StepShape shape) { return shape == StepShape::kDecodeOnly ? 0 : 1; }
  std::array<StepCostCurve, 2> curves_;
  StepCostCurve every_step_;  // both shapes' steps
  int64_t steps_ = 0;         // observed so far
};

}  // namespace exl3::engine
