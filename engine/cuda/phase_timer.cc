#include "engine/cuda/phase_timer.h"

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {

PhaseTimer::~PhaseTimer() {
  for (void* e : event_pool_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

absl::Status PhaseTimer::Begin() {
  marks_.clear();
  return Mark(Phase::kStart);
}

absl::Status PhaseTimer::Mark(Phase phase) {
  if (!recording_) return absl::OkStatus();
  if (marks_.size() == event_pool_.size()) {
    cudaEvent_t e;
    EXL3_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    event_pool_.push_back(e);
  }
  void* e = event_pool_[marks_.size()];
  marks_.push_back({e, phase});
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::StatusOr<StepPhaseTimes> PhaseTimer::Collect() {
  StepPhaseTimes times;
  for (size_t i = 1; i < marks_.size(); ++i) {
    float ms = 0;
    EXL3_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(marks_[i - 1].event),
                                                   static_cast<cudaEvent_t>(marks_[i].event)));
    const double s = ms * 1e-3;
    switch (marks_[i].phase) {
      case Phase::kEmbed: times.embed_s += s; break;
      case Phase::kAttention: times.attention_s += s; break;
      case Phase::kDenseMlp: times.dense_mlp_s += s; break;
      case Phase::kMoe: times.moe_s += s; break;
      case Phase::kHead: times.head_s += s; break;
      case Phase::kSample: times.sample_s += s; break;
      case Phase::kStart: break;
    }
  }
  marks_.clear();
  return times;
}

}  // namespace exl3::engine::cuda
