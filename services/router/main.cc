// exl3-router: the MoE router service (MoeRouter) in front of the expert workers.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "model/exl3_model.h"
#include "model/expert_map.h"
#include "services/common/flags.h"
#include "services/common/logging.h"
#include "services/common/metrics.h"
#include "services/common/server.h"
#include "services/common/signals.h"
#include "services/router/moe_router.h"
#include "services/router/router_metrics.h"
#include "services/router/worker_pool.h"

ABSL_FLAG(std::string, model, "", "model directory (config.json, router weights, shared experts)");
ABSL_FLAG(std::string, expert_map, "", "expert map YAML (docs/expert-map.md); SIGHUP reloads it");
ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "HOST:PORT of the MoeRouter gRPC service");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9451",
          "HOST:PORT of the Prometheus /metrics endpoint (empty: none)");
ABSL_FLAG(std::string, shared_expert, "local",
          "where the shared expert runs: local (the router's CPU), worker:NAME (that worker of "
          "the expert map, marked shared_expert: true, and its replicas) or none");
ABSL_FLAG(int64_t, default_deadline_ms, 10000,
          "deadline of a layer request that sets no timeout_us (0: none)");
ABSL_FLAG(int32_t, max_in_flight, 1024,
          "layer requests in flight across all streams; beyond it RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, shared_expert_threads, 2, "CPU threads running the local shared expert");
ABSL_FLAG(int32_t, gate_threads, 4,
          "CPU threads computing router logits (the gate reads the layer's whole router weight)");
ABSL_FLAG(int32_t, inline_max_tokens, 64,
          "requests of at most this many tokens are handled (gate, dispatch, local shared expert) "
          "on the gRPC thread that read them; larger ones on the handler threads");
ABSL_FLAG(int32_t, handler_threads, 2, "threads handling requests above --inline-max-tokens");
ABSL_FLAG(int64_t, max_tokens, 65536, "most tokens accepted in one layer request");
ABSL_FLAG(int32_t, max_message_bytes, 64 << 20, "gRPC message size limit (both directions)");
ABSL_FLAG(int32_t, drain_grace_ms, 10000,
          "on SIGTERM: how long in-flight requests may take before the server stops");
ABSL_FLAG(int32_t, reconnect_backoff_max_ms, 2000, "longest wait between worker reconnects");
ABSL_FLAG(bool, worker_tls, false,
          "TLS to the workers (implied by --worker-tls-ca/--worker-tls-cert)");
ABSL_FLAG(std::string, worker_tls_ca, "", "PEM CA bundle that signed the workers' certificates");
ABSL_FLAG(std::string, worker_tls_cert, "", "PEM client certificate for mutual TLS to workers");
ABSL_FLAG(std::string, worker_tls_key, "", "PEM private key of --worker-tls-cert");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");

namespace exl3::router {
namespace {

int Fail(const std::string& msg) {
  std::fprintf(stderr, "exl3-router: %s\n", msg.c_str());
  return 2;
}

int Main() {
  svc::LogLevel level;
  if (!svc::ParseLogLevel(absl::GetFlag(FLAGS_log_level).c_str(), &level)) {
    return Fail("--log-level must be debug, info, warning or error");
  }
  svc::SetLogLevel(level);
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  const std::string map_path = absl::GetFlag(FLAGS_expert_map);
  if (model_dir.empty()) return Fail("--model DIR is required");
  if (map_path.empty()) return Fail("--expert-map FILE is required");
  const std::string shared = absl::GetFlag(FLAGS_shared_expert);
  RouterOptions ropt;
  if (shared == "local") {
    ropt.shared_expert_local = true;
  } else if (shared == "none") {
    ropt.shared_expert_local = false;
  } else if (shared.rfind("worker:", 0) == 0 && shared.size() > 7) {
    ropt.shared_expert_local = false;
    ropt.shared_expert_worker = shared.substr(7);
  } else {
    return Fail("--shared-expert must be local, worker:NAME or none");
  }
  ropt.default_deadline_ms = absl::GetFlag(FLAGS_default_deadline_ms);
  ropt.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  ropt.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  ropt.shared_expert_threads = std::max(1, absl::GetFlag(FLAGS_shared_expert_threads));
  ropt.gate_threads = std::max(1, absl::GetFlag(FLAGS_gate_threads));
  ropt.inline_max_tokens = std::max(0, absl::GetFlag(FLAGS_inline_max_tokens));
  ropt.handler_threads = std::max(1, absl::GetFlag(FLAGS_handler_threads));
  if (ropt.max_in_flight < 1) return Fail("--max-in-flight must be at least 1");

  // The model: config, router weights, shared experts; no routed experts.
  Exl3ModelOptions mopt;
  mopt.experts = std::map<int, std::vector<int>>{};
  mopt.load_shared_experts = ropt.shared_expert_local;
  mopt.load_routers = true;
  const auto t0 = std::chrono::steady_clock::now();
  auto model = Exl3Model::Open(model_dir, mopt);
  if (!model.ok()) return Fail(std::string(model.status().message()));
  const MoeConfig& cfg = (*model)->config();
  svc::LogInfo("model %s: %s, %d MoE layers x %d experts (top-%d), fingerprint %s, loaded in %.2f s",
               model_dir.c_str(), cfg.architecture.c_str(), static_cast<int>(cfg.MoeLayers().size()),
               cfg.num_experts, cfg.top_k, (*model)->fingerprint().c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  auto map = LoadExpertMap(map_path, cfg);
  if (!map.ok()) return Fail(std::string(map.status().message()));
  absl::Status cover = CheckCoverage(*map, cfg);
  if (!cover.ok()) return Fail(std::string(cover.message()));
  // The map must name the shared expert's worker (checked again on every reload).
  auto check_shared = [&](const ExpertMap& m) -> absl::Status {
    if (ropt.shared_expert_worker.empty()) return absl::OkStatus();
    if (!cfg.has_shared_expert()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--shared-expert ", shared, ": the model (", cfg.architecture, ") has no shared expert"));
    }
    return SharedExpertWorkers(m, ropt.shared_expert_worker).status();
  };
  if (absl::Status sh = check_shared(*map); !sh.ok()) return Fail(std::string(sh.message()));

  WorkerPoolOptions popt;
  popt.fingerprint = (*model)->fingerprint();
  popt.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  popt.backoff_max_ms = absl::GetFlag(FLAGS_reconnect_backoff_max_ms);
  popt.shared_expert_worker = ropt.shared_expert_worker;
  popt.tls.ca_file = absl::GetFlag(FLAGS_worker_tls_ca);
  popt.tls.cert_file = absl::GetFlag(FLAGS_worker_tls_cert);
  popt.tls.key_file = absl::GetFlag(FLAGS_worker_tls_key);
  popt.tls.enabled = absl::GetFlag(FLAGS_worker_tls) || !popt.tls.ca_file.empty() ||
                     !popt.tls.cert_file.empty();
  if (popt.tls.cert_file.empty() != popt.tls.key_file.empty()) {
    return Fail("--worker-tls-cert and --worker-tls-key go together");
  }
  if (popt.tls.enabled) {
    auto creds = svc::MakeChannelCredentials(popt.tls);
    if (!creds.ok()) return Fail(std::string(creds.status().message()));
  } else {
    for (const auto& w : map->workers) {
      if (!svc::IsLoopbackAddress(w.address)) {
        svc::LogWarning("!!! worker %s at %s is reached WITHOUT TLS: hidden states cross the network "
                        "in clear text. Use --worker-tls-ca (and --worker-tls-cert/--worker-tls-key "
                        "for mTLS). !!!", w.name.c_str(), w.address.c_str());
      }
    }
  }

  auto metrics_ep = svc::MetricsEndpoint::Start(absl::GetFlag(FLAGS_metrics_listen));
  if (!metrics_ep.ok()) return Fail(std::string(metrics_ep.status().message()));
  RouterMetrics metrics((*metrics_ep)->registry(), cfg.MoeLayers());

  MoeRouterService service(**model, ropt, &metrics);
  std::mutex server_mu;
  svc::GrpcServer* server_ptr = nullptr;
  std::atomic<bool> draining{false};
  std::atomic<int> last_ready{-1};
  // Readiness follows the workers: ready only while every routed expert has a serving worker.
  auto update_ready = [&] {
    auto p = service.pool();
    if (!p) return;
    const int unserved = p->UnservedExperts();
    const bool ready = unserved == 0 && !draining;
    metrics.unserved().Set(unserved);
    metrics.ready().Set(ready ? 1 : 0);
    std::lock_guard<std::mutex> l(server_mu);
    if (server_ptr) server_ptr->SetServing(ready);
    if (last_ready.exchange(ready ? 1 : 0) != (ready ? 1 : 0)) {
      if (ready) {
        svc::LogInfo("ready: every routed expert%s has a serving worker",
                     ropt.shared_expert_worker.empty() ? "" : " and the shared expert");
      } else {
        svc::LogWarning("not ready: %d %s have no serving worker", unserved,
                        ropt.shared_expert_worker.empty()
                            ? "routed experts"
                            : "routed experts (and per-layer shared experts)");
      }
    }
  };
  popt.on_change = update_ready;
  service.SetPool(WorkerPool::Create(*map, cfg, popt, nullptr, &metrics));

  svc::ServerConfig scfg;
  scfg.listen = absl::GetFlag(FLAGS_listen);
  auto tls = svc::ServerTlsFromFlags();
  if (!tls.ok()) return Fail(std::string(tls.status().message()));
  scfg.tls = *tls;
  scfg.max_receive_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  scfg.max_send_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  scfg.services = {&service};
  scfg.health_names = {"exl3serve.v1.MoeRouter"};
  auto server = svc::GrpcServer::Start(scfg);
  if (!server.ok()) return Fail(std::string(server.status().message()));
  {
    std::lock_guard<std::mutex> l(server_mu);
    server_ptr = server->get();
  }
  update_ready();
  // The bound ports, not the flags: with port 0 the log is how a supervisor finds them.
  const std::string metrics_flag = absl::GetFlag(FLAGS_metrics_listen);
  const std::string metrics_at =
      (*metrics_ep)->port() == 0
          ? std::string("(none)")
          : absl::StrCat(metrics_flag.substr(0, metrics_flag.rfind(':')), ":",
                         (*metrics_ep)->port());
  svc::LogInfo("exl3-router listening on %s (%s), metrics on %s, %d workers in %s",
               (*server)->address().c_str(), scfg.tls.enabled() ? (scfg.tls.require_client_cert ? "mTLS" : "TLS") : "plaintext",
               metrics_at.c_str(), static_cast<int>(map->workers.size()), map_path.c_str());
  std::printf("listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);

  // Signals: SIGTERM/SIGINT drain (ShutdownSignals); SIGHUP reloads the expert map.
  std::mutex mu;
  std::condition_variable cv;
  int shutdown_count = 0;
  std::atomic<bool> stop_hup{false};
  std::vector<std::shared_ptr<WorkerPool>> retired;  // old pools stay alive until exit
  std::thread hup_thread([&] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGHUP);
    while (!stop_hup) {
      timespec ts{0, 200 * 1000 * 1000};
      if (sigtimedwait(&set, nullptr, &ts) != SIGHUP) continue;
      svc::LogInfo("SIGHUP: reloading expert map %s", map_path.c_str());
      auto next = LoadExpertMap(map_path, cfg);
      absl::Status st = next.ok() ? CheckCoverage(*next, cfg) : next.status();
      if (st.ok()) st = check_shared(*next);
      if (!st.ok()) {
        svc::LogError("reload refused, previous map stays in force: %s",
                      std::string(st.message()).c_str());
        continue;
      }
      auto old = service.pool();
      auto fresh = WorkerPool::Create(*next, cfg, popt, old.get(), &metrics);
      service.SetPool(fresh);
      old->StopUnshared(*fresh);
      retired.push_back(old);
      update_ready();
      svc::LogInfo("expert map reloaded: %d workers", static_cast<int>(next->workers.size()));
    }
  });

  auto signals = svc::ShutdownSignals::Install([&](int, int count) {
    std::lock_guard<std::mutex> l(mu);
    shutdown_count = count;
    cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return shutdown_count > 0; });
  }
  svc::LogInfo("draining: %d layer requests in flight, grace %d ms", service.in_flight(),
               absl::GetFlag(FLAGS_drain_grace_ms));
  draining = true;
  service.StartDrain();
  update_ready();
  const auto grace = std::chrono::milliseconds(absl::GetFlag(FLAGS_drain_grace_ms));
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (service.WaitIdle(std::chrono::milliseconds(50))) break;
    std::lock_guard<std::mutex> l(mu);
    if (shutdown_count > 1) break;  // second signal: stop now
  }
  const int left = service.in_flight();
  (*server)->Shutdown(absl::Milliseconds(500));
  {
    std::lock_guard<std::mutex> l(server_mu);
    server_ptr = nullptr;
  }
  stop_hup = true;
  hup_thread.join();
  auto p = service.pool();
  for (int i = 0; p && i < p->num_workers(); ++i) p->worker(i).Stop();
  for (auto& r : retired) {
    for (int i = 0; i < r->num_workers(); ++i) r->worker(i).Stop();
  }
  svc::LogInfo("drained (%d requests still in flight at the end); exiting", left);
  return 0;
}

}  // namespace
}  // namespace exl3::router

int main(int argc, char** argv) {
  // Before any thread exists: SIGHUP is taken by the reload thread (sigtimedwait), so it must be
  // blocked everywhere. (SIGTERM/SIGINT are blocked by ShutdownSignals::Install... which must also
  // run before threads: block them here too.)
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  exl3::svc::ParseServiceFlags(argc, argv,
      "exl3-router --model DIR --expert-map FILE [--listen HOST:PORT] [flags]\n"
      "The MoE router: gates each MoE layer's tokens, fans out to the expert workers of the map,\n"
      "combines their partial sums with the shared expert. SIGTERM drains, SIGHUP reloads the map.\n"
      "Flags may be written with dashes or underscores (--max-in-flight = --max_in_flight).");
  return exl3::router::Main();
}
