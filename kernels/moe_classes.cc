// ClassifyMoeExperts (moe_classes.h).
#include "kernels/moe_classes.h"

#include "absl/strings/str_cat.h"

namespace exl3 {

absl::StatusOr<MoeExpertClasses> ClassifyMoeExperts(const MoeLayerView& layer) {
  MoeExpertClasses c;
  const int E = layer.num_experts();
  c.expert_class.assign(E, -1);
  for (int e = 0; e < E; ++e) {
    const ExpertMlp* m = layer.experts[e];
    if (m == nullptr) continue;
    MoeClassSpec s;
    const Exl3LinearView* views[3] = {&m->gate, &m->up, &m->down};
    for (int p = 0; p < 3; ++p) {
      MoeProjSpec& q = s.proj[p];
      q.bits = views[p]->bits;
      q.codebook = static_cast<int>(views[p]->codebook);
      if (q.bits < 1 || q.bits > 8 || q.codebook < 0 || q.codebook > 2) {
        return absl::InvalidArgumentError(absl::StrCat(
            "MoE expert ", e, ": bit width ", q.bits, " or codebook ", q.codebook, " out of range"));
      }
    }
    int k = 0;
    while (k < c.num_classes() && !(c.classes[k] == s)) ++k;
    if (k == c.num_classes()) {
      if (k == kMaxMoeClasses) {
        return absl::UnimplementedError(absl::StrCat(
            "CUDA MoE: the layer's routed experts have more than ", kMaxMoeClasses,
            " distinct (K, codebook) combinations of gate, up and down"));
      }
      c.classes.push_back(s);
      c.class_held.push_back(0);
    }
    c.expert_class[e] = k;
    ++c.class_held[k];
  }
  c.class_first.assign(c.num_classes() + 1, 0);
  for (int k = 0; k < c.num_classes(); ++k) {
    c.class_first[k + 1] = c.class_first[k] + c.class_held[k];
  }
  c.order.reserve(E);
  for (int k = 0; k < c.num_classes(); ++k)
    for (int e = 0; e < E; ++e)
      if (c.expert_class[e] == k) c.order.push_back(e);
  for (int e = 0; e < E; ++e)
    if (c.expert_class[e] < 0) c.order.push_back(e);
  return c;
}

}  // namespace exl3
