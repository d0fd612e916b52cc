// One layer's attention on the CPU: the family's projections, positions and cache layout behind
// one interface, so the model's layer loop is the same for every family.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Attention> a, LoadAttention(cfg, src, /*layer=*/3));
//   (engine/cpu/attention/load_attention.h, the factory of the kinds)
//   AttentionCarry carry;   // one per micro-batch and step, handed to every layer in order
//   EXL3_RETURN_IF_ERROR(a->Forward(x_normed /*[T, hidden]*/, tokens, cache, carry, out /*[T, hidden]*/, cpu));
//
// Forward writes the step's keys and values into the cache first, then attends each token to the
// positions it may see (causal; within the sliding window when the model has one; DSA: the top-k
// of those its indexer picks).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/config/model_config.h"
#include "engine/cpu/paged_kv_cache.h"
#include "engine/core/step_tokens.h"
#include "model/safetensors.h"

namespace exl3::engine {

// The positions each token of a step attends to, as DSA's indexer chose them: positions[t]
// ascending, all ≤ the token's own position.
struct TopkSelection {
  std::vector<std::vector<int32_t>> positions;  // [num_tokens]
};

// What one layer's attention leaves for the later layers of the same step (and micro-batch).
struct AttentionCarry {
  // Set by each DSA layer that runs its own indexer; read by the "shared" layers after it.
  std::optional<TopkSelection> topk;
};

class Attention {
 public:
  virtual ~Attention() = default;
  virtual absl::Status Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                               AttentionCarry& carry, float* out, CpuCompute& compute) = 0;
};

// softmax(scores[0..n)) in place (fp32, max subtracted).
void SoftmaxInPlace(float* scores, int n);

// First position token t of a sequence may attend to (0, or the sliding window's start).
inline int FirstVisiblePosition(int position, int sliding_window) {
  return sliding_window > 0 && position - sliding_window + 1 > 0 ? position - sliding_window + 1 : 0;
}

}  // namespace exl3::engine
