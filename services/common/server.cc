#include "services/common/server.h"

#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "base/logging.h"

ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve TLS instead of plaintext");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle used to verify client certificates (with --tls-require-client-cert)");
ABSL_FLAG(bool, tls_require_client_cert, false,
          "mutual TLS: reject clients without a certificate signed by --tls-ca");

namespace exl3::svc {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(std::string(what), ": cannot read '", path, "'"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<ServerTls> ServerTlsFromFlags() {
  ServerTls t;
  t.cert_file = absl::GetFlag(FLAGS_tls_cert);
  t.key_file = absl::GetFlag(FLAGS_tls_key);
  t.ca_file = absl::GetFlag(FLAGS_tls_ca);
  t.require_client_cert = absl::GetFlag(FLAGS_tls_require_client_cert);
  if (t.cert_file.empty() != t.key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key must be given together");
  }
  if (!t.enabled() && (!t.ca_file.empty() || t.require_client_cert)) {
    return absl::InvalidArgumentError("--tls-ca/--tls-require-client-cert need --tls-cert and --tls-key");
  }
  if (t.require_client_cert && t.ca_file.empty()) {
    return absl::InvalidArgumentError("--tls-require-client-cert needs --tls-ca");
  }
  if (t.enabled()) {
    // Fail at start, not at the first handshake.
    for (const auto& [path, what] : {std::pair{t.cert_file, "--tls-cert"},
                                     std::pair{t.key_file, "--tls-key"}}) {
      if (auto r = ReadFile(path, what); !r.ok()) return r.status();
    }
    if (!t.ca_file.empty()) {
      if (auto r = ReadFile(t.ca_file, "--tls-ca"); !r.ok()) return r.status();
    }
  }
  return t;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const ServerTls& t) {
  if (!t.enabled()) return grpc::InsecureServerCredentials();
  auto cert = ReadFile(t.cert_file, "--tls-cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadFile(t.key_file, "--tls-key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions opts(
      t.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
      : t.ca_file.empty()   ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                            : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!t.ca_file.empty()) {
    auto ca = ReadFile(t.ca_file, "--tls-ca");
    if (!ca.ok()) return ca.status();
    opts.pem_root_certs = *ca;
  }
  opts.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(opts);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const ClientTls& t) {
  if (!t.enabled) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions opts;
  if (!t.ca_file.empty()) {
    auto ca = ReadFile(t.ca_file, "client TLS CA");
    if (!ca.ok()) return ca.status();
    opts.pem_root_certs = *ca;
  }
  if (t.cert_file.empty() != t.key_file.empty()) {
    return absl::InvalidArgumentError("client TLS: certificate and key must be given together");
  }
  if (!t.cert_file.empty()) {
    auto cert = ReadFile(t.cert_file, "client TLS certificate");
    if (!cert.ok()) return cert.status();
    auto key = ReadFile(t.key_file, "client TLS key");
    if (!key.ok()) return key.status();
    opts.pem_cert_chain = *cert;
    opts.pem_private_key = *key;
  }
  return grpc::SslCredentials(opts);
}

bool IsLoopbackAddress(std::string_view a) {
  if (a.starts_with("unix:") || a.starts_with("unix-abstract:")) return true;
  std::string_view host = a;
  if (host.starts_with("[")) {
    const size_t close = host.find(']');
    host = host.substr(1, close == std::string_view::npos ? std::string_view::npos : close - 1);
  } else if (const size_t colon = host.rfind(':'); colon != std::string_view::npos) {
    host = host.substr(0, colon);
  }
  return host == "localhost" || host == "::1" || host.starts_with("127.");
}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const ServerConfig& cfg) {
  if (cfg.listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--listen '", cfg.listen, "' is not HOST:PORT"));
  }
  auto creds = MakeServerCredentials(cfg.tls);
  if (!creds.ok()) return creds.status();
  if (!cfg.tls.enabled() && !IsLoopbackAddress(cfg.listen)) {
    LogWarning("!!! listening on %s WITHOUT TLS: anyone who can reach this address can send "
               "requests and read hidden states. Use --tls-cert/--tls-key (and --tls-ca "
               "--tls-require-client-cert for mTLS) outside a trusted network. !!!",
               cfg.listen.c_str());
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::unique_ptr<GrpcServer> s(new GrpcServer());
  grpc::ServerBuilder b;
  b.AddListeningPort(cfg.listen, *creds, &s->port_);
  b.SetMaxReceiveMessageSize(cfg.max_receive_bytes);
  b.SetMaxSendMessageSize(cfg.max_send_bytes);
  // Long-lived streams: keepalive pings detect dead peers; permit clients' pings too.
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // No SO_REUSEPORT: a second process on the same port must fail, not silently share traffic.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  for (grpc::Service* svc : cfg.services) b.RegisterService(svc);
  s->server_ = b.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", cfg.listen,
                                               " (address in use or invalid)"));
  }
  const size_t colon = cfg.listen.rfind(':');
  s->address_ = absl::StrCat(cfg.listen.substr(0, colon), ":", s->port_);
  s->health_names_ = cfg.health_names;
  s->SetServing(false);
  LogInfo("gRPC listening on %s (%s)", s->address_.c_str(),
          cfg.tls.enabled() ? (cfg.tls.require_client_cert ? "mTLS" : "TLS") : "plaintext");
  return s;
}

GrpcServer::~GrpcServer() {
  if (!shut_down_) Shutdown(absl::ZeroDuration());
}

void GrpcServer::SetServing(bool serving) {
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* h = server_->GetHealthCheckService();
  if (h == nullptr) return;
  h->SetServingStatus(serving);  // overall "" and every registered name
  for (const auto& n : health_names_) h->SetServingStatus(n, serving);
}

void GrpcServer::Shutdown(absl::Duration grace) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  if (auto* h = server_->GetHealthCheckService()) h->Shutdown();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
}

}  // namespace exl3::svc
