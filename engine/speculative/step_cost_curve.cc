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

void StepCostCurve::Observe(int rows, double seconds, int64_t step) {
  if (rows < 1 || !(seconds > 0) || !std::isfinite(seconds)) return;
  Bucket& bucket = buckets_[BucketOf(rows)];
  bucket.last_step = step;
  switch (bucket.state) {
    case BucketState::kNeverSeen:
      bucket.state = BucketState::kUntrusted;  // a warm-up
      return;
    case BucketState::kUntrusted:
      bucket.state = BucketState::kMeasured;
      bucket.rows = rows;
      bucket.seconds = seconds;
      ++num_measured_;
      return;
    case BucketState::kMeasured:
      bucket.rows = (1 - kWeight) * bucket.rows + kWeight * rows;
      bucket.seconds = (1 - kWeight) * bucket.seconds + kWeight * seconds;
      return;
  }
}

void StepCostCurve::ForgetBefore(int64_t step) {
  for (Bucket& bucket : buckets_) {
    if (bucket.state != BucketState::kMeasured || bucket.last_step >= step) continue;
    bucket.state = BucketState::kUntrusted;
    --num_measured_;
  }
}

std::optional<double> StepCostCurve::Seconds(int rows) const {
  // The measured points nearest below and above `rows`: buckets, and so their mean rows, are in
  // row order.
  const Bucket* below = nullptr;
  const Bucket* above = nullptr;
  int nearest_bucket = -1;
  for (int b = 0; b < kNumBuckets; ++b) {
    const Bucket* p = Measured(b);
    if (p == nullptr) continue;
    if (p->rows <= rows) {
      below = p;
      nearest_bucket = b;
    }
    if (p->rows >= rows) {
      above = p;
      if (below == nullptr) nearest_bucket = b;
      break;
    }
  }
  if (below != nullptr && above != nullptr) {
    if (above->rows <= below->rows) return below->seconds;  // `rows` is the point's own
    return below->seconds + (above->seconds - below->seconds) * (rows - below->rows) / (above->rows - below->rows);
  }
  // Past the outermost point on one side: known only within that point's bucket.
  if (nearest_bucket >= 0 && BucketOf(rows) == nearest_bucket) return buckets_[nearest_bucket].seconds;
  return std::nullopt;
}

std::optional<double> StepCostCurve::NearestObservedSeconds(int rows) const {
  std::optional<double> best;
  double best_distance = 0;
  for (int b = 0; b < kNumBuckets; ++b) {
    const Bucket* p = Measured(b);
    if (p == nullptr) continue;
    const double distance = std::abs(p->rows - rows);
    if (!best.has_value() || distance < best_distance) {
      best = p->seconds;
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace exl3::engine
