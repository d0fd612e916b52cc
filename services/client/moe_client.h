// C++ client of the MoeRouter service, for attention engines and tools.
//
//   ClientOptions o; o.target = "127.0.0.1:50051";            // o.tls for TLS / mTLS
//   auto client = MoeClient::Connect(o);                       // StatusOr<unique_ptr<MoeClient>>
//   auto info = (*client)->Describe();                         // model identity, workers
//   std::unique_ptr<MoeStream> s = (*client)->OpenStream();
//   pb::MoeLayerRequest req = MakeLayerRequest(layer, x.data(), T, hidden, pb::DTYPE_FP16);
//   s->Send(req, [](absl::Status st, const pb::MoeLayerResponse* r) { ... });  // pipelined
//   absl::StatusOr<pb::MoeLayerResponse> r = s->Call(req);                    // or blocking
//   s->CancelRequest(req.id());              // withdraw one request (answered CANCELLED)
//   std::vector<float> y; absl::Status ok = ResponseOutput(*r, hidden, &y);
//
// Many requests may be in flight on one stream; each callback runs once, on the stream's reader
// thread, with the response (whose in-band status may be an error) or, when the stream ended
// before it was answered, with the stream's error and a null response.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "services/client/layer_stream.h"
#include "services/common/server.h"

namespace exl3::client {

namespace pb = ::exl3serve::v1;

struct ClientOptions {
  std::string target;         // HOST:PORT
  svc::ClientTls tls;         // enabled=false: plaintext
  int max_message_bytes = 64 << 20;
  std::string ssl_target_name_override;  // tests: certificate name when dialing an IP
};

class MoeStream final : public LayerStream {
 public:
  ~MoeStream() override;  // Close()
  // Sends `req` with a fresh id (overwriting req.id). `cb` runs exactly once unless Send fails.
  absl::Status Send(pb::MoeLayerRequest& req, ResponseCallback cb) override;
  // Send and wait for the answer.
  absl::StatusOr<pb::MoeLayerResponse> Call(pb::MoeLayerRequest req);
  // Requests sent and not yet answered.
  int in_flight() const;
  // Half-closes, waits for the outstanding answers and the stream's end; returns its status.
  absl::Status Close() override;
  // Cancels the stream (outstanding callbacks get CANCELLED).
  void Cancel() override;
  // Withdraws one request (`id`: req.id() after Send): the router answers it CANCELLED (its
  // callback runs with that answer) and withdraws its work from the workers, unless it was
  // answered already. The stream and the other requests go on.
  absl::Status CancelRequest(uint64_t id,
                             pb::CancelReason reason = pb::CANCEL_REASON_CLIENT) override;

 private:
  friend class MoeClient;
  MoeStream() = default;
  void ReadLoop();
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::MoeLayerRequest, pb::MoeLayerResponse>> rw_;
  std::mutex write_mu_;
  bool writes_done_ = false;  // guarded by write_mu_
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool ended_ = false;  // guarded by mu_
  absl::Status end_status_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, ResponseCallback> pending_;
  std::thread reader_;
  bool closed_ = false;
};

class MoeClient {
 public:
  static absl::StatusOr<std::unique_ptr<MoeClient>> Connect(const ClientOptions& o);
  absl::StatusOr<pb::RouterDescribeResponse> Describe(int timeout_ms = 5000);
  // Waits until the channel is connected (or the timeout passes).
  bool WaitForConnected(int timeout_ms);
  std::unique_ptr<MoeStream> OpenStream();
  std::shared_ptr<grpc::Channel> channel() { return channel_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::MoeRouter::Stub> stub_;
};

// A request for `layer` with hidden states x [T, hidden] (fp32) sent as `dtype`.
pb::MoeLayerRequest MakeLayerRequest(int layer, const float* x, int64_t T, int hidden,
                                     pb::DType dtype, pb::DType output_dtype = pb::DTYPE_FP32,
                                     bool include_shared_expert = true);
// The response's output as fp32 [T, hidden]; its in-band error when not OK.
absl::Status ResponseOutput(const pb::MoeLayerResponse& r, int hidden, std::vector<float>* out);
// The same into `out`, which holds `floats` values: INTERNAL when the output has another size.
absl::Status ResponseOutputTo(const pb::MoeLayerResponse& r, int hidden, float* out, size_t floats);

}  // namespace exl3::client
