#include "services/router/gate.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/routing.h"

namespace exl3::router {

Gate::Gate(const Exl3Model& model, int threads) : model_(model), cfg_(model.config()) {
  if (threads > 1) pool_ = std::make_unique<cpu::ThreadPool>(threads);
}

Gate::~Gate() = default;

absl::StatusOr<Routing> Gate::Route(GateInput in, const float* hidden) {
  if (!in.token_ids.empty() && static_cast<int64_t>(in.token_ids.size()) != in.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids has ", in.token_ids.size(),
                                                   " entries, hidden has ", in.num_tokens, " rows"));
  }
  switch (in.source) {
    case RoutingSource::kTopK:
      return CheckTopK(in);
    case RoutingSource::kLogits: {
      if (in.logit_rows != in.num_tokens) {
        return absl::InvalidArgumentError(absl::StrCat("router_logits has ", in.logit_rows,
                                                       " rows, hidden has ", in.num_tokens));
      }
      Routing r;
      r.k = cfg_.top_k;
      r.ids.resize(static_cast<size_t>(in.num_tokens) * r.k);
      r.weights.resize(r.ids.size());
      EXL3_RETURN_IF_ERROR(RouteFromLogits(cfg_, in.layer, in.logits.data(),
                                           model_.CorrectionBias(in.layer), in.num_tokens,
                                           r.ids.data(), r.weights.data()));
      return r;
    }
    case RoutingSource::kGateWeights:
      return FromGateWeights(in, hidden);
  }
  return absl::InternalError("unknown routing source");
}

absl::StatusOr<Routing> Gate::CheckTopK(GateInput& in) const {
  const int64_t T = in.num_tokens;
  // A token may use at most the model's top_k experts (the workers refuse more).
  if (in.topk_k < 1 || in.topk_k > cfg_.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("topk.k is ", in.topk_k, ", not in 1..",
                                                   cfg_.top_k, " (the model's top_k)"));
  }
  const int64_t n = T * in.topk_k;
  if (static_cast<int64_t>(in.topk_ids.size()) != n ||
      static_cast<int64_t>(in.topk_weights.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topk.ids and topk.weights must have T*k = ", n, " entries (have ", in.topk_ids.size(),
        " and ", in.topk_weights.size(), ")"));
  }
  const int k = in.topk_k, E = cfg_.num_experts;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* ids = in.topk_ids.data() + t * k;
    for (int j = 0; j < k; ++j) {
      if (ids[j] < 0 || ids[j] >= E) {
        return absl::InvalidArgumentError(absl::StrCat("topk.ids[", t, ", ", j, "] = ", ids[j],
                                                       " is not an expert (0..", E - 1, ")"));
      }
      if (std::find(ids, ids + j, ids[j]) != ids + j) {
        return absl::InvalidArgumentError(
            absl::StrCat("topk.ids: expert ", ids[j], " repeated for token ", t));
      }
      if (!std::isfinite(in.topk_weights[t * k + j])) {
        return absl::InvalidArgumentError(
            absl::StrCat("topk.weights[", t, ", ", j, "] is not finite"));
      }
    }
  }
  return Routing{k, std::move(in.topk_ids), std::move(in.topk_weights)};
}

absl::StatusOr<Routing> Gate::FromGateWeights(const GateInput& in, const float* hidden) {
  const int L = in.layer, T = in.num_tokens;
  const float* router_w = model_.RouterWeight(L);
  if (router_w == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", L, ": the router holds no gate weight; send router_logits or topk"));
  }
  Routing r;
  r.k = cfg_.top_k;
  r.ids.resize(static_cast<size_t>(T) * r.k);
  r.weights.resize(r.ids.size());
  if (cfg_.IsHashRoutedLayer(L)) {
    if (in.token_ids.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", L, " is hash-routed: token_ids required"));
    }
    int64_t vocab = 0;
    const int32_t* table = model_.HashTable(L, &vocab);
    if (table == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("layer ", L, ": hash table not loaded"));
    }
    std::vector<float> logits(static_cast<size_t>(T) * cfg_.num_experts);
    ComputeLogits(router_w, hidden, T, logits.data());
    EXL3_RETURN_IF_ERROR(RouteHashed(cfg_, L, logits.data(), table, vocab, in.token_ids.data(), T,
                                     r.ids.data(), r.weights.data()));
    return r;
  }
  std::vector<float> logits(static_cast<size_t>(T) * cfg_.num_experts);  // hidden is finite
  ComputeLogits(router_w, hidden, T, logits.data());
  EXL3_RETURN_IF_ERROR(RouteFromLogits(cfg_, L, logits.data(), model_.CorrectionBias(L), T,
                                       r.ids.data(), r.weights.data()));
  return r;
}

void Gate::ComputeLogits(const float* router_w, const float* x, int num_tokens, float* logits) {
  const int E = cfg_.num_experts, H = cfg_.hidden_size;
  constexpr int kExpertsPerItem = 16;
  // A small gate (decode on a small model) is cheaper on this thread than the pool's hand-off.
  constexpr int64_t kPoolMinMacs = 256 * 1024;
  const int items = (E + kExpertsPerItem - 1) / kExpertsPerItem;
  if (!pool_ || items < 2 || static_cast<int64_t>(num_tokens) * E * H < kPoolMinMacs) {
    ComputeRouterLogits(router_w, x, num_tokens, E, H, logits);
    return;
  }
  // The pool serves one gate at a time; while it is busy (many streams at once) a gate runs on its
  // own request thread instead of queueing, so concurrency keeps its throughput.
  std::unique_lock<std::mutex> l(pool_mu_, std::try_to_lock);
  if (!l.owns_lock()) {
    ComputeRouterLogits(router_w, x, num_tokens, E, H, logits);
    return;
  }
  pool_->ParallelFor(items, [&](int item, int) {
    const int e0 = item * kExpertsPerItem, n = std::min(kExpertsPerItem, E - e0);
    const float* w = router_w + static_cast<size_t>(e0) * H;
    for (int t = 0; t < num_tokens; ++t) {  // each token's logits of experts e0..e0+n
      ComputeRouterLogits(w, x + static_cast<size_t>(t) * H, 1, n, H,
                          logits + static_cast<size_t>(t) * E + e0);
    }
  });
}

}  // namespace exl3::router
