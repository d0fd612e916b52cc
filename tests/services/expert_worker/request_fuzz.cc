// libFuzzer target: arbitrary bytes as a serialized ExpertRequest through the worker's request
// validation (DecodeExpertRequest) against a fixed model shape. Whatever it accepts must be safe
// to hand to a backend: ids held or -1, weights and hidden states finite, sizes consistent.
// Built and run by scripts/checks/worker_fuzz.sh.
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "services/expert_worker/request.h"

namespace {

const exl3::worker::ModelShape& Shape() {
  static const exl3::worker::ModelShape s = [] {
    exl3::worker::ModelShape m;
    m.hidden_size = 8;
    m.num_layers = 3;
    m.num_experts = 6;
    m.top_k = 3;
    m.moe_layer = {false, true, true};
    m.held.assign(3, std::vector<bool>(6, false));
    for (int e = 0; e < 4; ++e) m.held[1][e] = m.held[2][e] = true;
    m.held_ranges = {"none", "0-3", "0-3"};
    return m;
  }();
  return s;
}

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  exl3::worker::pb::ExpertRequest msg;
  if (!msg.ParseFromArray(data, static_cast<int>(size))) return 0;
  exl3::worker::RequestLimits limits;
  limits.max_message_bytes = 1 << 20;
  limits.max_tokens = 4096;
  auto r = exl3::worker::DecodeExpertRequest(std::move(msg), Shape(), limits,
                                             exl3::worker::Clock::now());
  if (!r.ok()) {
    Check(!r.status().message().empty());
    return 0;
  }
  const auto& w = **r;
  const auto& sh = Shape();
  Check(w.tokens >= 1 && w.slots >= 1 && w.slots <= limits.max_slots);
  Check(w.layer >= 0 && w.layer < sh.num_layers && sh.moe_layer[w.layer]);
  Check(w.ids.size() == static_cast<size_t>(w.tokens) * w.slots);
  Check(w.weights.size() == w.ids.size());
  for (size_t i = 0; i < w.ids.size(); ++i) {
    const int e = w.ids[i];
    Check(e == -1 || (e >= 0 && e < sh.num_experts && sh.held[w.layer][e]));
    if (e >= 0) Check(std::isfinite(w.weights[i]));
  }
  for (int64_t i = 0; i < static_cast<int64_t>(w.tokens) * sh.hidden_size; ++i) {
    Check(std::isfinite(w.x[i]));
  }
  return 0;
}
