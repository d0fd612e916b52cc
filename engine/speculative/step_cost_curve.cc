#include "engine/speculative/step_cost_curve.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace exl3::engine {

int StepCostCurve::BucketOf(int rows) {
  const unsigned r = static_cast<unsigned>(std::clamp(rows, 1, (1 << kNumOctaves) - 1));
  const int octave = std::bit_width(r) - 1;  // r in [2^octave, 2^(octave + 1))
  const int part = static_cast<int>((static_cast<uint64_t>(r - (1u << octave)) * kBucketsPerOctave) >> octave);
  return octave * kBucketsPerOctave + part;
}

void StepCostCurve::Observe(int rows, double seconds) {
  if (rows < 1 || !(seconds > 0) || !std::isfinite(seconds)) return;
  std::optional<Point>& bucket = buckets_[BucketOf(rows)];
  if (!bucket.has_value()) {
    bucket = Point{static_cast<double>(rows), seconds};
    ++num_observed_;
    return;
  }
  bucket->rows = (1 - kWeight) * bucket->rows + kWeight * rows;
  bucket->seconds = (1 - kWeight) * bucket->seconds + kWeight * seconds;
}

std::optional<double> StepCostCurve::Seconds(int rows) const {
  // The observed points nearest below and above `rows`: buckets, and so their mean rows, are in
  // row order.
  int below = -1, above = -1;
  for (int b = 0; b < kNumBuckets; ++b) {
    if (!buckets_[b].has_value()) continue;
    if (buckets_[b]->rows <= rows) below = b;
    if (buckets_[b]->rows >= rows) {
      above = b;
      break;
    }
  }
  if (below >= 0 && above >= 0) {
    const Point& lo = *buckets_[below];
    const Point& hi = *buckets_[above];
    if (hi.rows <= lo.rows) return lo.seconds;  // `rows` is the point's own
    return lo.seconds + (hi.seconds - lo.seconds) * (rows - lo.rows) / (hi.rows - lo.rows);
  }
  // Past the outermost point on one side: known only within that point's bucket.
  const int nearest = below >= 0 ? below : above;
  if (nearest >= 0 && BucketOf(rows) == nearest) return buckets_[nearest]->seconds;
  return std::nullopt;
}

std::optional<double> StepCostCurve::NearestObservedSeconds(int rows) const {
  std::optional<double> best;
  double best_distance = 0;
  for (const std::optional<Point>& p : buckets_) {
    if (!p.has_value()) continue;
    const double distance = std::abs(p->rows - rows);
    if (!best.has_value() || distance < best_distance) {
      best = p->seconds;
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace exl3::engine
