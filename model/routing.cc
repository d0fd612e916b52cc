#include "model/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace exl3 {
namespace {

// Indices of the k largest scores: descending score, lower index first on ties.
void TopK(const float* scores, int n, int k, int32_t* out) {
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  std::copy(idx.begin(), idx.begin() + k, out);
}

float Softplus(float x) {
  // PyTorch's softplus (beta 1, threshold 20).
  return x > 20.0f ? x : std::log1p(std::exp(x));
}

absl::Status CheckLayer(const MoeConfig& cfg, int layer) {
  if (!cfg.IsMoeLayer(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not a MoE layer of this ",
                                                   cfg.architecture, " model"));
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(const float* v, size_t n, const char* what) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) {
      return absl::InvalidArgumentError(absl::StrCat(what, " element ", i, " is not finite"));
    }
  }
  return absl::OkStatus();
}

void ScoreBiasTopK(const MoeConfig& cfg, const float* logits, const float* bias, int32_t* ids,
                   float* weights) {
  const int E = cfg.num_experts, k = cfg.top_k;
  std::vector<float> s(E), choice(E);
  for (int e = 0; e < E; ++e) {
    const float l = logits[e];
    s[e] = cfg.scoring == ScoringFunc::kSigmoid ? 1.0f / (1.0f + std::exp(-l))
                                                : std::sqrt(Softplus(l));
    choice[e] = s[e] + (bias != nullptr ? bias[e] : 0.0f);
  }
  if (cfg.n_group > 1 && cfg.topk_group < cfg.n_group) {
    const int G = cfg.n_group, per = E / G;
    std::vector<float> group_score(G);
    for (int g = 0; g < G; ++g) {
      float a = -INFINITY, b = -INFINITY;  // top two
      for (int e = g * per; e < (g + 1) * per; ++e) {
        const float v = choice[e];
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      group_score[g] = a + b;
    }
    std::vector<int32_t> kept(cfg.topk_group);
    TopK(group_score.data(), G, cfg.topk_group, kept.data());
    std::vector<bool> keep(G, false);
    for (int32_t g : kept) keep[g] = true;
    for (int e = 0; e < E; ++e) {
      // transformers 5.x masks dropped groups with -inf (4.x used 0.0, which let a dropped
      // expert win whenever every kept biased score was negative).
      if (!keep[e / per]) choice[e] = -INFINITY;
    }
  }
  TopK(choice.data(), E, k, ids);
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) {
    weights[i] = s[ids[i]];
    sum += weights[i];
  }
  for (int i = 0; i < k; ++i) {
    if (cfg.norm_topk_prob) weights[i] /= (sum + 1e-20f);
    weights[i] *= cfg.routed_scaling_factor;
  }
}

void SoftmaxTopK(const MoeConfig& cfg, const float* logits, int32_t* ids, float* weights) {
  const int E = cfg.num_experts, k = cfg.top_k;
  std::vector<float> p(E);
  float mx = -INFINITY;
  for (int e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
  double sum = 0.0;
  for (int e = 0; e < E; ++e) {
    p[e] = std::exp(logits[e] - mx);
    sum += p[e];
  }
  for (int e = 0; e < E; ++e) p[e] = static_cast<float>(p[e] / sum);
  TopK(p.data(), E, k, ids);
  float ksum = 0.0f;
  for (int i = 0; i < k; ++i) {
    weights[i] = p[ids[i]];
    ksum += weights[i];
  }
  for (int i = 0; i < k; ++i) {
    if (cfg.norm_topk_prob) weights[i] /= ksum;
    weights[i] *= cfg.routed_scaling_factor;
  }
}

}  // namespace

// Cloned for AVX2 (chosen at load time where the CPU has it) so the accumulator lanes vectorise.
// Not under ThreadSanitizer: GCC instruments the clones' ifunc resolver, which the dynamic loader
// runs before the TSan runtime is initialised (the binary crashes at startup).
#ifndef __SANITIZE_THREAD__
__attribute__((target_clones("avx2", "default")))
#endif
void ComputeRouterLogits(const float* router_weight, const float* x, int num_tokens,
                         int num_experts, int hidden, float* logits) {
  for (int t = 0; t < num_tokens; ++t) {
    const float* xt = x + static_cast<size_t>(t) * hidden;
    for (int e = 0; e < num_experts; ++e) {
      const float* we = router_weight + static_cast<size_t>(e) * hidden;
      // Eight independent double accumulators: exact products, far less rounding than the fp32
      // the model families use, and no serial add chain (a single accumulator made the gate of a
      // 288-expert, 4096-wide layer cost 1.6 ms).
      double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int i = 0;
      for (; i + 8 <= hidden; i += 8) {
        for (int j = 0; j < 8; ++j) acc[j] += static_cast<double>(xt[i + j]) * we[i + j];
      }
      for (; i < hidden; ++i) acc[0] += static_cast<double>(xt[i]) * we[i];
      const double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      logits[static_cast<size_t>(t) * num_experts + e] = static_cast<float>(sum);
    }
  }
}

absl::Status RouteFromLogits(const MoeConfig& cfg, int layer, const float* logits,
                             const float* bias, int num_tokens, int32_t* topk_ids,
                             float* topk_weights) {
  absl::Status st = CheckLayer(cfg, layer);
  if (!st.ok()) return st;
  if (cfg.IsHashRoutedLayer(layer)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " of this ", cfg.architecture,
        " model is hash-routed (its experts come from token ids through tid2eid): route it with "
        "token ids (RouteHashed), not from hidden states alone"));
  }
  if (num_tokens < 0) return absl::InvalidArgumentError("negative token count");
  const int E = cfg.num_experts, k = cfg.top_k;
  st = CheckFinite(logits, static_cast<size_t>(num_tokens) * E, "router logit");
  if (!st.ok()) return st;
  if (bias != nullptr) {
    st = CheckFinite(bias, E, "correction bias");
    if (!st.ok()) return st;
  }
  for (int t = 0; t < num_tokens; ++t) {
    const float* l = logits + static_cast<size_t>(t) * E;
    int32_t* ids = topk_ids + static_cast<size_t>(t) * k;
    float* w = topk_weights + static_cast<size_t>(t) * k;
    if (cfg.scoring == ScoringFunc::kSoftmax) {
      SoftmaxTopK(cfg, l, ids, w);
    } else {
      ScoreBiasTopK(cfg, l, bias, ids, w);
    }
  }
  return absl::OkStatus();
}

absl::Status RouteTokens(const MoeConfig& cfg, int layer, const float* router_weight,
                         const float* bias, const float* x, int num_tokens, int32_t* topk_ids,
                         float* topk_weights) {
  absl::Status st = CheckLayer(cfg, layer);
  if (!st.ok()) return st;
  if (num_tokens < 0) return absl::InvalidArgumentError("negative token count");
  st = CheckFinite(x, static_cast<size_t>(num_tokens) * cfg.hidden_size, "hidden state");
  if (!st.ok()) return st;
  std::vector<float> logits(static_cast<size_t>(num_tokens) * cfg.num_experts);
  ComputeRouterLogits(router_weight, x, num_tokens, cfg.num_experts, cfg.hidden_size,
                      logits.data());
  return RouteFromLogits(cfg, layer, logits.data(), bias, num_tokens, topk_ids, topk_weights);
}

absl::Status RouteHashed(const MoeConfig& cfg, int layer, const float* logits,
                         const int32_t* tid2eid, int64_t vocab_size, const int64_t* token_ids,
                         int num_tokens, int32_t* topk_ids, float* topk_weights) {
  absl::Status st = CheckLayer(cfg, layer);
  if (!st.ok()) return st;
  if (!cfg.IsHashRoutedLayer(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not hash-routed"));
  }
  const int E = cfg.num_experts, k = cfg.top_k;
  st = CheckFinite(logits, static_cast<size_t>(num_tokens) * E, "router logit");
  if (!st.ok()) return st;
  for (int t = 0; t < num_tokens; ++t) {
    const int64_t tok = token_ids[t];
    if (tok < 0 || tok >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", tok, " is outside the hash table's vocabulary of ", vocab_size));
    }
    const float* l = logits + static_cast<size_t>(t) * E;
    int32_t* ids = topk_ids + static_cast<size_t>(t) * k;
    float* w = topk_weights + static_cast<size_t>(t) * k;
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) {
      const int32_t e = tid2eid[tok * k + i];
      if (e < 0 || e >= E) {
        return absl::DataLossError(absl::StrCat("tid2eid[", tok, "] names expert ", e,
                                                ", outside [0, ", E, ")"));
      }
      ids[i] = e;
      w[i] = cfg.scoring == ScoringFunc::kSigmoid ? 1.0f / (1.0f + std::exp(-l[e]))
                                                  : std::sqrt(Softplus(l[e]));
      sum += w[i];
    }
    for (int i = 0; i < k; ++i) {
      if (cfg.norm_topk_prob) w[i] /= (sum + 1e-20f);
      w[i] *= cfg.routed_scaling_factor;
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3
