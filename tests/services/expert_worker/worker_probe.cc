// exl3-worker-probe: drives an exl3-worker over gRPC with random requests built from its
// Describe answer. Two uses:
//   traffic:  exl3-worker-probe --target 127.0.0.1:50061 --requests 200 --streams 4
//             (every answer must be OK; exit 1 otherwise)
//   decode p99 under a long prefill (the batcher's starvation check):
//             exl3-worker-probe --target ... --decode-streams 4 --duration-s 5 --prefill-tokens 65536
//             measures per-layer decode (T=1) round trips on an idle worker, then again while one
//             request of --prefill-tokens tokens runs through the same worker, and prints both.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "services/common/flags.h"
#include "services/common/wire.h"
#include "tests/services/common/grpc_test_util.h"
#include "tests/services/common/service_test_util.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50061", "worker HOST:PORT");
ABSL_FLAG(int, requests, 0, "traffic mode: requests to send in total");
ABSL_FLAG(int, streams, 4, "traffic mode: concurrent streams");
ABSL_FLAG(int, tokens, 4, "traffic mode: tokens per request (1..tokens)");
ABSL_FLAG(int, decode_streams, 0,
          "decode mode: closed-loop T=1 streams (0 with --prefill-tokens: time the prefill alone)");
ABSL_FLAG(double, duration_s, 5, "decode mode: seconds of idle measurement");
ABSL_FLAG(int, prefill_tokens, 65536, "decode mode: tokens of the concurrent prefill request");
ABSL_FLAG(int, seed, 1, "random seed");

namespace pb = ::exl3serve::v1;
using Clock = std::chrono::steady_clock;

namespace {

struct Shape {
  int hidden = 0, top_k = 0;
  std::vector<int> layers;
  std::map<int, std::vector<int>> experts;
};

pb::ExpertRequest Random(std::mt19937& rng, const Shape& sh, uint64_t id, int layer, int T,
                         pb::DType in_dtype, pb::DType out_dtype) {
  std::vector<int32_t> ids;
  std::vector<float> w;
  const std::vector<float> x = exl3::testing::RandomHidden(rng, T, sh.hidden);
  const int S = std::min<int>(sh.top_k, static_cast<int>(sh.experts.at(layer).size()));
  exl3::testing::RandomRouting(rng, T, S, sh.experts.at(layer), S, &ids, &w);
  pb::ExpertRequest r = exl3::testing::MakeRequest(id, layer, x, T, sh.hidden, S, ids, w);
  if (in_dtype != pb::DTYPE_FP32) exl3::svc::EncodeTensor(x.data(), {T, sh.hidden}, in_dtype, r.mutable_hidden());
  r.set_output_dtype(out_dtype);
  return r;
}

double Pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// Closed-loop T=1 requests on `n` streams until `stop`; latencies (us) per layer.
std::map<int, std::vector<double>> Decode(pb::ExpertWorker::Stub* stub, const Shape& sh, int n,
                                          std::atomic<bool>& stop, int seed, int* errors) {
  std::map<int, std::vector<double>> lat;
  std::mutex mu;
  std::vector<std::thread> ts;
  std::atomic<int> errs{0};
  for (int s = 0; s < n; ++s) {
    ts.emplace_back([&, s] {
      std::mt19937 rng(seed * 1000 + s);
      grpc::ClientContext ctx;
      auto rw = stub->Forward(&ctx);
      std::map<int, std::vector<double>> mine;
      uint64_t id = 0;
      while (!stop.load()) {
        const int layer = sh.layers[id % sh.layers.size()];
        const pb::ExpertRequest req = Random(rng, sh, id++, layer, 1, pb::DTYPE_BF16, pb::DTYPE_FP32);
        const auto t0 = Clock::now();
        pb::ExpertResponse resp;
        if (!rw->Write(req) || !rw->Read(&resp)) break;
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (resp.status().code() != pb::OK) {
          ++errs;
          continue;
        }
        mine[layer].push_back(us);
      }
      rw->WritesDone();
      rw->Finish();
      std::lock_guard<std::mutex> l(mu);
      for (auto& [k, v] : mine) lat[k].insert(lat[k].end(), v.begin(), v.end());
    });
  }
  for (auto& t : ts) t.join();
  *errors = errs.load();
  return lat;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("drives an exl3-worker with random requests (see the file header)");
  std::vector<char*> args = exl3::svc::DashesToUnderscores(argc, argv);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  auto channel = exl3::testing::LoopbackChannel(absl::GetFlag(FLAGS_target));
  auto stub = pb::ExpertWorker::NewStub(channel);
  pb::DescribeResponse d;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status st = stub->Describe(&ctx, pb::DescribeRequest(), &d);
    if (!st.ok()) {
      std::fprintf(stderr, "exl3-worker-probe: Describe on %s failed: %s\n",
                   absl::GetFlag(FLAGS_target).c_str(), st.error_message().c_str());
      return 1;
    }
  }
  Shape sh;
  sh.hidden = d.model().hidden_size();
  sh.top_k = d.model().top_k();
  for (const auto& le : d.experts()) {
    if (le.experts_size() == 0) continue;
    sh.layers.push_back(le.layer());
    sh.experts[le.layer()] = std::vector<int>(le.experts().begin(), le.experts().end());
  }
  if (sh.layers.empty()) {
    std::fprintf(stderr, "exl3-worker-probe: the worker holds no experts\n");
    return 1;
  }

  if (absl::GetFlag(FLAGS_requests) > 0) {
    const int total = absl::GetFlag(FLAGS_requests), ns = std::max(1, absl::GetFlag(FLAGS_streams));
    std::atomic<int> ok{0}, bad{0};
    std::vector<std::thread> ts;
    for (int s = 0; s < ns; ++s) {
      ts.emplace_back([&, s] {
        std::mt19937 rng(absl::GetFlag(FLAGS_seed) * 7919 + s);
        grpc::ClientContext ctx;
        auto rw = stub->Forward(&ctx);
        int n = total / ns + (s < total % ns ? 1 : 0);
        for (int i = 0; i < n; ++i) {
          const int layer = sh.layers[rng() % sh.layers.size()];
          const int T = 1 + static_cast<int>(rng() % std::max(1, absl::GetFlag(FLAGS_tokens)));
          if (!rw->Write(Random(rng, sh, i, layer, T, pb::DTYPE_FP16, pb::DTYPE_FP32))) break;
        }
        rw->WritesDone();
        pb::ExpertResponse r;
        while (rw->Read(&r)) {
          if (r.status().code() == pb::OK) {
            ++ok;
          } else {
            ++bad;
            std::fprintf(stderr, "request %lu: %s\n", static_cast<unsigned long>(r.id()),
                         r.status().message().c_str());
          }
        }
        grpc::Status st = rw->Finish();
        if (!st.ok()) std::fprintf(stderr, "stream %d: %s\n", s, st.error_message().c_str());
      });
    }
    for (auto& t : ts) t.join();
    std::printf("traffic: %d OK, %d errors of %d\n", ok.load(), bad.load(), total);
    return (ok.load() == total) ? 0 : 1;
  }

  const int nd = absl::GetFlag(FLAGS_decode_streams);
  if (nd <= 0) {
    // Prefill alone: the throughput baseline for the decode-under-prefill numbers.
    std::mt19937 rng(99);
    const int P = absl::GetFlag(FLAGS_prefill_tokens);
    const pb::ExpertRequest req = Random(rng, sh, 1, sh.layers[0], P, pb::DTYPE_FP16, pb::DTYPE_FP16);
    grpc::ClientContext ctx;
    auto rw = stub->Forward(&ctx);
    const auto t0 = Clock::now();
    pb::ExpertResponse r;
    rw->Write(req);
    rw->WritesDone();
    rw->Read(&r);
    rw->Finish();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("prefill alone: %d tokens on layer %d in %.2f s (%.0f tokens/s), status %s, %u chunks\n",
                P, sh.layers[0], s, P / s, r.status().code() == pb::OK ? "OK" : r.status().message().c_str(),
                r.timings().chunks());
    return r.status().code() == pb::OK ? 0 : 1;
  }
  int errors = 0;
  std::atomic<bool> stop{false};
  // Phase 1: idle worker.
  std::thread timer([&] {
    std::this_thread::sleep_for(std::chrono::duration<double>(absl::GetFlag(FLAGS_duration_s)));
    stop.store(true);
  });
  auto idle = Decode(stub.get(), sh, nd, stop, absl::GetFlag(FLAGS_seed), &errors);
  timer.join();
  // Phase 2: the same decode load while one long prefill runs.
  stop.store(false);
  const int P = absl::GetFlag(FLAGS_prefill_tokens);
  double prefill_s = 0;
  pb::ExpertResponse presp;
  std::thread prefill([&] {
    std::mt19937 rng(99);
    const pb::ExpertRequest req = Random(rng, sh, 1, sh.layers[0], P, pb::DTYPE_FP16, pb::DTYPE_FP16);
    grpc::ClientContext ctx;
    auto rw = stub->Forward(&ctx);
    const auto t0 = Clock::now();
    rw->Write(req);
    rw->WritesDone();
    rw->Read(&presp);
    rw->Finish();
    prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
    stop.store(true);
  });
  int errors2 = 0;
  auto busy = Decode(stub.get(), sh, nd, stop, absl::GetFlag(FLAGS_seed) + 1, &errors2);
  prefill.join();
  std::printf("prefill: %d tokens on layer %d in %.2f s (%.0f tokens/s), status %s, %u chunks\n", P,
              sh.layers[0], prefill_s, P / prefill_s,
              presp.status().code() == pb::OK ? "OK" : presp.status().message().c_str(),
              presp.timings().chunks());
  std::printf("%-6s %10s %10s %10s %10s %10s %10s %8s\n", "layer", "idle n", "idle p50", "idle p99",
              "busy n", "busy p50", "busy p99", "p99 x");
  double worst = 0;
  for (int l : sh.layers) {
    const double i50 = Pct(idle[l], 0.5), i99 = Pct(idle[l], 0.99);
    const double b50 = Pct(busy[l], 0.5), b99 = Pct(busy[l], 0.99);
    worst = std::max(worst, i99 > 0 ? b99 / i99 : 0);
    std::printf("%-6d %10zu %9.0fus %9.0fus %10zu %9.0fus %9.0fus %8.2f\n", l, idle[l].size(), i50,
                i99, busy[l].size(), b50, b99, i99 > 0 ? b99 / i99 : 0.0);
  }
  std::printf("worst decode p99 ratio (busy/idle): %.2f; decode errors %d/%d\n", worst, errors, errors2);
  return 0;
}
