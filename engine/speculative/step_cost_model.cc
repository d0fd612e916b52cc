#include "engine/speculative/step_cost_model.h"

#include <cmath>

namespace exl3::engine {

void StepCostModel::Observe(StepShape shape, int rows, double seconds) {
  if (rows < 1 || !(seconds > 0) || !std::isfinite(seconds)) return;
  ++steps_;
  curves_[Index(shape)].Observe(rows, seconds, steps_);
  every_step_.Observe(rows, seconds, steps_);
  // Forgotten: a bucket whose last step is kMaxAgeSteps or more steps back.
  for (StepCostCurve* curve : {&curves_[0], &curves_[1], &every_step_}) curve->ForgetBefore(steps_ - kMaxAgeSteps + 1);
}

std::optional<double> StepCostModel::Guess(StepShape shape, int rows) const {
  if (std::optional<double> s = Seconds(shape, rows)) return s;
  if (std::optional<double> s = every_step_.Seconds(rows)) return s;
  return every_step_.NearestObservedSeconds(rows);
}

}  // namespace exl3::engine
