// GPU time of a step by phase: device events recorded on the stream where each phase's work ends,
// read after the step's synchronisation (engine/core/model_runner.h StepPhaseTimes). Not recorded while
// a decode graph is captured (events cannot be), so a graph's replay is timed as one span.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/core/model_runner.h"

namespace exl3::engine::cuda {

// The work between the previous mark and this one.
enum class Phase { kStart, kEmbed, kAttention, kDenseMlp, kMoe, kHead, kSample };

class PhaseTimer {
 public:
  explicit PhaseTimer(StreamHandle stream) : stream_(stream) {}
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  // A step's first mark (kStart), its earlier marks dropped.
  absl::Status Begin();
  absl::Status Mark(Phase phase);
  // Marks are skipped while off (a capture).
  void set_recording(bool on) { recording_ = on; }
  // After the step's synchronisation: the times between the marks, summed by phase.
  absl::StatusOr<StepPhaseTimes> Collect();

 private:
  struct PhaseMark {
    void* event;  // cudaEvent_t
    Phase phase;
  };
  StreamHandle stream_;
  bool recording_ = true;
  std::vector<void*> event_pool_;  // cudaEvent_t, created as needed, reused every step
  std::vector<PhaseMark> marks_;
};

}  // namespace exl3::engine::cuda
