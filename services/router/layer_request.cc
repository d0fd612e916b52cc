#include "services/router/layer_request.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/index_ranges.h"
#include "services/common/wire.h"

namespace exl3::router {

namespace {

// Which routing the request gives: at most one of router_logits, topk and token_ids.
absl::Status DecodeGateInput(const pb::MoeLayerRequest& req, const MoeConfig& cfg,
                             GateInput* in) {
  const bool has_logits = req.has_router_logits();
  const bool has_topk = req.has_topk();
  const bool has_tokens = req.token_ids_size() > 0;
  if (static_cast<int>(has_logits) + has_topk + has_tokens > 1) {
    return absl::InvalidArgumentError("give at most one of router_logits, topk and token_ids");
  }
  in->token_ids.assign(req.token_ids().begin(), req.token_ids().end());
  if (has_topk) {
    in->source = RoutingSource::kTopK;
    in->topk_k = req.topk().k();
    in->topk_ids.assign(req.topk().ids().begin(), req.topk().ids().end());
    in->topk_weights.assign(req.topk().weights().begin(), req.topk().weights().end());
  } else if (has_logits) {
    in->source = RoutingSource::kLogits;
    EXL3_RETURN_IF_ERROR(svc::DecodeMatrix(req.router_logits(), "router_logits", cfg.num_experts,
                                           &in->logits, &in->logit_rows));
  } else {
    in->source = RoutingSource::kGateWeights;
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

absl::StatusOr<LayerRequest> Decode(pb::MoeLayerRequest& req, const MoeConfig& cfg,
                                    const LayerRequestLimits& limits, bool always_f32,
                                    bool local_shared_expert) {
  if (const size_t n = req.ByteSizeLong(); n > static_cast<size_t>(limits.max_message_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request is ", n, " bytes, over --max-message-bytes ", limits.max_message_bytes,
        ": split it into requests of fewer tokens"));
  }
  if (!cfg.IsMoeLayer(req.layer())) {
    const std::vector<int> ml = cfg.MoeLayers();
    return absl::NotFoundError(absl::StrCat(
        "layer ", req.layer(), " is not an MoE layer of this model (MoE layers: ",
        FormatIndexRanges(std::vector<int32_t>(ml.begin(), ml.end())), ")"));
  }
  if (!req.has_hidden()) return absl::InvalidArgumentError("empty request: no hidden tensor");
  LayerRequest r;
  EXL3_RETURN_IF_ERROR(svc::ResolveOutputDType(req.output_dtype(), "output_dtype", &r.out_dtype));
  // The gate reads the hidden states only when it computes the logits itself.
  const bool gated_here = !req.has_router_logits() && !req.has_topk();
  const bool f32 =
      always_f32 || gated_here || (local_shared_expert && req.include_shared_expert());
  if (f32) {
    EXL3_RETURN_IF_ERROR(
        svc::DecodeMatrix(req.hidden(), "hidden", cfg.hidden_size, &r.hidden, &r.num_tokens));
  } else {
    EXL3_RETURN_IF_ERROR(svc::ValidateTensor(req.hidden(), "hidden", {-1, cfg.hidden_size}));
    EXL3_RETURN_IF_ERROR(svc::CheckFinite(req.hidden(), "hidden"));
    r.num_tokens = req.hidden().shape(0);
  }
  if (r.num_tokens > limits.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("request has ", r.num_tokens,
                                                     " tokens; the router accepts at most ",
                                                     limits.max_tokens, " (--max-tokens)"));
  }
  r.hidden_size = cfg.hidden_size;
  r.in_dtype = req.hidden().dtype();
  r.row_bytes = static_cast<size_t>(r.hidden_size) * svc::WireDTypeSize(r.in_dtype);
  r.hidden_bytes = std::move(*req.mutable_hidden()->mutable_data());
  r.include_shared_expert = req.include_shared_expert();
  r.gate.layer = req.layer();
  r.gate.num_tokens = static_cast<int>(r.num_tokens);
  EXL3_RETURN_IF_ERROR(DecodeGateInput(req, cfg, &r.gate));
  return r;
}

}  // namespace

absl::StatusOr<LayerRequest> DecodeLayerRequest(const pb::MoeLayerRequest& req,
                                                const MoeConfig& cfg,
                                                const LayerRequestLimits& limits) {
  pb::MoeLayerRequest copy = req;
  return Decode(copy, cfg, limits, /*always_f32=*/true, /*local_shared_expert=*/false);
}

absl::StatusOr<LayerRequest> TakeLayerRequest(pb::MoeLayerRequest& req, const MoeConfig& cfg,
                                              const LayerRequestLimits& limits,
                                              bool local_shared_expert) {
  return Decode(req, cfg, limits, /*always_f32=*/false, local_shared_expert);
}

}  // namespace exl3::router
