// The expert worker on loopback with a real gRPC server, a generated EXL3 model on disk and the
// CPU reference MoE as the judge.
#include <atomic>
#include <fstream>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "services/common/wire.h"
#include "tests/services/expert_worker/worker_harness.h"

namespace exl3::testing {
namespace {

constexpr int kH = 256;
const std::vector<int> kHeld = {0, 1, 2, 3, 4, 5};

struct Sent {
  pb::ExpertRequest req;
  std::vector<float> x;
  int T, S;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Sent RandomRequest(std::mt19937& rng, uint64_t id, int layer, int T, int S) {
  Sent s;
  s.T = T;
  s.S = S;
  s.x = RandomHidden(rng, T, kH);
  RandomRouting(rng, T, S, kHeld, 4, &s.ids, &s.w);
  s.req = MakeRequest(id, layer, s.x, T, kH, S, s.ids, s.w);
  return s;
}

TEST(Worker, SixtyFourConcurrentStreamsMatchTheReference) {
  WorkerHarness h;
  h.Start(h.Options());
  constexpr int kStreams = 64, kPerStream = 3;
  std::vector<std::vector<Sent>> sent(kStreams);
  std::mt19937 rng(7);
  for (int s = 0; s < kStreams; ++s) {
    for (int i = 0; i < kPerStream; ++i) {
      const int T = 1 + static_cast<int>(rng() % 3);
      sent[s].push_back(RandomRequest(rng, 1000 * s + i, 1 + static_cast<int>(rng() % 2), T,
                                      2 + static_cast<int>(rng() % 3)));
    }
  }
  std::vector<std::vector<pb::ExpertResponse>> got(kStreams);
  std::vector<grpc::Status> st(kStreams);
  std::vector<std::thread> threads;
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      std::vector<pb::ExpertRequest> reqs;
      for (const auto& x : sent[s]) reqs.push_back(x.req);
      st[s] = RunStream(h.stub.get(), reqs, &got[s]);
    });
  }
  for (auto& t : threads) t.join();
  int batched = 0;
  for (int s = 0; s < kStreams; ++s) {
    ASSERT_TRUE(st[s].ok()) << st[s].error_message();
    ASSERT_EQ(got[s].size(), sent[s].size());
    for (const auto& r : got[s]) {
      ASSERT_EQ(r.status().code(), pb::OK) << r.status().message();
      const Sent& q = sent[s][r.id() % 1000];
      ASSERT_EQ(r.id(), q.req.id());
      EXPECT_EQ(r.layer(), q.req.layer());
      ASSERT_EQ(r.output().shape_size(), 2);
      EXPECT_EQ(r.output().shape(0), q.T);
      EXPECT_EQ(r.output().dtype(), pb::DTYPE_FP32);
      const std::vector<float> ref = h.Reference(q.req.layer(), q.x, q.T, q.S, q.ids, q.w);
      EXPECT_LT(RelError(OutputAsFloat(r), ref), 1e-5) << "stream " << s << " id " << r.id();
      EXPECT_GE(r.timings().total_us(), r.timings().queue_us());
      EXPECT_EQ(r.timings().chunks(), 1u);
      if (r.timings().batch_requests() > 1) ++batched;
    }
  }
  // 64 streams at once: the batcher must have combined requests.
  EXPECT_GT(batched, 0);
}

TEST(Worker, HalfPrecisionOutputsAndChunkedLongRequests) {
  WorkerHarness h;
  auto o = h.Options();
  o.long_prefill_token_threshold = 16;
  h.Start(o);
  std::mt19937 rng(11);
  std::vector<Sent> sent;
  sent.push_back(RandomRequest(rng, 1, 1, 50, 4));  // 4 chunks of <= 16
  sent.push_back(RandomRequest(rng, 2, 2, 3, 4));
  sent.push_back(RandomRequest(rng, 3, 2, 3, 4));
  sent.push_back(RandomRequest(rng, 4, 1, 17, 3));  // 2 chunks
  sent[1].req.set_output_dtype(pb::DTYPE_FP16);
  sent[2].req.set_output_dtype(pb::DTYPE_BF16);
  // fp16 and bf16 inputs are accepted too.
  svc::EncodeTensor(sent[3].x.data(), {17, kH}, pb::DTYPE_BF16, sent[3].req.mutable_hidden());
  std::vector<pb::ExpertRequest> reqs;
  for (const auto& s : sent) reqs.push_back(s.req);
  std::vector<pb::ExpertResponse> got;
  ASSERT_TRUE(RunStream(h.stub.get(), reqs, &got).ok());
  ASSERT_EQ(got.size(), 4u);
  for (const auto& r : got) {
    ASSERT_EQ(r.status().code(), pb::OK) << r.status().message();
    const Sent& q = sent[r.id() - 1];
    std::vector<float> x = q.x;
    if (r.id() == 4) {  // the worker saw bf16-rounded inputs
      std::vector<float> back(x.size());
      ASSERT_TRUE(svc::TensorToFloat(q.req.hidden(), "x", true, back.data()).ok());
      x = back;
    }
    const std::vector<float> ref = h.Reference(q.req.layer(), x, q.T, q.S, q.ids, q.w);
    const double tol = r.id() == 2 ? 1e-3 : r.id() == 3 ? 8e-3 : 1e-5;
    EXPECT_LT(RelError(OutputAsFloat(r), ref), tol) << "id " << r.id();
  }
  for (const auto& r : got) {
    // Chunks hold at most the threshold's 16 tokens (fewer while decode traffic is present).
    if (r.id() == 1) {
      EXPECT_GE(r.timings().chunks(), 4u);
    }
    if (r.id() == 4) {
      EXPECT_GE(r.timings().chunks(), 2u);
    }
    if (r.id() == 2) {
      EXPECT_EQ(r.output().dtype(), pb::DTYPE_FP16);
    }
    if (r.id() == 3) {
      EXPECT_EQ(r.output().dtype(), pb::DTYPE_BF16);
    }
  }
}

TEST(Worker, SmallRequestsAreNotQueuedBehindALongPrefill) {
  WorkerHarness h;
  auto o = h.Options();
  o.long_prefill_token_threshold = 16;
  h.Start(o);
  std::mt19937 rng(31);
  constexpr int kLong = 6400, kChecked = 64;  // long enough that a loaded CI machine still overlaps
  const Sent long_req = RandomRequest(rng, 1, 1, kLong, 4);
  std::atomic<bool> long_done{false};
  pb::ExpertResponse long_resp;
  grpc::ClientContext long_ctx;
  auto long_stream = h.stub->Forward(&long_ctx);
  ASSERT_TRUE(long_stream->Write(long_req.req));
  std::thread reader([&] {
    long_stream->Read(&long_resp);
    long_done.store(true);
  });
  // Closed-loop decode on the same layer while the prefill runs: each must come back while the
  // prefill is still being computed (checked against the reference afterwards, not in the loop).
  grpc::ClientContext ctx;
  auto stream = h.stub->Forward(&ctx);
  std::vector<Sent> small;
  std::vector<pb::ExpertResponse> small_resp;
  int finished_before_long = 0;
  for (int i = 0; i < 8; ++i) {
    small.push_back(RandomRequest(rng, 100 + i, 1, 1, 4));
    ASSERT_TRUE(stream->Write(small.back().req));
    small_resp.emplace_back();
    ASSERT_TRUE(stream->Read(&small_resp.back()));
    if (!long_done.load()) ++finished_before_long;
  }
  // Wall-clock overlap alone depends on how the test's threads are scheduled on a loaded machine,
  // so the check is on the worker's own timings: every small request that overlapped the prefill
  // spent a small fraction of the prefill's time in the worker (queued behind it, it would have
  // waited for most of it).
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  reader.join();
  long_stream->WritesDone();
  EXPECT_TRUE(long_stream->Finish().ok());
  EXPECT_GE(finished_before_long, 1) << "no decode request overlapped the prefill";
  ASSERT_EQ(long_resp.status().code(), pb::OK) << long_resp.status().message();
  for (int i = 0; i < finished_before_long; ++i) {
    EXPECT_LT(small_resp[i].timings().total_us() * 4, long_resp.timings().total_us())
        << "decode request " << i << " waited behind the prefill";
  }
  for (size_t i = 0; i < small.size(); ++i) {
    const Sent& q = small[i];
    ASSERT_EQ(small_resp[i].status().code(), pb::OK) << small_resp[i].status().message();
    EXPECT_LT(RelError(OutputAsFloat(small_resp[i]), h.Reference(1, q.x, q.T, q.S, q.ids, q.w)), 1e-5);
  }
  ASSERT_EQ(long_resp.status().code(), pb::OK) << long_resp.status().message();
  // Cut into pieces of at most the threshold (smaller while decode batches are timed faster).
  EXPECT_GE(long_resp.timings().chunks(), static_cast<unsigned>(kLong / 16));
  // The first rows against the reference (tokens are independent).
  const std::vector<float> x(long_req.x.begin(), long_req.x.begin() + kChecked * kH);
  const std::vector<int32_t> ids(long_req.ids.begin(), long_req.ids.begin() + kChecked * 4);
  const std::vector<float> w(long_req.w.begin(), long_req.w.begin() + kChecked * 4);
  std::vector<float> out = OutputAsFloat(long_resp);
  out.resize(static_cast<size_t>(kChecked) * kH);
  EXPECT_LT(RelError(out, h.Reference(1, x, kChecked, 4, ids, w)), 1e-5);
}

struct BadCase {
  std::string name;
  pb::ExpertRequest req;
  pb::StatusCode code;
  std::string needle;
};

TEST(Worker, EveryBadInputFailsAloneWithTheRightCode) {
  WorkerHarness h;
  h.Start(h.Options());
  std::mt19937 rng(3);
  const Sent good = RandomRequest(rng, 0, 1, 2, 4);
  std::vector<BadCase> cases;
  auto add = [&](std::string name, pb::StatusCode code, std::string needle,
                 const std::function<void(pb::ExpertRequest&)>& edit) {
    pb::ExpertRequest r = good.req;
    r.set_id(100 + cases.size());
    edit(r);
    cases.push_back({std::move(name), r, code, std::move(needle)});
  };
  add("unknown dtype", pb::INVALID_ARGUMENT, "dtype unknown(7)",
      [](auto& r) { r.mutable_hidden()->set_dtype(static_cast<pb::DType>(7)); });
  add("rank 1", pb::INVALID_ARGUMENT, "rank 1", [](auto& r) {
    r.mutable_hidden()->clear_shape();
    r.mutable_hidden()->add_shape(2 * kH);
  });
  add("hidden size", pb::INVALID_ARGUMENT, "hidden size 128 is not the model's hidden_size 256",
      [](auto& r) { r.mutable_hidden()->set_shape(1, 128); });
  add("byte length", pb::INVALID_ARGUMENT, "data has 2044 bytes",
      [](auto& r) { r.mutable_hidden()->mutable_data()->resize(2044); });
  add("NaN", pb::INVALID_ARGUMENT, "non-finite value nan at [1, 3]", [](auto& r) {
    float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(r.mutable_hidden()->mutable_data()->data() + 4 * (kH + 3), &nan, 4);
  });
  add("Inf", pb::INVALID_ARGUMENT, "non-finite value inf at [0, 0]", [](auto& r) {
    float inf = std::numeric_limits<float>::infinity();
    std::memcpy(r.mutable_hidden()->mutable_data()->data(), &inf, 4);
  });
  add("layer out of range", pb::NOT_FOUND, "layer 99 is out of range", [](auto& r) { r.set_layer(99); });
  add("negative layer", pb::NOT_FOUND, "layer -1 is out of range", [](auto& r) { r.set_layer(-1); });
  add("dense layer", pb::NOT_FOUND, "layer 0 is not an MoE layer (MoE layers: 1-2)",
      [](auto& r) { r.set_layer(0); });
  add("expert not held", pb::NOT_FOUND, "expert 7 of layer 1 is not held by this worker (held: 0-5)",
      [](auto& r) { r.set_expert_ids(1, 7); r.set_expert_ids(0, 0); r.set_expert_ids(2, -1); r.set_expert_ids(3, -1); });
  add("expert out of range", pb::NOT_FOUND, "expert 8 is out of range [0, 8)",
      [](auto& r) { r.set_expert_ids(0, 8); });
  add("weight NaN", pb::INVALID_ARGUMENT, "is not finite", [](auto& r) {
    r.set_expert_ids(0, 1);
    r.set_expert_weights(0, std::numeric_limits<float>::quiet_NaN());
  });
  add("weight Inf", pb::INVALID_ARGUMENT, "is not finite", [](auto& r) {
    r.set_expert_ids(0, 1);
    r.set_expert_weights(0, -std::numeric_limits<float>::infinity());
  });
  add("empty request", pb::INVALID_ARGUMENT, "empty request", [](auto& r) { r.clear_hidden(); });
  add("zero tokens", pb::INVALID_ARGUMENT, "empty request", [](auto& r) {
    r.mutable_hidden()->set_shape(0, 0);
    r.mutable_hidden()->clear_data();
  });
  add("slots 0", pb::INVALID_ARGUMENT, "slots is 0", [](auto& r) { r.set_slots(0); });
  add("routing length", pb::INVALID_ARGUMENT, "expert_ids has 7", [](auto& r) {
    r.mutable_expert_ids()->RemoveLast();
  });
  add("expert twice in a token", pb::INVALID_ARGUMENT, "expert 2 appears in slots 0 and 1", [](auto& r) {
    r.set_expert_ids(0, 2);
    r.set_expert_ids(1, 2);
  });
  add("output dtype", pb::INVALID_ARGUMENT, "output_dtype: unknown dtype 6",
      [](auto& r) { r.set_output_dtype(static_cast<pb::DType>(6)); });

  // Bad and good requests interleaved on one stream: every good one succeeds.
  std::vector<pb::ExpertRequest> reqs;
  for (size_t i = 0; i < cases.size(); ++i) {
    reqs.push_back(cases[i].req);
    pb::ExpertRequest g = good.req;
    g.set_id(500 + i);
    reqs.push_back(g);
  }
  std::vector<pb::ExpertResponse> got;
  grpc::Status st = RunStream(h.stub.get(), reqs, &got);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(got.size(), reqs.size());
  const std::vector<float> ref = h.Reference(1, good.x, good.T, good.S, good.ids, good.w);
  int good_ok = 0;
  for (const auto& r : got) {
    if (r.id() >= 500) {
      EXPECT_EQ(r.status().code(), pb::OK) << r.status().message();
      EXPECT_LT(RelError(OutputAsFloat(r), ref), 1e-5);
      ++good_ok;
      continue;
    }
    const BadCase& c = cases[r.id() - 100];
    EXPECT_EQ(r.status().code(), c.code) << c.name << ": " << r.status().message();
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos)
        << c.name << ": '" << r.status().message() << "' lacks '" << c.needle << "'";
    EXPECT_FALSE(r.has_output()) << c.name;
  }
  EXPECT_EQ(good_ok, static_cast<int>(cases.size()));
  const std::string metrics = h.server->ScrapeMetrics();
  EXPECT_NE(metrics.find("exl3_worker_errors_total{code=\"NOT_FOUND\"} 5"), std::string::npos) << metrics;
}

TEST(Worker, DuplicateInFlightIdIsRejectedAndTheFirstCompletes) {
  WorkerHarness h;
  auto o = h.Options();
  o.batch_window_us = 300000;  // holds the first request in the queue
  h.Start(o);
  std::mt19937 rng(5);
  const Sent a = RandomRequest(rng, 42, 1, 2, 4);
  Sent b = RandomRequest(rng, 42, 2, 1, 4);
  std::vector<pb::ExpertResponse> got;
  ASSERT_TRUE(RunStream(h.stub.get(), {a.req, b.req}, &got).ok());
  ASSERT_EQ(got.size(), 2u);
  // The duplicate is answered first (at once), the original after its batch window.
  EXPECT_EQ(got[0].status().code(), pb::INVALID_ARGUMENT);
  EXPECT_NE(got[0].status().message().find("duplicate in-flight id 42"), std::string::npos);
  EXPECT_EQ(got[1].status().code(), pb::OK);
  EXPECT_EQ(got[1].layer(), 1);
  EXPECT_LT(RelError(OutputAsFloat(got[1]), h.Reference(1, a.x, a.T, a.S, a.ids, a.w)), 1e-5);
  // Once answered, the id may be used again.
  got.clear();
  ASSERT_TRUE(RunStream(h.stub.get(), {a.req}, &got).ok());
  EXPECT_EQ(got[0].status().code(), pb::OK);
}

TEST(Worker, OversizedMessagesAndFullQueueAndDeadlines) {
  WorkerHarness h;
  auto o = h.Options();
  o.max_message_bytes = 64 << 10;
  o.max_queue = 3;
  o.batch_window_us = 200000;
  h.Start(o);
  std::mt19937 rng(9);
  // 80 tokens fp32 = 80 KiB > 64 KiB: answered in-band, the stream lives on.
  Sent big = RandomRequest(rng, 1, 1, 80, 1);
  // 40 tokens in fp16 (20 KiB) asking for fp32 output (40 KiB): fine. 70 tokens: output too big.
  Sent out_big = RandomRequest(rng, 2, 1, 70, 1);
  svc::EncodeTensor(out_big.x.data(), {70, kH}, pb::DTYPE_FP16, out_big.req.mutable_hidden());
  Sent d = RandomRequest(rng, 3, 2, 1, 2);
  d.req.set_timeout_us(1000);  // expires in the 200 ms batch window
  std::vector<pb::ExpertRequest> reqs = {big.req, out_big.req, d.req};
  for (int i = 0; i < 6; ++i) {
    Sent q = RandomRequest(rng, 10 + i, 1, 1, 2);
    reqs.push_back(q.req);
  }
  std::vector<pb::ExpertResponse> got;
  ASSERT_TRUE(RunStream(h.stub.get(), reqs, &got).ok());
  ASSERT_EQ(got.size(), reqs.size());
  int ok = 0, full = 0;
  for (const auto& r : got) {
    if (r.id() == 1) {
      EXPECT_EQ(r.status().code(), pb::RESOURCE_EXHAUSTED);
      EXPECT_NE(r.status().message().find("over --max-message-bytes 65536"), std::string::npos)
          << r.status().message();
    } else if (r.id() == 2) {
      EXPECT_EQ(r.status().code(), pb::RESOURCE_EXHAUSTED);
      EXPECT_NE(r.status().message().find("output of 70 tokens"), std::string::npos)
          << r.status().message();
    } else if (r.id() == 3) {
      EXPECT_EQ(r.status().code(), pb::DEADLINE_EXCEEDED) << r.status().message();
    } else if (r.status().code() == pb::OK) {
      ++ok;
    } else {
      EXPECT_EQ(r.status().code(), pb::RESOURCE_EXHAUSTED);
      EXPECT_NE(r.status().message().find("queue is full"), std::string::npos);
      ++full;
    }
  }
  EXPECT_GE(ok, 2);
  EXPECT_GE(full, 1);

  // Above twice the limit gRPC itself refuses the message: that stream ends, others don't.
  Sent huge = RandomRequest(rng, 99, 1, 200, 1);
  got.clear();
  grpc::Status st = RunStream(h.stub.get(), {huge.req}, &got);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  got.clear();
  ASSERT_TRUE(RunStream(h.stub.get(), {reqs[5]}, &got).ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status().code(), pb::OK);
}

TEST(Worker, HealthTransitionsAndDescribe) {
  WorkerHarness h;
  h.Start(h.Options(), /*load=*/false);
  const std::string svc_name = pb::ExpertWorker::service_full_name();
  EXPECT_EQ(HealthCheck(h.channel, ""), 2);  // NOT_SERVING while loading
  EXPECT_EQ(HealthCheck(h.channel, svc_name), 2);
  {
    grpc::ClientContext ctx;
    pb::DescribeResponse d;
    ASSERT_TRUE(h.stub->Describe(&ctx, pb::DescribeRequest(), &d).ok());
    EXPECT_EQ(d.state(), pb::STATE_LOADING);
  }
  std::mt19937 rng(1);
  Sent q = RandomRequest(rng, 1, 1, 1, 2);
  std::vector<pb::ExpertResponse> got;
  ASSERT_TRUE(RunStream(h.stub.get(), {q.req}, &got).ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status().code(), pb::UNAVAILABLE);
  EXPECT_NE(got[0].status().message().find("loading"), std::string::npos);

  ASSERT_TRUE(h.server->Load().ok());
  EXPECT_EQ(HealthCheck(h.channel, ""), 1);
  EXPECT_EQ(HealthCheck(h.channel, svc_name), 1);
  {
    grpc::ClientContext ctx;
    pb::DescribeResponse d;
    ASSERT_TRUE(h.stub->Describe(&ctx, pb::DescribeRequest(), &d).ok());
    EXPECT_EQ(d.state(), pb::STATE_SERVING);
    EXPECT_EQ(d.model().architecture(), "Glm4MoeForCausalLM");
    EXPECT_EQ(d.model().hidden_size(), kH);
    EXPECT_EQ(d.model().num_layers(), 3);
    EXPECT_EQ(d.model().num_experts(), 8);
    EXPECT_EQ(d.model().top_k(), 4);
    EXPECT_EQ(d.model().moe_layers_size(), 2);
    EXPECT_EQ(d.model().fingerprint().size(), 32u);
    ASSERT_EQ(d.experts_size(), 2);
    EXPECT_EQ(d.experts(0).layer(), 1);
    EXPECT_EQ(d.experts(0).experts_size(), 6);
    EXPECT_EQ(d.backend(), "cpu");
    EXPECT_EQ(d.versions().protocol(), "exl3serve.v1");
    EXPECT_FALSE(d.versions().grpc().empty());
    EXPECT_EQ(d.max_queue(), 1024u);
  }
  got.clear();
  ASSERT_TRUE(RunStream(h.stub.get(), {q.req}, &got).ok());
  EXPECT_EQ(got[0].status().code(), pb::OK);

  h.server->BeginDrain();
  EXPECT_EQ(HealthCheck(h.channel, ""), 2);
  EXPECT_EQ(HealthCheck(h.channel, svc_name), 2);
  got.clear();
  ASSERT_TRUE(RunStream(h.stub.get(), {q.req}, &got).ok());
  EXPECT_EQ(got[0].status().code(), pb::UNAVAILABLE);
  EXPECT_NE(got[0].status().message().find("draining"), std::string::npos);
  EXPECT_TRUE(h.server->Drain(absl::Seconds(5)));
}

TEST(Worker, StartupErrorsNameTheProblem) {
  WorkerHarness h;
  auto o = h.Options();
  o.experts = "0-9";
  auto w = worker::WorkerServer::Create(o);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("--experts '0-9'"), std::string::npos) << w.status();
  EXPECT_NE(w.status().message().find("8 routed experts"), std::string::npos) << w.status();

  // A model directory missing expert 3's tensors cannot serve --experts 0-5.
  TempDir other;
  ExpertModelSpec spec = ServiceModelSpec();
  spec.skip_experts = {3};
  ASSERT_TRUE(WriteExpertModel(other.path(), spec).ok());
  o = h.Options();
  o.model_dir = other.path();
  w = worker::WorkerServer::Create(o);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("model.layers.1.mlp.experts.3.gate_proj"), std::string::npos)
      << w.status();
  // ... but it can serve the others.
  o.experts = "0-2,4-7";
  w = worker::WorkerServer::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();

  o = h.Options();
  o.expert_map = "";
  o.experts = "";
  EXPECT_FALSE(worker::WorkerServer::Create(o).ok());
  o.model_dir = h.dir.path() + "/nope";
  o.experts = "0-3";
  w = worker::WorkerServer::Create(o);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("nope"), std::string::npos) << w.status();
}

TEST(Worker, ExpertMapSelectsThisWorkersExperts) {
  WorkerHarness h;
  auto o = h.Options();
  const std::string map = h.dir.path() + "/map.yaml";
  std::ofstream(map) << "workers:\n"
                        "  - name: w0\n    address: 127.0.0.1:1\n    experts: 0-3\n"
                        "  - name: w1\n    address: 127.0.0.1:2\n    experts:\n"
                        "      - layers: 1\n        experts: 4-7\n"
                        "      - layers: 2\n        experts: 0-7\n";
  o.experts = "";
  o.expert_map = map;
  o.worker_name = "w1";
  h.Start(o);
  EXPECT_EQ(h.server->experts().at(1), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(h.server->experts().at(2).size(), 8u);
  o.worker_name = "w9";
  auto w = worker::WorkerServer::Create(o);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("'w9' is not in"), std::string::npos) << w.status();
}

TEST(Worker, CancelledStreamDoesNotDisturbOthers) {
  WorkerHarness h;
  auto o = h.Options();
  o.batch_window_us = 100000;
  h.Start(o);
  std::mt19937 rng(21);
  {
    grpc::ClientContext ctx;
    auto stream = h.stub->Forward(&ctx);
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(stream->Write(RandomRequest(rng, i, 1, 2, 2).req));
    ctx.TryCancel();
    pb::ExpertResponse r;
    while (stream->Read(&r)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  const Sent q = RandomRequest(rng, 1, 2, 3, 3);
  std::vector<pb::ExpertResponse> got;
  ASSERT_TRUE(RunStream(h.stub.get(), {q.req}, &got).ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status().code(), pb::OK);
  EXPECT_LT(RelError(OutputAsFloat(got[0]), h.Reference(2, q.x, q.T, q.S, q.ids, q.w)), 1e-5);
}

TEST(Worker, CancelDropsAQueuedRequestAndLeavesItsBatchAlone) {
  WorkerHarness h;
  auto o = h.Options();
  o.batch_window_us = 400000;  // the three requests wait together in the queue
  h.Start(o);
  pb::DescribeResponse d;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(h.stub->Describe(&ctx, pb::DescribeRequest(), &d).ok());
  }
  EXPECT_TRUE(d.cancel_supported());
  EXPECT_FALSE(d.holds_shared_expert());
  std::mt19937 rng(31);
  const Sent a = RandomRequest(rng, 1, 1, 3, 2);
  const Sent b = RandomRequest(rng, 2, 1, 5, 2);
  const Sent c = RandomRequest(rng, 3, 1, 2, 2);
  pb::ExpertRequest cancel_b;
  cancel_b.set_id(2);
  cancel_b.mutable_cancel()->set_reason(pb::CANCEL_REASON_CLIENT);
  pb::ExpertRequest cancel_unknown;  // not in flight: ignored, never answered
  cancel_unknown.set_id(77);
  cancel_unknown.mutable_cancel()->set_reason(pb::CANCEL_REASON_DEADLINE);
  std::vector<pb::ExpertResponse> got;
  ASSERT_TRUE(RunStream(h.stub.get(), {a.req, b.req, c.req, cancel_b, cancel_unknown}, &got).ok());
  ASSERT_EQ(got.size(), 3u);  // one answer per request, none for the cancels
  // The cancelled request is answered at once, before the batch window ends.
  EXPECT_EQ(got[0].id(), 2u);
  EXPECT_EQ(got[0].status().code(), pb::CANCELLED) << got[0].status().message();
  EXPECT_FALSE(got[0].has_output());
  for (const auto& r : got) {
    if (r.id() == 2) continue;
    ASSERT_EQ(r.status().code(), pb::OK) << r.status().message();
    const Sent& s = r.id() == 1 ? a : c;
    EXPECT_LT(RelError(OutputAsFloat(r), h.Reference(1, s.x, s.T, s.S, s.ids, s.w)), 1e-5);
    EXPECT_EQ(r.timings().batch_requests(), 2u);  // its batch held the other survivor only
  }
  // Never computed: only a's and c's tokens were.
  const std::string m = h.server->ScrapeMetrics();
  EXPECT_NE(m.find("exl3_worker_tokens_total{layer=\"1\"} 5"), std::string::npos) << m;
  EXPECT_NE(m.find("exl3_worker_cancels_total{outcome=\"dropped\",reason=\"client\"} 1"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("exl3_worker_cancels_total{outcome=\"late\",reason=\"deadline\"} 1"),
            std::string::npos);
  EXPECT_NE(m.find("exl3_worker_errors_total{code=\"CANCELLED\"} 1"), std::string::npos);
}

TEST(Worker, MetricsSeriesExistAtZeroAndCount) {
  WorkerHarness h;
  h.Start(h.Options());
  std::string m = h.server->ScrapeMetrics();
  for (const char* s : {
           "exl3_worker_layer_latency_seconds_count{layer=\"1\",stage=\"queue\"} 0",
           "exl3_worker_layer_latency_seconds_count{layer=\"2\",stage=\"compute\"} 0",
           "exl3_worker_layer_latency_seconds_count{layer=\"2\",stage=\"total\"} 0",
           "exl3_worker_batch_tokens_count{layer=\"1\"} 0",
           "exl3_worker_batch_requests_count{layer=\"2\"} 0",
           "exl3_worker_requests_total{layer=\"1\"} 0",
           "exl3_worker_tokens_total{layer=\"2\"} 0",
           "exl3_worker_errors_total{code=\"DEADLINE_EXCEEDED\"} 0",
           "exl3_worker_cancels_total{outcome=\"dropped\",reason=\"stream_closed\"} 0",
           "exl3_worker_expert_tokens_total{expert=\"5\"} 0",
           "exl3_worker_queue_depth 0",
           "exl3_worker_ready 1",
           "exl3_worker_info{backend=\"cpu\"",
           "exl3_worker_load_seconds ",
           "exl3_worker_pinned_bytes ",
       }) {
    EXPECT_NE(m.find(s), std::string::npos) << s;
  }
  EXPECT_EQ(m.find("layer=\"0\""), std::string::npos);  // the dense layer has no series
  std::mt19937 rng(2);
  Sent q = RandomRequest(rng, 1, 1, 3, 1);
  q.ids = {5, 5, 5};
  q.w = {0.5f, 0.5f, 0.5f};
  q.req = MakeRequest(1, 1, q.x, 3, kH, 1, q.ids, q.w);
  std::vector<pb::ExpertResponse> got;
  ASSERT_TRUE(RunStream(h.stub.get(), {q.req}, &got).ok());
  m = h.server->ScrapeMetrics();
  EXPECT_NE(m.find("exl3_worker_requests_total{layer=\"1\"} 1"), std::string::npos);
  EXPECT_NE(m.find("exl3_worker_tokens_total{layer=\"1\"} 3"), std::string::npos);
  EXPECT_NE(m.find("exl3_worker_expert_tokens_total{expert=\"5\"} 3"), std::string::npos);
  EXPECT_NE(m.find("exl3_worker_layer_latency_seconds_count{layer=\"1\",stage=\"total\"} 1"),
            std::string::npos);
}

}  // namespace
}  // namespace exl3::testing
