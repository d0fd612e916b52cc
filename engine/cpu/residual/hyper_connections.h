// DeepSeek-V4's manifold-constrained hyper-connections (mHC), as transformers 5.24's
// DeepseekV4HyperConnection and DeepseekV4HyperHead compute them. The residual of each token is
// hc_mult streams [N, hidden] instead of one vector. Before a block (attention or MoE):
//
//   f = RMS-normalised (no weight) concatenation of the N streams        [N * hidden]
//   (pre_w, post_w, comb_w) = fn · f                                     [N], [N], [N * N]
//   pre  = sigmoid(pre_w * scale[0] + base_pre) + hc_eps
//   post = 2 * sigmoid(post_w * scale[1] + base_post)
//   comb = softmax_rows(comb_w * scale[2] + base_comb) + hc_eps, then Sinkhorn: columns
//          normalised once, then (rows, columns) hc_sinkhorn_iters - 1 times (each sum + hc_eps)
//   block input = Σ_n pre[n] * stream[n]
//
// and after it: stream'[k] = post[k] * block_output + Σ_j comb[j][k] * stream[j]. The head
// (`model.hc_head.*`) collapses the streams once more with its own pre weights before the final
// norm. Weights (fp32, as transformers keeps them): model.layers.L.hc_{attn,ffn}_{fn,base,scale},
// model.hc_head.hc_{fn,base,scale}. GLM-5.3-Flash (transformers 5.25's Glm5NextTextHyperConnection)
// mixes its streams the same way; its head is the streams' unweighted mean (HyperHead::Mean).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "model/safetensors.h"

namespace exl3::engine {

struct HyperConnectionShape {
  int hidden = 0;
  int streams = 0;         // hc_mult
  int sinkhorn_iters = 0;  // hc_sinkhorn_iters
  float eps = 0.0f;        // hc_eps
  float norm_eps = 0.0f;   // rms_norm_eps (the streams' unweighted RMS norm)
};

// One block's mixing weights for the tokens of a step, from Collapse, consumed by Expand.
struct HyperConnectionMix {
  std::vector<float> post;  // [T, N]
  std::vector<float> comb;  // [T, N, N]: comb[t][j][k] weighs input stream j into output stream k
};

class HyperConnection {
 public:
  // `prefix`: "model.layers.L.hc_attn_" or "model.layers.L.hc_ffn_".
  static absl::StatusOr<HyperConnection> Load(const TensorSource& src, const std::string& prefix,
                                              const HyperConnectionShape& shape);
  // streams [T, N, hidden] → block input [T, hidden] and the mix Expand needs.
  void Collapse(const float* streams, int num_tokens, float* block_input, HyperConnectionMix* mix,
                CpuCompute& compute) const;
  // streams [T, N, hidden] ← post * block_output [T, hidden] + combᵀ · streams.
  void Expand(const HyperConnectionMix& mix, const float* block_output, int num_tokens,
              float* streams, CpuCompute& compute) const;
  // The weights as loaded (fp32), for the GPU engine's copy (engine/cuda/hyper_connection_kernels.h).
  const std::vector<float>& fn() const { return fn_; }
  const std::vector<float>& base() const { return base_; }
  const std::vector<float>& scale() const { return scale_; }

 private:
  HyperConnectionShape shape_;
  std::vector<float> fn_;     // [(2 + N) * N, N * hidden]
  std::vector<float> base_;   // [(2 + N) * N]
  std::vector<float> scale_;  // [3]
};

// How the head collapses the streams before the final norm.
enum class HyperHeadKind {
  kLearned,  // DeepSeek-V4: sigmoid pre weights from hc_fn / hc_base / hc_scale
  kMean,     // GLM-5.3-Flash: the streams' mean, no weights
};

class HyperHead {
 public:
  static absl::StatusOr<HyperHead> Load(const TensorSource& src, const std::string& prefix,
                                        const HyperConnectionShape& shape);
  static HyperHead Mean(const HyperConnectionShape& shape);
  HyperHeadKind kind() const { return kind_; }
  // streams [T, N, hidden] → [T, hidden] for the rows `rows` (indices of tokens).
  void Collapse(const float* streams, const std::vector<int>& rows, float* out) const;
  const std::vector<float>& fn() const { return fn_; }
  const std::vector<float>& base() const { return base_; }
  float scale() const { return scale_; }

 private:
  HyperConnectionShape shape_;
  HyperHeadKind kind_ = HyperHeadKind::kLearned;
  std::vector<float> fn_;    // [N, N * hidden]
  std::vector<float> base_;  // [N]
  float scale_ = 1.0f;
};

}  // namespace exl3::engine
