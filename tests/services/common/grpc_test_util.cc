#include "tests/services/common/grpc_test_util.h"

#include <chrono>

#include "grpcpp/generic/generic_stub.h"

namespace exl3::testing {

std::shared_ptr<grpc::Channel> LoopbackChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // A fresh connection per channel (tests open many streams on purpose).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

int HealthCheck(const std::shared_ptr<grpc::Channel>& ch, const std::string& service) {
  // HealthCheckRequest { string service = 1; } encoded by hand.
  std::string req;
  if (!service.empty()) {
    req.push_back(0x0a);
    req.push_back(static_cast<char>(service.size()));
    req += service;
  }
  grpc::Slice slice(req);
  grpc::ByteBuffer in(&slice, 1), out;
  grpc::GenericStub stub(ch);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", in, &cq);
  call->StartCall();
  grpc::Status st;
  call->Finish(&out, &st, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!st.ok()) return st.error_code() == grpc::StatusCode::NOT_FOUND ? 3 : -1;
  std::vector<grpc::Slice> slices;
  if (!out.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse { ServingStatus status = 1; }: empty means 0 (UNKNOWN).
  if (bytes.size() >= 2 && bytes[0] == 0x08) return static_cast<unsigned char>(bytes[1]);
  return 0;
}

}  // namespace exl3::testing
