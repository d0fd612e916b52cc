// The (K, codebook) classes of an MoE layer's routed experts, for the CUDA MoE path
// (kernels/cuda/moe_layer.cu, moe_runner.cu): the GEMV/GEMM kernels are templated on K and
// codebook, so experts whose gate, up and down projections have the same (K, codebook) triple
// form one class and each class's row chunks run in the launch of their (K, codebook). The CPU
// path (kernels/moe_cpu.h) needs none of this: it decodes every expert with its own view.
//
// Usage:
//   absl::StatusOr<MoeExpertClasses> c = ClassifyMoeExperts(layer);   // kernels/moe_cpu.h view
//   c->uniform()                    // one class: the launch sequence of a uniform layer
//   c->order[c->class_first[k] .. c->class_first[k + 1])    // class k's experts, ascending ids
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "kernels/moe_cpu.h"

namespace exl3 {

// The most classes one layer may have (the CUDA routing's per-class chunk counters).
inline constexpr int kMaxMoeClasses = 32;

struct MoeProjSpec {
  int bits = 0;      // K, 1..8
  int codebook = 0;  // static_cast<int>(Codebook)
  bool operator==(const MoeProjSpec& o) const { return bits == o.bits && codebook == o.codebook; }
  bool operator!=(const MoeProjSpec& o) const { return !(*this == o); }
};

// Projection roles, the index into MoeClassSpec::proj.
enum MoeProj : int { kMoeGate = 0, kMoeUp = 1, kMoeDown = 2 };

struct MoeClassSpec {
  MoeProjSpec proj[3];  // gate, up, down
  bool operator==(const MoeClassSpec& o) const {
    return proj[0] == o.proj[0] && proj[1] == o.proj[1] && proj[2] == o.proj[2];
  }
};

struct MoeExpertClasses {
  std::vector<MoeClassSpec> classes;  // in order of their first expert id
  std::vector<int> expert_class;      // [num_experts]: each held expert's class, -1 if not held
  std::vector<int> class_held;        // [classes]: held experts per class
  // [num_experts]: the held experts ordered by class (ascending ids within one), then the experts
  // not held (ascending ids).
  std::vector<int> order;
  // [classes + 1]: class k's experts are order[class_first[k] .. class_first[k + 1]);
  // class_first[classes] = the number of held experts.
  std::vector<int> class_first;
  bool uniform() const { return classes.size() <= 1; }
  int num_classes() const { return static_cast<int>(classes.size()); }
};

// Classes of the layer's held routed experts. Fails (Unimplemented) with more than
// kMaxMoeClasses classes, (InvalidArgument) with a K outside 1..8 or a codebook outside 0..2.
absl::StatusOr<MoeExpertClasses> ClassifyMoeExperts(const MoeLayerView& layer);

}  // namespace exl3
