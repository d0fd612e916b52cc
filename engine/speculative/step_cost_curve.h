// What one engine step of one shape costs, in seconds, as a function of its rows (the tokens it
// computes: every chunk's tokens, verify chunks' drafts included), learned from the steps that
// ran. StepCostModel (engine/speculative/step_cost_model.h) keeps one per step shape. No clocks:
// the caller passes each step's rows and time.
//
// Rows fall into buckets: each power of two [2^e, 2^(e+1)) is split into kBucketsPerOctave equal
// parts (rows 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8-9 | 10-11 | ... | 64-79 | 80-95 | ...). A bucket keeps
// exponential moving averages (weight kWeight; its first step sets them) of its steps' rows and
// seconds: one point (mean rows, mean seconds) per observed bucket. Seconds(rows) is
//   - between two observed points (by mean rows): the straight line between the nearest one on
//     each side;
//   - past the outermost observed point on its side: that point's seconds where `rows` falls in
//     the point's own bucket, else unknown (nullopt): no step near it has been observed.
// NearestObservedSeconds(rows) is the seconds of the observed point nearest `rows` (unknown
// only before the first step), for a caller that must guess where Seconds has nothing.
//
//   StepCostCurve cost;
//   cost.Observe(/*rows=*/64, /*seconds=*/0.009);
//   cost.Observe(256, 0.018);
//   std::optional<double> t = cost.Seconds(128);  // 0.0105, on the line between the two
#pragma once

#include <array>
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

  // A step of `rows` (>= 1) rows took `seconds` (> 0); anything else is ignored.
  void Observe(int rows, double seconds);
  // The predicted seconds of a step of `rows` rows, or unknown (see above).
  std::optional<double> Seconds(int rows) const;
  // The seconds of the observed point nearest `rows`; unknown while nothing was observed.
  std::optional<double> NearestObservedSeconds(int rows) const;
  bool empty() const { return num_observed_ == 0; }

  // The bucket of a row count >= 1: 0 for 1 row, increasing with rows.
  static int BucketOf(int rows);

 private:
  static constexpr int kNumBuckets = kNumOctaves * kBucketsPerOctave;
  struct Point {
    double rows = 0;     // the bucket's steps' mean rows
    double seconds = 0;  // and mean seconds
  };
  std::array<std::optional<Point>, kNumBuckets> buckets_{};
  int num_observed_ = 0;  // buckets with a point
};

}  // namespace exl3::engine
