#include "services/expert_worker/request.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/wire.h"

namespace exl3::worker {
namespace {

std::string MoeLayerList(const ModelShape& s) {
  std::string out;
  int run_start = -1;
  for (int l = 0; l <= s.num_layers; ++l) {
    const bool m = l < s.num_layers && s.moe_layer[l];
    if (m && run_start < 0) run_start = l;
    if (!m && run_start >= 0) {
      absl::StrAppend(&out, out.empty() ? "" : ",", run_start);
      if (l - 1 > run_start) absl::StrAppend(&out, "-", l - 1);
      run_start = -1;
    }
  }
  return out.empty() ? "none" : out;
}

}  // namespace

absl::StatusOr<std::shared_ptr<WorkRequest>> DecodeExpertRequest(pb::ExpertRequest&& msg,
                                                                 const ModelShape& shape,
                                                                 const RequestLimits& limits,
                                                                 Clock::time_point received) {
  const int layer = msg.layer();
  if (layer < 0 || layer >= shape.num_layers) {
    return absl::NotFoundError(absl::StrCat("layer ", layer, " is out of range: the model has ",
                                            shape.num_layers, " layers (MoE layers: ",
                                            MoeLayerList(shape), ")"));
  }
  if (!shape.moe_layer[layer]) {
    return absl::NotFoundError(absl::StrCat("layer ", layer, " is not an MoE layer (MoE layers: ",
                                            MoeLayerList(shape), ")"));
  }
  if (!msg.has_hidden() || msg.hidden().shape_size() == 0 || msg.hidden().data().empty()) {
    return absl::InvalidArgumentError("empty request: no hidden states (hidden must be [T, hidden_size] with T >= 1)");
  }
  const pb::Tensor& h = msg.hidden();
  if (h.shape_size() == 2 && h.shape(0) == 0) {
    return absl::InvalidArgumentError("empty request: hidden has 0 tokens");
  }
  if (h.shape_size() == 2 && h.shape(1) != shape.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("hidden size ", h.shape(1),
                                                   " is not the model's hidden_size ",
                                                   shape.hidden_size));
  }
  if (absl::Status s = svc::ValidateTensor(h, "hidden", {-1, shape.hidden_size}); !s.ok()) return s;
  const int64_t T = h.shape(0);
  if (T > limits.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("request has ", T, " tokens, more than the ",
                                                     limits.max_tokens, " this worker accepts"));
  }
  if (msg.shared_expert() && !shape.shared_expert) {
    return absl::NotFoundError(
        "shared_expert: this worker does not hold the shared expert (start it with "
        "--shared-expert, or give it shared_expert: true in the expert map)");
  }
  const int S = msg.slots();
  // A shared-expert request may carry no routed slots at all.
  const int min_slots = msg.shared_expert() ? 0 : 1;
  if (S < min_slots || S > limits.max_slots) {
    return absl::InvalidArgumentError(absl::StrCat("slots is ", S, ", must be in ", min_slots, "..",
                                                   limits.max_slots));
  }
  const size_t n = static_cast<size_t>(T) * S;
  if (static_cast<size_t>(msg.expert_ids_size()) != n ||
      static_cast<size_t>(msg.expert_weights_size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert_ids has ", msg.expert_ids_size(), " and expert_weights ", msg.expert_weights_size(),
        " entries; T * slots = ", T, " * ", S, " = ", n, " expected for each"));
  }
  pb::DType out_dtype;
  if (absl::Status s = svc::ResolveOutputDType(msg.output_dtype(), "output_dtype", &out_dtype);
      !s.ok()) {
    return s;
  }
  const uint64_t out_bytes = static_cast<uint64_t>(T) * shape.hidden_size * svc::WireDTypeSize(out_dtype);
  if (out_bytes + 1024 > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the output of ", T, " tokens would be ", out_bytes, " bytes, over the message limit of ",
        limits.max_message_bytes, " (send fewer tokens per request or ask for fp16/bf16 output)"));
  }

  auto r = std::make_shared<WorkRequest>();
  r->id = msg.id();
  r->layer = layer;
  r->tokens = static_cast<int>(T);
  r->slots = S;
  r->shared = msg.shared_expert();
  r->output_dtype = out_dtype;
  r->received = received;
  if (msg.timeout_us() > 0) {
    r->deadline = received + svc::RequestTimeout(msg.timeout_us());
  }
  r->ids.assign(msg.expert_ids().begin(), msg.expert_ids().end());
  r->weights.assign(msg.expert_weights().begin(), msg.expert_weights().end());
  const std::vector<bool>& held = shape.held[layer];
  std::vector<int> per_expert(shape.num_experts, 0);  // routed tokens per expert
  for (int64_t t = 0; t < T; ++t) {
    int used = 0;
    for (int s = 0; s < S; ++s) {
      const size_t i = static_cast<size_t>(t) * S + s;
      const int32_t e = r->ids[i];
      if (e == -1) continue;
      if (e < -1 || e >= shape.num_experts) {
        return absl::NotFoundError(absl::StrCat("token ", t, " slot ", s, ": expert ", e,
                                                " is out of range [0, ", shape.num_experts,
                                                ") (-1 marks an empty slot)"));
      }
      if (!held[e]) {
        return absl::NotFoundError(absl::StrCat("token ", t, " slot ", s, ": expert ", e,
                                                " of layer ", layer,
                                                " is not held by this worker (held: ",
                                                shape.held_ranges[layer], ")"));
      }
      if (!std::isfinite(r->weights[i])) {
        return absl::InvalidArgumentError(absl::StrCat("token ", t, " slot ", s, ": weight ",
                                                       r->weights[i], " of expert ", e,
                                                       " is not finite"));
      }
      for (int s2 = 0; s2 < s; ++s2) {
        if (r->ids[static_cast<size_t>(t) * S + s2] == e) {
          return absl::InvalidArgumentError(absl::StrCat("token ", t, ": expert ", e,
                                                         " appears in slots ", s2, " and ", s));
        }
      }
      ++used;
      ++per_expert[e];
    }
    if (used > shape.top_k) {
      return absl::InvalidArgumentError(absl::StrCat("token ", t, " routes to ", used,
                                                      " experts, more than the model's top_k ",
                                                      shape.top_k));
    }
  }
  for (int e = 0; e < shape.num_experts; ++e) {
    if (per_expert[e] > 0) r->expert_tokens.emplace_back(e, per_expert[e]);
  }

  // Hidden states last (the largest work): fp32 bytes are taken over, others converted.
  pb::Tensor* ht = msg.mutable_hidden();
  if (ht->dtype() == pb::DTYPE_FP32) {
    r->x_bytes = std::move(*ht->mutable_data());
    const float* x = reinterpret_cast<const float*>(r->x_bytes.data());
    const int64_t bad = svc::FirstNonFinite(x, r->x_bytes.size() / 4);
    if (bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hidden: non-finite value ", x[bad], " at [", bad / shape.hidden_size, ", ",
          bad % shape.hidden_size, "] (NaN/Inf inputs are rejected)"));
    }
    r->x = x;
  } else {
    r->x_f32.resize(static_cast<size_t>(T) * shape.hidden_size);
    if (absl::Status s = svc::TensorToFloat(*ht, "hidden", /*require_finite=*/true, r->x_f32.data());
        !s.ok()) {
      return s;
    }
    r->x = r->x_f32.data();
  }
  return r;
}

}  // namespace exl3::worker
