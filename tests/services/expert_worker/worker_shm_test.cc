// The worker's shared-memory transport (ExpertRequest.shm_offer) on loopback: a real gRPC stream
// plus a real ShmChannel in /dev/shm, answers checked against the CPU reference and against the
// same request sent through gRPC.
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "services/common/shm_channel.h"
#include "services/common/wire.h"
#include "tests/services/expert_worker/worker_harness.h"

namespace exl3::testing {
namespace {

constexpr int kH = 256;
const std::vector<int> kHeld = {0, 1, 2, 3, 4, 5};

using Stream = grpc::ClientReaderWriter<pb::ExpertRequest, pb::ExpertResponse>;

struct Request {
  pb::ExpertRequest msg;
  std::vector<float> x;
  int T, S;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Request Random(std::mt19937& rng, uint64_t id, int T) {
  Request r;
  r.T = T;
  r.S = 3;
  r.x = RandomHidden(rng, T, kH);
  RandomRouting(rng, T, r.S, kHeld, 4, &r.ids, &r.w);
  r.msg = MakeRequest(id, 1, r.x, T, kH, r.S, r.ids, r.w);
  return r;
}

bool ShmSend(svc::ShmChannel& ch, const pb::ExpertRequest& m) {
  const size_t n = m.ByteSizeLong();
  return ch.TryWrite(n, [&](uint8_t* dst) { m.SerializeWithCachedSizesToArray(dst); });
}

bool ShmReceive(svc::ShmChannel& ch, pb::ExpertResponse* r) {
  bool parsed = false;
  if (!ch.Read([&](const uint8_t* p, size_t n) { parsed = r->ParseFromArray(p, static_cast<int>(n)); })) {
    return false;
  }
  return parsed;
}

// A worker on loopback, a fresh channel of `ring_bytes` and one Forward stream to the worker.
struct ShmSetup {
  explicit ShmSetup(size_t ring_bytes, bool worker_shm = true, int spin_us = 0) {
    auto o = h.Options();
    o.shm = worker_shm;
    h.Start(o);
    auto c = svc::ShmChannel::Create(ring_bytes, spin_us);
    EXPECT_TRUE(c.ok()) << c.status();
    ch = std::move(*c);
    s = h.stub->Forward(&ctx);
  }
  WorkerHarness h;
  std::unique_ptr<svc::ShmChannel> ch;
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> s;
};

// Offers `ch` on `s` and returns the worker's answer.
pb::ExpertResponse Offer(Stream& s, const std::string& name, uint64_t nonce) {
  pb::ExpertRequest offer;
  offer.set_id(77);
  offer.mutable_shm_offer()->set_name(name);
  offer.mutable_shm_offer()->set_nonce(nonce);
  EXPECT_TRUE(s.Write(offer));
  pb::ExpertResponse r;
  EXPECT_TRUE(s.Read(&r));
  EXPECT_EQ(r.id(), 77u);
  return r;
}

TEST(WorkerShm, RequestsThroughTheChannelMatchGrpcAndTheReference) {
  ShmSetup t(256 << 10, /*worker_shm=*/true, /*spin_us=*/50);
  WorkerHarness& h = t.h;
  auto& s = t.s;
  pb::DescribeResponse d;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(h.stub->Describe(&ctx, pb::DescribeRequest(), &d).ok());
  }
  EXPECT_TRUE(d.shm_supported());
  EXPECT_EQ(d.host_id(), svc::HostId());
  pb::ExpertResponse ack = Offer(*s, t.ch->name(), t.ch->nonce());
  ASSERT_TRUE(ack.shm_attached()) << ack.status().message();
  // The worker removed the name once it had the channel mapped.
  EXPECT_EQ(svc::ShmChannel::Attach(t.ch->name(), t.ch->nonce(), 0).status().code(),
            absl::StatusCode::kNotFound);

  std::mt19937 rng(5);
  for (int T : {1, 8, 17}) {
    Request q = Random(rng, 100 + T, T);
    ASSERT_TRUE(ShmSend(*t.ch, q.msg));
    pb::ExpertResponse by_shm;
    ASSERT_TRUE(ShmReceive(*t.ch, &by_shm));
    ASSERT_EQ(by_shm.status().code(), pb::OK) << by_shm.status().message();
    EXPECT_EQ(by_shm.id(), q.msg.id());
    ASSERT_TRUE(s->Write(q.msg));  // the same request through gRPC, same id (the first is answered)
    pb::ExpertResponse by_grpc;
    ASSERT_TRUE(s->Read(&by_grpc));
    EXPECT_EQ(by_shm.output().data(), by_grpc.output().data()) << "T=" << T;
    const std::vector<float> ref = h.Reference(1, q.x, T, q.S, q.ids, q.w);
    EXPECT_LT(RelError(OutputAsFloat(by_shm), ref), 1e-5);
  }
  // An answer larger than the channel takes comes back through gRPC.
  Request big = Random(rng, 500, 96);  // 96 KiB of fp32 output > a quarter of 256 KiB,
  svc::EncodeTensor(big.x.data(), {96, kH}, pb::DTYPE_FP16, big.msg.mutable_hidden());  // 48 in
  ASSERT_TRUE(ShmSend(*t.ch, big.msg));
  pb::ExpertResponse r;
  ASSERT_TRUE(s->Read(&r));
  EXPECT_EQ(r.id(), 500u);
  EXPECT_EQ(r.status().code(), pb::OK);
  // Bad input through the channel gets the same in-band error as through gRPC.
  pb::ExpertRequest bad = Random(rng, 600, 2).msg;
  bad.set_layer(99);
  ASSERT_TRUE(ShmSend(*t.ch, bad));
  ASSERT_TRUE(ShmReceive(*t.ch, &r));
  EXPECT_EQ(r.id(), 600u);
  EXPECT_EQ(r.status().code(), pb::NOT_FOUND) << r.status().message();
  // Half-closing the stream ends it and the channel with it.
  s->WritesDone();
  EXPECT_TRUE(s->Finish().ok());
  EXPECT_FALSE(ShmReceive(*t.ch, &r));
}

TEST(WorkerShm, ReusedBuffersCarryNothingOverBetweenRequests) {
  // The worker parses each channel request into the previous one's hidden-states buffer and
  // computes into the previous answer's output buffer (services/expert_worker/worker_stream.h):
  // shrinking and growing sizes must still give the reference, and a request without hidden
  // states is refused as through gRPC.
  ShmSetup t(1 << 20, /*worker_shm=*/true, /*spin_us=*/50);
  auto& s = t.s;
  ASSERT_TRUE(Offer(*s, t.ch->name(), t.ch->nonce()).shm_attached());
  std::mt19937 rng(11);
  uint64_t id = 1;
  for (int T : {33, 7, 1, 20, 20, 2}) {
    Request q = Random(rng, id++, T);
    ASSERT_TRUE(ShmSend(*t.ch, q.msg));
    pb::ExpertResponse r;
    ASSERT_TRUE(ShmReceive(*t.ch, &r));
    ASSERT_EQ(r.status().code(), pb::OK) << r.status().message();
    ASSERT_EQ(r.output().shape(0), T);
    const std::vector<float> ref = t.h.Reference(1, q.x, T, q.S, q.ids, q.w);
    EXPECT_LT(RelError(OutputAsFloat(r), ref), 1e-5) << "T=" << T;
  }
  pb::ExpertRequest empty = Random(rng, id++, 3).msg;
  empty.clear_hidden();
  ASSERT_TRUE(ShmSend(*t.ch, empty));
  pb::ExpertResponse by_shm, by_grpc;
  ASSERT_TRUE(ShmReceive(*t.ch, &by_shm));
  ASSERT_TRUE(s->Write(empty));
  ASSERT_TRUE(s->Read(&by_grpc));
  EXPECT_EQ(by_shm.status().code(), pb::INVALID_ARGUMENT);
  EXPECT_EQ(by_shm.status().message(), by_grpc.status().message());
  s->WritesDone();
  EXPECT_TRUE(s->Finish().ok());
}

TEST(WorkerShm, BadOffersAreDeclinedAndTheStreamGoesOn) {
  ShmSetup t(64 << 10);
  auto& s = t.s;
  pb::ExpertResponse r = Offer(*s, t.ch->name(), t.ch->nonce() ^ 1);
  EXPECT_FALSE(r.shm_attached());
  EXPECT_EQ(r.status().code(), pb::FAILED_PRECONDITION) << r.status().message();
  r = Offer(*s, "/exl3-missing", 1);
  EXPECT_FALSE(r.shm_attached());
  EXPECT_EQ(r.status().code(), pb::NOT_FOUND) << r.status().message();
  std::mt19937 rng(3);
  Request q = Random(rng, 1, 2);
  ASSERT_TRUE(s->Write(q.msg));
  ASSERT_TRUE(s->Read(&r));
  EXPECT_EQ(r.status().code(), pb::OK);
  s->WritesDone();
  EXPECT_TRUE(s->Finish().ok());
}

TEST(WorkerShm, OffWhenDisabled) {
  ShmSetup t(64 << 10, /*worker_shm=*/false);
  auto& s = t.s;
  pb::ExpertResponse r = Offer(*s, t.ch->name(), t.ch->nonce());
  EXPECT_FALSE(r.shm_attached());
  EXPECT_EQ(r.status().code(), pb::FAILED_PRECONDITION);
  s->WritesDone();
  EXPECT_TRUE(s->Finish().ok());
}

TEST(WorkerShm, GarbageInTheChannelEndsTheStreamNotTheWorker) {
  ShmSetup t(64 << 10);
  auto& s = t.s;
  ASSERT_TRUE(Offer(*s, t.ch->name(), t.ch->nonce()).shm_attached());
  // Bytes that are not an ExpertRequest.
  ASSERT_TRUE(t.ch->TryWrite(9, [](uint8_t* dst) { std::memset(dst, 0xff, 9); }));
  pb::ExpertResponse r;
  while (s->Read(&r)) {
  }
  EXPECT_FALSE(s->Finish().ok());
  // The worker still serves other streams.
  std::mt19937 rng(9);
  std::vector<pb::ExpertResponse> got;
  ASSERT_TRUE(RunStream(t.h.stub.get(), {Random(rng, 1, 1).msg}, &got).ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status().code(), pb::OK);
}

}  // namespace
}  // namespace exl3::testing

namespace exl3::testing {
namespace {

// The router vanishing (its stream cancelled, no half-close) with a request of its still in the
// channel: the worker ends that stream and its channel reader, and serves the next stream.
TEST(WorkerShm, CallerThatVanishesLeavesTheWorkerServing) {
  ShmSetup t(256 << 10, /*worker_shm=*/true, /*spin_us=*/50);
  ASSERT_TRUE(Offer(*t.s, t.ch->name(), t.ch->nonce()).shm_attached());
  std::mt19937 rng(21);
  ASSERT_TRUE(ShmSend(*t.ch, Random(rng, 1, 8).msg));
  t.ctx.TryCancel();
  EXPECT_FALSE(t.s->Finish().ok());
  std::vector<pb::ExpertResponse> got;
  ASSERT_TRUE(RunStream(t.h.stub.get(), {Random(rng, 2, 3).msg}, &got).ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status().code(), pb::OK);
  // A fresh channel on a fresh stream attaches as the first did.
  auto ch2 = svc::ShmChannel::Create(64 << 10, 0);
  ASSERT_TRUE(ch2.ok());
  grpc::ClientContext ctx2;
  auto s2 = t.h.stub->Forward(&ctx2);
  EXPECT_TRUE(Offer(*s2, (*ch2)->name(), (*ch2)->nonce()).shm_attached());
  s2->WritesDone();
  EXPECT_TRUE(s2->Finish().ok());
}

}  // namespace
}  // namespace exl3::testing
