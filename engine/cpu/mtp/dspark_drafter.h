// DeepSeek-V4's MTP component, the DSPARK block drafter (the checkpoint's mtp.* tensors), on the
// CPU: what docs/dspark.md states (exllamav3 1.6.5's computation; the fp32 torch reference is
// scripts/conformance/dspark_reference.py). Two entry points:
//
//   * MainKvRows: each block's main-kv row of a position from the trunk's taps there (the mean
//     over the hyper-connection streams of each of dspark_target_layer_ids' outputs, ascending,
//     concatenated [T * H]):  rope_p(kv_norm_i(wkv_i · main_norm(main_proj · taps))).
//   * Draft: one block forward at position p0 over [seed, noise, ..., noise] (dspark_block_size
//     tokens) whose attention sees the last min(sliding_window, p0) main-kv rows before p0 and the
//     whole block non-causally (plus a per-head sink), then hc_head, the final norm, the model's
//     head, the greedy Markov bigram loop (drafts), the confidence head and the draft length (the
//     longest prefix with a confidence logit >= 0).
//
// Linears (main_proj, the attention's, the experts') are EXL3 or dense as stored
// (engine/cpu/linear.h); the MoE is MtpMoe (sqrt-softplus routing of the model, layer index
// num_hidden_layers + i, tensors under "mtp.i."). The embedding and the head are the trunk's.
//
//   EXL3_ASSIGN_OR_RETURN(auto d, DsparkDrafter::Load(cfg, src, embedding, model_head));
//   EXL3_RETURN_IF_ERROR(d->MainKvRows(taps, n, /*first_position=*/0, rows, compute));
//   EXL3_ASSIGN_OR_RETURN(DsparkDraft r, d->Draft(history, hist, seed, p0, compute));
//
// The CPU model (engine/cpu/cpu_model.h) runs it for speculative method mtp: it taps the trunk
// in its layer loop (TapLayer), keeps each position's main-kv rows in one more cache layer, and
// proposes per decoding span one block draft (ProposeDsparkDrafts). The GPU engine's counterpart
// is engine/cuda/cuda_dspark_drafter.h.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/mtp/mtp_moe.h"
#include "engine/cpu/residual/hyper_connections.h"
#include "model/safetensors.h"

namespace exl3::engine {

// The drafter's sizes (docs/dspark.md's notation) from the model's config, as both engines' drafters
// read them (engine/cuda/cuda_dspark_drafter.h).
struct DsparkShape {
  int hidden = 0, heads = 0, head_dim = 0, rope_dim = 0, q_lora_rank = 0, o_groups = 0, o_lora_rank = 0,
      window = 0, streams = 0, vocab = 0, block_size = 0, noise_token = 0, markov_rank = 0, tap_width = 0;
  float eps = 1e-6f, hc_eps = 1e-6f;
  std::vector<double> inv_freq;  // [rope_dim / 2]: the sliding layers' "main" rope, theta^(-2j/rd), no YaRN
  // FAILED_PRECONDITION without a DSPARK drafter in `cfg`; INVALID_ARGUMENT for a noise token outside
  // the vocabulary.
  static absl::StatusOr<DsparkShape> Of(const ModelConfig& cfg);
};

struct DsparkDraft {
  std::vector<int32_t> drafts;     // [block_size]: t_1 .. t_B
  std::vector<float> logits;       // [block_size, vocab]: the head's logits plus the Markov bias of t_j
  std::vector<float> confidence;   // [block_size]: c_j, scoring t_{j+1}
  int length = 0;                  // the longest prefix with c_j >= 0
};

class DsparkDrafter {
 public:
  // `cfg.dsv4->dspark` must be enabled(); `embedding` (the trunk's [vocab, hidden], f32 / f16 /
  // bf16) and `model_head` must outlive the drafter.
  static absl::StatusOr<std::unique_ptr<DsparkDrafter>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                             TensorView embedding, const Linear& model_head);
  DsparkDrafter(const DsparkDrafter&) = delete;
  DsparkDrafter& operator=(const DsparkDrafter&) = delete;

  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  int row_width() const { return shape_.head_dim; }    // D: one main-kv row per block and position
  int tap_width() const { return shape_.tap_width; }   // T * hidden
  int block_size() const { return shape_.block_size; }
  int window() const { return shape_.window; }         // at most this many history rows are read

  // rows[i] [n, D] (block i) of positions first_position .. first_position + n - 1 from their
  // taps [n, T * hidden].
  absl::Status MainKvRows(const float* taps, int n, int first_position, const std::vector<float*>& rows,
                          CpuCompute& compute) const;
  // One draft call at p0 with seed = the token at p0 (not yet cached); history[i] [hist, D] block
  // i's rows of positions p0 - hist .. p0 - 1 (hist <= min(window(), p0); the caller passes
  // min(window(), p0) for exllamav3's drafts).
  absl::StatusOr<DsparkDraft> Draft(const std::vector<const float*>& history, int hist, int seed, int p0,
                                    CpuCompute& compute) const;

 private:
  struct Block {
    std::vector<float> attn_norm, ffn_norm, q_norm, kv_norm, sinks;
    Linear wq_a, wq_b, wkv, wo_b;
    std::vector<Linear> wo_a;  // one per group [o_lora_rank, heads * D / G]
    std::optional<HyperConnection> hc_attn, hc_ffn;
    std::optional<MtpMoe> moe;
  };
  DsparkDrafter() = default;
  // x [n, heads, D] rotated at positions first .. first + n - 1 (sign -1: rotated back), GPT-J
  // pairs of the last rope_dim dims of each head.
  void Rope(float* x, int n, int heads, int first, double sign) const;
  // Main-kv / block rows [n, D]: rope(kv_norm(wkv · h)) at positions first .. first + n - 1.
  absl::Status KvRows(const Block& b, const float* h, int n, int first, float* out, CpuCompute& compute) const;
  absl::Status Attend(const Block& b, const float* h, const float* history, int hist, int p0,
                      float* out, CpuCompute& compute) const;

  DsparkShape shape_;
  Linear main_proj_;
  std::vector<float> main_norm_;
  std::vector<Block> blocks_;
  std::vector<float> head_fn_, head_base_;  // the last block's hc_head [hc, hc * H], [hc]
  float head_scale_ = 1.0f;
  std::vector<float> norm_;
  std::vector<float> markov_w1_, markov_w2_, markov_b2_;  // [V, r], [V, r], [V] or empty
  std::vector<float> conf_w_;                            // [H + r]
  float conf_b_ = 0.0f;
  TensorView embedding_;
  const Linear* head_ = nullptr;
};

}  // namespace exl3::engine
