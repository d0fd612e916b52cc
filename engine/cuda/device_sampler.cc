#include "engine/cuda/device_sampler.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/sampling_kernels.h"
#include "engine/sampling/token_constraint.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {
namespace {

cudaStream_t Stream(StreamHandle s) { return static_cast<cudaStream_t>(s); }

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

DeviceSampler::DeviceSampler(int vocab_size) : vocab_size_(vocab_size), packer_(vocab_size) {}

bool DeviceSampler::Supports(const SamplingParams& params) {
  // logit_bias is applied by the host's Sampler only: such steps are sampled on the host
  // (engine/core/engine.cc RunForward).
  return (!params.logprobs.has_value() || *params.logprobs <= kMaxDeviceTopLogprobs) && params.logit_bias.empty();
}

absl::Status DeviceSampler::Launch(float* logits, std::span<const RowSampling> rows,
                                   StreamHandle stream) {
  for (const RowSampling& r : rows) {
    if (!Supports(r.params)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the device sampler takes no logit_bias and reports at most ",
          kMaxDeviceTopLogprobs, " top logprobs (asked: ", r.params.logprobs.value_or(0), ")"));
    }
  }
  packer_.Pack(rows, &packed_);
  const int num_rows = static_cast<int>(rows.size());
  masked_rows_.clear();
  if (num_rows == 0) return absl::OkStatus();
  // A mask that leaves no token (the scheduler fails such a row and ignores its token) is not
  // applied: the kernels never see a row of -inf.
  for (int i = 0; i < num_rows; ++i) {
    const SequenceHistory& h = rows[i].history;
    if (!h.allowed_tokens.empty() && TokenConstraint::AllowsAnyToken(h.allowed_tokens, h.banned_tokens))
      masked_rows_.push_back(i);
  }
  // Upload: rows | entries | masked row ids | masks (ceil(vocab / 32) words each).
  const size_t words = (static_cast<size_t>(vocab_size_) + 31) / 32;
  const size_t rows_bytes = packed_.rows.size() * sizeof(PackedSamplingRow);
  const size_t entries_offset = AlignUp(rows_bytes, 16);
  const size_t ids_offset = AlignUp(entries_offset + packed_.entries.size() * sizeof(PackedPenaltyEntry), 16);
  const size_t masks_offset = AlignUp(ids_offset + masked_rows_.size() * sizeof(int32_t), 16);
  const size_t bytes = masks_offset + masked_rows_.size() * words * sizeof(uint32_t);
  EXL3_RETURN_IF_ERROR(upload_.Reserve(AlignUp(bytes, sizeof(float)) / sizeof(float)));
  unsigned char* host = reinterpret_cast<unsigned char*>(upload_.get());
  std::memcpy(host, packed_.rows.data(), rows_bytes);
  if (!packed_.entries.empty()) {
    std::memcpy(host + entries_offset, packed_.entries.data(),
                packed_.entries.size() * sizeof(PackedPenaltyEntry));
  }
  if (!masked_rows_.empty()) {
    std::memcpy(host + ids_offset, masked_rows_.data(), masked_rows_.size() * sizeof(int32_t));
    auto* masks = reinterpret_cast<uint32_t*>(host + masks_offset);
    for (size_t m = 0; m < masked_rows_.size(); ++m) {
      // Words past the mask's end allow nothing (Sampler::ApplyAllowedMask).
      const std::span<const uint32_t> allowed = rows[masked_rows_[m]].history.allowed_tokens;
      const size_t n = std::min(words, allowed.size());
      std::memcpy(masks + m * words, allowed.data(), n * sizeof(uint32_t));
      std::fill(masks + m * words + n, masks + (m + 1) * words, 0u);
    }
  }
  EXL3_RETURN_IF_ERROR(device_in_.Reserve(bytes));
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(device_in_.get(), host, bytes, cudaMemcpyHostToDevice, Stream(stream)));
  if (!masked_rows_.empty()) {
    EXL3_RETURN_IF_ERROR(masked_logits_.Reserve(masked_rows_.size() * static_cast<size_t>(vocab_size_)));
    EXL3_RETURN_IF_ERROR(MaskRows(logits, vocab_size_, static_cast<int>(masked_rows_.size()),
                                  reinterpret_cast<const int32_t*>(device_in_.get() + ids_offset),
                                  reinterpret_cast<const uint32_t*>(device_in_.get() + masks_offset),
                                  static_cast<int>(words), masked_logits_.get(), stream));
  }

  const size_t out_words = static_cast<size_t>(num_rows) * OutputWordsPerRow(packed_.max_top);
  EXL3_RETURN_IF_ERROR(device_out_.Reserve(out_words));
  EXL3_RETURN_IF_ERROR(results_.Reserve(out_words));
  const auto* d_rows = reinterpret_cast<const PackedSamplingRow*>(device_in_.get());
  auto* d_entries = reinterpret_cast<PackedPenaltyEntry*>(device_in_.get() + entries_offset);
  EXL3_RETURN_IF_ERROR(SampleRows(logits, vocab_size_, num_rows, d_rows, d_entries, packed_.max_top,
                                  device_out_.get(), stream));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(results_.get(), device_out_.get(), out_words * sizeof(uint32_t),
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

absl::Status DeviceSampler::MaskedRow(int row, std::span<float> logits, StreamHandle stream) const {
  const auto it = std::find(masked_rows_.begin(), masked_rows_.end(), row);
  if (it == masked_rows_.end())
    return absl::NotFoundError(absl::StrCat("MaskedRow: row ", row, " of the last step had no mask"));
  if (logits.size() != static_cast<size_t>(vocab_size_))
    return absl::InvalidArgumentError(absl::StrCat("MaskedRow: ", logits.size(), " floats for a row of ", vocab_size_));
  const size_t m = static_cast<size_t>(it - masked_rows_.begin());
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits.data(), masked_logits_.get() + m * vocab_size_,
                                            logits.size() * sizeof(float), cudaMemcpyDeviceToHost, Stream(stream)));
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(Stream(stream)));
  return absl::OkStatus();
}

}  // namespace exl3::engine::cuda
