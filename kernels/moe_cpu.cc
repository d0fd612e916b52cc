#include "kernels/moe_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace exl3 {
namespace {

// `expert` < 0: the shared expert. The name is only built for an error (this runs on every call,
// for every held expert).
absl::Status CheckMlp(const ExpertMlp& m, int hidden, int inter, int expert) {
  auto what = [expert] {
    return expert < 0 ? std::string("shared expert") : absl::StrCat("expert ", expert);
  };
  const Exl3LinearView* lins[3] = {&m.gate, &m.up, &m.down};
  const char* names[3] = {"gate", "up", "down"};
  for (int i = 0; i < 3; ++i) {
    absl::Status s = ValidateLinear(*lins[i]);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(what(), " ", names[i], ": ", s.message()));
    const int want_in = i < 2 ? hidden : inter, want_out = i < 2 ? inter : hidden;
    if (lins[i]->in_features != want_in || lins[i]->out_features != want_out) {
      return absl::InvalidArgumentError(absl::StrCat(
          what(), " ", names[i], " is ", lins[i]->in_features, "x", lins[i]->out_features,
          ", expected ", want_in, "x", want_out));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateMoeLayer(const MoeLayerView& layer) {
  if (layer.hidden_size <= 0 || layer.intermediate_size <= 0) {
    return absl::InvalidArgumentError("MoE layer has no hidden or intermediate size");
  }
  if (!(layer.swiglu_limit >= 0.0f) || !(layer.shared_swiglu_limit >= 0.0f)) return absl::InvalidArgumentError("swiglu_limit must be >= 0");
  for (int e = 0; e < layer.num_experts(); ++e) {
    if (layer.experts[e] == nullptr) continue;
    absl::Status s = CheckMlp(*layer.experts[e], layer.hidden_size, layer.intermediate_size, e);
    if (!s.ok()) return s;
  }
  if (layer.shared != nullptr) {
    absl::Status s = CheckMlp(*layer.shared, layer.hidden_size, layer.shared_intermediate_size, -1);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ValidateAssignments(const MoeLayerView& layer, const MoeAssignments& a) {
  if (a.num_tokens < 0) return absl::InvalidArgumentError("negative token count");
  if (a.num_tokens == 0) return absl::OkStatus();
  if (a.offsets == nullptr && a.per_token < 0) {
    return absl::InvalidArgumentError("negative pairs per token");
  }
  if (a.offsets != nullptr && a.offsets[0] != 0) {
    return absl::InvalidArgumentError("assignment offsets must start at 0");
  }
  for (int t = 0; t < a.num_tokens; ++t) {
    if (a.end(t) < a.begin(t)) {
      return absl::InvalidArgumentError(absl::StrCat("assignment offsets decrease at token ", t));
    }
    for (int i = a.begin(t); i < a.end(t); ++i) {
      const int32_t e = a.expert_ids[i];
      if (e < 0 || e >= layer.num_experts()) {
        return absl::InvalidArgumentError(absl::StrCat("token ", t, ": expert ", e,
                                                       " is out of range [0, ",
                                                       layer.num_experts(), ")"));
      }
      if (layer.experts[e] == nullptr) {
        return absl::NotFoundError(absl::StrCat("token ", t, ": expert ", e, " is not held here"));
      }
      if (!std::isfinite(a.weights[i])) {
        return absl::InvalidArgumentError(absl::StrCat("token ", t, ": weight of expert ", e,
                                                       " is not finite"));
      }
    }
  }
  return absl::OkStatus();
}

void SwiGlu(float* gate, const float* up, size_t n, float limit) {
  // gate[i] = g / (1 + exp(-g)) * u, per element exactly these fp32 operations. In blocks, so
  // that the clamps and the division/product run as vector loops around a loop of plain expf
  // calls (which nothing else shares registers with); the libm exp itself stays scalar.
  constexpr size_t kBlock = 64;
  float g[kBlock], u[kBlock], e[kBlock];
  for (size_t i0 = 0; i0 < n; i0 += kBlock) {
    const size_t m = std::min(kBlock, n - i0);
    if (limit > 0.0f) {
      for (size_t i = 0; i < m; ++i) {
        g[i] = std::min(gate[i0 + i], limit);
        u[i] = std::clamp(up[i0 + i], -limit, limit);
      }
    } else {
      for (size_t i = 0; i < m; ++i) {
        g[i] = gate[i0 + i];
        u[i] = up[i0 + i];
      }
    }
    for (size_t i = 0; i < m; ++i) e[i] = std::exp(-g[i]);
    for (size_t i = 0; i < m; ++i) gate[i0 + i] = g[i] / (1.0f + e[i]) * u[i];
  }
}

void ExpertMlpForwardReference(const ExpertMlp& mlp, float swiglu_limit, const float* x,
                               int num_tokens, float* y) {
  const size_t inter = static_cast<size_t>(mlp.gate.out_features);
  std::vector<float> g(num_tokens * inter), u(num_tokens * inter);
  LinearForwardReference(mlp.gate, x, num_tokens, g.data());
  LinearForwardReference(mlp.up, x, num_tokens, u.data());
  SwiGlu(g.data(), u.data(), g.size(), swiglu_limit);
  LinearForwardReference(mlp.down, g.data(), num_tokens, y);
}

absl::Status MoeForwardReference(const MoeLayerView& layer, const float* x,
                                 const MoeAssignments& a, bool include_shared, float* y) {
  absl::Status s = ValidateMoeLayer(layer);
  if (!s.ok()) return s;
  s = ValidateAssignments(layer, a);
  if (!s.ok()) return s;
  const int H = layer.hidden_size;
  std::vector<float> out(static_cast<size_t>(a.num_tokens) * H, 0.0f);
  std::vector<float> tmp(H);
  // Token by token, pair by pair: the plainest statement of the sum.
  for (int t = 0; t < a.num_tokens; ++t) {
    const float* xt = x + static_cast<size_t>(t) * H;
    float* ot = out.data() + static_cast<size_t>(t) * H;
    for (int i = a.begin(t); i < a.end(t); ++i) {
      ExpertMlpForwardReference(*layer.experts[a.expert_ids[i]], layer.swiglu_limit, xt, 1,
                                tmp.data());
      const float w = a.weights[i];
      for (int h = 0; h < H; ++h) ot[h] += w * tmp[h];
    }
    if (include_shared && layer.shared != nullptr) {
      ExpertMlpForwardReference(*layer.shared, layer.shared_swiglu_limit, xt, 1, tmp.data());
      float w = 1.0f;
      if (layer.shared_gate != nullptr) {
        double acc = 0.0;
        for (int h = 0; h < H; ++h) acc += static_cast<double>(xt[h]) * layer.shared_gate[h];
        w = 1.0f / (1.0f + std::exp(-static_cast<float>(acc)));
      }
      for (int h = 0; h < H; ++h) ot[h] += w * tmp[h];
    }
  }
  std::memcpy(y, out.data(), out.size() * sizeof(float));
  return absl::OkStatus();
}

}  // namespace exl3
