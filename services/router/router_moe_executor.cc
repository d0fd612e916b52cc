#include "services/router/router_moe_executor.h"

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "base/status_macros.h"
#include "services/client/moe_client.h"
#include "services/common/wire.h"

namespace exl3::router {
namespace {

// The router answers every request by its deadline at the latest, so Wait is bounded.
class RouterMoeCall final : public engine::MoeCall {
 public:
  RouterMoeCall(float* y, size_t floats) : y_(y), floats_(floats) {}
  absl::Status Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    return status_;
  }
  // On the thread that completes the request. An OK answer without an output tensor summed into
  // y_ itself (InProcessStream::SendOwned).
  void Complete(absl::Status st, const pb::MoeLayerResponse* r, int hidden) {
    if (st.ok() && r == nullptr) st = absl::InternalError("MoE request ended without an answer");
    if (st.ok() && (r->status().code() != pb::OK || r->has_output())) {
      st = client::ResponseOutputTo(*r, hidden, y_, floats_);
    }
    std::lock_guard<std::mutex> lock(mu_);
    status_ = st;
    done_ = true;
    cv_.notify_all();
  }

 private:
  float* y_;
  size_t floats_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
};

}  // namespace

RouterMoeExecutor::RouterMoeExecutor(MoeRouterService& service, int inline_max_tokens,
                                     int hidden_size, std::chrono::milliseconds timeout)
    : stream_(InProcessStream::Open(service, inline_max_tokens)),
      spare_(service.spare_buffers()),
      hidden_(hidden_size),
      timeout_(timeout) {}

RouterMoeExecutor::~RouterMoeExecutor() { (void)stream_->Close(); }

pb::MoeLayerRequest RouterMoeExecutor::Request(int layer, const float* x, int T) const {
  pb::MoeLayerRequest req;
  req.set_layer(layer);
  pb::Tensor* h = req.mutable_hidden();
  *h->mutable_data() = spare_->Take();
  svc::EncodeTensor(x, {T, hidden_}, pb::DTYPE_FP32, h);
  req.set_output_dtype(pb::DTYPE_FP32);
  req.set_include_shared_expert(true);
  return req;
}

std::unique_ptr<engine::MoeCall> RouterMoeExecutor::Start(int layer, const float* x, int T,
                                                          const int32_t* token_ids, float* y) {
  pb::MoeLayerRequest req = Request(layer, x, T);
  // The router gates from the hidden states; token ids choose the experts of hash-routed layers
  // (DeepSeek-V4's hash_moe) and are ignored on the others, so they always travel (T int64s
  // beside T x hidden floats).
  if (token_ids != nullptr) {
    req.mutable_token_ids()->Reserve(T);
    for (int t = 0; t < T; ++t) req.add_token_ids(token_ids[t]);
  }
  return Send(std::move(req), T, y);
}

std::unique_ptr<engine::MoeCall> RouterMoeExecutor::StartRouted(int layer, const float* x, int T,
                                                                const engine::MoeRouting& routing, float* y) {
  pb::MoeLayerRequest req = Request(layer, x, T);
  pb::TopK* topk = req.mutable_topk();
  topk->set_k(routing.k);
  const size_t n = static_cast<size_t>(T) * routing.k;
  topk->mutable_ids()->Add(routing.ids, routing.ids + n);
  topk->mutable_weights()->Add(routing.weights, routing.weights + n);
  return Send(std::move(req), T, y);
}

std::unique_ptr<engine::MoeCall> RouterMoeExecutor::Send(pb::MoeLayerRequest req, int T, float* y) {
  req.set_timeout_us(static_cast<uint64_t>(timeout_.count()) * 1000);
  auto call = std::make_shared<RouterMoeCall>(y, static_cast<size_t>(T) * hidden_);
  const int hidden = hidden_;
  const absl::Status sent = stream_->SendOwned(
      std::move(req), y,
      [call, hidden](absl::Status st, const pb::MoeLayerResponse* r) {
        call->Complete(st, r, hidden);
      });
  if (!sent.ok()) call->Complete(sent, nullptr, hidden);
  // The callback holds the call too; a handle dropped unwaited still waits, so the answer never
  // lands in a buffer its caller has freed.
  struct Handle final : engine::MoeCall {
    std::shared_ptr<RouterMoeCall> call;
    ~Handle() override { (void)call->Wait(); }
    absl::Status Wait() override { return call->Wait(); }
  };
  auto h = std::make_unique<Handle>();
  h->call = std::move(call);
  return h;
}

absl::Status RouterMoeExecutor::Forward(int layer, const float* x, int T, const int32_t* token_ids,
                                        float* y) {
  return Start(layer, x, T, token_ids, y)->Wait();
}

}  // namespace exl3::router
