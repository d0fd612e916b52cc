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

#include "absl/status/status.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/pinned_buffer.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/sampling_pack.h"

namespace exl3::engine::cuda {

class DeviceSampler {
 public:
  explicit DeviceSampler(int vocab_size);

  // Whether rows of `params` can be sampled here: at most kMaxDeviceTopLogprobs top logprobs, no
  // logit_bias and no constraint (the host samples those steps).
  static bool Supports(const SamplingParams& params);

  // Queues on `stream` the upload of the rows' parameters, the sampling of logit rows
  // [0, rows.size()) of `logits` (device, [rows, vocab] fp32; overwritten where bans and
  // penalties apply) and the copy of the results to the host. Every row must be Supported.
  absl::Status Launch(float* logits, std::span<const RowSampling> rows, StreamHandle stream);
  // The last Launch's results, once its stream has been synchronised; tokens.size() == its rows.
  void Collect(std::span<SampledToken> tokens) const;

 private:
  const int vocab_size_;
  SamplingPacker packer_;
  PackedSampling packed_;
  PinnedBuffer upload_;                  // rows, then entries (PinnedBuffer counts floats)
  DeviceArray<uint8_t> device_in_;
  DeviceArray<uint32_t> device_out_;
  PinnedBuffer results_;                 // OutputWordsPerRow(max_top) words per row
};

}  // namespace exl3::engine::cuda
