#include "engine/cpu/mtp/mtp_moe.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/moe_cpu.h"
#include "model/routing.h"

namespace exl3::engine {

absl::StatusOr<MtpMoe> MtpMoe::Load(const ModelConfig& cfg, const TensorSource& src, int layer) {
  return Load(cfg, src, layer, LayerPrefix(cfg.moe, layer));
}

absl::StatusOr<MtpMoe> MtpMoe::Load(const ModelConfig& cfg, const TensorSource& src, int layer,
                                    const std::string& layer_prefix) {
  MtpMoe m;
  m.layer_ = layer;
  m.routing_ = cfg.moe;
  // Routing reads the layer's kind from the per-layer lists, which end at the decoder layers.
  m.routing_.num_hidden_layers = layer + 1;
  m.routing_.moe_layers.resize(layer + 1, false);
  m.routing_.moe_layers[layer] = true;
  m.routing_.hash_routed_layers.resize(layer + 1, false);
  m.routing_.hash_routed_layers[layer] = false;
  const MoeConfig& c = m.routing_;
  // The key functions name layer `layer`'s tensors; the layer's own prefix replaces theirs.
  const std::string model_prefix = LayerPrefix(c, layer);
  auto key = [&](const std::string& k) { return k.empty() ? k : layer_prefix + k.substr(model_prefix.size()); };
  const int H = cfg.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  if (E <= 0 || I <= 0 || c.top_k <= 0)
    return absl::InvalidArgumentError(absl::StrCat(cfg.architecture(), ": no routed experts configured"));
  const std::string router = key(RouterWeightKey(c, layer));
  EXL3_ASSIGN_OR_RETURN(TensorView w, src.Get(router));
  if (w.info->shape != std::vector<int64_t>{E, H})
    return absl::InvalidArgumentError(absl::StrCat(router, ": expected shape [", E, ", ", H, "]"));
  EXL3_ASSIGN_OR_RETURN(m.router_, ToFloat32(w));
  const std::string bias = key(CorrectionBiasKey(c, layer));
  if (!bias.empty()) {
    EXL3_ASSIGN_OR_RETURN(m.bias_, LoadVector(src, bias, E));
  }
  m.experts_.reserve(E);
  for (int e = 0; e < E; ++e) {
    Mlp mlp;
    EXL3_ASSIGN_OR_RETURN(mlp.gate, Linear::Load(src, key(RoutedExpertPrefix(c, layer, e, Projection::kGate)), H, I));
    EXL3_ASSIGN_OR_RETURN(mlp.up, Linear::Load(src, key(RoutedExpertPrefix(c, layer, e, Projection::kUp)), H, I));
    EXL3_ASSIGN_OR_RETURN(mlp.down, Linear::Load(src, key(RoutedExpertPrefix(c, layer, e, Projection::kDown)), I, H));
    m.experts_.push_back(std::move(mlp));
  }
  if (c.has_shared_expert()) {
    const int S = c.shared_intermediate_size;
    Mlp mlp;
    EXL3_ASSIGN_OR_RETURN(mlp.gate, Linear::Load(src, key(SharedExpertPrefix(c, layer, Projection::kGate)), H, S));
    EXL3_ASSIGN_OR_RETURN(mlp.up, Linear::Load(src, key(SharedExpertPrefix(c, layer, Projection::kUp)), H, S));
    EXL3_ASSIGN_OR_RETURN(mlp.down, Linear::Load(src, key(SharedExpertPrefix(c, layer, Projection::kDown)), S, H));
    m.shared_.push_back(std::move(mlp));
    if (c.shared_expert_gated) {
      const std::string gate = key(SharedExpertGateKey(c, layer));
      EXL3_ASSIGN_OR_RETURN(TensorView g, src.Get(gate));
      if (g.info->shape != std::vector<int64_t>{1, H})
        return absl::InvalidArgumentError(absl::StrCat(gate, ": expected shape [1, ", H, "]"));
      EXL3_ASSIGN_OR_RETURN(m.shared_gate_, ToFloat32(g));
    }
  }
  return m;
}

absl::Status MtpMoe::RunMlp(const Mlp& mlp, float limit, const float* x, int T, float* y,
                            CpuCompute& compute) const {
  const size_t n = static_cast<size_t>(T) * mlp.gate.out_features();
  std::vector<float> gate(n), up(n);
  EXL3_RETURN_IF_ERROR(mlp.gate.Forward(x, T, gate.data(), compute));
  EXL3_RETURN_IF_ERROR(mlp.up.Forward(x, T, up.data(), compute));
  SwiGlu(gate.data(), up.data(), n, limit);
  return mlp.down.Forward(gate.data(), T, y, compute);
}

absl::Status MtpMoe::Forward(const float* x, int T, float* y, CpuCompute& compute) const {
  const MoeConfig& c = routing_;
  const int H = c.hidden_size, E = c.num_experts, K = c.top_k;
  std::vector<float> logits(static_cast<size_t>(T) * E);
  ComputeRouterLogits(router_.data(), x, T, E, H, logits.data());
  std::vector<int32_t> ids(static_cast<size_t>(T) * K);
  std::vector<float> weights(static_cast<size_t>(T) * K);
  EXL3_RETURN_IF_ERROR(RouteFromLogits(c, layer_, logits.data(), bias_.empty() ? nullptr : bias_.data(), T,
                                       ids.data(), weights.data()));
  std::fill_n(y, static_cast<size_t>(T) * H, 0.0f);
  // Each expert once, on the rows of the tokens that chose it.
  std::vector<float> rows, out;
  for (int e = 0; e < E; ++e) {
    std::vector<std::pair<int, float>> users;  // (token, weight)
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k)
        if (ids[static_cast<size_t>(t) * K + k] == e) users.emplace_back(t, weights[static_cast<size_t>(t) * K + k]);
    if (users.empty()) continue;
    const int n = static_cast<int>(users.size());
    rows.resize(static_cast<size_t>(n) * H);
    out.resize(static_cast<size_t>(n) * H);
    for (int u = 0; u < n; ++u) std::copy_n(x + static_cast<size_t>(users[u].first) * H, H, &rows[static_cast<size_t>(u) * H]);
    EXL3_RETURN_IF_ERROR(RunMlp(experts_[e], c.swiglu_limit, rows.data(), n, out.data(), compute));
    for (int u = 0; u < n; ++u) {
      float* dst = y + static_cast<size_t>(users[u].first) * H;
      const float* src = &out[static_cast<size_t>(u) * H];
      for (int i = 0; i < H; ++i) dst[i] += users[u].second * src[i];
    }
  }
  for (const Mlp& shared : shared_) {
    out.resize(static_cast<size_t>(T) * H);
    EXL3_RETURN_IF_ERROR(RunMlp(shared, c.shared_swiglu_limit, x, T, out.data(), compute));
    for (int t = 0; t < T; ++t) {
      float scale = 1.0f;
      if (!shared_gate_.empty()) {  // sigmoid(x[t] · gate)
        double dot = 0;
        for (int i = 0; i < H; ++i) dot += static_cast<double>(x[static_cast<size_t>(t) * H + i]) * shared_gate_[i];
        scale = static_cast<float>(1.0 / (1.0 + std::exp(-dot)));
      }
      for (int i = 0; i < H; ++i) y[static_cast<size_t>(t) * H + i] += scale * out[static_cast<size_t>(t) * H + i];
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3::engine
