#include "services/router/router_moe_executor.h"

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "base/status_macros.h"
#include "services/client/moe_client.h"

namespace exl3::router {

RouterMoeExecutor::RouterMoeExecutor(MoeRouterService& service, int inline_max_tokens,
                                     int hidden_size, std::chrono::milliseconds timeout)
    : stream_(InProcessStream::Open(service, inline_max_tokens)),
      hidden_(hidden_size),
      timeout_(timeout) {}

RouterMoeExecutor::~RouterMoeExecutor() { (void)stream_->Close(); }

absl::Status RouterMoeExecutor::Forward(int layer, const float* x, int T, const int32_t* token_ids,
                                        float* y) {
  pb::MoeLayerRequest req = client::MakeLayerRequest(layer, x, T, hidden_, pb::DTYPE_FP32);
  // token_ids route hash-routed layers only (a routing source of their own); the families the
  // engine runs have none, so the router gates from the hidden states.
  (void)token_ids;
  req.set_timeout_us(static_cast<uint64_t>(timeout_.count()) * 1000);

  struct Answer {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    absl::Status status;
    std::vector<float> output;
  };
  auto answer = std::make_shared<Answer>();
  const int hidden = hidden_;
  EXL3_RETURN_IF_ERROR(stream_->Send(req, [answer, hidden](absl::Status st,
                                                           const pb::MoeLayerResponse* r) {
    std::vector<float> out;
    if (st.ok() && r != nullptr) st = client::ResponseOutput(*r, hidden, &out);
    std::lock_guard<std::mutex> lock(answer->mu);
    answer->status = st;
    answer->output = std::move(out);
    answer->done = true;
    answer->cv.notify_one();
  }));
  // The router answers every request by its deadline at the latest.
  std::unique_lock<std::mutex> lock(answer->mu);
  answer->cv.wait(lock, [&] { return answer->done; });
  EXL3_RETURN_IF_ERROR(answer->status);
  if (answer->output.size() != static_cast<size_t>(T) * hidden_)
    return absl::InternalError("MoE answer of the wrong size");
  std::memcpy(y, answer->output.data(), answer->output.size() * sizeof(float));
  return absl::OkStatus();
}

}  // namespace exl3::router
