// The gate of one MoE layer request: which experts each token uses, with which weights. Plain
// structs in and out (no gRPC): the caller's top-k as given (checked), the caller's router logits
// through the model's routing function (model/routing.h), or logits computed here from the
// layer's gate weight (hash-routed layers: from the token ids).
//
//   Gate gate(model, /*threads=*/4);
//   GateInput in; in.layer = 3; in.num_tokens = T;            // source: kGateWeights
//   absl::StatusOr<Routing> r = gate.Route(std::move(in), hidden);  // r->ids, r->weights: [T, k]
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/thread_pool.h"
#include "model/exl3_model.h"

namespace exl3::router {

enum class RoutingSource {
  kGateWeights,  // logits computed from the layer's gate weight (hash-routed layers: token_ids)
  kLogits,       // the caller's router logits, through the model's routing function
  kTopK,         // the caller's expert ids and weights, as they are
};

struct GateInput {
  int layer = 0;
  int num_tokens = 0;
  RoutingSource source = RoutingSource::kGateWeights;
  // kLogits: [logit_rows, num_experts] (logit_rows must equal num_tokens).
  std::vector<float> logits;
  int64_t logit_rows = 0;
  // kTopK: [num_tokens, topk_k] each.
  int topk_k = 0;
  std::vector<int32_t> topk_ids;
  std::vector<float> topk_weights;
  // kGateWeights: the tokens' ids (required on hash-routed layers, else optional); empty or
  // num_tokens entries.
  std::vector<int64_t> token_ids;
};

// The experts of each token: ids and weights [num_tokens, k], row-major.
struct Routing {
  int k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

class Gate {
 public:
  // `model` must outlive the gate; `threads` > 1: a pool of that many computes large gates.
  Gate(const Exl3Model& model, int threads);
  ~Gate();

  // `hidden`: [in.num_tokens, hidden_size] fp32, finite (read for kGateWeights only). Errors
  // (INVALID_ARGUMENT, FAILED_PRECONDITION) name the field and the problem. A given top-k is
  // moved into the answer.
  absl::StatusOr<Routing> Route(GateInput in, const float* hidden);

 private:
  absl::StatusOr<Routing> CheckTopK(GateInput& in) const;
  absl::StatusOr<Routing> FromGateWeights(const GateInput& in, const float* hidden);
  // logits [T, E] = x [T, hidden] · router_w^T, split over the pool by blocks of experts.
  void ComputeLogits(const float* router_w, const float* x, int num_tokens, float* logits);

  const Exl3Model& model_;
  const MoeConfig& cfg_;
  // The gate reads the layer's whole router weight (4.7 MB at 288 x 4096 fp32), usually cold in
  // cache: one thread is bound by its own memory bandwidth, several split it.
  std::mutex pool_mu_;  // held while the pool computes one gate (ParallelFor: one call at a time)
  std::unique_ptr<cpu::ThreadPool> pool_;
};

}  // namespace exl3::router
