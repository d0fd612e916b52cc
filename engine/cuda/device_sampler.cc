#include "engine/cuda/device_sampler.h"

#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/sampling_kernels.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {
namespace {

cudaStream_t Stream(StreamHandle s) { return static_cast<cudaStream_t>(s); }

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

DeviceSampler::DeviceSampler(int vocab_size) : vocab_size_(vocab_size), packer_(vocab_size) {}

bool DeviceSampler::Supports(const SamplingParams& params) {
  // logit_bias and constraints (masks) are applied by the host's Sampler only: such steps are
  // sampled on the host (engine/core/engine.cc RunForward).
  return (!params.logprobs.has_value() || *params.logprobs <= kMaxDeviceTopLogprobs) &&
         params.logit_bias.empty() && params.grammar == nullptr;
}

absl::Status DeviceSampler::Launch(float* logits, std::span<const RowSampling> rows,
                                   StreamHandle stream) {
  for (const RowSampling& r : rows) {
    if (!Supports(r.params)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the device sampler takes no logit_bias or constraint and reports at most ",
          kMaxDeviceTopLogprobs, " top logprobs (asked: ", r.params.logprobs.value_or(0), ")"));
    }
  }
  packer_.Pack(rows, &packed_);
  const int num_rows = static_cast<int>(rows.size());
  if (num_rows == 0) return absl::OkStatus();
  const size_t rows_bytes = packed_.rows.size() * sizeof(PackedSamplingRow);
  const size_t entries_offset = AlignUp(rows_bytes, 16);
  const size_t bytes = entries_offset + packed_.entries.size() * sizeof(PackedPenaltyEntry);
  EXL3_RETURN_IF_ERROR(upload_.Reserve(AlignUp(bytes, sizeof(float)) / sizeof(float)));
  unsigned char* host = reinterpret_cast<unsigned char*>(upload_.get());
  std::memcpy(host, packed_.rows.data(), rows_bytes);
  if (!packed_.entries.empty()) {
    std::memcpy(host + entries_offset, packed_.entries.data(),
                packed_.entries.size() * sizeof(PackedPenaltyEntry));
  }
  EXL3_RETURN_IF_ERROR(device_in_.Reserve(bytes));
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(device_in_.get(), host, bytes, cudaMemcpyHostToDevice, Stream(stream)));

  const size_t words = static_cast<size_t>(num_rows) * OutputWordsPerRow(packed_.max_top);
  EXL3_RETURN_IF_ERROR(device_out_.Reserve(words));
  EXL3_RETURN_IF_ERROR(results_.Reserve(words));
  const auto* d_rows = reinterpret_cast<const PackedSamplingRow*>(device_in_.get());
  auto* d_entries = reinterpret_cast<PackedPenaltyEntry*>(device_in_.get() + entries_offset);
  EXL3_RETURN_IF_ERROR(SampleRows(logits, vocab_size_, num_rows, d_rows, d_entries, packed_.max_top,
                                  device_out_.get(), stream));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(results_.get(), device_out_.get(), words * sizeof(uint32_t),
                                            cudaMemcpyDeviceToHost, Stream(stream)));
  return absl::OkStatus();
}

void DeviceSampler::Collect(std::span<SampledToken> tokens) const {
  const size_t stride = OutputWordsPerRow(packed_.max_top);
  const auto* words = reinterpret_cast<const uint32_t*>(results_.get());
  for (size_t i = 0; i < tokens.size() && i < packed_.rows.size(); ++i) {
    tokens[i] = UnpackSampledRow(std::span<const uint32_t>(words + i * stride, stride), packed_.rows[i]);
  }
}

}  // namespace exl3::engine::cuda
