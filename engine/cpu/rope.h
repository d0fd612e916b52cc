// Rotary position embeddings for every variant the engine's families use (default, linear,
// dynamic NTK, YaRN), in the half-split or interleaved layout (engine/config/model_config.h).
//
//   Rope rope(cfg.rope, cfg.max_position_embeddings);
//   rope.Apply(q, /*num_heads=*/32, /*head_stride=*/128, /*position=*/17, /*seq_len=*/18);
//
// The first rotary_dim dimensions of each head rotate; the rest pass through. The angles are
// position * inv_freq in fp32 and cos/sin are scaled by the attention factor (YaRN), as
// transformers computes them. Dynamic NTK recomputes the frequencies from the sequence's length
// once it exceeds max_position_embeddings (per sequence, for the length after the current step).
#pragma once

#include <vector>

#include "engine/config/model_config.h"

namespace exl3::engine {

// cos and sin of one position's angles (scaled by the attention factor), computed once to rotate
// every tensor at that position (queries and keys).
struct RopeAngles {
  std::vector<float> cos, sin;  // [rotary_dim / 2]
  std::vector<float> scratch;   // [rotary_dim]: the interleaved layout's output
};

class Rope {
 public:
  Rope(const RopeConfig& cfg, int max_position_embeddings);

  int rotary_dim() const { return cfg_.rotary_dim; }
  // The angles of `position`; seq_len: the sequence's length after this step (dynamic NTK only).
  void Angles(int position, int seq_len, RopeAngles* out) const;
  // Rotates `num_heads` heads starting at x, head h at x + h * head_stride.
  void Apply(RopeAngles& angles, float* x, int num_heads, int head_stride) const;
  // Both at once, for a single tensor.
  void Apply(float* x, int num_heads, int head_stride, int position, int seq_len) const;

 private:

  RopeConfig cfg_;
  int max_position_ = 0;
  std::vector<float> inv_freq_;  // [rotary_dim / 2]
};

// The inverse frequencies of `cfg` for a sequence of `seq_len` tokens (exposed for tests).
std::vector<float> RopeInverseFrequencies(const RopeConfig& cfg, int max_position_embeddings,
                                          int seq_len);

}  // namespace exl3::engine
