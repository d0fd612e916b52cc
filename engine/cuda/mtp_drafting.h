// Speculative method mtp on the GPU model (engine/cuda/cuda_model.h): the checkpoint's MTP drafter,
// loaded from the model's directory when the engine enables it, the states the model's last step
// kept for it, and the draft loop of ProposeMtpDrafts (engine/core/model_runner.h MtpSpan), as the
// CPU model drafts (engine/cpu/cpu_model.cc). Two kinds of drafter:
//   * a next-token MTP head (engine/cuda/cuda_mtp_drafter.h), chained for more than one draft;
//     the model keeps each position's head input or its residual streams for it;
//   * DeepSeek-V4's DSPARK block drafter (engine/cuda/cuda_dspark_drafter.h): the model keeps each
//     position's taps (the stream mean of each tapped layer's output, TapSlot); per span the
//     kept positions' main-kv rows are written into the drafter's row cache, and a decoding span
//     gets one block draft, as many of its drafts as its confidence head keeps (up to num_drafts).
//
//   CudaMtpDrafting mtp(cfg, dir, parts, device);        // at the model's load: nothing read yet
//   EXL3_RETURN_IF_ERROR(mtp.Check());                    // the design and its tensors, by name
//   EXL3_RETURN_IF_ERROR(mtp.Enable());                   // loads the layer
//   // a step with StepBatch::keep_hidden_states:
//   mtp.BeginStep(); EXL3_RETURN_IF_ERROR(mtp.ReserveKept(T)); ... the model writes kept_rows() ...
//   mtp.RecordKept(batch);                                // once the step succeeded
//   EXL3_ASSIGN_OR_RETURN(auto drafts, mtp.ProposeDrafts(spans, cache_shape));
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "engine/core/kept_chunks.h"
#include "engine/core/model_runner.h"
#include "engine/core/step_tokens.h"
#include "engine/cuda/cuda_dspark_drafter.h"
#include "engine/cuda/cuda_mtp_drafter.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/device_context.h"
#include "engine/cuda/device_sampler.h"

namespace exl3::engine::cuda {

class CudaMtpDrafting {
 public:
  // `parts` and `device` are the model's and outlive this.
  CudaMtpDrafting(const ModelConfig& cfg, std::string dir, const CudaMtpModelParts& parts, DeviceContext* device)
      : cfg_(cfg), dir_(std::move(dir)), parts_(parts), device_(device) {}

  absl::Status Check() const;
  // Loads the drafter (once). Its cache layer is sized by the next AllocateCache.
  absl::Status Enable();
  bool enabled() const { return drafter_ != nullptr || dspark_ != nullptr; }
  // What a keeping step keeps of each position for the enabled drafter: the head's input, the
  // residual streams (a next-token head's MtpInput), or the DSPARK drafter's taps.
  enum class Kept { kHeadInput, kStreams, kTaps };
  Kept kept() const;
  // Of the enabled drafter: the floats kept per position, its cache layer's bytes per token.
  int state_width() const { return dspark_ != nullptr ? dspark_->tap_width() : drafter_->state_width(); }
  int64_t KvBytesPerToken() const {
    return dspark_ != nullptr ? dspark_->KvBytesPerToken() : drafter_->KvBytesPerToken();
  }
  // Kept::kTaps: the slot (of hidden floats in a position's kept row) of layer `layer`'s tap, or -1
  // where it is not tapped; -1 for the other kinds.
  int TapSlot(int layer) const;
  // The drafter's cache layer; nothing while not enabled.
  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle stream);

  // Every step forgets the last one's kept states; a keeping step records its own once it succeeded.
  void BeginStep() { kept_.chunks.Clear(); }
  // Before a step of T rows that keeps its states: room for them and, for a head-input drafter,
  // the identity rows [T] that make every row's head input (all_rows()).
  absl::Status ReserveKept(int T);
  float* kept_rows() { return kept_.rows.get(); }
  const int32_t* all_rows() const { return all_rows_.get(); }
  void RecordKept(const StepBatch& batch);

  // Each span's greedy drafts, in span order: num_drafts of them (a block drafter: at most that
  // many, as many as its confidence keeps, maybe none).
  absl::StatusOr<std::vector<std::vector<int32_t>>> ProposeDrafts(std::span<const MtpSpan> spans,
                                                                   const KvCacheShape& shape);

 private:
  // The last step's states the drafter reads: rows [T, width] in step order, where each chunk's start.
  struct KeptStates {
    DeviceArray<float> rows;
    KeptChunks chunks;  // cleared unless the last step kept them and succeeded
  };
  // The drafter's batch over `spans` of the kept step, its states gathered into in_.
  absl::Status BatchOf(std::span<const MtpSpan> spans, StepBatch* batch);
  // Runs the drafter over `batch` (states in in_, output into out_) and its logit rows' greedy tokens
  // into *tokens.
  absl::Status RunStep(const StepBatch& batch, const KvCacheShape& shape, StepTokens* step_tokens,
                       std::vector<int32_t>* tokens);
  // ProposeDrafts with the DSPARK drafter: every span's kept positions' rows written, one block
  // draft per decoding span.
  absl::StatusOr<std::vector<std::vector<int32_t>>> ProposeBlockDrafts(std::span<const MtpSpan> spans);

  const ModelConfig& cfg_;
  const std::string dir_;
  const CudaMtpModelParts parts_;
  DeviceContext* device_;
  std::unique_ptr<CudaMtpDrafter> drafter_;  // a next-token head: null until Enable
  std::unique_ptr<CudaDsparkDrafter> dspark_;  // or DeepSeek-V4's block drafter
  std::unique_ptr<DeviceSampler> sampler_;   // greedy (a next-token head's)
  KeptStates kept_;
  DeviceArray<int32_t> all_rows_;
  DeviceArray<float> in_, out_, logits_;  // the drafter's states in and out [rows, width], logits
};

}  // namespace exl3::engine::cuda
