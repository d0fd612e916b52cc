#include "engine/cuda/device_sequence_states.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {

DeviceSequenceStates::DeviceSequenceStates(std::vector<int64_t> floats_per_layer, int num_slots,
                                           int max_kept_states)
    : layout_(floats_per_layer), slots_(num_slots, max_kept_states) {}

absl::StatusOr<std::unique_ptr<DeviceSequenceStates>> DeviceSequenceStates::Create(
    std::vector<int64_t> floats_per_layer, int num_slots, int max_kept_states) {
  EXL3_RETURN_IF_ERROR(CheckStateStoreShape(num_slots, max_kept_states));
  std::unique_ptr<DeviceSequenceStates> s(
      new DeviceSequenceStates(std::move(floats_per_layer), num_slots, max_kept_states));
  const int copies = s->num_copies();
  const size_t rows = static_cast<size_t>(num_slots) * copies + 2;
  const size_t n = std::max<size_t>(rows * s->layout_.floats, 1);
  if (!s->data_.Reserve(n).ok())
    return StateStoreTooLarge("the per-sequence state store on the GPU", num_slots, copies, s->layout_.floats,
                              max_kept_states);
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemset(s->data_.get(), 0, n * sizeof(float)));
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the engine's stream does not wait for it
  return s;
}

absl::Status DeviceSequenceStates::BeginStep(const StepBatch& batch, StreamHandle stream) {
  EXL3_ASSIGN_OR_RETURN(std::vector<int> fresh, slots_.BeginStep(batch));
  for (int slot : fresh) {
    EXL3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
        data_.get() + static_cast<size_t>(ReadRow(slot)) * layout_.floats, 0,
        static_cast<size_t>(layout_.floats) * sizeof(float), static_cast<cudaStream_t>(stream)));
  }
  return absl::OkStatus();
}

}  // namespace exl3::engine::cuda
