// Qwen4-Exp's low-rank gated residual hyper-connections (`attn_hyper_connection`,
// `mlp_hyper_connection`, and `hyper_connection_mixer` before the head; docs/engine.md,
// "Qwen4-Exp"), the residual scheme that replaces its layer norms. A token's residual is
// `streams` copies of the hidden state, h [streams, hidden]. Around a block:
//
//   ĥ = RMSNorm of each stream (`hc_norm`, zero-centred weight over streams * hidden)
//   w = sigmoid(up(silu(down(ĥ) / streams)))           down [lowrank, S·H], up [S·H, lowrank]
//   x = mean over streams of w ⊙ ĥ                       the block's input [hidden]
//   inject = 2 · sigmoid(block_inject(ĥ) / streams)    [streams]
//   after the block: h_k ← h_k + inject_k · out         (h as it was, not normalised)
//
// The mixer before the head has no block_inject: its x is the final hidden state (no final norm).
//
//   EXL3_ASSIGN_OR_RETURN(GatedResidual g, GatedResidual::Load(src, prefix, shape, /*inject=*/true));
//   g.Collapse(h, T, x, &inject, compute);   // ... block(x) -> out ...
//   g.Expand(inject, out, T, h);
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear.h"
#include "model/safetensors.h"

namespace exl3::engine {

struct GatedResidualShape {
  int hidden = 0;
  int streams = 0;
  int lowrank = 0;
  float eps = 1e-6f;
};

class GatedResidual {
 public:
  // `prefix` ends with '.', e.g. "model.language_model.layers.3.attn_hyper_connection.";
  // `with_inject`: a block's connection (false: the mixer before the head).
  static absl::StatusOr<GatedResidual> Load(const TensorSource& src, const std::string& prefix,
                                            const GatedResidualShape& shape, bool with_inject);

  // x [T, hidden] from h [T, streams, hidden]; with inject, its weights [T, streams].
  absl::Status Collapse(const float* h, int num_tokens, float* x, std::vector<float>* inject,
                        CpuCompute& compute) const;
  // h_k += inject_k · out for every token and stream.
  void Expand(const std::vector<float>& inject, const float* out, int num_tokens, float* h) const;

 private:
  GatedResidualShape shape_;
  std::vector<float> norm_weight_;  // 1 + w [streams * hidden]
  Linear down_, up_;
  std::optional<Linear> inject_;
};

}  // namespace exl3::engine
