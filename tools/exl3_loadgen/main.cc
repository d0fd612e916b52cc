// exl3-loadgen: closed-loop load against an exl3-router (MoeRouter.Forward), decode-step shaped:
// every stream walks the model's MoE layers in order, each layer one (or --pipeline) requests of
// --tokens tokens. With --in-process-router the router's logic runs in this process (one gRPC hop,
// to the workers). Optionally verifies every answer against the CPU reference MoE of the model
// and measures a plain gRPC echo of the same payloads (--echo-baseline) as the transport floor.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "base/command_line.h"
#include "kernels/moe_cpu.h"
#include "model/config/read_moe_config.h"
#include "model/exl3_model.h"
#include "model/expert_map.h"
#include "model/routing.h"
#include "services/client/moe_client.h"
#include "services/common/flags.h"
#include "services/common/status.h"
#include "services/common/wire.h"
#include "services/router/in_process_router.h"
#include "tools/exl3_loadgen/echo_server.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "router HOST:PORT");
ABSL_FLAG(bool, in_process_router, false,
          "instead of --target: run the router's logic in this process (InProcessRouter) over the "
          "workers of --expert-map; --model must then hold the router weights and shared experts");
ABSL_FLAG(std::string, expert_map, "", "--in-process-router: expert map YAML (docs/expert-map.md)");
ABSL_FLAG(int32_t, ready_timeout_ms, 30000,
          "--in-process-router: how long to wait for every expert to have a serving worker");
ABSL_FLAG(std::string, model, "", "model directory (config.json; all weights with --verify)");
ABSL_FLAG(int32_t, concurrency, 1, "concurrent streams (closed loop each)");
ABSL_FLAG(int32_t, tokens, 1, "tokens per layer request");
ABSL_FLAG(int64_t, requests, 0, "total layer requests to send (0: use --duration)");
ABSL_FLAG(double, duration, 0, "seconds to run (when --requests is 0; default 10)");
ABSL_FLAG(int32_t, pipeline, 1, "micro-batches in flight per stream and layer");
ABSL_FLAG(bool, verify, false, "check every answer against the CPU reference MoE");
ABSL_FLAG(double, tolerance, 0,
          "--verify: max |y - ref| / max |ref| (0: 1e-3 for fp32 output, 4e-3 fp16, 2e-2 bf16)");
ABSL_FLAG(bool, allow_failures, false, "exit 0 even when requests failed or mismatched");
ABSL_FLAG(bool, echo_baseline, false,
          "also run the same load against a built-in gRPC echo server (the transport floor)");
ABSL_FLAG(std::string, dtype, "fp16", "hidden states dtype on the wire: fp32, fp16, bf16");
ABSL_FLAG(std::string, output_dtype, "fp32", "answer dtype: fp32, fp16, bf16");
ABSL_FLAG(bool, shared, true, "ask for the shared expert (include_shared_expert)");
ABSL_FLAG(int64_t, timeout_ms, 0, "per-request timeout_us sent to the router (0: router default)");
ABSL_FLAG(int32_t, warmup, 0, "requests per stream sent first and not counted");
ABSL_FLAG(int32_t, seed, 1, "random seed of the hidden states");
ABSL_FLAG(std::string, layers, "", "MoE layers to use, e.g. 1-3 (default: all)");
ABSL_FLAG(std::string, target_tls_ca, "", "PEM CA of the router's certificate (enables TLS)");
ABSL_FLAG(std::string, target_tls_cert, "", "PEM client certificate (mutual TLS)");
ABSL_FLAG(std::string, target_tls_key, "", "PEM key of --target-tls-cert");
ABSL_FLAG(std::string, target_name_override, "", "TLS: expected server certificate name");
ABSL_FLAG(int32_t, max_errors_shown, 5, "distinct error messages printed");

namespace exl3::loadgen {
namespace {

namespace pb = ::exl3serve::v1;
using Clock = std::chrono::steady_clock;

bool ParseDType(const std::string& s, pb::DType* d) {
  if (s == "fp32") *d = pb::DTYPE_FP32;
  else if (s == "fp16") *d = pb::DTYPE_FP16;
  else if (s == "bf16") *d = pb::DTYPE_BF16;
  else return false;
  return true;
}

struct Sample {
  int layer;
  double us;
};

struct Totals {
  std::mutex mu;
  std::vector<Sample> samples;
  int64_t requests = 0, ok = 0, failed = 0, verified = 0, mismatched = 0;
  std::map<std::string, int64_t> by_code;
  std::set<std::string> messages;
  double max_rel_err = 0;
  // Sums of the router's own timings over OK answers (RouterTimings).
  double gate_us = 0, dispatch_us = 0, workers_us = 0, combine_us = 0, total_us = 0;
};

struct Config {
  std::vector<int> layers;
  int hidden = 0;
  int T = 1;
  int pipeline = 1;
  pb::DType dtype = pb::DTYPE_FP16, out = pb::DTYPE_FP32;
  bool shared = true;
  int64_t timeout_ms = 0;
  double tol = 1e-3;
  const Exl3Model* ref = nullptr;  // --verify
  int max_errors = 5;
};

// Reference answer for x (as the router saw it) on `layer`: routing + experts (+ shared).
absl::Status Reference(const Exl3Model& m, int layer, const std::vector<float>& x, int T, bool shared,
                       std::vector<int32_t>* ids, std::vector<float>* y) {
  const MoeConfig& cfg = m.config();
  ids->resize(static_cast<size_t>(T) * cfg.top_k);
  std::vector<float> w(ids->size());
  absl::Status s = RouteTokens(cfg, layer, m.RouterWeight(layer), m.CorrectionBias(layer), x.data(),
                               T, ids->data(), w.data());
  if (!s.ok()) return s;
  auto view = m.LayerView(layer);
  if (!view.ok()) return view.status();
  y->resize(static_cast<size_t>(T) * cfg.hidden_size);
  return MoeForwardReference(*view, x.data(), MoeAssignments::Fixed(T, cfg.top_k, ids->data(), w.data()),
                             shared, y->data());
}

class Budget {
 public:
  Budget(int64_t requests, double seconds)
      : left_(requests), end_(Clock::now() + std::chrono::microseconds(
                                                 static_cast<int64_t>(seconds * 1e6))),
        by_count_(requests > 0) {}
  // Claims up to n requests; returns how many were granted.
  int Claim(int n) {
    if (!by_count_) return Clock::now() < end_ ? n : 0;
    int64_t have = left_.load();
    while (have > 0) {
      const int64_t take = std::min<int64_t>(have, n);
      if (left_.compare_exchange_weak(have, have - take)) return static_cast<int>(take);
    }
    return 0;
  }

 private:
  std::atomic<int64_t> left_;
  Clock::time_point end_;
  bool by_count_;
};

// Opens a stream to the router: a MoeStream (--target) or an InProcessStream.
using StreamOpener = std::function<std::unique_ptr<client::LayerStream>()>;

void RunStream(const StreamOpener& open, const Config& c, Budget& budget, int warmup, uint32_t seed,
               Totals& tot) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::unique_ptr<client::LayerStream> stream = open();
  const size_t n = static_cast<size_t>(c.T) * c.hidden;
  struct Slot {
    std::vector<float> x;
    pb::MoeLayerRequest req;
    Clock::time_point sent;
    double us = 0;
    absl::Status st;
    pb::MoeLayerResponse resp;
    bool has_resp = false;
  };
  std::vector<Slot> slots(c.pipeline);
  bool stop = false;
  while (!stop) {
    for (int layer : c.layers) {
      const bool counted = warmup <= 0;
      const int np = counted ? budget.Claim(c.pipeline) : std::min(warmup, c.pipeline);
      if (np == 0) {
        stop = true;
        break;
      }
      if (!counted) warmup -= np;
      std::mutex m;
      std::condition_variable cv;
      int answered = 0;
      for (int p = 0; p < np; ++p) {
        Slot& s = slots[p];
        s.x.resize(n);
        for (float& v : s.x) v = nd(rng);
        s.req = client::MakeLayerRequest(layer, s.x.data(), c.T, c.hidden, c.dtype, c.out, c.shared);
        if (c.timeout_ms > 0) s.req.set_timeout_us(c.timeout_ms * 1000);
        s.has_resp = false;
        s.sent = Clock::now();
        absl::Status st = stream->Send(s.req, [&, p](absl::Status st, const pb::MoeLayerResponse* r) {
          Slot& sl = slots[p];
          sl.us = std::chrono::duration<double, std::micro>(Clock::now() - sl.sent).count();
          sl.st = st;
          if (r) {
            sl.resp = *r;
            sl.has_resp = true;
          }
          std::lock_guard<std::mutex> l(m);
          ++answered;
          cv.notify_all();
        });
        if (!st.ok()) {
          std::lock_guard<std::mutex> l(m);
          s.st = st;
          ++answered;
        }
      }
      {
        std::unique_lock<std::mutex> l(m);
        cv.wait(l, [&] { return answered == np; });
      }
      bool stream_broken = false;
      for (int p = 0; p < np; ++p) {
        Slot& s = slots[p];
        absl::Status st = s.st;
        if (st.ok() && s.has_resp) st = svc::FromRequestStatus(s.resp.status());
        if (st.ok() && !s.has_resp) st = absl::UnknownError("no response");
        if (!s.has_resp) stream_broken = true;
        if (!counted) continue;
        bool verified = false, mismatched = false;
        double rel = 0;
        std::string mismatch_msg;
        if (st.ok() && c.ref) {
          // What the router saw: the hidden states after rounding to the wire dtype.
          std::vector<float> xs(n), y, ref;
          std::vector<int32_t> ids;
          absl::Status d = svc::TensorToFloat(s.req.hidden(), "hidden", false, xs.data());
          if (d.ok()) d = client::ResponseOutput(s.resp, c.hidden, &y);
          if (d.ok()) d = Reference(*c.ref, layer, xs, c.T, c.shared, &ids, &ref);
          if (!d.ok()) {
            mismatched = true;
            mismatch_msg = absl::StrCat("layer ", layer, ": cannot verify: ", d.message());
          } else {
            const pb::TopK& tk = s.resp.topk();
            bool same_route = tk.ids_size() == static_cast<int>(ids.size());
            // The same experts per token (order within a token may differ).
            for (int t = 0; same_route && t < c.T; ++t) {
              std::vector<int32_t> a(ids.begin() + t * tk.k(), ids.begin() + (t + 1) * tk.k());
              std::vector<int32_t> b(tk.ids().begin() + t * tk.k(), tk.ids().begin() + (t + 1) * tk.k());
              std::sort(a.begin(), a.end());
              std::sort(b.begin(), b.end());
              same_route = a == b;
            }
            double maxref = 0, maxdiff = 0;
            for (size_t i = 0; i < ref.size(); ++i) {
              maxref = std::max(maxref, static_cast<double>(std::fabs(ref[i])));
              maxdiff = std::max(maxdiff, static_cast<double>(std::fabs(ref[i] - y[i])));
            }
            rel = maxdiff / std::max(maxref, 1e-12);
            if (!same_route || !(rel <= c.tol) || y.size() != ref.size()) {
              mismatched = true;
              mismatch_msg = absl::StrCat("layer ", layer, ": ", same_route ? "" : "routing differs; ",
                                          "relative error ", rel, " > tolerance ", c.tol);
            } else {
              verified = true;
            }
          }
        }
        std::lock_guard<std::mutex> l(tot.mu);
        ++tot.requests;
        if (st.ok()) {
          ++tot.ok;
          tot.samples.push_back({layer, s.us});
          const pb::RouterTimings& tm = s.resp.timings();
          tot.gate_us += tm.gate_us();
          tot.dispatch_us += tm.dispatch_us();
          tot.workers_us += tm.workers_us();
          tot.combine_us += tm.combine_us();
          tot.total_us += tm.total_us();
        } else {
          ++tot.failed;
          const std::string code = svc::StatusCodeName(st.code());
          ++tot.by_code[code];
          const std::string msg = absl::StrCat(code, ": ", st.message());
          if (static_cast<int>(tot.messages.size()) < c.max_errors && tot.messages.insert(msg).second) {
            std::fprintf(stderr, "error: layer %d: %s\n", layer, msg.c_str());
          }
        }
        if (verified) ++tot.verified;
        if (mismatched) {
          ++tot.mismatched;
          if (static_cast<int>(tot.messages.size()) < c.max_errors &&
              tot.messages.insert(mismatch_msg).second) {
            std::fprintf(stderr, "mismatch: %s\n", mismatch_msg.c_str());
          }
        }
        tot.max_rel_err = std::max(tot.max_rel_err, rel);
      }
      if (stream_broken) {
        // The stream ended (router restarted or unreachable): open a new one after a pause.
        stream->Cancel();
        (void)stream->Close();
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        stream = open();
      }
    }
  }
  (void)stream->Close();
}

double Pct(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + i, v.end());
  return v[i];
}

struct RunResult {
  double p50 = 0, p90 = 0, p99 = 0, seconds = 0;
  int64_t ok = 0;
};

RunResult PrintTable(const char* title, Totals& tot, double seconds, int T) {
  std::map<int, std::vector<double>> by_layer;
  std::vector<double> all;
  for (const Sample& s : tot.samples) {
    by_layer[s.layer].push_back(s.us);
    all.push_back(s.us);
  }
  std::printf("%s: per-layer round trip (microseconds)\n", title);
  std::printf("%6s %8s %10s %10s %10s\n", "layer", "ok", "p50", "p90", "p99");
  for (auto& [layer, v] : by_layer) {
    std::printf("%6d %8zu %10.1f %10.1f %10.1f\n", layer, v.size(), Pct(v, 0.5), Pct(v, 0.9),
                Pct(v, 0.99));
  }
  RunResult r;
  r.p50 = Pct(all, 0.5);
  r.p90 = Pct(all, 0.9);
  r.p99 = Pct(all, 0.99);
  r.seconds = seconds;
  r.ok = static_cast<int64_t>(all.size());
  std::printf("%6s %8zu %10.1f %10.1f %10.1f\n", "all", all.size(), r.p50, r.p90, r.p99);
  std::printf("%s: %.1f layer-requests/s, %.1f tokens/s over %.2f s\n", title,
              static_cast<double>(r.ok) / seconds, static_cast<double>(r.ok) * T / seconds, seconds);
  return r;
}

void RunLoad(const StreamOpener& open, const Config& c, int concurrency, int64_t requests,
             double duration, int warmup, uint32_t seed, Totals& tot, double* seconds) {
  Budget budget(requests, duration);
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int i = 0; i < concurrency; ++i) {
    threads.emplace_back([&, i] { RunStream(open, c, budget, warmup, seed * 7919u + i, tot); });
  }
  for (auto& t : threads) t.join();
  *seconds = std::chrono::duration<double>(Clock::now() - t0).count();
}

int Main() {
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  if (model_dir.empty()) {
    std::fprintf(stderr, "exl3-loadgen: --model DIR is required\n");
    return 2;
  }
  Config c;
  if (!ParseDType(absl::GetFlag(FLAGS_dtype), &c.dtype) ||
      !ParseDType(absl::GetFlag(FLAGS_output_dtype), &c.out)) {
    std::fprintf(stderr, "exl3-loadgen: --dtype/--output-dtype must be fp32, fp16 or bf16\n");
    return 2;
  }
  c.T = absl::GetFlag(FLAGS_tokens);
  c.pipeline = absl::GetFlag(FLAGS_pipeline);
  c.shared = absl::GetFlag(FLAGS_shared);
  c.timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  c.max_errors = absl::GetFlag(FLAGS_max_errors_shown);
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  if (c.T < 1 || c.pipeline < 1 || concurrency < 1) {
    std::fprintf(stderr, "exl3-loadgen: --tokens, --pipeline and --concurrency must be >= 1\n");
    return 2;
  }
  c.tol = absl::GetFlag(FLAGS_tolerance);
  if (c.tol <= 0) c.tol = c.out == pb::DTYPE_FP32 ? 1e-3 : c.out == pb::DTYPE_FP16 ? 4e-3 : 2e-2;

  std::unique_ptr<Exl3Model> ref;
  MoeConfig cfg;
  if (absl::GetFlag(FLAGS_verify)) {
    auto m = Exl3Model::Open(model_dir);
    if (!m.ok()) {
      std::fprintf(stderr, "exl3-loadgen: %s\n", std::string(m.status().message()).c_str());
      return 2;
    }
    ref = std::move(*m);
    cfg = ref->config();
    c.ref = ref.get();
  } else {
    auto mc = LoadMoeConfig(model_dir);
    if (!mc.ok()) {
      std::fprintf(stderr, "exl3-loadgen: %s\n", std::string(mc.status().message()).c_str());
      return 2;
    }
    cfg = *mc;
  }
  c.hidden = cfg.hidden_size;
  c.layers = cfg.MoeLayers();
  if (!absl::GetFlag(FLAGS_layers).empty()) {
    auto want = ParseIndexRanges(absl::GetFlag(FLAGS_layers), cfg.num_hidden_layers);
    if (!want.ok()) {
      std::fprintf(stderr, "exl3-loadgen: --layers: %s\n", std::string(want.status().message()).c_str());
      return 2;
    }
    c.layers.assign(want->begin(), want->end());
    for (int L : c.layers) {
      if (!cfg.IsMoeLayer(L)) {
        std::fprintf(stderr, "exl3-loadgen: --layers: layer %d is not an MoE layer\n", L);
        return 2;
      }
    }
  }
  int64_t requests = absl::GetFlag(FLAGS_requests);
  double duration = absl::GetFlag(FLAGS_duration);
  if (requests <= 0 && duration <= 0) duration = 10;

  client::ClientOptions o;
  std::unique_ptr<client::MoeClient> cl;
  std::unique_ptr<router::InProcessRouter> inproc;
  StreamOpener open;
  std::string target_text;
  if (absl::GetFlag(FLAGS_in_process_router)) {
    router::InProcessRouterOptions ro;
    ro.core.model_dir = model_dir;
    ro.core.expert_map_path = absl::GetFlag(FLAGS_expert_map);
    ro.ready_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_ready_timeout_ms));
    if (ro.core.expert_map_path.empty()) {
      std::fprintf(stderr, "exl3-loadgen: --in-process-router needs --expert-map FILE\n");
      return 2;
    }
    auto r = router::InProcessRouter::Create(ro);
    if (!r.ok()) {
      std::fprintf(stderr, "exl3-loadgen: %s\n", std::string(r.status().message()).c_str());
      return 2;
    }
    inproc = std::move(*r);
    open = [&] { return std::unique_ptr<client::LayerStream>(inproc->OpenStream()); };
    target_text = absl::StrCat("in-process router over ", ro.core.expert_map_path);
  } else {
    o.target = absl::GetFlag(FLAGS_target);
    o.tls.ca_file = absl::GetFlag(FLAGS_target_tls_ca);
    o.tls.cert_file = absl::GetFlag(FLAGS_target_tls_cert);
    o.tls.key_file = absl::GetFlag(FLAGS_target_tls_key);
    o.tls.enabled = !o.tls.ca_file.empty() || !o.tls.cert_file.empty();
    o.ssl_target_name_override = absl::GetFlag(FLAGS_target_name_override);
    auto c2 = client::MoeClient::Connect(o);
    if (!c2.ok()) {
      std::fprintf(stderr, "exl3-loadgen: %s\n", std::string(c2.status().message()).c_str());
      return 2;
    }
    cl = std::move(*c2);
    open = [&] { return std::unique_ptr<client::LayerStream>(cl->OpenStream()); };
    target_text = absl::StrCat("target ", o.target);
  }
  std::printf("exl3-loadgen: %s, %d streams, T=%d, pipeline %d, %zu MoE layers, %s in, %s out%s\n",
              target_text.c_str(), concurrency, c.T, c.pipeline, c.layers.size(),
              absl::GetFlag(FLAGS_dtype).c_str(), absl::GetFlag(FLAGS_output_dtype).c_str(),
              c.ref ? ", verifying" : "");
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const uint32_t seed = static_cast<uint32_t>(absl::GetFlag(FLAGS_seed));
  double secs = 0;
  Totals tot;
  RunLoad(open, c, concurrency, requests, duration, warmup, seed, tot, &secs);
  RunResult rr = PrintTable("router", tot, secs, c.T);
  if (!tot.by_code.empty()) {
    std::printf("failures by code:");
    for (auto& [code, n] : tot.by_code) std::printf(" %s=%lld", code.c_str(), static_cast<long long>(n));
    std::printf("\n");
  }
  if (tot.ok > 0) {
    const double n = static_cast<double>(tot.ok);
    std::printf("router stages (mean us, from the answers): gate %.1f dispatch %.1f workers %.1f "
                "combine %.1f total %.1f\n", tot.gate_us / n, tot.dispatch_us / n,
                tot.workers_us / n, tot.combine_us / n, tot.total_us / n);
  }
  if (c.ref) std::printf("verify: max relative error %.3g (tolerance %.3g)\n", tot.max_rel_err, c.tol);

  if (absl::GetFlag(FLAGS_echo_baseline)) {
    auto echo = EchoServer::Start(o.max_message_bytes);
    if (!echo.ok()) {
      std::fprintf(stderr, "exl3-loadgen: %s\n", std::string(echo.status().message()).c_str());
      return 2;
    }
    client::ClientOptions eo;
    eo.target = (*echo)->address();
    auto ecl = client::MoeClient::Connect(eo);
    Config ec = c;
    ec.ref = nullptr;
    double esecs = 0;
    Totals et;
    if (!ecl.ok()) {
      std::fprintf(stderr, "exl3-loadgen: %s\n", std::string(ecl.status().message()).c_str());
      return 2;
    }
    StreamOpener eopen = [&] { return std::unique_ptr<client::LayerStream>((*ecl)->OpenStream()); };
    RunLoad(eopen, ec, concurrency, requests, duration, warmup, seed, et, &esecs);
    RunResult er = PrintTable("echo", et, esecs, c.T);
    // The hops of plain gRPC the router path needs: engine -> router -> worker, or only
    // engine -> worker with the router in process.
    const int hops = inproc ? 1 : 2;
    std::printf("transport floor (%d echo round trip%s) p50 %.1f us; router p50 %.1f us = %.2fx the floor\n",
                hops, hops == 1 ? "" : "s", hops * er.p50, rr.p50,
                er.p50 > 0 ? rr.p50 / (hops * er.p50) : 0.0);
    std::printf("summary: router_p50_us=%.1f router_p90_us=%.1f router_p99_us=%.1f router_rps=%.1f "
                "echo_p50_us=%.1f echo_p99_us=%.1f\n",
                rr.p50, rr.p90, rr.p99, rr.ok / rr.seconds, er.p50, er.p99);
  } else {
    std::printf("summary: router_p50_us=%.1f router_p90_us=%.1f router_p99_us=%.1f router_rps=%.1f\n",
                rr.p50, rr.p90, rr.p99, rr.ok / rr.seconds);
  }
  std::printf("requests=%lld ok=%lld failed=%lld verified=%lld mismatched=%lld\n",
              static_cast<long long>(tot.requests), static_cast<long long>(tot.ok),
              static_cast<long long>(tot.failed), static_cast<long long>(tot.verified),
              static_cast<long long>(tot.mismatched));
  std::fflush(stdout);
  if ((tot.failed > 0 || tot.mismatched > 0) && !absl::GetFlag(FLAGS_allow_failures)) return 1;
  return 0;
}

}  // namespace
}  // namespace exl3::loadgen

int main(int argc, char** argv) {
  exl3::ConfigureFlagsUsage(
      "exl3-loadgen",
      "exl3-loadgen (--target HOST:PORT | --in-process-router --expert-map FILE) --model DIR [--concurrency N] [--tokens T] "
      "[--requests N | --duration S] [--pipeline P] [--verify] [--echo-baseline]\n"
      "Closed-loop decode-shaped load on an exl3-router. Ends with one line\n"
      "requests=N ok=N failed=N verified=N mismatched=N; exits 1 when anything failed or\n"
      "mismatched (unless --allow-failures).",
      "exl3_loadgen");
  std::vector<char*> args = exl3::svc::DashesToUnderscores(argc, argv);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  return exl3::loadgen::Main();
}
