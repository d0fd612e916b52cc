// One layer's linear attention on the CPU: a token mixer whose memory of a sequence is a
// fixed-size state per sequence (engine/cpu/sequence_state.h) instead of KV cache slots. Qwen3-Next's
// gated DeltaNet (engine/cpu/linear_attention/gated_deltanet.h) and GLM-5.3-Flash's KDA
// (engine/cpu/linear_attention/kimi_delta_attention.h) behind one interface, so the model's layer loop is the same.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<LinearAttention> a, LoadLinearAttention(cfg, src, 0));
//   (engine/cpu/linear_attention/load_linear_attention.h, the factory of the kinds)
//   EXL3_RETURN_IF_ERROR(a->Forward(x_normed /*[T, hidden]*/, tokens, states, out, cpu));
//
// Forward reads each chunk's state from states.Current(layer, slot) and writes the states it keeps
// to states.KeptState(layer, slot, k): after its last token (Next), and a verify chunk's per row.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/config/model_config.h"
#include "engine/cpu/sequence_state.h"
#include "engine/core/step_tokens.h"
#include "model/safetensors.h"

namespace exl3::engine {

class LinearAttention {
 public:
  virtual ~LinearAttention() = default;
  virtual absl::Status Forward(const float* x, const StepTokens& tokens, SequenceStateStore& states,
                               float* out, CpuCompute& compute) const = 0;
};

}  // namespace exl3::engine
