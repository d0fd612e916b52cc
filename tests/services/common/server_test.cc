// services/common/server.h on loopback: health starts NOT_SERVING and follows SetServing; TLS and
// mutual TLS with certificates made by openssl in the test.
#include "services/common/server.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/services/common/grpc_test_util.h"
#include "tests/services/common/service_test_util.h"

namespace exl3::svc {
namespace {

using exl3::testing::HealthCheck;
using exl3::testing::TempDir;

TEST(Server, HealthFollowsSetServing) {
  ServerConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.health_names = {"exl3serve.v1.ExpertWorker"};
  auto s = GrpcServer::Start(cfg);
  ASSERT_TRUE(s.ok()) << s.status();
  auto ch = exl3::testing::LoopbackChannel((*s)->address());
  EXPECT_EQ(HealthCheck(ch, ""), 2);
  EXPECT_EQ(HealthCheck(ch, "exl3serve.v1.ExpertWorker"), 2);
  EXPECT_EQ(HealthCheck(ch, "no.such.Service"), 3);
  (*s)->SetServing(true);
  EXPECT_EQ(HealthCheck(ch, ""), 1);
  EXPECT_EQ(HealthCheck(ch, "exl3serve.v1.ExpertWorker"), 1);
  (*s)->SetServing(false);
  EXPECT_EQ(HealthCheck(ch, "exl3serve.v1.ExpertWorker"), 2);
}

TEST(Server, RefusesBadListenAndBadTlsFiles) {
  ServerConfig cfg;
  cfg.listen = "no-port";
  EXPECT_EQ(GrpcServer::Start(cfg).status().code(), absl::StatusCode::kInvalidArgument);
  cfg.listen = "127.0.0.1:0";
  cfg.tls.cert_file = "/nonexistent/cert.pem";
  cfg.tls.key_file = "/nonexistent/key.pem";
  auto s = GrpcServer::Start(cfg);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("/nonexistent/cert.pem"), std::string::npos) << s.status();
}

TEST(Server, RefusesAPortInUse) {
  ServerConfig cfg;
  cfg.listen = "127.0.0.1:0";
  auto a = GrpcServer::Start(cfg);
  ASSERT_TRUE(a.ok()) << a.status();
  cfg.listen = (*a)->address();
  auto b = GrpcServer::Start(cfg);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("cannot listen on " + cfg.listen), std::string::npos)
      << b.status();
}

// A CA, a server certificate for 127.0.0.1/localhost and a client certificate.
class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string d = dir_.path();
    const std::string cmd =
        "cd " + d + " && "
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
        "-subj /CN=exl3-test-ca >/dev/null 2>&1 && "
        "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr "
        "-subj /CN=localhost >/dev/null 2>&1 && "
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext && "
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem "
        "-days 1 -extfile san.ext >/dev/null 2>&1 && "
        "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr "
        "-subj /CN=exl3-router >/dev/null 2>&1 && "
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem "
        "-days 1 >/dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl failed";
  }
  std::string P(const char* f) const { return dir_.path() + "/" + f; }

  std::shared_ptr<grpc::Channel> Channel(const std::string& addr, bool client_cert) {
    ClientTls t;
    t.enabled = true;
    t.ca_file = P("ca.pem");
    if (client_cert) {
      t.cert_file = P("client.pem");
      t.key_file = P("client.key");
    }
    auto creds = MakeChannelCredentials(t);
    EXPECT_TRUE(creds.ok()) << creds.status();
    return grpc::CreateChannel(addr, *creds);
  }

  TempDir dir_;
};

TEST_F(TlsTest, TlsServes) {
  ServerConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.tls.cert_file = P("server.pem");
  cfg.tls.key_file = P("server.key");
  auto s = GrpcServer::Start(cfg);
  ASSERT_TRUE(s.ok()) << s.status();
  (*s)->SetServing(true);
  EXPECT_EQ(HealthCheck(Channel((*s)->address(), false), ""), 1);
  // A plaintext client cannot talk to a TLS server.
  EXPECT_EQ(HealthCheck(exl3::testing::LoopbackChannel((*s)->address()), ""), -1);
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificate) {
  ServerConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.tls.cert_file = P("server.pem");
  cfg.tls.key_file = P("server.key");
  cfg.tls.ca_file = P("ca.pem");
  cfg.tls.require_client_cert = true;
  auto s = GrpcServer::Start(cfg);
  ASSERT_TRUE(s.ok()) << s.status();
  (*s)->SetServing(true);
  EXPECT_EQ(HealthCheck(Channel((*s)->address(), true), ""), 1);
  EXPECT_EQ(HealthCheck(Channel((*s)->address(), false), ""), -1);
}

}  // namespace
}  // namespace exl3::svc
