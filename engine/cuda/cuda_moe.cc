#include "engine/cuda/cuda_moe.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3::engine::cuda {

absl::StatusOr<std::unique_ptr<CudaMoe>> CudaMoe::Create(const ModelConfig& cfg, std::unique_ptr<MoeExecutor> remote,
                                                         const Options& options, const CudaLinearContext& linear) {
  if (options.max_moe_tokens < 1) return absl::InvalidArgumentError("max_moe_tokens must be positive");
  std::unique_ptr<CudaMoe> moe(new CudaMoe(cfg, linear));
  moe->gate_ = GateConfigFor(cfg.moe);
  moe->max_moe_tokens_ = options.max_moe_tokens;
  if (remote != nullptr) {
    moe->remote_ = std::move(remote);
    moe->micro_batches_ = options.micro_batches;
    EXL3_ASSIGN_OR_RETURN(moe->exchange_, RemoteMoeExchange::Create(moe->remote_.get(), options.micro_batches,
                                                                    cfg.hidden_size, cfg.moe.top_k));
  }
  return moe;
}

absl::StatusOr<CudaMoeLayer> CudaMoe::LoadLayer(const Exl3Model& experts, int l, CudaWeightBytes* bytes) {
  const MoeConfig& mc = cfg_.moe;
  CudaMoeLayer moe;
  moe.layer = l;
  EXL3_ASSIGN_OR_RETURN(moe.router, CudaLinear::UploadDense(experts.RouterWeight(l), cfg_.hidden_size, mc.num_experts));
  bytes->router += moe.router.weight_bytes();
  if (const float* bias = experts.CorrectionBias(l)) EXL3_RETURN_IF_ERROR(moe.bias.Upload(bias, mc.num_experts));
  if (mc.IsHashRoutedLayer(l)) {
    // Checked once here: the device gate reads tid2eid[token id] unchecked.
    int64_t vocab = 0;
    const int32_t* table = experts.HashTable(l, &vocab);
    if (table == nullptr)
      return absl::NotFoundError(absl::StrCat("layer ", l, " is hash-routed but the model has no ",
                                              HashTableKey(mc, l)));
    if (vocab < cfg_.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat(HashTableKey(mc, l), ": ", vocab, " rows for a vocabulary of ",
                                                     cfg_.vocab_size));
    const size_t n = static_cast<size_t>(cfg_.vocab_size) * mc.top_k;
    for (size_t i = 0; i < n; ++i)
      if (table[i] < 0 || table[i] >= mc.num_experts)
        return absl::DataLossError(absl::StrCat(HashTableKey(mc, l), "[", i / mc.top_k, "] names expert ", table[i],
                                                ", outside [0, ", mc.num_experts, ")"));
    EXL3_RETURN_IF_ERROR(moe.hash_table.Upload(table, n));
  }
  if (remote()) return moe;
  EXL3_ASSIGN_OR_RETURN(MoeLayerView view, experts.LayerView(l));
  EXL3_RETURN_IF_ERROR(UploadExperts(view, &moe, bytes));
  return moe;
}

absl::StatusOr<CudaMoeLayer> CudaMoe::LoadLayer(int l, const float* router, const float* bias,
                                                const MoeLayerView& view, CudaWeightBytes* bytes) {
  if (remote()) return absl::InternalError(absl::StrCat("MoE layer ", l, " is loaded apart only with experts in process"));
  const MoeConfig& mc = cfg_.moe;
  CudaMoeLayer moe;
  moe.layer = l;
  EXL3_ASSIGN_OR_RETURN(moe.router, CudaLinear::UploadDense(router, cfg_.hidden_size, mc.num_experts));
  bytes->router += moe.router.weight_bytes();
  if (bias != nullptr) EXL3_RETURN_IF_ERROR(moe.bias.Upload(bias, mc.num_experts));
  EXL3_RETURN_IF_ERROR(UploadExperts(view, &moe, bytes));
  return moe;
}

absl::Status CudaMoe::UploadExperts(const MoeLayerView& view, CudaMoeLayer* moe, CudaWeightBytes* bytes) {
  EXL3_ASSIGN_OR_RETURN(moe->experts, exl3::cuda::DeviceMoeLayer::Upload(view));
  bytes->experts_resident += static_cast<int64_t>(moe->experts->device_bytes());
  for (const ExpertMlp* e : view.experts)
    if (e != nullptr) for (const Exl3LinearView* v : {&e->gate, &e->up, &e->down}) bytes->experts_decoded.Add(*v);
  if (view.shared != nullptr)
    for (const Exl3LinearView* v : {&view.shared->gate, &view.shared->up, &view.shared->down})
      bytes->experts_decoded.Add(*v);
  if (runner_ == nullptr) {
    EXL3_ASSIGN_OR_RETURN(runner_, exl3::cuda::MoeRunner::Create(*moe->experts, max_moe_tokens_, cfg_.moe.top_k));
  }
  return absl::OkStatus();
}

absl::Status CudaMoe::Reserve(int rows, bool* moved) {
  const size_t t = static_cast<size_t>(rows), k = static_cast<size_t>(std::max(cfg_.moe.top_k, 1));
  const size_t logits = t * std::max(cfg_.moe.num_experts, 1);
  if (router_logits_.size() < logits || topk_weights_.size() < t * k || topk_ids_.size() < t * k) {
    *moved = true;
    EXL3_RETURN_IF_ERROR(router_logits_.Reserve(logits));
    EXL3_RETURN_IF_ERROR(topk_weights_.Reserve(t * k));
    EXL3_RETURN_IF_ERROR(topk_ids_.Reserve(t * k));
  }
  return absl::OkStatus();
}

absl::Status CudaMoe::BeginStep(const std::vector<MicroBatchRange>& micro_batches) {
  if (exchange_ == nullptr) return absl::OkStatus();
  std::vector<int> rows;
  for (const MicroBatchRange& mb : micro_batches) rows.push_back(mb.num_tokens);
  return exchange_->BeginStep(rows);
}

absl::Status CudaMoe::Route(const CudaMoeLayer& moe, const CudaStep& step, int first, int n, const float* x) {
  const size_t r = static_cast<size_t>(first), k = static_cast<size_t>(cfg_.moe.top_k);
  float* logits = router_logits_.get() + r * cfg_.moe.num_experts;
  int32_t* ids = topk_ids_.get() + r * k;
  float* weights = topk_weights_.get() + r * k;
  EXL3_RETURN_IF_ERROR(moe.router.Forward(x + r * cfg_.hidden_size, n, logits, linear_));
  if (!moe.hash_table.empty())  // experts from the token ids (this step's, on the device)
    return HashRouteOnDevice(gate_, logits, moe.hash_table.get(), step.ids + r, n, ids, weights, linear_.stream);
  return RouteOnDevice(gate_, logits, moe.bias.empty() ? nullptr : moe.bias.get(), n, ids, weights, linear_.stream);
}

absl::Status CudaMoe::Run(const CudaMoeLayer& moe, const CudaStep& step, int m, int first, int n, const float* x,
                          float* d, const int32_t* host_token_ids) {
  EXL3_RETURN_IF_ERROR(Route(moe, step, first, n, x));
  const size_t H = static_cast<size_t>(cfg_.hidden_size), k = static_cast<size_t>(cfg_.moe.top_k);
  if (exchange_ != nullptr) {
    // The gate ran on this GPU: the workers get the micro-batch's top-k with its hidden states.
    const size_t r = static_cast<size_t>(first);
    const MoeRouting routing{cfg_.moe.top_k, topk_ids_.get() + r * k, topk_weights_.get() + r * k};
    return exchange_->Send(m, moe.layer, x + r * H, &routing,
                           host_token_ids != nullptr ? host_token_ids + first : nullptr, linear_.stream);
  }
  EXL3_RETURN_IF_ERROR(runner_->Rebind(*moe.experts));
  for (int t0 = first; t0 < first + n; t0 += max_moe_tokens_) {
    const int rows = std::min(max_moe_tokens_, first + n - t0);
    const size_t row = static_cast<size_t>(t0);
    EXL3_RETURN_IF_ERROR(runner_->Forward(x + row * H, rows, topk_ids_.get() + row * k, topk_weights_.get() + row * k,
                                          d + row * H, linear_.stream));
  }
  return absl::OkStatus();
}

absl::Status CudaMoe::Finish(int m, int first, float* d) {
  return exchange_->Finish(m, d + static_cast<size_t>(first) * cfg_.hidden_size, linear_.stream);
}

absl::StatusOr<RemoteExchangeTimes> CudaMoe::StepTimes() {
  if (exchange_ == nullptr) return RemoteExchangeTimes{};
  return exchange_->StepTimes();
}

}  // namespace exl3::engine::cuda
