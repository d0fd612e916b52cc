#include "engine/cuda/cuda_mtp_moe.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/linear.h"
#include "model/exl3_linear_loader.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {

absl::StatusOr<CudaMtpMoe> CudaMtpMoe::Load(const ModelConfig& cfg, const TensorSource& src, int n,
                                            const std::string& layer_prefix, int max_moe_tokens,
                                            const CudaLinearContext& linear) {
  const int H = cfg.hidden_size;
  const MoeConfig& c = cfg.moe;
  const int E = c.num_experts, I = c.moe_intermediate_size;
  if (E <= 0 || I <= 0 || c.top_k <= 0)
    return absl::InvalidArgumentError(absl::StrCat(cfg.architecture(), ": no routed experts configured"));
  if (!cfg.IsMoeLayer(n))
    return absl::InternalError(absl::StrCat("the MTP layer ", n, " is not counted as a MoE layer"));
  // The key functions name layer n's tensors under the model's layer prefix; the layer's own replaces it.
  const std::string model_prefix = LayerPrefix(c, n);
  auto key = [&](const std::string& k) { return k.empty() ? k : layer_prefix + k.substr(model_prefix.size()); };
  const std::string router_key = key(RouterWeightKey(c, n));
  EXL3_ASSIGN_OR_RETURN(TensorView w, src.Get(router_key));
  if (w.info->shape != std::vector<int64_t>{E, H})
    return absl::InvalidArgumentError(absl::StrCat(router_key, ": expected shape [", E, ", ", H, "]"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> router, ToFloat32(w));
  std::vector<float> bias;
  if (const std::string bias_key = key(CorrectionBiasKey(c, n)); !bias_key.empty()) {
    EXL3_ASSIGN_OR_RETURN(bias, LoadVector(src, bias_key, E));
  }
  // The experts' EXL3 layers, held while they are copied to the device.
  std::vector<std::unique_ptr<Exl3Linear>> held;
  // expert -1: the shared expert.
  auto load_mlp = [&](int expert, int inter, ExpertMlp* mlp) -> absl::Status {
    Exl3LinearView* views[3] = {&mlp->gate, &mlp->up, &mlp->down};
    const Projection projections[3] = {Projection::kGate, Projection::kUp, Projection::kDown};
    for (int i = 0; i < 3; ++i) {
      const std::string prefix = key(expert >= 0 ? RoutedExpertPrefix(c, n, expert, projections[i])
                                                 : SharedExpertPrefix(c, n, projections[i]));
      const bool down = projections[i] == Projection::kDown;
      EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Exl3Linear> linear, LoadExl3Linear(src, prefix, down ? inter : H,
                                                                               down ? H : inter));
      *views[i] = linear->view;
      held.push_back(std::move(linear));
    }
    return absl::OkStatus();
  };
  std::vector<ExpertMlp> experts(E);
  MoeLayerView view;
  view.hidden_size = H;
  view.intermediate_size = I;
  view.swiglu_limit = c.swiglu_limit;
  view.shared_swiglu_limit = c.shared_swiglu_limit;
  for (int e = 0; e < E; ++e) {
    EXL3_RETURN_IF_ERROR(load_mlp(e, I, &experts[e]));
    view.experts.push_back(&experts[e]);
  }
  ExpertMlp shared;
  std::vector<float> shared_gate;
  if (c.has_shared_expert()) {
    EXL3_RETURN_IF_ERROR(load_mlp(-1, c.shared_intermediate_size, &shared));
    view.shared = &shared;
    view.shared_intermediate_size = c.shared_intermediate_size;
    if (c.shared_expert_gated) {  // Qwen4-Exp: sigmoid(x · shared_expert_gate) scales it
      const std::string gate = key(SharedExpertGateKey(c, n));
      EXL3_ASSIGN_OR_RETURN(TensorView g, src.Get(gate));
      if (g.info->shape != std::vector<int64_t>{1, H})
        return absl::InvalidArgumentError(absl::StrCat(gate, ": expected shape [1, ", H, "]"));
      EXL3_ASSIGN_OR_RETURN(shared_gate, ToFloat32(g));
      view.shared_gate = shared_gate.data();
    }
  }
  CudaMtpMoe m;
  EXL3_ASSIGN_OR_RETURN(m.moe_, CudaMoe::Create(cfg, nullptr, CudaMoe::Options{max_moe_tokens, 1}, linear));
  EXL3_ASSIGN_OR_RETURN(CudaMoeLayer layer,
                        m.moe_->LoadLayer(n, router.data(), bias.empty() ? nullptr : bias.data(), view, &m.weight_bytes_));
  m.layer_ = std::make_unique<CudaMoeLayer>(std::move(layer));
  return m;
}

absl::Status CudaMtpMoe::Reserve(int rows) {
  bool moved = false;  // no decode graph holds these addresses
  return moe_->Reserve(rows, &moved);
}

absl::Status CudaMtpMoe::Forward(const CudaStep& step, const float* x, int T, float* d) {
  return moe_->Run(*layer_, step, /*m=*/0, /*first=*/0, T, x, d, /*host_token_ids=*/nullptr);
}

}  // namespace exl3::engine::cuda
