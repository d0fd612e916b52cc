// The transport floor for exl3-loadgen --echo-baseline: an in-process MoeRouter server whose
// Forward answers every request at once with an output tensor of the size a real answer has
// ([T, hidden] in the requested dtype), doing no work. Same proto, same gRPC settings.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"

namespace exl3::loadgen {

class EchoServer {
 public:
  // Listens on 127.0.0.1 with a free port.
  static absl::StatusOr<std::unique_ptr<EchoServer>> Start(int max_message_bytes);
  ~EchoServer();
  const std::string& address() const { return address_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string address_;
};

}  // namespace exl3::loadgen
