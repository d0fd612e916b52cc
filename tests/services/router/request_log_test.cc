// The Generator service's request log (services/router/request_log.h) through gRPC: a real
// exl3-router Generation (the CPU engine on a generated whole model) behind a loopback server,
// called with Generate and GenerateStream; the request id the client sends must be on the line
// the service writes when it takes the request and on the one when it ends (stderr captured).
// A Generate call without a request_id is named by its x-request-id metadata; with --log-format
// json each event is one JSON object (base/logging_test.cc: the quoting of values).
#include "services/router/request_log.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "base/logging.h"
#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "gtest/gtest.h"
#include "model/config/config_file.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "services/common/server.h"
#include "services/router/generation.h"
#include "tests/services/common/grpc_test_util.h"
#include "tests/services/common/service_test_util.h"
#include "tests/services/router/router_test_model.h"

namespace exl3::router {
namespace {

namespace pb = ::exl3serve::v1;

// The captured lines that contain `what`.
std::vector<std::string> LinesWith(const std::string& log, const std::string& what) {
  std::vector<std::string> out;
  for (const std::string& line : std::vector<std::string>(absl::StrSplit(log, '\n'))) {
    if (line.find(what) != std::string::npos) out.push_back(line);
  }
  return out;
}

pb::GenerateRequest Request(const std::string& id, int max_tokens) {
  pb::GenerateRequest r;
  r.set_request_id(id);
  for (int t : {5, 6, 7}) r.add_prompt_token_ids(t);
  r.set_max_tokens(max_tokens);
  r.set_ignore_eos(true);  // the random model may sample its end token: the count is exact
  return r;
}

class RequestLogTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    SetLogLevel(LogLevel::kInfo);
    dir_ = new testing::TempDir();
    ASSERT_TRUE(testing::WriteRouterTestModel(dir_->path()).ok());
    registry_ = new prometheus::Registry();
    GenerationOptions o;
    o.model_dir = dir_->path();
    o.threads = 1;
    o.engine.kv_capacity = {engine::KvCacheCapacity::Unit::kTokens, 2048};
    auto config = ConfigFile::Read(dir_->path() + "/config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    auto g = Generation::Start(o, *config, /*router=*/nullptr, *registry_);
    ASSERT_TRUE(g.ok()) << g.status();
    generation_ = g->release();
    svc::ServerConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.services = {&generation_->service()};
    auto server = svc::GrpcServer::Start(cfg);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
    server_->SetServing(true);
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
    delete server_;
    delete generation_;
    delete registry_;
    delete dir_;
  }

  std::unique_ptr<pb::Generator::Stub> Stub() {
    return pb::Generator::NewStub(testing::LoopbackChannel(server_->address()));
  }

  // What the service logs for one Generate call of `req` (with `x-request-id` metadata where
  // given), which must succeed.
  std::string LogOfGenerate(const pb::GenerateRequest& req, const std::string& x_request_id = "") {
    auto stub = Stub();
    ::testing::internal::CaptureStderr();
    grpc::ClientContext ctx;
    if (!x_request_id.empty()) ctx.AddMetadata("x-request-id", x_request_id);
    auto reader = stub->Generate(&ctx, req);
    pb::GenerateResponse m;
    while (reader->Read(&m)) {
    }
    const grpc::Status st = reader->Finish();
    std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(st.ok()) << st.error_message();
    return log;
  }

  static testing::TempDir* dir_;
  static prometheus::Registry* registry_;
  static Generation* generation_;
  static svc::GrpcServer* server_;
};
testing::TempDir* RequestLogTest::dir_ = nullptr;
prometheus::Registry* RequestLogTest::registry_ = nullptr;
Generation* RequestLogTest::generation_ = nullptr;
svc::GrpcServer* RequestLogTest::server_ = nullptr;

TEST_F(RequestLogTest, GenerateLogsTheClientsIdWhenTakenAndWhenEnded) {
  auto stub = Stub();
  ::testing::internal::CaptureStderr();
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, Request("chatcmpl-abc", 4));
  pb::GenerateResponse m;
  int tokens = 0;
  while (reader->Read(&m)) tokens += m.tokens_size();
  const grpc::Status st = reader->Finish();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(tokens, 4);
  const std::vector<std::string> start = LinesWith(log, "request start id=chatcmpl-abc ");
  ASSERT_EQ(start.size(), 1u) << log;
  EXPECT_NE(start[0].find(" prompt_tokens=3 max_tokens=4"), std::string::npos) << start[0];
  const std::vector<std::string> end = LinesWith(log, "request end id=chatcmpl-abc ");
  ASSERT_EQ(end.size(), 1u) << log;
  for (const char* field : {" prompt_tokens=3 ", " generated_tokens=4 ", " finish_reason=length ",
                            " ttft_s=0.", " total_s="}) {
    EXPECT_NE(end[0].find(field), std::string::npos) << field << " in " << end[0];
  }
  EXPECT_EQ(end[0].find("error="), std::string::npos) << end[0];
  EXPECT_LT(log.find("request start id=chatcmpl-abc "), log.find("request end id=chatcmpl-abc "));
}

TEST_F(RequestLogTest, GenerateStreamLogsEachRequestsId) {
  auto stub = Stub();
  ::testing::internal::CaptureStderr();
  grpc::ClientContext ctx;
  auto call = stub->GenerateStream(&ctx);
  pb::GenerateStreamRequest out;
  for (int i = 0; i < 2; ++i) {
    pb::GenerateAction* a = out.add_actions();
    a->set_stream_id(i + 1);
    *a->mutable_start() = Request("cmpl-stream-" + std::to_string(i), 3);
  }
  ASSERT_TRUE(call->Write(out));
  call->WritesDone();
  pb::GenerateStreamResponse in;
  int last = 0;
  while (call->Read(&in)) {
    for (const pb::GenerateUpdate& u : in.updates()) last += u.last() ? 1 : 0;
  }
  const grpc::Status st = call->Finish();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(last, 2);
  for (int i = 0; i < 2; ++i) {
    const std::string id = "cmpl-stream-" + std::to_string(i);
    ASSERT_EQ(LinesWith(log, "request start id=" + id + " ").size(), 1u) << log;
    const std::vector<std::string> end = LinesWith(log, "request end id=" + id + " ");
    ASSERT_EQ(end.size(), 1u) << log;
    EXPECT_NE(end[0].find(" generated_tokens=3 "), std::string::npos) << end[0];
    EXPECT_NE(end[0].find(" finish_reason=length "), std::string::npos) << end[0];
  }
}

TEST_F(RequestLogTest, ARefusedRequestEndsWithItsError) {
  auto stub = Stub();
  ::testing::internal::CaptureStderr();
  grpc::ClientContext ctx;
  pb::GenerateRequest req = Request("bad one", 0);  // max_tokens 0: refused by the engine
  auto reader = stub->Generate(&ctx, req);
  pb::GenerateResponse m;
  while (reader->Read(&m)) {
  }
  const grpc::Status st = reader->Finish();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_EQ(LinesWith(log, "request start id=\"bad one\" ").size(), 1u) << log;
  const std::vector<std::string> end = LinesWith(log, "request end id=\"bad one\" ");
  ASSERT_EQ(end.size(), 1u) << log;
  EXPECT_NE(end[0].find(" generated_tokens=0 cached_tokens=0 finish_reason=refused ttft_s=none "),
            std::string::npos) << end[0];
  EXPECT_NE(end[0].find(" error=\"INVALID_ARGUMENT: "), std::string::npos) << end[0];
}

TEST_F(RequestLogTest, AGenerateCallWithoutAnIdIsNamedByItsXRequestIdMetadata) {
  const std::string log = LogOfGenerate(Request("", 2), "client-trace-7");
  EXPECT_EQ(LinesWith(log, "request start id=client-trace-7 ").size(), 1u) << log;
  EXPECT_EQ(LinesWith(log, "request end id=client-trace-7 ").size(), 1u) << log;
}

TEST_F(RequestLogTest, TheRequestIdOutranksTheMetadata) {
  const std::string log = LogOfGenerate(Request("from-request", 2), "from-metadata");
  EXPECT_EQ(LinesWith(log, "request end id=from-request ").size(), 1u) << log;
  EXPECT_TRUE(LinesWith(log, "from-metadata").empty()) << log;
}

TEST_F(RequestLogTest, WithTheJsonFormatEachEventIsOneObjectWithItsFields) {
  SetLogFormat(LogFormat::kJson);
  const std::string log = LogOfGenerate(Request("chatcmpl-json", 3));
  SetLogFormat(LogFormat::kText);
  std::vector<nlohmann::json> events;
  for (const std::string& line : LinesWith(log, "\"id\":\"chatcmpl-json\"")) {
    events.push_back(nlohmann::json::parse(line));
  }
  ASSERT_EQ(events.size(), 2u) << log;
  EXPECT_EQ(events[0]["event"], "request start");
  EXPECT_EQ(events[0]["max_tokens"], 3);
  EXPECT_EQ(events[1]["event"], "request end");
  EXPECT_EQ(events[1]["level"], "INFO");
  EXPECT_EQ(events[1]["generated_tokens"], 3);
  EXPECT_EQ(events[1]["finish_reason"], "length");
  EXPECT_GT(events[1]["ttft_s"].get<double>(), 0.0);
  EXPECT_FALSE(events[1].contains("error"));
}

}  // namespace
}  // namespace exl3::router
