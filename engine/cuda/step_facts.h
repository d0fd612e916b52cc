// A step's per-token facts on the device, as every layer of the CUDA model reads them: token ids,
// positions, the first position each may see, cache slots, block tables, the rows whose logits
// are wanted, RoPE's angles, the attention's split-K layout and its runs of prefill and decode
// tokens. Packed on the host into one int32 array, to which the mixer kinds append their own
// facts (engine/cuda/cuda_mixer.h PackStep), and copied to the device in one transfer. A decode
// graph keeps an array of its own (its launches hold that array's addresses).
//
//   StepFacts facts(cfg, split_shape);
//   facts.SetCache(shape);
//   EXL3_RETURN_IF_ERROR(facts.Pack(tokens, StepLayout{T, 0, 0}));
//   ... kinds append to facts.host() ...
//   EXL3_ASSIGN_OR_RETURN(const CudaStep* step, facts.Upload(&device, stream));
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_array.h"
#include "engine/config/model_config.h"
#include "engine/cpu/rope.h"
#include "engine/core/step_tokens.h"

namespace exl3::engine::cuda {

// Consecutive tokens of the step as attention runs them: a prefill chunk of one sequence (the
// tensor-core prefill kernel) or decode-like tokens (the paged decode kernel).
struct AttentionRun {
  int first_token = 0, num_tokens = 0;
  bool prefill = false;
};

// What a step gives every layer; device pointers unless said.
struct CudaStep {
  int rows = 0;  // the step's tokens, or a decode graph's bucket (padding rows after them)
  const int32_t *ids = nullptr, *position = nullptr, *first_visible = nullptr, *slot = nullptr,
                *table_offset = nullptr, *tables = nullptr;  // [rows] each; tables: every block table
  const int32_t* logit_rows = nullptr;       // [logit rows]: the rows whose logits are wanted
  const int32_t* split_positions = nullptr;  // one int32: positions per attention split
  const float *cos = nullptr, *sin = nullptr;  // [rows, rotary_half]
  int rotary_half = 0;
  int block_size = 16;
  int splits = 1;  // attention splits (split-K)
  int sm_count = 1;
  bool tensor_core_prefill = true;
  std::vector<AttentionRun> attention_runs;  // host

  // Rows [first, ...)'s positions, windows and block tables.
  AttentionTokens attention_tokens(int first = 0) const {
    return AttentionTokens{position + first, first_visible + first, table_offset + first, tables, block_size};
  }
};

// How Pack lays the step out.
struct StepLayout {
  int rows = 0;          // the step's tokens, or a decode graph's bucket (padded)
  int table_stride = 0;  // 0: the chunks' block tables packed; else chunk c's at c * stride
  int splits = 0;        // attention splits; 0: chosen from the step's longest context
};

// How attention splits a token's positions (split-K): enough blocks to fill the GPU twice.
struct SplitShape {
  int blocks_per_token = 1;   // attention blocks of one token and split
  int max_positions = 1 << 30;  // the most positions a token attends to (DSA: index_topk)
};

class StepFacts {
 public:
  StepFacts(const ModelConfig& cfg, SplitShape split, int sm_count, bool tensor_core_prefill);

  void SetCache(const KvCacheShape& shape) { cache_ = shape; }
  // The cache's spare block (allocated one past the engine's): decode graphs' padding rows write there.
  int padding_block() const { return cache_.num_blocks; }
  // Attention splits of a decode graph of `rows` rows (fixed at capture).
  int DecodeSplits(int rows) const;

  // The step's facts into host(), as `layout` says.
  absl::Status Pack(const StepTokens& tokens, const StepLayout& layout);
  // The packed array; mixer kinds append their facts after Pack and before Upload.
  std::vector<int32_t>& host() { return host_; }
  // Copies host() into `device` (grown as needed) and points step() there.
  absl::StatusOr<const CudaStep*> Upload(DeviceArray<int32_t>* device, StreamHandle stream);
  // Where eager steps' facts go (a decode graph has its own array: its launches hold its address).
  DeviceArray<int32_t>* eager_device() { return &eager_device_; }
  const CudaStep& step() const { return step_; }

 private:
  int SplitsFor(int rows, int longest_span) const;
  void PlanAttention(const StepTokens& tokens, int rows);

  const ModelConfig& cfg_;
  Rope rope_;
  SplitShape split_;
  bool prefill_kernel_;
  KvCacheShape cache_;
  std::vector<int32_t> host_;
  DeviceArray<int32_t> eager_device_;
  // Where Pack put each part (ints from the array's start).
  size_t logit_rows_at_ = 0, split_at_ = 0, tables_at_ = 0, cos_at_ = 0, sin_at_ = 0;
  CudaStep step_;
};

}  // namespace exl3::engine::cuda
