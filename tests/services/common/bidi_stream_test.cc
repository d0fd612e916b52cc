// The stream plumbing (services/common/bidi_stream.h) with real gRPC on loopback: a server end
// behind a generic callback service, driven by a synchronous client (or by the plumbing's own
// client end), and a real shared-memory side channel.
#include "services/common/bidi_stream.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "services/common/shm_channel.h"

namespace exl3::svc {
namespace {

namespace pb = ::exl3serve::v1;
using namespace std::chrono_literals;

const char kMethod[] = "/exl3serve.v1.ExpertWorker/Forward";

// Waits up to `limit` for `done()`.
template <class F>
bool WaitFor(F done, std::chrono::milliseconds limit = 5000ms) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

// The server end under test: answers each request with `answer_bytes` of payload, at once or
// (held) when the test releases it.
class TestStream : public BidiStream<ServerSide, pb::ExpertRequest, pb::ExpertResponse> {
 public:
  TestStream(BidiStreamOptions opt, size_t answer_bytes, bool hold)
      : BidiStream(std::move(opt)), answer_bytes_(answer_bytes), hold_(hold) {}

  std::atomic<int> read{0};
  std::atomic<int> read_on_side{0};
  std::atomic<size_t> max_unwritten{0};
  std::atomic<bool> abandoned{false};
  std::atomic<bool> ended{false};
  grpc::Status end_status;  // set before `ended`

  // Answers what is held; each id leaves held_ in the step that queues its answer (as a user
  // must: else the stream may finish in between).
  void Release() {
    std::lock_guard<std::mutex> l(mutex());
    while (!held_.empty()) {
      const uint64_t id = held_.back();
      held_.pop_back();
      AnswerLocked(id, Path::kStream);
    }
  }
  using BidiStream::AttachSideChannelLocked;

 private:
  void OnMessage(pb::ExpertRequest& m, Path from) override {
    ++read;
    if (from == Path::kSideChannel) ++read_on_side;
    if (hold_) {
      std::lock_guard<std::mutex> l(mutex());
      held_.push_back(m.id());
      return;
    }
    Answer(m.id(), from);
  }
  bool OwesAnswersLocked() const override { return !held_.empty(); }
  void OnAbandoned() override { abandoned = true; }
  void OnEnded(const grpc::Status& st) override {
    end_status = st;
    ended = true;
  }

  void Answer(uint64_t id, Path path) {
    std::lock_guard<std::mutex> l(mutex());
    AnswerLocked(id, path);
  }
  void AnswerLocked(uint64_t id, Path path) {
    pb::ExpertResponse r;
    r.set_id(id);
    r.mutable_output()->set_data(std::string(answer_bytes_, 'x'));
    WriteLocked(std::move(r), path);
    if (UnwrittenMessagesLocked() > max_unwritten) max_unwritten = UnwrittenMessagesLocked();
  }

  const size_t answer_bytes_;
  const bool hold_;
  std::vector<uint64_t> held_;  // guarded by mutex()
};

// A peer that accepts the call and never reads from it.
class FrozenStream : public grpc::ServerGenericBidiReactor {
 public:
  void OnDone() override { delete this; }
  void OnCancel() override { Finish(grpc::Status::CANCELLED); }
};

// A loopback server whose streams are made by `make` (kept alive until the server is gone).
class Loopback : public grpc::CallbackGenericService {
 public:
  BidiStreamOptions options;
  size_t answer_bytes = 16;
  bool hold = false;
  bool frozen = false;

  void Start() {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterCallbackGenericService(this);
    b.SetMaxReceiveMessageSize(64 << 20);
    b.SetMaxSendMessageSize(64 << 20);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    channel_ = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port_),
                                         grpc::InsecureChannelCredentials(), args);
  }
  ~Loopback() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + 2s);
  }

  std::shared_ptr<TestStream> stream(size_t i = 0) {
    if (!WaitFor([&] {
          std::lock_guard<std::mutex> l(mu_);
          return streams_.size() > i;
        })) {
      return nullptr;
    }
    std::lock_guard<std::mutex> l(mu_);
    return streams_[i];
  }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  std::unique_ptr<pb::ExpertWorker::Stub> stub() { return pb::ExpertWorker::NewStub(channel_); }

 private:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    if (frozen) return new FrozenStream();
    auto s = std::make_shared<TestStream>(options, answer_bytes, hold);
    {
      std::lock_guard<std::mutex> l(mu_);
      streams_.push_back(s);
    }
    s->Begin();
    return s.get();
  }

  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::mutex mu_;
  std::vector<std::shared_ptr<TestStream>> streams_;
};

pb::ExpertRequest Request(uint64_t id) {
  pb::ExpertRequest r;
  r.set_id(id);
  r.set_layer(1);
  return r;
}

// A reader that stops reading: the server reads no more than its pause allows and its queue of
// unwritten answers stays bounded; once the reader reads again, every answer comes and the stream
// finishes OK after the half-close.
TEST(BidiStreamTest, SlowReaderIsNotReadFromAndMemoryStaysBounded) {
  Loopback lb;
  lb.options.pause_reads_at = 8;
  lb.answer_bytes = 2 << 20;  // each answer larger than the transport's window
  lb.Start();
  auto stub = lb.stub();
  grpc::ClientContext ctx;
  auto call = stub->Forward(&ctx);
  constexpr int kRequests = 64;
  for (int i = 0; i < kRequests; ++i) ASSERT_TRUE(call->Write(Request(i)));
  std::shared_ptr<TestStream> s = lb.stream();
  ASSERT_NE(s, nullptr);
  std::this_thread::sleep_for(300ms);
  // The pause, plus what the transport's windows take before a write stalls.
  EXPECT_LE(s->read.load(), 40) << "the server kept reading from a client that does not read";
  EXPECT_LE(s->max_unwritten.load(), 8u);
  ASSERT_TRUE(call->WritesDone());
  pb::ExpertResponse r;
  int answers = 0;
  while (call->Read(&r)) ++answers;
  EXPECT_EQ(answers, kRequests);
  EXPECT_TRUE(call->Finish().ok());
  EXPECT_LE(s->max_unwritten.load(), 8u);
  EXPECT_TRUE(WaitFor([&] { return s->ended.load(); }));
  EXPECT_TRUE(s->end_status.ok()) << s->end_status.error_message();
  EXPECT_FALSE(s->abandoned.load());
}

// After the half-close the server end waits for the answers it owes, then finishes OK.
TEST(BidiStreamTest, FinishesWhenIdleAfterTheHalfClose) {
  Loopback lb;
  lb.hold = true;
  lb.Start();
  auto stub = lb.stub();
  grpc::ClientContext ctx;
  auto call = stub->Forward(&ctx);
  for (int i = 1; i <= 3; ++i) ASSERT_TRUE(call->Write(Request(i)));
  ASSERT_TRUE(call->WritesDone());
  std::shared_ptr<TestStream> s = lb.stream();
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(WaitFor([&] { return s->read.load() == 3; }));
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(s->ended.load()) << "finished while answers were owed";
  s->Release();
  pb::ExpertResponse r;
  int answers = 0;
  while (call->Read(&r)) ++answers;
  EXPECT_EQ(answers, 3);
  EXPECT_TRUE(call->Finish().ok());
  EXPECT_TRUE(WaitFor([&] { return s->ended.load(); }));
  EXPECT_TRUE(s->end_status.ok());
}

// The client cancels while a large answer is being written: the server end abandons its work,
// drops what is queued and ends CANCELLED.
TEST(BidiStreamTest, PeerCancelMidWriteEndsTheStream) {
  Loopback lb;
  lb.answer_bytes = 16 << 20;
  lb.Start();
  auto stub = lb.stub();
  grpc::ClientContext ctx;
  auto call = stub->Forward(&ctx);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(call->Write(Request(i)));
  std::shared_ptr<TestStream> s = lb.stream();
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(WaitFor([&] { return s->read.load() == 4; }));
  EXPECT_GE(s->unwritten_messages(), 1u);  // the first answer is stuck: nobody reads
  ctx.TryCancel();
  ASSERT_TRUE(WaitFor([&] { return s->ended.load(); }));
  EXPECT_TRUE(s->abandoned.load());
  EXPECT_EQ(s->end_status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(s->unwritten_messages(), 0u);
  EXPECT_EQ(call->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

// A message that does not parse ends the stream INVALID_ARGUMENT saying why.
TEST(BidiStreamTest, UnparsableMessageEndsTheStream) {
  Loopback lb;
  lb.Start();
  grpc::GenericStub stub(lb.channel());
  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, kMethod, &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  const char garbage[] = "\xff\xff\xff\xff";
  grpc::Slice slice(garbage, 4);
  grpc::ByteBuffer bb(&slice, 1);
  call->Write(bb, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Status st;
  call->Finish(&st, reinterpret_cast<void*>(3));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("does not parse as exl3serve.v1.ExpertRequest"),
            std::string::npos)
      << st.error_message();
  std::shared_ptr<TestStream> s = lb.stream();
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(WaitFor([&] { return s->ended.load(); }));
  EXPECT_TRUE(s->abandoned.load());
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

// A fresh shared-memory channel whose peer end is attached to `s` as its side channel; the
// test's end, or null (with a failure) when that did not work.
std::unique_ptr<ShmChannel> AttachSideChannel(TestStream& s) {
  auto mine = ShmChannel::Create(1 << 20, 0);
  EXPECT_TRUE(mine.ok()) << mine.status();
  if (!mine.ok()) return nullptr;
  auto theirs = ShmChannel::Attach((*mine)->name(), (*mine)->nonce(), 0);
  EXPECT_TRUE(theirs.ok()) << theirs.status();
  if (!theirs.ok()) return nullptr;
  std::lock_guard<std::mutex> l(s.mutex());
  if (!s.AttachSideChannelLocked(std::move(*theirs))) {
    ADD_FAILURE() << "the stream took no side channel";
    return nullptr;
  }
  return std::move(*mine);
}

// A loopback server, a call on it with one request written, and the server end it made (null
// when none came).
struct StreamWithOneRequest {
  StreamWithOneRequest() {
    lb.Start();
    stub = lb.stub();
    call = stub->Forward(&ctx);
    EXPECT_TRUE(call->Write(Request(1)));
    s = lb.stream();
  }
  auto parts() { return std::tie(ctx, call, s); }
  Loopback lb;
  std::unique_ptr<pb::ExpertWorker::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<pb::ExpertRequest, pb::ExpertResponse>> call;
  std::shared_ptr<TestStream> s;
};

// A side channel attached to a server end: messages through it are read and answered through it;
// the stream's end closes it (the peer sees it closed).
TEST(BidiStreamTest, SideChannelCarriesMessagesAndClosesWithTheStream) {
  StreamWithOneRequest one;
  auto [ctx, call, s] = one.parts();
  ASSERT_NE(s, nullptr);
  pb::ExpertResponse r;
  ASSERT_TRUE(call->Read(&r));  // the stream is up
  std::unique_ptr<ShmChannel> mine = AttachSideChannel(*s);
  ASSERT_NE(mine, nullptr);
  const pb::ExpertRequest req = Request(7);
  ASSERT_TRUE(mine->TryWrite(req.ByteSizeLong(), [&](uint8_t* dst) {
    req.SerializeWithCachedSizesToArray(dst);
  }));
  bool parsed = false;
  ASSERT_TRUE(mine->Read([&](const uint8_t* p, size_t n) {
    parsed = r.ParseFromArray(p, static_cast<int>(n));
  }));
  ASSERT_TRUE(parsed);
  EXPECT_EQ(r.id(), 7u);
  EXPECT_EQ(s->read_on_side.load(), 1);
  ctx.TryCancel();
  ASSERT_TRUE(WaitFor([&] { return s->ended.load(); }));
  EXPECT_TRUE(mine->closed()) << "the stream ended but its side channel stayed open";
  call->Finish();
}

// The side channel's end (closed by the peer) ends the stream.
TEST(BidiStreamTest, StreamEndsWhenItsSideChannelCloses) {
  StreamWithOneRequest one;
  auto [ctx, call, s] = one.parts();
  ASSERT_NE(s, nullptr);
  std::unique_ptr<ShmChannel> mine = AttachSideChannel(*s);
  ASSERT_NE(mine, nullptr);
  mine->Close();
  ASSERT_TRUE(WaitFor([&] { return s->ended.load(); }));
  EXPECT_TRUE(s->abandoned.load());
  EXPECT_EQ(s->end_status.error_code(), grpc::StatusCode::UNAVAILABLE);
  pb::ExpertResponse r;
  while (call->Read(&r)) {
  }
  const grpc::Status st = call->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_NE(st.error_message().find("shared-memory channel closed"), std::string::npos);
}

// The client end against a peer that never reads: its unwritten bytes stay within
// max_unwritten_bytes (HasRoomLocked refuses more), and End cancels the call at once.
class TestClient : public BidiStream<ClientSide, pb::ExpertResponse, pb::ExpertRequest> {
 public:
  explicit TestClient(BidiStreamOptions o) : BidiStream(std::move(o)) {}
  std::atomic<bool> ended{false};
  grpc::Status end_status;
  std::shared_ptr<TestClient> self;  // keeps it alive until OnEnded

 private:
  void OnMessage(pb::ExpertResponse&, Path) override {}
  void OnEnded(const grpc::Status& st) override {
    std::shared_ptr<TestClient> keep = std::move(self);
    end_status = st;
    ended = true;
  }
};

TEST(BidiStreamTest, ClientEndBoundsItsUnwrittenBytes) {
  Loopback lb;
  lb.frozen = true;
  lb.Start();
  grpc::GenericStub stub(lb.channel());
  BidiStreamOptions o;
  o.max_unwritten_bytes = 8 << 20;
  auto client = std::make_shared<TestClient>(o);
  client->self = client;
  TestClient& c = *client;
  c.BeginCall(stub, kMethod);
  pb::ExpertRequest big = Request(1);
  big.mutable_hidden()->set_data(std::string(1 << 20, 'h'));
  const size_t n = big.ByteSizeLong();
  int queued = 0;
  for (int i = 0; i < 64; ++i) {
    std::lock_guard<std::mutex> l(c.mutex());
    if (!c.HasRoomLocked(n)) break;
    c.WriteLocked(big, Path::kStream);
    ++queued;
  }
  EXPECT_LT(queued, 64) << "the client end took every write while its peer read nothing";
  EXPECT_LE(c.unwritten_bytes(), static_cast<size_t>(8 << 20));
  c.End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the test ends it"));
  ASSERT_TRUE(WaitFor([&] { return c.ended.load(); }));
  EXPECT_EQ(c.end_status.error_message(), "the test ends it");
  EXPECT_EQ(c.unwritten_bytes(), 0u);
}

}  // namespace
}  // namespace exl3::svc
