// Sampling a step's logit rows where they are, on the GPU (engine/cuda/sampling_kernels.h), so
// that only tokens and the logprobs asked for come back: one small host-to-device copy of the
// rows' packed parameters (engine/sampling/sampling_pack.h), one kernel, one small device-to-host copy.
// The same tokens and logprobs as the CPU sampler (engine/sampling/sampler.h) on the same logits.
//
//   DeviceSampler sampler(vocab_size);
//   EXL3_RETURN_IF_ERROR(sampler.Launch(d_logits, rows, stream));  // queued on `stream`
//   ... synchronise the stream ...
//   sampler.Collect(tokens);                                        // tokens[i]: row i's
//
// Buffers grow to the largest step seen and are reused; nothing of it runs inside a captured
// graph (the CUDA model launches it after a decode graph's replay).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/pinned_buffer.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/sampling_pack.h"

namespace exl3::engine::cuda {

class DeviceSampler {
 public:
  explicit DeviceSampler(int vocab_size);

  // Whether rows of `params` can be sampled here: at most kMaxDeviceTopLogprobs top logprobs and no
  // logit_bias (the host samples those steps). A constrained row brings its mask in its history.
  static bool Supports(const SamplingParams& params);

  // Queues on `stream` the upload of the rows' parameters and constraint masks
  // (history.allowed_tokens), the masks' application, the sampling of logit rows
  // [0, rows.size()) of `logits` (device, [rows, vocab] fp32; overwritten where masks, bans and
  // penalties apply) and the copy of the results to the host. Every row must be Supported.
  absl::Status Launch(float* logits, std::span<const RowSampling> rows, StreamHandle stream);
  // The last Launch's results, once its stream has been synchronised; tokens.size() == its rows.
  void Collect(std::span<SampledToken> tokens) const;
  // After the last Launch (synchronising `stream`): row `row`'s logits as its mask left them,
  // before bans and penalties; NOT_FOUND for a row that had no mask. logits.size() == vocab.
  absl::Status MaskedRow(int row, std::span<float> logits, StreamHandle stream) const;

 private:
  const int vocab_size_;
  SamplingPacker packer_;
  PackedSampling packed_;
  PinnedBuffer upload_;                  // rows, then entries (PinnedBuffer counts floats)
  DeviceArray<uint8_t> device_in_;
  DeviceArray<uint32_t> device_out_;
  PinnedBuffer results_;                 // OutputWordsPerRow(max_top) words per row
  std::vector<int32_t> masked_rows_;     // the last Launch's rows with a mask, in row order
  DeviceArray<float> masked_logits_;     // [masked rows, vocab]: those rows after their masks
};

}  // namespace exl3::engine::cuda
