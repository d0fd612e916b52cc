// ClassifyMoeExperts (kernels/moe_classes.h): the (K, codebook) classes of a layer's routed
// experts, as the CUDA MoE path orders its row chunks by them. Only the views' bits and codebook
// matter here: no tensor data.
#include "kernels/moe_classes.h"

#include <deque>
#include <vector>

#include "gtest/gtest.h"

namespace exl3 {
namespace {

struct Spec {
  int gate_k, up_k, down_k;
  Codebook cb = Codebook::kMcg;
};

struct Layer {
  std::deque<ExpertMlp> mlps;
  MoeLayerView view;
  // specs[e] with gate_k == 0: expert e not held.
  explicit Layer(const std::vector<Spec>& specs) {
    view.hidden_size = 128;
    view.intermediate_size = 128;
    for (const Spec& s : specs) {
      if (s.gate_k == 0) {
        view.experts.push_back(nullptr);
        continue;
      }
      ExpertMlp m;
      m.gate.bits = s.gate_k;
      m.up.bits = s.up_k;
      m.down.bits = s.down_k;
      m.gate.codebook = m.up.codebook = m.down.codebook = s.cb;
      mlps.push_back(m);
      view.experts.push_back(&mlps.back());
    }
  }
};

TEST(MoeClassesTest, UniformLayerIsOneClassInIdOrder) {
  Layer l({{2, 2, 3}, {2, 2, 3}, {0, 0, 0}, {2, 2, 3}});
  absl::StatusOr<MoeExpertClasses> c = ClassifyMoeExperts(l.view);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->uniform());
  ASSERT_EQ(c->num_classes(), 1);
  EXPECT_EQ(c->classes[0].proj[kMoeGate].bits, 2);
  EXPECT_EQ(c->classes[0].proj[kMoeDown].bits, 3);
  EXPECT_EQ(c->expert_class, (std::vector<int>{0, 0, -1, 0}));
  EXPECT_EQ(c->order, (std::vector<int>{0, 1, 3, 2}));
  EXPECT_EQ(c->class_first, (std::vector<int>{0, 3}));
  EXPECT_EQ(c->class_held, (std::vector<int>{3}));
}

TEST(MoeClassesTest, MixedKAndCodebookOrderExpertsByClass) {
  Layer l({{2, 2, 2},
           {4, 4, 4},
           {2, 2, 2, Codebook::kMul1},  // same K as expert 0, other codebook: its own class
           {0, 0, 0},
           {4, 4, 4},
           {2, 2, 3},  // differs only in down
           {2, 2, 2}});
  absl::StatusOr<MoeExpertClasses> c = ClassifyMoeExperts(l.view);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->uniform());
  ASSERT_EQ(c->num_classes(), 4);
  EXPECT_EQ(c->expert_class, (std::vector<int>{0, 1, 2, -1, 1, 3, 0}));
  EXPECT_EQ(c->order, (std::vector<int>{0, 6, 1, 4, 2, 5, 3}));
  EXPECT_EQ(c->class_first, (std::vector<int>{0, 2, 4, 5, 6}));
  EXPECT_EQ(c->class_held, (std::vector<int>{2, 2, 1, 1}));
  EXPECT_EQ(c->classes[2].proj[kMoeUp].codebook, static_cast<int>(Codebook::kMul1));
  EXPECT_EQ(c->classes[3].proj[kMoeDown].bits, 3);
  EXPECT_EQ(c->classes[3].proj[kMoeGate].bits, 2);
  // Every expert's class holds its spec.
  for (int e = 0; e < l.view.num_experts(); ++e) {
    if (l.view.experts[e] == nullptr) continue;
    const MoeClassSpec& s = c->classes[c->expert_class[e]];
    EXPECT_EQ(s.proj[kMoeGate].bits, l.view.experts[e]->gate.bits);
    EXPECT_EQ(s.proj[kMoeDown].bits, l.view.experts[e]->down.bits);
  }
}

TEST(MoeClassesTest, RefusesTooManyClassesAndBadBitWidths) {
  std::vector<Spec> specs;
  for (int i = 0; i <= kMaxMoeClasses; ++i) {
    specs.push_back({1 + i % 8, 1 + (i / 8) % 8, 1 + i / 64});
  }
  Layer many(specs);
  EXPECT_EQ(ClassifyMoeExperts(many.view).status().code(), absl::StatusCode::kUnimplemented);
  specs.pop_back();
  Layer most(specs);
  absl::StatusOr<MoeExpertClasses> c = ClassifyMoeExperts(most.view);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_classes(), kMaxMoeClasses);
  Layer bad({{2, 2, 2}, {9, 2, 2}});
  EXPECT_EQ(ClassifyMoeExperts(bad.view).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MoeClassesTest, NoHeldExpertsNoClasses) {
  Layer l({{0, 0, 0}, {0, 0, 0}});
  absl::StatusOr<MoeExpertClasses> c = ClassifyMoeExperts(l.view);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_classes(), 0);
  EXPECT_EQ(c->order, (std::vector<int>{0, 1}));
  EXPECT_EQ(c->class_first, (std::vector<int>{0}));
}

}  // namespace
}  // namespace exl3
