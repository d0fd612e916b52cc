#include "engine/cpu/local_moe.h"

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/routing.h"

namespace exl3::engine {

namespace {

Exl3ModelOptions ExpertOptions(TensorResidency residency) {
  Exl3ModelOptions opt;
  opt.residency = residency;
  opt.require_exl3 = false;  // experts may be EXL3 in an otherwise unquantized checkpoint's layout
  return opt;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalMoe>> LocalMoe::Open(const std::string& dir, CpuCompute& compute,
                                                         TensorResidency residency) {
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Exl3Model> m, Exl3Model::Open(dir, ExpertOptions(residency)));
  return std::unique_ptr<LocalMoe>(new LocalMoe(std::move(m), compute));
}

absl::StatusOr<std::unique_ptr<LocalMoe>> LocalMoe::Open(const std::string& dir, const ConfigFile& config,
                                                         CpuCompute& compute, TensorResidency residency) {
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Exl3Model> m, Exl3Model::Open(dir, config, ExpertOptions(residency)));
  return std::unique_ptr<LocalMoe>(new LocalMoe(std::move(m), compute));
}

MoeStageTimes LocalMoe::TakeStageTimes() {
  const MoeStageTimes t = times_;
  times_ = MoeStageTimes{};
  return t;
}

absl::Status LocalMoe::Forward(int layer, const float* x, int T, const int32_t* token_ids, float* y) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  const MoeConfig& cfg = model_->config();
  const int k = cfg.top_k;
  std::vector<int32_t> ids(static_cast<size_t>(T) * k);
  std::vector<float> weights(static_cast<size_t>(T) * k);
  if (cfg.IsHashRoutedLayer(layer)) {
    // DeepSeek-V4's hash_moe layers: the experts from tid2eid[token id], weighted by the gate.
    int64_t vocab = 0;
    const int32_t* table = model_->HashTable(layer, &vocab);
    if (table == nullptr)
      return absl::NotFoundError(absl::StrCat("layer ", layer, " is hash-routed but the model has no ",
                                              HashTableKey(cfg, layer)));
    if (token_ids == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is hash-routed: token ids required"));
    std::vector<int64_t> tokens(token_ids, token_ids + T);
    std::vector<float> logits(static_cast<size_t>(T) * cfg.num_experts);
    ComputeRouterLogits(model_->RouterWeight(layer), x, T, cfg.num_experts, cfg.hidden_size, logits.data());
    EXL3_RETURN_IF_ERROR(RouteHashed(cfg, layer, logits.data(), table, vocab, tokens.data(), T,
                                     ids.data(), weights.data()));
  } else {
    EXL3_RETURN_IF_ERROR(RouteTokens(cfg, layer, model_->RouterWeight(layer),
                                     model_->CorrectionBias(layer), x, T, ids.data(), weights.data()));
  }
  const Clock::time_point t1 = Clock::now();
  times_.gate_s += std::chrono::duration<double>(t1 - t0).count();
  EXL3_ASSIGN_OR_RETURN(MoeLayerView view, model_->LayerView(layer));
  const absl::Status st = compute_.exl3().Moe(view, x, MoeAssignments::Fixed(T, k, ids.data(), weights.data()),
                                              /*include_shared=*/true, y);
  times_.experts_s += std::chrono::duration<double>(Clock::now() - t1).count();
  return st;
}

std::unique_ptr<MoeCall> LocalMoe::StartRouted(int layer, const float* x, int T, const MoeRouting& routing,
                                               float* y) {
  const MoeConfig& cfg = model_->config();
  if (routing.k != cfg.top_k)
    return Finished(absl::InvalidArgumentError(absl::StrCat("routing of ", routing.k, " experts per token for a model of ",
                                                            cfg.top_k)));
  for (int64_t i = 0; i < static_cast<int64_t>(T) * routing.k; ++i)
    if (routing.ids[i] < 0 || routing.ids[i] >= cfg.num_experts)
      return Finished(absl::InvalidArgumentError(absl::StrCat("routing names expert ", routing.ids[i], ", outside [0, ",
                                                              cfg.num_experts, ")")));
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<MoeLayerView> view = model_->LayerView(layer);
  if (!view.ok()) return Finished(view.status());
  absl::Status st = compute_.exl3().Moe(*view, x, MoeAssignments::Fixed(T, routing.k, routing.ids, routing.weights),
                                        /*include_shared=*/true, y);
  times_.experts_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Finished(std::move(st));
}

}  // namespace exl3::engine
