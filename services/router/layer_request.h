// One MoeLayerRequest (proto/exl3serve/v1/exl3serve.proto) decoded and checked against the model:
// the hidden states (as sent, and in fp32), the answer's dtype, the shared-expert flag and the
// gate's input (services/router/gate.h). What is wrong is named in the error (INVALID_ARGUMENT,
// NOT_FOUND for a layer that is not MoE, RESOURCE_EXHAUSTED above the limits).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "exl3serve/v1/exl3serve.pb.h"
#include "model/moe_config.h"
#include "services/router/gate.h"

namespace exl3::router {

namespace pb = ::exl3serve::v1;

struct LayerRequestLimits {
  int64_t max_tokens = 65536;             // --max-tokens
  int64_t max_message_bytes = 64 << 20;  // --max-message-bytes
};

struct LayerRequest {
  int64_t num_tokens = 0;
  int hidden_size = 0;
  pb::DType in_dtype = pb::DTYPE_FP32;   // of hidden_bytes
  pb::DType out_dtype = pb::DTYPE_FP32;  // of the answer
  std::string hidden_bytes;              // [T, H] as sent (sliced per worker)
  size_t row_bytes = 0;                  // of one row of hidden_bytes
  // [T, H] fp32 for the gate and the local shared expert; empty when TakeLayerRequest was told
  // neither needs it (the caller's top-k or logits, no local shared expert).
  std::vector<float> hidden;
  bool include_shared_expert = false;
  GateInput gate;
};

// Decodes a copy of `req`'s hidden states; `hidden` (fp32) is always filled.
absl::StatusOr<LayerRequest> DecodeLayerRequest(const pb::MoeLayerRequest& req,
                                                const MoeConfig& cfg,
                                                const LayerRequestLimits& limits);

// The same checks and errors, taking `req`'s hidden bytes (left empty in `req`) instead of copying
// them, and converting them to fp32 `hidden` only when something reads it: the gate computing
// logits from them (no router_logits or topk given), or the local shared expert
// (`local_shared_expert` and the request includes it). Otherwise their finiteness is checked on
// the wire bytes.
absl::StatusOr<LayerRequest> TakeLayerRequest(pb::MoeLayerRequest& req, const MoeConfig& cfg,
                                              const LayerRequestLimits& limits,
                                              bool local_shared_expert);

}  // namespace exl3::router
