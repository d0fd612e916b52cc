// DeepSeek-V4's MTP component, the DSPARK block drafter (the checkpoint's mtp.* tensors), on the
// GPU: the CPU engine's engine/cpu/mtp/dspark_drafter.h (docs/dspark.md says what it computes) on
// device memory, built from the GPU engine's own blocks. It is not a next-token head: one forward
// over a block [seed, noise, ..., noise] drafts a whole block, so it does not implement
// CudaMtpDrafter (engine/cuda/cuda_mtp_drafter.h) but this interface of its own, which
// CudaMtpDrafting (engine/cuda/mtp_drafting.h) drives for speculative method mtp.
//
//   main-kv rows   x = main_norm(main_proj · taps), then per block i rope_p(kv_norm_i(wkv_i · x)),
//                  written into the drafter's row cache (one more cache layer: per block one row of
//                  head_dim fp32 per position, paged by the sequence's block table as a sliding
//                  layer's kv is: engine/cuda/dsv4_attention_kernels.h Dsv4WriteSlots), so the rows
//                  live on the device per sequence, in its blocks, like the CPU engine's cache layer
//   block forward  the block embedded (the model's embeddings) into hc_mult streams; per block i
//                  hc_attn (HyperCollapse / HyperExpand), the attention (CudaLinear wq_a, q_norm,
//                  wq_b; Dsv4RotateTail; the block's own kv rows; DsparkGatherKeys puts the last
//                  min(sliding_window, p0) history rows and the block's rows in one run per draft,
//                  which Dsv4Attend reads as a one-block cache so that every block query sees all
//                  of them, non-causally, with the head's sink; the grouped wo_a as one batched
//                  cuBLAS product; wo_b), hc_ffn and the MoE (CudaMtpMoe, layer num_hidden_layers
//                  + i, tensors under "mtp.i."); then hc_head (HyperHeadCollapse), the final norm
//                  and the model's head
//   drafts         the greedy Markov loop and the confidence head (DsparkMarkovStep,
//                  engine/cuda/dspark_kernels.h); the draft length (the longest prefix with a
//                  confidence logit >= 0) on the host
//
// Activations fp32 as on the CPU. Every launch goes on the model's stream (CudaMtpModelParts);
// Run synchronises once, at its end, to return the drafts.
//
//   EXL3_ASSIGN_OR_RETURN(auto d, CudaDsparkDrafter::Load(cfg, src, parts));
//   EXL3_RETURN_IF_ERROR(d->AllocateCache(shape, stream));
//   EXL3_ASSIGN_OR_RETURN(std::vector<DsparkDraft> drafts, d->Run(writes, calls, /*want_logits=*/false));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "engine/core/model_runner.h"
#include "engine/cpu/mtp/dspark_drafter.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/cuda_mtp_drafter.h"
#include "engine/cuda/cuda_mtp_moe.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/dspark_kernels.h"
#include "engine/cuda/hyper_residual.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// One sequence's kept positions whose main-kv rows a Run writes.
struct DsparkRowWrite {
  const float* taps = nullptr;  // device [num_positions, tap_width()]: the positions' taps
  int start_position = 0;
  int num_positions = 0;
  const std::vector<int32_t>* block_table = nullptr;  // covers every position written
};

// One block draft: seed at position p0, reading the rows of positions p0 - min(window(), p0) .. p0 - 1.
struct DsparkDraftCall {
  int32_t seed = 0;
  int p0 = 0;
  const std::vector<int32_t>* block_table = nullptr;  // covers every position read
};

class CudaDsparkDrafter {
 public:
  // `cfg`: the model's (cfg.dsv4->dspark enabled()); parts: the model's embeddings, head and stream.
  static absl::StatusOr<std::unique_ptr<CudaDsparkDrafter>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                                 const CudaMtpModelParts& parts);
  CudaDsparkDrafter(const CudaDsparkDrafter&) = delete;
  CudaDsparkDrafter& operator=(const CudaDsparkDrafter&) = delete;

  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  int row_width() const { return shape_.head_dim; }  // D: one main-kv row per block and position
  int tap_width() const { return shape_.tap_width; }  // taps * hidden
  int block_size() const { return shape_.block_size; }
  int window() const { return shape_.window; }
  // The tapped trunk layers; tap k (the stream mean of layer tap_layers()[k]'s output) is the k-th
  // hidden-size slice of a position's taps.
  const std::vector<int>& tap_layers() const { return tap_layers_; }

  // The row cache for `shape` (every block's rows of every cache block, one spare block).
  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle stream);
  int64_t KvBytesPerToken() const { return static_cast<int64_t>(num_blocks()) * shape_.head_dim * sizeof(float); }

  // Writes every write's rows, then runs every call's block draft (in one forward of all calls'
  // blocks), and returns each call's drafts, confidence logits and length (logits only with
  // want_logits: the head's plus the Markov bias, [block_size, vocab]). Synchronises at its end.
  absl::StatusOr<std::vector<DsparkDraft>> Run(std::span<const DsparkRowWrite> writes,
                                               std::span<const DsparkDraftCall> calls, bool want_logits);
  // Tests: block `block`'s rows [n, D] of positions first .. first + n - 1 of the sequence whose
  // blocks `block_table` names, after the stream's work so far.
  absl::StatusOr<std::vector<float>> ReadRows(int block, const std::vector<int32_t>& block_table, int first, int n);

 private:
  struct Block {
    DeviceArray<float> attn_norm, ffn_norm, q_norm, kv_norm, sinks;
    CudaLinear wq_a, wq_b, wkv, wo_b;
    DeviceArray<float> wo_a;  // [G * o_lora_rank, heads * D / G] fp32, decoded as the CPU decodes it
    HyperConnectionWeights hc_attn, hc_ffn;
    std::optional<CudaMtpMoe> moe;
  };
  // The device facts of one Run (offsets into host_ / facts_, in int32 units).
  struct Layout {
    size_t tables = 0, write_position = 0, write_first = 0, write_table = 0, write_cos = 0, write_sin = 0;
    size_t ids = 0, block_cos = 0, block_sin = 0, call_table = 0, call_p0 = 0, call_hist = 0;
    size_t key_position = 0, key_first = 0, key_table = 0, key_tables = 0, tokens = 0;
  };
  CudaDsparkDrafter(ModelConfig cfg, const CudaMtpModelParts& parts) : cfg_(std::move(cfg)), parts_(parts) {}
  // The view of block i's rows in the row cache.
  Dsv4CacheView RowsView(int block) const;
  // Rope angles of `position` (the trunk's main rope, as DsparkDrafter: theta^(-2j/rd) in double)
  // appended to cos / sin.
  void Angles(int position, std::vector<float>* cos, std::vector<float>* sin) const;
  // Packs and uploads the Run's facts; *key_rows: the key run of each draft.
  absl::StatusOr<Layout> Upload(std::span<const DsparkRowWrite> writes, std::span<const DsparkDraftCall> calls,
                                int* key_rows);
  absl::Status Reserve(int written, int drafts, int key_rows);
  // rows [n, D] = rope(kv_norm(wkv · h)) of block b at the angles cos / sin [n, rd / 2].
  absl::Status KvRows(const Block& b, const float* h, int n, const float* cos, const float* sin, float* rows) const;
  // a_ [M, H] = block b's attention of x_ [M, H] for the Run's calls.
  absl::Status Attend(int block, const Layout& at, int num_drafts, int key_rows);

  const ModelConfig cfg_;  // the model's with the blocks as layers num_hidden_layers + i; the MoE keeps references
  const CudaMtpModelParts parts_;
  DsparkShape shape_;
  std::vector<int> tap_layers_;
  CudaLinear main_proj_;
  DeviceArray<float> main_norm_;
  std::vector<Block> blocks_;
  DeviceArray<float> head_fn_, head_base_, norm_;  // the last block's hc_head [hc, hc * H], [hc]; norm [H]
  float head_scale_ = 1.0f;
  DeviceArray<float> markov_w1_, markov_w2_, markov_b2_, conf_w_;
  DsparkHeads heads_args_;  // points into the arrays above
  // The row cache: block i's rows of cache block c, slot j at ((i * blocks + c) * block_size + j) * D.
  DeviceArray<float> rows_;
  int cache_blocks_ = 0, cache_block_size_ = 0;
  // One Run's facts (host_ uploaded into facts_) and buffers, grown to the largest Run.
  std::vector<int32_t> host_;
  DeviceArray<int32_t> facts_;
  DeviceArray<float> taps_, main_x_, kv_, x_, d_, a_, streams_buf_, post_, comb_, q_resid_, q_, keys_, attn_,
      low_rank_, pre_, hn_, logits_, confidence_, partial_max_;
  DeviceArray<double> collapse_scratch_;
  DeviceArray<int32_t> drafts_, partial_arg_;
};

}  // namespace exl3::engine::cuda
