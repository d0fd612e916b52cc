// The step cost model by shape (engine/speculative/step_cost_model.h): each shape learns apart,
// and Guess falls back from the shape's estimate to the curve over every step of either shape.
#include "engine/speculative/step_cost_model.h"

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

// Two steps: the bucket's warm-up, then its measure (engine/speculative/step_cost_curve.h).
void Measure(StepCostModel& cost, StepShape shape, int rows, double seconds) {
  cost.Observe(shape, rows, seconds);
  cost.Observe(shape, rows, seconds);
}

TEST(StepCostModelTest, ShapesLearnApart) {
  StepCostModel cost;
  EXPECT_TRUE(cost.empty());
  EXPECT_FALSE(cost.Guess(StepShape::kMixed, 64).has_value());
  Measure(cost, StepShape::kDecodeOnly, 64, 0.006);
  Measure(cost, StepShape::kMixed, 65, 0.010);
  EXPECT_FALSE(cost.empty());
  EXPECT_DOUBLE_EQ(*cost.Seconds(StepShape::kDecodeOnly, 64), 0.006);
  EXPECT_DOUBLE_EQ(*cost.Seconds(StepShape::kMixed, 65), 0.010);
  EXPECT_DOUBLE_EQ(*cost.Seconds(StepShape::kMixed, 64), 0.010);  // within its point's bucket
  EXPECT_FALSE(cost.curve(StepShape::kDecodeOnly).empty());
}

TEST(StepCostModelTest, GuessFallsBackToEveryStepsCurve) {
  StepCostModel cost;
  Measure(cost, StepShape::kDecodeOnly, 64, 0.006);
  // No mixed step yet: the plain steps' estimate, then their nearest point.
  EXPECT_FALSE(cost.Seconds(StepShape::kMixed, 65).has_value());
  EXPECT_DOUBLE_EQ(*cost.Guess(StepShape::kMixed, 65), 0.006);
  EXPECT_DOUBLE_EQ(*cost.Guess(StepShape::kMixed, 256), 0.006);
  // A mixed step observed far above: below it, the line from the plain step up to it.
  Measure(cost, StepShape::kMixed, 256, 0.018);
  EXPECT_FALSE(cost.Seconds(StepShape::kMixed, 160).has_value());
  EXPECT_DOUBLE_EQ(*cost.Guess(StepShape::kMixed, 160), 0.012);
  // Once the mixed curve covers a row count, it alone answers there.
  Measure(cost, StepShape::kMixed, 128, 0.012);
  EXPECT_DOUBLE_EQ(*cost.Guess(StepShape::kMixed, 192), 0.015);
  Measure(cost, StepShape::kMixed, 65, 0.010);
  EXPECT_DOUBLE_EQ(*cost.Guess(StepShape::kMixed, 65), 0.010);
  EXPECT_DOUBLE_EQ(*cost.Guess(StepShape::kDecodeOnly, 64), 0.006);
  // Past every step: the nearest point of any.
  EXPECT_DOUBLE_EQ(*cost.Guess(StepShape::kDecodeOnly, 4096), 0.018);
}

TEST(StepCostModelTest, CostsNotMeasuredForLongAreForgotten) {
  StepCostModel cost;
  Measure(cost, StepShape::kMixed, 4, 0.004);
  for (int i = 0; i < StepCostModel::kMaxAgeSteps - 1; ++i) cost.Observe(StepShape::kDecodeOnly, 1, 0.002);
  EXPECT_DOUBLE_EQ(*cost.Seconds(StepShape::kMixed, 4), 0.004);
  cost.Observe(StepShape::kDecodeOnly, 1, 0.002);
  EXPECT_FALSE(cost.Seconds(StepShape::kMixed, 4).has_value());
  EXPECT_DOUBLE_EQ(*cost.Guess(StepShape::kMixed, 4), 0.002);  // the plain steps' curve: explored
  cost.Observe(StepShape::kMixed, 4, 0.003);  // measured anew in one step
  EXPECT_DOUBLE_EQ(*cost.Seconds(StepShape::kMixed, 4), 0.003);
}

}  // namespace
}  // namespace exl3::engine
