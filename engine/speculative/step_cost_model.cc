#include "engine/speculative/step_cost_model.h"

namespace exl3::engine {

std::optional<double> StepCostModel::Guess(StepShape shape, int rows) const {
  if (std::optional<double> s = Seconds(shape, rows)) return s;
  if (std::optional<double> s = every_step_.Seconds(rows)) return s;
  return every_step_.NearestObservedSeconds(rows);
}

}  // namespace exl3::engine
