#include "tools/exl3_loadgen/echo_server.h"

#include <mutex>

#include "absl/strings/str_cat.h"
#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "services/common/wire.h"

namespace exl3::loadgen {

namespace pb = ::exl3serve::v1;

struct EchoServer::Impl final : public pb::MoeRouter::Service {
  grpc::Status Forward(grpc::ServerContext*,
                       grpc::ServerReaderWriter<pb::MoeLayerResponse, pb::MoeLayerRequest>* rw)
      override {
    pb::MoeLayerRequest req;
    pb::MoeLayerResponse resp;
    while (rw->Read(&req)) {
      resp.Clear();
      resp.set_id(req.id());
      resp.set_layer(req.layer());
      resp.mutable_status()->set_code(pb::OK);
      const pb::DType out = req.output_dtype() == pb::DTYPE_UNSPECIFIED ? pb::DTYPE_FP32
                                                                        : req.output_dtype();
      pb::Tensor* t = resp.mutable_output();
      t->set_dtype(out);
      *t->mutable_shape() = req.hidden().shape();
      int64_t n = 1;
      for (int64_t d : req.hidden().shape()) n *= d;
      // An answer of the real size; the bytes are the request's, repeated as needed.
      std::string* data = t->mutable_data();
      data->resize(static_cast<size_t>(n) * svc::WireDTypeSize(out));
      const std::string& in = req.hidden().data();
      for (size_t off = 0; off < data->size() && !in.empty(); off += in.size()) {
        data->replace(off, std::min(in.size(), data->size() - off), in, 0,
                      std::min(in.size(), data->size() - off));
      }
      rw->Write(resp);
    }
    return grpc::Status::OK;
  }
  std::unique_ptr<grpc::Server> server;
};

absl::StatusOr<std::unique_ptr<EchoServer>> EchoServer::Start(int max_message_bytes) {
  std::unique_ptr<EchoServer> e(new EchoServer());
  e->impl_ = std::make_unique<Impl>();
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.SetMaxReceiveMessageSize(max_message_bytes);
  b.SetMaxSendMessageSize(max_message_bytes);
  b.RegisterService(e->impl_.get());
  e->impl_->server = b.BuildAndStart();
  if (!e->impl_->server || port == 0) return absl::InternalError("echo server failed to start");
  e->address_ = absl::StrCat("127.0.0.1:", port);
  return e;
}

EchoServer::~EchoServer() {
  if (impl_ && impl_->server) impl_->server->Shutdown(std::chrono::system_clock::now());
}

}  // namespace exl3::loadgen
