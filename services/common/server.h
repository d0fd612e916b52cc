// Building a gRPC server the way every exl3serve service does: listen address, TLS or mTLS
// from flags, max message sizes, the standard health service (grpc.health.v1) and reflection.
//
//   ServerConfig cfg;
//   cfg.listen = "127.0.0.1:50061";
//   cfg.tls = *ServerTlsFromFlags();          // --tls-cert, --tls-key, --tls-ca, --tls-require-client-cert
//   cfg.max_message_bytes = 64 << 20;
//   cfg.services = {&my_service};
//   cfg.health_names = {"exl3serve.v1.ExpertWorker"};
//   auto server = GrpcServer::Start(cfg);     // health starts NOT_SERVING
//   ... load ...; (*server)->SetServing(true);
//
// Plaintext is the default and meant for loopback: listening on another address without TLS
// logs a loud warning.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"

namespace exl3::svc {

struct ServerTls {
  std::string cert_file;             // PEM server certificate chain; empty: plaintext
  std::string key_file;              // PEM private key
  std::string ca_file;               // PEM CA bundle to verify client certificates
  bool require_client_cert = false;  // mTLS: reject clients without a cert signed by ca_file
  bool enabled() const { return !cert_file.empty(); }
};

// From the flags --tls-cert, --tls-key, --tls-ca, --tls-require-client-cert (defined in
// server.cc, so every binary linking this library has them). Checks the combination and that
// the files are readable.
absl::StatusOr<ServerTls> ServerTlsFromFlags();
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const ServerTls& t);

// Client side (router -> worker, tools -> services).
struct ClientTls {
  std::string ca_file;    // PEM roots to verify the server; empty with enabled: system roots
  std::string cert_file;  // PEM client certificate for mTLS, or empty
  std::string key_file;
  bool enabled = false;
};
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const ClientTls& t);

// "127.0.0.1:1", "localhost:1", "[::1]:1", "unix:..." are loopback; anything else is not.
bool IsLoopbackAddress(std::string_view host_port);

struct ServerConfig {
  std::string listen;  // HOST:PORT; port 0 picks a free one (see GrpcServer::port)
  ServerTls tls;
  int max_receive_bytes = 64 << 20;
  int max_send_bytes = 64 << 20;
  std::vector<grpc::Service*> services;  // sync, async or callback services; not owned
  std::vector<std::string> health_names;  // service names reported by the health service
};

class GrpcServer {
 public:
  // Binds and starts serving; health starts NOT_SERVING for "" and every health name.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const ServerConfig& cfg);
  ~GrpcServer();

  int port() const { return port_; }
  // The address clients on this host can dial: "HOST:PORT" with the bound port.
  const std::string& address() const { return address_; }
  // Health: SERVING or NOT_SERVING for "" and every health name.
  void SetServing(bool serving);
  // Stops accepting, waits up to `grace` for calls to end, then cancels the rest.
  void Shutdown(absl::Duration grace);
  grpc::Server* server() { return server_.get(); }

 private:
  GrpcServer() = default;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> health_names_;
  std::string address_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace exl3::svc
