// What one engine step of one shape costs, in seconds, as a function of its rows (the tokens it
// computes: every chunk's tokens, verify chunks' drafts included), learned from the steps that
// ran. StepCostModel (engine/speculative/step_cost_model.h) keeps one per step shape. No clocks:
// the caller passes each step's rows and time.
//
// Rows fall into buckets: each power of two [2^e, 2^(e+1)) is split into kBucketsPerOctave equal
// parts (rows 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8-9 | 10-11 | ... | 64-79 | 80-95 | ...). A bucket is
//   - never seen;
//   - untrusted: its first step was a warm-up (a GPU engine's first step of a shape loads its
//     kernels, captures a CUDA graph or grows a workspace: on an H100 the first verify step of a
//     run took 9.5 ms where the next took 3.0), or it was measured but not observed again since
//     the step the caller passed to ForgetBefore, so what it knew may be stale; its next step
//     measures it anew;
//   - measured: exponential moving averages (weight kWeight; the step that measured it sets
//     them) of its steps' rows and seconds: one point (mean rows, mean seconds).
// Seconds(rows) is, over the measured points
//   - between two points (by mean rows): the straight line between the nearest one on each side;
//   - past the outermost point on its side: that point's seconds where `rows` falls in the
//     point's own bucket, else unknown (nullopt): no step near it has been measured.
// NearestObservedSeconds(rows) is the seconds of the measured point nearest `rows` (unknown only
// before the first is measured), for a caller that must guess where Seconds has nothing.
//
//   StepCostCurve cost;
//   cost.Observe(/*rows=*/64, /*seconds=*/0.030, /*step=*/1);  // a warm-up: not used
//   cost.Observe(64, 0.009, 2);
//   cost.Observe(256, 0.050, 3);  // a warm-up
//   cost.Observe(256, 0.018, 4);
//   std::optional<double> t = cost.Seconds(128);  // 0.012, on the line between the two
#pragma once

#include <array>
#include <cstdint>
#include <optional>

namespace exl3::engine {

class StepCostCurve {
 public:
  static constexpr int kBucketsPerOctave = 4;
  // Each step's share of its bucket's averages: about the last ten steps of a row count count, so
  // the model follows the step time as contexts grow.
  static constexpr double kWeight = 0.2;
  // Row counts up to 2^kNumOctaves - 1 have a bucket; larger ones share the last.
  static constexpr int kNumOctaves = 24;

  // Step number `step` (the caller's count, increasing) of `rows` (>= 1) rows took `seconds`
  // (> 0); anything else is ignored.
  void Observe(int rows, double seconds, int64_t step);
  // Measured buckets whose last step came before `step` become untrusted.
  void ForgetBefore(int64_t step);
  // The predicted seconds of a step of `rows` rows, or unknown (see above).
  std::optional<double> Seconds(int rows) const;
  // The seconds of the measured point nearest `rows`; unknown while nothing is measured.
  std::optional<double> NearestObservedSeconds(int rows) const;
  bool empty() const { return num_measured_ == 0; }

  // The bucket of a row count >= 1: 0 for 1 row, increasing with rows.
  static int BucketOf(int rows);

 private:
  static constexpr int kNumBuckets = kNumOctaves * kBucketsPerOctave;
  enum class BucketState { kNeverSeen, kUntrusted, kMeasured };
  struct Bucket {
    BucketState state = BucketState::kNeverSeen;
    double rows = 0;         // kMeasured: the bucket's steps' mean rows
    double seconds = 0;      // and mean seconds
    int64_t last_step = 0;   // the step that last observed it
  };
  const Bucket* Measured(int b) const {
    return buckets_[b].state == BucketState::kMeasured ? &buckets_[b] : nullptr;
  }
  std::array<Bucket, kNumBuckets> buckets_{};
  int num_measured_ = 0;
};

}  // namespace exl3::engine
