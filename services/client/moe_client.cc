#include "services/client/moe_client.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "services/common/status.h"
#include "services/common/wire.h"

namespace exl3::client {

absl::StatusOr<std::unique_ptr<MoeClient>> MoeClient::Connect(const ClientOptions& o) {
  if (o.target.empty()) return absl::InvalidArgumentError("no target address");
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (o.tls.enabled) {
    auto c = svc::MakeChannelCredentials(o.tls);
    if (!c.ok()) return c.status();
    creds = *c;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(o.max_message_bytes);
  args.SetMaxSendMessageSize(o.max_message_bytes);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  if (!o.ssl_target_name_override.empty()) {
    args.SetSslTargetNameOverride(o.ssl_target_name_override);
  }
  std::unique_ptr<MoeClient> c(new MoeClient());
  c->channel_ = grpc::CreateCustomChannel(o.target, creds, args);
  c->stub_ = pb::MoeRouter::NewStub(c->channel_);
  return c;
}

bool MoeClient::WaitForConnected(int timeout_ms) {
  return channel_->WaitForConnected(std::chrono::system_clock::now() +
                                    std::chrono::milliseconds(timeout_ms));
}

absl::StatusOr<pb::RouterDescribeResponse> MoeClient::Describe(int timeout_ms) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  pb::RouterDescribeResponse r;
  grpc::Status st = stub_->Describe(&ctx, pb::RouterDescribeRequest(), &r);
  if (!st.ok()) return svc::FromGrpcStatus(st);
  return r;
}

std::unique_ptr<MoeStream> MoeClient::OpenStream() {
  std::unique_ptr<MoeStream> s(new MoeStream());
  s->ctx_ = std::make_unique<grpc::ClientContext>();
  s->rw_ = stub_->Forward(s->ctx_.get());
  MoeStream* raw = s.get();
  s->reader_ = std::thread([raw] { raw->ReadLoop(); });
  return s;
}

MoeStream::~MoeStream() {
  // Whoever wanted the stream's end status asked Close() for it before.
  Close().IgnoreError();
}

void MoeStream::ReadLoop() {
  pb::MoeLayerResponse r;
  while (rw_->Read(&r)) {
    ResponseCallback cb;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = pending_.find(r.id());
      if (it == pending_.end()) continue;
      cb = std::move(it->second);
      pending_.erase(it);
    }
    cb(absl::OkStatus(), &r);
    cv_.notify_all();
  }
  {
    std::lock_guard<std::mutex> l(write_mu_);
    writes_done_ = true;  // no writes after the stream ended
  }
  grpc::Status st = rw_->Finish();
  std::unordered_map<uint64_t, ResponseCallback> left;
  {
    std::lock_guard<std::mutex> l(mu_);
    ended_ = true;
    end_status_ = svc::FromGrpcStatus(st);
    left.swap(pending_);
  }
  const absl::Status why = st.ok() ? absl::UnavailableError("stream ended before the answer")
                                   : svc::FromGrpcStatus(st);
  for (auto& [id, cb] : left) cb(why, nullptr);
  cv_.notify_all();
}

absl::Status MoeStream::Send(pb::MoeLayerRequest& req, ResponseCallback cb) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (ended_) {
      return end_status_.ok() ? absl::UnavailableError("stream ended") : end_status_;
    }
    id = next_id_++;
    pending_[id] = std::move(cb);
  }
  req.set_id(id);
  bool ok;
  {
    std::lock_guard<std::mutex> l(write_mu_);
    ok = !writes_done_ && rw_->Write(req);
  }
  if (ok) return absl::OkStatus();
  std::lock_guard<std::mutex> l(mu_);
  if (pending_.erase(id) == 1) return absl::UnavailableError("stream closed: write failed");
  return absl::OkStatus();  // the reader already answered it with the stream's error
}

absl::StatusOr<pb::MoeLayerResponse> MoeStream::Call(pb::MoeLayerRequest req) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  absl::Status status;
  pb::MoeLayerResponse out;
  absl::Status s = Send(req, [&](absl::Status st, const pb::MoeLayerResponse* r) {
    std::lock_guard<std::mutex> l(m);
    status = st;
    if (r) out = *r;
    done = true;
    cv.notify_all();
  });
  if (!s.ok()) return s;
  std::unique_lock<std::mutex> l(m);
  cv.wait(l, [&] { return done; });
  if (!status.ok()) return status;
  return out;
}

int MoeStream::in_flight() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int>(pending_.size());
}

absl::Status MoeStream::Close() {
  if (closed_) {
    std::lock_guard<std::mutex> l(mu_);
    return end_status_;
  }
  closed_ = true;
  {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return pending_.empty() || ended_; });
  }
  {
    std::lock_guard<std::mutex> l(write_mu_);
    if (!writes_done_) {
      rw_->WritesDone();
      writes_done_ = true;
    }
  }
  if (reader_.joinable()) reader_.join();
  std::lock_guard<std::mutex> l(mu_);
  return end_status_;
}

void MoeStream::Cancel() { ctx_->TryCancel(); }

absl::Status MoeStream::CancelRequest(uint64_t id, pb::CancelReason reason) {
  pb::MoeLayerRequest c;
  c.set_id(id);
  c.mutable_cancel()->set_reason(reason);
  std::lock_guard<std::mutex> l(write_mu_);
  if (writes_done_ || !rw_->Write(c)) return absl::UnavailableError("stream closed: write failed");
  return absl::OkStatus();
}

pb::MoeLayerRequest MakeLayerRequest(int layer, const float* x, int64_t T, int hidden,
                                     pb::DType dtype, pb::DType output_dtype,
                                     bool include_shared_expert) {
  pb::MoeLayerRequest r;
  r.set_layer(layer);
  svc::EncodeTensor(x, {T, hidden}, dtype, r.mutable_hidden());
  r.set_output_dtype(output_dtype);
  r.set_include_shared_expert(include_shared_expert);
  return r;
}

absl::Status ResponseOutput(const pb::MoeLayerResponse& r, int hidden, std::vector<float>* out) {
  if (r.status().code() != pb::OK) return svc::FromRequestStatus(r.status());
  const pb::Tensor& t = r.output();
  absl::Status v = svc::ValidateTensor(t, "output", {-1, hidden});
  if (!v.ok()) return v;
  out->resize(static_cast<size_t>(t.shape(0)) * hidden);
  return svc::TensorToFloat(t, "output", false, out->data());
}

absl::Status ResponseOutputTo(const pb::MoeLayerResponse& r, int hidden, float* out,
                              size_t floats) {
  if (r.status().code() != pb::OK) return svc::FromRequestStatus(r.status());
  const pb::Tensor& t = r.output();
  if (absl::Status v = svc::ValidateTensor(t, "output", {-1, hidden}); !v.ok()) return v;
  if (static_cast<size_t>(t.shape(0)) * hidden != floats) {
    return absl::InternalError("MoE answer of the wrong size");
  }
  return svc::TensorToFloat(t, "output", false, out);
}

}  // namespace exl3::client
