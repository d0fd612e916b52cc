#include "engine/cuda/step_facts.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "base/status_macros.h"
#include "engine/cpu/attention/attention.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {

StepFacts::StepFacts(const ModelConfig& cfg, SplitShape split, int sm_count, bool tensor_core_prefill)
    : cfg_(cfg),
      rope_(cfg.rope, cfg.max_position_embeddings),
      split_(split),
      prefill_kernel_(tensor_core_prefill && PrefillAttentionSupports(cfg.head_dim)) {
  step_.sm_count = sm_count;
  step_.tensor_core_prefill = tensor_core_prefill;
  step_.rotary_half = rope_.rotary_dim() / 2;
}

int StepFacts::DecodeSplits(int rows) const {
  return DecodeAttentionSplits(rows, split_.blocks_per_token, step_.sm_count);
}

int StepFacts::SplitsFor(int rows, int span) const {
  // Split-K: enough blocks to fill the GPU twice, each split at least 64 positions long.
  const int blocks = rows * split_.blocks_per_token;
  const int splits = std::max(1, std::min((2 * step_.sm_count + blocks - 1) / blocks, (span + 63) / 64));
  const int per = (span + splits - 1) / splits;
  return (span + per - 1) / per;
}

absl::Status StepFacts::Pack(const StepTokens& tokens, const StepLayout& layout) {
  const int T = tokens.num_tokens, Tp = layout.rows;
  const bool padded = layout.table_stride > 0;
  const int R = padded ? Tp : static_cast<int>(tokens.logit_tokens.size());
  const int half = step_.rotary_half, bs = cache_.block_size;
  const StepBatch& batch = *tokens.batch;
  int table_ints = 0;
  if (padded) {
    table_ints = Tp * layout.table_stride;
  } else {
    for (const SequenceChunk& c : batch.chunks) table_ints += static_cast<int>(c.block_table.size());
  }
  // Layout: ids, position, first_visible, slot, table_offset [Tp] | logit_rows [R] |
  // split_positions [1] | tables | cos, sin [Tp, half] (float bits).
  const size_t tp = static_cast<size_t>(Tp);
  logit_rows_at_ = 5 * tp;
  split_at_ = logit_rows_at_ + R;
  tables_at_ = split_at_ + 1;
  cos_at_ = tables_at_ + table_ints;
  sin_at_ = cos_at_ + tp * half;
  host_.assign(sin_at_ + tp * half, 0);
  int32_t* ids = host_.data();
  int32_t* position = ids + Tp;
  int32_t* first = position + Tp;
  int32_t* slot = first + Tp;
  int32_t* table_offset = slot + Tp;
  int32_t* logit_rows = host_.data() + logit_rows_at_;
  int32_t* tables = host_.data() + tables_at_;
  float* cos = reinterpret_cast<float*>(host_.data() + cos_at_);
  float* sin = reinterpret_cast<float*>(host_.data() + sin_at_);
  std::vector<int32_t> chunk_offset(batch.chunks.size());
  int off = 0;
  for (size_t c = 0; c < batch.chunks.size(); ++c) {
    chunk_offset[c] = padded ? static_cast<int>(c) * layout.table_stride : off;
    std::copy(batch.chunks[c].block_table.begin(), batch.chunks[c].block_table.end(), tables + chunk_offset[c]);
    off += static_cast<int>(batch.chunks[c].block_table.size());
  }
  int span = 1;
  RopeAngles angles;
  for (int t = 0; t < Tp; ++t) {
    const bool real = t < T;
    const int pos = real ? tokens.positions[t] : 0;
    ids[t] = real ? tokens.token_ids[t] : 0;
    position[t] = pos;
    first[t] = FirstVisiblePosition(pos, cfg_.sliding_window);
    if (real) {
      const std::vector<int32_t>& table = tokens.block_table(t);
      slot[t] = table[pos / bs] * bs + pos % bs;
      table_offset[t] = chunk_offset[tokens.chunk_of[t]];
      span = std::max(span, pos - first[t] + 1);
    } else {  // a padding row of a decode graph: position 0 of the spare block
      slot[t] = padding_block() * bs;
      table_offset[t] = t * layout.table_stride;
      tables[table_offset[t]] = padding_block();
    }
    rope_.Angles(pos, real ? tokens.seq_len_after[t] : 1, &angles);
    std::copy(angles.cos.begin(), angles.cos.end(), cos + static_cast<size_t>(t) * half);
    std::copy(angles.sin.begin(), angles.sin.end(), sin + static_cast<size_t>(t) * half);
  }
  if (padded) {
    // A graph's step: every row's logits (a decode step's one token per chunk and padding rows, a
    // verify step's every token), so row r is token r.
    for (int r = 0; r < R; ++r) logit_rows[r] = r;
  } else {
    std::copy(tokens.logit_tokens.begin(), tokens.logit_tokens.end(), logit_rows);
  }
  // A layer attending to at most max_positions chosen positions (DSA): splits of the whole span
  // would leave all but the first few idle.
  span = std::min(span, split_.max_positions);
  step_.splits = layout.splits > 0 ? layout.splits : SplitsFor(Tp, span);
  host_[split_at_] = (span + step_.splits - 1) / step_.splits;
  step_.rows = Tp;
  step_.block_size = bs;
  PlanAttention(tokens, Tp);
  return absl::OkStatus();
}

void StepFacts::PlanAttention(const StepTokens& tokens, int rows) {
  std::vector<AttentionRun>& runs = step_.attention_runs;
  runs.clear();
  int t = 0;
  for (const SequenceChunk& c : tokens.batch->chunks) {  // tokens are flattened chunk by chunk
    const int n = static_cast<int>(c.tokens.size());
    if (n == 0) continue;
    const bool prefill = prefill_kernel_ && n >= kPrefillMinTokens;
    if (!prefill && !runs.empty() && !runs.back().prefill) {
      runs.back().num_tokens += n;  // decode-like tokens of consecutive chunks: one launch
    } else {
      runs.push_back({t, n, prefill});
    }
    t += n;
  }
  // A decode graph's padding rows (each its own one-position sequence) join the last decode run.
  if (rows > t) {
    if (!runs.empty() && !runs.back().prefill) {
      runs.back().num_tokens += rows - t;
    } else {
      runs.push_back({t, rows - t, false});
    }
  }
}

absl::StatusOr<const CudaStep*> StepFacts::Upload(DeviceArray<int32_t>* device, StreamHandle stream) {
  EXL3_RETURN_IF_ERROR(device->Reserve(host_.size()));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device->get(), host_.data(), host_.size() * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
  const int32_t* d = device->get();
  const size_t tp = static_cast<size_t>(step_.rows);
  step_.ids = d;
  step_.position = d + tp;
  step_.first_visible = d + 2 * tp;
  step_.slot = d + 3 * tp;
  step_.table_offset = d + 4 * tp;
  step_.logit_rows = d + logit_rows_at_;
  step_.split_positions = d + split_at_;
  step_.tables = d + tables_at_;
  step_.cos = reinterpret_cast<const float*>(d + cos_at_);
  step_.sin = reinterpret_cast<const float*>(d + sin_at_);
  return &step_;
}

}  // namespace exl3::engine::cuda
