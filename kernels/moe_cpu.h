// One MoE layer's expert MLPs on the CPU in fp32: the reference the fast CPU backend and the CUDA
// kernels are checked against.
//
// Usage:
//   MoeLayerView layer;                       // non-owning; Exl3Model::LayerView() builds one
//   layer.hidden_size = 4096; layer.intermediate_size = 1408; layer.swiglu_limit = 0;
//   layer.experts = {&e0, nullptr, &e2, ...}; // indexed by expert id, null where not held
//   layer.shared = &shared;                   // or null
//   MoeAssignments a = MoeAssignments::Fixed(T, k, ids, weights);   // [T, k] each
//   absl::Status s = MoeForwardReference(layer, x /*[T, hidden]*/, a, /*include_shared=*/true, y);
//
// y[t] = sum over t's (expert, weight) pairs of weight * down(act(gate(x[t])) * up(x[t]))
//        (+ shared(x[t]) with weight 1, Qwen3-Next: times sigmoid(x[t] · shared_gate)),
// act = SiLU; with swiglu_limit L > 0: gate pre-activation clamped to <= L, up clamped to [-L, L].
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/exl3_linear.h"

namespace exl3 {

// One expert's three projections: gate, up [hidden -> intermediate], down [intermediate -> hidden].
struct ExpertMlp {
  Exl3LinearView gate, up, down;
};

// Non-owning view of one MoE layer as the kernels see it.
struct MoeLayerView {
  int hidden_size = 0;
  int intermediate_size = 0;  // routed experts'
  float swiglu_limit = 0.0f;  // 0: no clamp
  std::vector<const ExpertMlp*> experts;  // [num routed experts], null where not held here
  const ExpertMlp* shared = nullptr;      // shared expert MLP (weight 1), or null
  int shared_intermediate_size = 0;
  // The clamp for the shared expert (public implementations differ on whether DeepSeek-V4's
  // shared expert is clamped; Exl3Model sets it to swiglu_limit, callers may override).
  float shared_swiglu_limit = 0.0f;
  const float* shared_gate = nullptr;  // Qwen3-Next: [hidden] fp32 (sigmoid gate), or null

  int num_experts() const { return static_cast<int>(experts.size()); }
};

// Per-token (expert, weight) lists. Token t's pairs are entries offsets[t] .. offsets[t+1]-1 of
// expert_ids/weights; with offsets null, every token has exactly `per_token` pairs (t*per_token..).
// A worker passes only the pairs of its own experts.
struct MoeAssignments {
  int num_tokens = 0;
  const int32_t* expert_ids = nullptr;
  const float* weights = nullptr;
  const int32_t* offsets = nullptr;  // [num_tokens + 1], or null
  int per_token = 0;                 // used when offsets is null

  static MoeAssignments Fixed(int num_tokens, int k, const int32_t* ids, const float* w) {
    return MoeAssignments{num_tokens, ids, w, nullptr, k};
  }
  int begin(int t) const { return offsets ? offsets[t] : t * per_token; }
  int end(int t) const { return offsets ? offsets[t + 1] : (t + 1) * per_token; }
};

// Checks the layer's shapes (every held expert and the shared one match hidden/intermediate) and
// the assignments: expert ids in range and held, weights finite, offsets monotone.
absl::Status ValidateMoeLayer(const MoeLayerView& layer);
absl::Status ValidateAssignments(const MoeLayerView& layer, const MoeAssignments& a);

// act(gate) * up elementwise for `n` values, with the swiglu clamp when limit > 0 (in place on
// gate: gate[i] <- silu(min(gate, L)) * clamp(up, -L, L)).
void SwiGlu(float* gate, const float* up, size_t n, float limit);

// One expert MLP on x [T, hidden] -> y [T, hidden] (overwritten), reference linears.
void ExpertMlpForwardReference(const ExpertMlp& mlp, float swiglu_limit, const float* x,
                               int num_tokens, float* y);

// The whole layer: x [T, hidden] fp32 -> y [T, hidden] fp32 (overwritten). Shared expert only
// when include_shared and layer.shared is set. Validates first; on error y is untouched.
absl::Status MoeForwardReference(const MoeLayerView& layer, const float* x,
                                 const MoeAssignments& assignments, bool include_shared, float* y);

}  // namespace exl3
