// exl3-remote-moe-bench MODEL_DIR MAP [options]: the CPU-side cost of one MoE layer call on
// remote experts, as the GPU engine makes it: an InProcessRouter
// (services/router/in_process_router.h) in this process, RouterMoeExecutor::StartRouted
// (services/router/router_moe_executor.h) with the caller's top-k and fp32 hidden states,
// answered by the workers of MAP. With tiny experts (exl3-tool make-test-model --intermediate 128)
// on a CPU worker the compute is small but, at 1024 tokens on a few cores, not negligible: the last
// column subtracts the worker's own compute stage, leaving dispatch, copies, encoding, transport
// and hand-offs (bench/results/service.md).
//
// Per token count it prints the call's mean / p50 / min wall time and, from the router's and the
// worker's Prometheus histograms (docs/metrics.md), the mean of each stage over the measured calls:
//   T calls mean_us p50_us min_us | gate dispatch workers combine total | w_queue w_compute w_total
//     | mean - w_compute (what the call costs beyond the worker's compute)
//
// Options:
//   --tokens 1,64,1024      token counts per call
//   --iters N               measured calls per token count (default 20)
//   --warmup N              calls first, not counted (default 3)
//   --shm-mb N              shared-memory ring per direction (0: gRPC only; default 256)
//   --shared-expert S       worker:NAME (the map marks NAME shared_expert), local or none
//   --worker-metrics H:P    the worker's /metrics endpoint (its --metrics-listen), for w_*
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "services/router/in_process_router.h"
#include "services/router/router_moe_executor.h"

namespace exl3 {
namespace {

using Clock = std::chrono::steady_clock;

// GET http://host:port/metrics; empty on any failure.
std::string HttpGetMetrics(const std::string& hostport) {
  const size_t colon = hostport.rfind(':');
  if (colon == std::string::npos) return "";
  const std::string host = hostport.substr(0, colon), port = hostport.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) return "";
  const int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  if (fd < 0 || connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
    return "";
  }
  freeaddrinfo(res);
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: " + host + "\r\n\r\n";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return "";
  }
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

// Sum over all label sets of `metric`_sum and _count whose labels contain `label`.
struct SumCount {
  double sum = 0, count = 0;
};
SumCount Histogram(const std::string& text, const std::string& metric, const std::string& label) {
  SumCount sc;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#' || line.find(label) == absl::string_view::npos) continue;
    const bool is_sum = absl::StartsWith(line, metric + "_sum");
    const bool is_count = absl::StartsWith(line, metric + "_count");
    if (!is_sum && !is_count) continue;
    const size_t sp = line.rfind(' ');
    double v = 0;
    if (sp == absl::string_view::npos || !absl::SimpleAtod(line.substr(sp + 1), &v)) continue;
    (is_sum ? sc.sum : sc.count) += v;
  }
  return sc;
}

// Mean in µs of the stage between two scrapes; -1 when nothing was observed.
double StageMeanUs(const std::string& before, const std::string& after, const std::string& metric,
                   const std::string& stage) {
  const std::string label = "stage=\"" + stage + "\"";
  const SumCount a = Histogram(before, metric, label), b = Histogram(after, metric, label);
  const double n = b.count - a.count;
  return n > 0 ? (b.sum - a.sum) / n * 1e6 : -1;
}

int Main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: exl3-remote-moe-bench MODEL_DIR MAP [--tokens 1,64,1024] [--iters 20] "
                 "[--warmup 3] [--shm-mb 256] [--shared-expert worker:NAME|local|none] "
                 "[--worker-metrics HOST:PORT]\n");
    return 2;
  }
  std::vector<int> tokens = {1, 64, 1024};
  int iters = 20, warmup = 3, shm_mb = 256;
  std::string shared = "none", worker_metrics;
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--tokens") {
      tokens.clear();
      for (absl::string_view t : absl::StrSplit(v, ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(t, &n) || n < 1) return std::fprintf(stderr, "bad --tokens\n"), 2;
        tokens.push_back(n);
      }
    } else if (a == "--iters") {
      iters = std::max(1, std::atoi(v.c_str()));
    } else if (a == "--warmup") {
      warmup = std::max(0, std::atoi(v.c_str()));
    } else if (a == "--shm-mb") {
      shm_mb = std::max(0, std::atoi(v.c_str()));
    } else if (a == "--shared-expert") {
      shared = v;
    } else if (a == "--worker-metrics") {
      worker_metrics = v;
    } else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  router::InProcessRouterOptions o;
  o.core.model_dir = argv[1];
  o.core.expert_map_path = argv[2];
  o.core.worker_shm_bytes = static_cast<size_t>(shm_mb) << 20;
  o.core.router.shared_expert_local = shared == "local";
  if (absl::StartsWith(shared, "worker:")) o.core.router.shared_expert_worker = shared.substr(7);
  auto r = router::InProcessRouter::Create(o);
  if (!r.ok()) {
    std::fprintf(stderr, "exl3-remote-moe-bench: %s\n", std::string(r.status().message()).c_str());
    return 2;
  }
  const MoeConfig& cfg = (*r)->core().model().config();
  const int H = cfg.hidden_size, E = cfg.num_experts, K = cfg.top_k;
  const int L = cfg.MoeLayers().front();
  router::RouterMoeExecutor executor((*r)->core().service(), o.core.router.inline_max_tokens, H,
                                     std::chrono::seconds(60));
  std::printf("# hidden %d, %d experts, top-%d, layer %d; transport %s; shared expert %s\n", H, E,
              K, L, shm_mb > 0 ? "shm (if the worker is on this host)" : "grpc", shared.c_str());
  std::printf("T calls mean_us p50_us min_us | gate dispatch workers combine total | w_queue "
              "w_compute w_total | mean-w_compute\n");
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int T : tokens) {
    std::vector<float> x(static_cast<size_t>(T) * H), y(x.size());
    for (float& v : x) v = 0.1f * u(rng);
    std::vector<int32_t> ids(static_cast<size_t>(T) * K);
    std::vector<float> w(ids.size());
    std::vector<int32_t> perm(E);
    for (int e = 0; e < E; ++e) perm[e] = e;
    for (int t = 0; t < T; ++t) {
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int k = 0; k < K; ++k) {
        ids[static_cast<size_t>(t) * K + k] = perm[k];
        w[static_cast<size_t>(t) * K + k] = 1.0f / K;
      }
    }
    const engine::MoeRouting routing{K, ids.data(), w.data()};
    std::string rb, wb;
    std::vector<double> us;
    for (int i = 0; i < warmup + iters; ++i) {
      if (i == warmup) {
        // The router records a call's stages just after answering it: let the last one land.
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        rb = (*r)->ScrapeMetrics();
        if (!worker_metrics.empty()) wb = HttpGetMetrics(worker_metrics);
      }
      const auto t0 = Clock::now();
      const absl::Status st = executor.StartRouted(L, x.data(), T, routing, y.data())->Wait();
      const double dt = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (!st.ok()) {
        std::fprintf(stderr, "T=%d call %d: %s\n", T, i, st.ToString().c_str());
        return 1;
      }
      if (i >= warmup) us.push_back(dt);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const std::string ra = (*r)->ScrapeMetrics();
    const std::string wa = worker_metrics.empty() ? "" : HttpGetMetrics(worker_metrics);
    std::vector<double> sorted = us;
    std::sort(sorted.begin(), sorted.end());
    double mean = 0;
    for (double v : us) mean += v / us.size();
    const std::string rm = "exl3_router_layer_latency_seconds";
    const std::string wm = "exl3_worker_layer_latency_seconds";
    const double w_compute = worker_metrics.empty() ? 0 : StageMeanUs(wb, wa, wm, "compute");
    std::printf("%d %zu %.0f %.0f %.0f | %.0f %.0f %.0f %.0f %.0f | %.0f %.0f %.0f | %.0f\n", T,
                us.size(), mean, sorted[sorted.size() / 2], sorted.front(),
                StageMeanUs(rb, ra, rm, "gate"), StageMeanUs(rb, ra, rm, "dispatch"),
                StageMeanUs(rb, ra, rm, "workers"), StageMeanUs(rb, ra, rm, "combine"),
                StageMeanUs(rb, ra, rm, "total"),
                worker_metrics.empty() ? -1 : StageMeanUs(wb, wa, wm, "queue"), w_compute,
                worker_metrics.empty() ? -1 : StageMeanUs(wb, wa, wm, "total"), mean - w_compute);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace exl3

int main(int argc, char** argv) { return exl3::Main(argc, argv); }
