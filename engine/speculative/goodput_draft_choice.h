// The goodput draft length (DraftLengthPolicy::kGoodput): how many of its drafts each decoding
// sequence verifies in the step being built, chosen to maximise the step's expected tokens per
// second (its "goodput") under the step cost learned so far (engine/speculative/step_cost_model.h).
//
// A sequence whose drafts are each right with probability q (given the ones before it were)
// yields, besides its own token, q + q^2 + ... + q^k expected tokens from k drafts: its j-th
// draft adds q^j. Every draft row adds one row to the step. So, with E0 the tokens the step
// yields without drafts and R0 its rows, giving the step D draft rows in all yields at best
// E(D) = E0 + the D largest gains q_i^j (each sequence's first, then its second, ... as its
// gains only fall) in a step of predicted time T(R0 + D) (never less than at fewer rows, whatever
// dips the learned curve has from noise). T is the cost model's for the step's shape: the
// step's own (DraftStep::shape) at D = 0, a mixed step's with any draft, so where plain decode
// steps replay a CUDA graph and drafted ones run eagerly the first draft is charged that jump.
// The choice takes the D in [0, max_drafts] with the highest E(D) / T(R0 + D) (the smallest such
// D on a tie or a gain within rounding): where rows are nearly free (a memory-bound step) drafts
// are taken while they add anything; where each row costs its share of the step (compute-bound,
// large batches) only drafts likely to land (q^j above the step's tokens per row) are. The best D
// over all of [0, max_drafts] rather than the first where the ratio stops rising, as a learned
// cost curve can have plateaus.
//
// Where the cost model has no estimate for the step without drafts (nothing observed near its
// rows in its shape), the step gets no drafts besides probes: its time is then observed, and the
// next such step can be weighed. Where it has one but none for a drafted step of some row count,
// that step counts as the nearest observed one (StepCostModel::Guess): a row count or shape
// never seen looks as cheap as what was seen nearest, so the choice drafts there, the step's
// time is observed, and the next choice knows (exploring optimistically, as each sequence's q
// starts at 1). A scheduler whose steps' times nobody reports (Scheduler::ObserveStepTime) thus
// never drafts with this policy.
//
// A candidate marked `probe` (DraftLength::probe_due, at the scheduler's probe steps) gets one
// draft whatever the gains say, so that its q, which only verify chunks update, can rise again
// once its drafts start landing; but only where its drafts could pay at all: were they certain
// (q = 1), the choice would take one of them (the others as they are, nobody probed). Elsewhere
// (a batch of 64 whose plain steps replay a CUDA graph, where a few drafts make the step eager)
// a probe's rows would buy a q the choice could not use. Where the step's own time is unknown
// every probe is given. Probes are counted in E0 and R0 (the step then mixed) before the choice;
// the budget (max_drafts) goes to them first, in candidate order.
//
//   std::vector<DraftCandidate> c = {{/*acceptance=*/0.9, /*limit=*/3, /*probe=*/false}, ...};
//   std::vector<int> counts = ChooseDraftCounts(
//       cost, {.shape = StepShape::kDecodeOnly, .base_rows = 64, .base_tokens = 64, .max_drafts = 192}, c);
#pragma once

#include <span>
#include <vector>

#include "engine/speculative/step_cost_model.h"

namespace exl3::engine {

struct DraftCandidate {
  double acceptance = 1;  // q in [0, 1]: DraftLength::draft_acceptance
  int limit = 0;          // the most drafts it may get this step (the drafts it has), >= 0
  bool probe = false;     // it gets one draft (where limit >= 1) whatever the gains say
};

struct DraftStep {
  StepShape shape = StepShape::kDecodeOnly;  // the step's shape without drafts
  int base_rows = 0;    // the step's rows without drafts
  int base_tokens = 0;  // the tokens it yields without drafts: its chunks that sample one
  int max_drafts = 0;   // the most draft rows it may take in all (the token budget left)
};

// counts[i]: candidate i's drafts, 0..candidates[i].limit, summing to at most step.max_drafts.
std::vector<int> ChooseDraftCounts(const StepCostModel& cost, const DraftStep& step,
                                   std::span<const DraftCandidate> candidates);

}  // namespace exl3::engine
