// The step cost curve (engine/speculative/step_cost_curve.h): its buckets, the warm-up, the
// unknown and forgotten states, interpolation between measured buckets and the moving averages.
#include "engine/speculative/step_cost_curve.h"

#include <cmath>
#include <limits>
#include <set>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

TEST(StepCostCurveTest, BucketsSplitEachPowerOfTwoInFour) {
  EXPECT_EQ(StepCostCurve::BucketOf(1), 0);
  EXPECT_EQ(StepCostCurve::BucketOf(2), 4);
  EXPECT_EQ(StepCostCurve::BucketOf(3), 6);
  EXPECT_EQ(StepCostCurve::BucketOf(4), 8);
  EXPECT_EQ(StepCostCurve::BucketOf(7), 11);
  EXPECT_EQ(StepCostCurve::BucketOf(8), 12);
  EXPECT_EQ(StepCostCurve::BucketOf(9), 12);
  EXPECT_EQ(StepCostCurve::BucketOf(10), 13);
  // 64-79 | 80-95 | 96-111 | 112-127 | 128-159
  EXPECT_EQ(StepCostCurve::BucketOf(64), StepCostCurve::BucketOf(79));
  EXPECT_EQ(StepCostCurve::BucketOf(80), StepCostCurve::BucketOf(64) + 1);
  EXPECT_EQ(StepCostCurve::BucketOf(127), StepCostCurve::BucketOf(64) + 3);
  EXPECT_EQ(StepCostCurve::BucketOf(128), StepCostCurve::BucketOf(64) + 4);
  EXPECT_EQ(StepCostCurve::BucketOf(159), StepCostCurve::BucketOf(128));
  for (int rows = 1; rows < 70000; ++rows) ASSERT_LE(StepCostCurve::BucketOf(rows), StepCostCurve::BucketOf(rows + 1));
  // Out of range: the first and the last bucket.
  EXPECT_EQ(StepCostCurve::BucketOf(0), 0);
  EXPECT_EQ(StepCostCurve::BucketOf(std::numeric_limits<int>::max()),
            StepCostCurve::kNumOctaves * StepCostCurve::kBucketsPerOctave - 1);
}

// A curve whose buckets' warm-ups are behind them: each Measure observes a new bucket twice.
class Curve {
 public:
  void Measure(int rows, double seconds) {
    if (!measured_.contains(StepCostCurve::BucketOf(rows))) curve.Observe(rows, seconds, ++step);
    measured_.insert(StepCostCurve::BucketOf(rows));
    curve.Observe(rows, seconds, ++step);
  }
  StepCostCurve curve;
  int64_t step = 0;

 private:
  std::set<int> measured_;
};

TEST(StepCostCurveTest, UnknownUntilSomethingNearIsMeasured) {
  Curve c;
  StepCostCurve& cost = c.curve;
  EXPECT_TRUE(cost.empty());
  EXPECT_FALSE(cost.Seconds(64).has_value());
  EXPECT_FALSE(cost.NearestObservedSeconds(64).has_value());
  c.Measure(64, 0.009);
  EXPECT_FALSE(cost.empty());
  EXPECT_DOUBLE_EQ(*cost.Seconds(64), 0.009);
  // The rest of its bucket (64-79) takes its time; beyond it, nothing is known.
  EXPECT_DOUBLE_EQ(*cost.Seconds(79), 0.009);
  EXPECT_FALSE(cost.Seconds(80).has_value());
  EXPECT_FALSE(cost.Seconds(63).has_value());
  EXPECT_FALSE(cost.Seconds(256).has_value());
  EXPECT_DOUBLE_EQ(*cost.NearestObservedSeconds(256), 0.009);
  EXPECT_DOUBLE_EQ(*cost.NearestObservedSeconds(1), 0.009);
}

TEST(StepCostCurveTest, ABucketsFirstStepIsAWarmUp) {
  StepCostCurve cost;
  cost.Observe(4, 0.0095, 1);  // the run's first verify step, loading its kernels
  EXPECT_TRUE(cost.empty());
  EXPECT_FALSE(cost.Seconds(4).has_value());
  EXPECT_FALSE(cost.NearestObservedSeconds(4).has_value());
  cost.Observe(4, 0.0030, 2);  // sets it: no trace of the warm-up
  EXPECT_DOUBLE_EQ(*cost.Seconds(4), 0.0030);
  cost.Observe(4, 0.0040, 3);
  EXPECT_DOUBLE_EQ(*cost.Seconds(4), (1 - StepCostCurve::kWeight) * 0.0030 + StepCostCurve::kWeight * 0.0040);
}

TEST(StepCostCurveTest, ForgottenBucketsAreMeasuredAnew) {
  StepCostCurve cost;
  cost.Observe(64, 0.010, 1);
  cost.Observe(64, 0.010, 2);
  cost.Observe(256, 0.050, 3);
  cost.Observe(256, 0.050, 4);
  cost.ForgetBefore(3);  // 64's last step was 2
  EXPECT_FALSE(cost.Seconds(64).has_value());
  EXPECT_DOUBLE_EQ(*cost.Seconds(256), 0.050);
  EXPECT_DOUBLE_EQ(*cost.NearestObservedSeconds(64), 0.050);
  cost.Observe(64, 0.007, 5);  // measured anew at once (its warm-up was long ago), not averaged
  EXPECT_DOUBLE_EQ(*cost.Seconds(64), 0.007);
  cost.ForgetBefore(10);
  EXPECT_TRUE(cost.empty());
}

TEST(StepCostCurveTest, InterpolatesBetweenMeasuredBuckets) {
  Curve c;
  StepCostCurve& cost = c.curve;
  c.Measure(64, 0.010);
  c.Measure(256, 0.020);
  EXPECT_NEAR(*cost.Seconds(160), 0.015, 1e-12);
  EXPECT_NEAR(*cost.Seconds(96), 0.010 + 0.010 * 32 / 192, 1e-12);
  EXPECT_DOUBLE_EQ(*cost.Seconds(300), 0.020);  // 256's own bucket (256-319)
  EXPECT_FALSE(cost.Seconds(320).has_value());
  EXPECT_FALSE(cost.Seconds(32).has_value());
  EXPECT_DOUBLE_EQ(*cost.NearestObservedSeconds(1000), 0.020);
  EXPECT_DOUBLE_EQ(*cost.NearestObservedSeconds(100), 0.010);
  // A third point between them: the nearest on each side.
  c.Measure(128, 0.011);
  EXPECT_NEAR(*cost.Seconds(96), 0.0105, 1e-12);
  EXPECT_NEAR(*cost.Seconds(192), 0.0155, 1e-12);
}

TEST(StepCostCurveTest, MovingAveragesOfRowsAndSeconds) {
  Curve c;
  c.Measure(64, 0.010);
  c.Measure(64, 0.020);
  const double w = StepCostCurve::kWeight;
  EXPECT_DOUBLE_EQ(*c.curve.Seconds(64), (1 - w) * 0.010 + w * 0.020);
  // Another row count of the bucket moves its point's rows too: with a second point at 256, the
  // line runs from the mean rows.
  Curve mixed;
  mixed.Measure(64, 0.010);
  mixed.Measure(74, 0.010);  // the point: rows 64 + 10 w
  mixed.Measure(256, 0.020);
  const double rows = 64 + 10 * w;
  EXPECT_NEAR(*mixed.curve.Seconds(160), 0.010 + 0.010 * (160 - rows) / (256 - rows), 1e-12);
  EXPECT_DOUBLE_EQ(*mixed.curve.Seconds(65), 0.010);  // below the point, in its bucket
}

TEST(StepCostCurveTest, IgnoresNonsense) {
  StepCostCurve cost;
  for (int i = 0; i < 2; ++i) {
    cost.Observe(0, 0.01, 1);
    cost.Observe(-3, 0.01, 2);
    cost.Observe(8, 0, 3);
    cost.Observe(8, -1, 4);
    cost.Observe(8, std::nan(""), 5);
    cost.Observe(8, std::numeric_limits<double>::infinity(), 6);
  }
  EXPECT_TRUE(cost.empty());
}

}  // namespace
}  // namespace exl3::engine
